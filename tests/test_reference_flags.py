"""The reference trainer's metrics file around a flagged step (issue 47, points 13 and 14): a flagged step between
log steps leaves a line of its own and a count in the next log step; a skipped update logs no update ratio. Its
other writers (point 15): `treetools train --tensorboard DIR --wandb PROJECT`."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main as cli_main
from treetools.reference.train import TrainConfig, train

SPIKE = 26  # between the log steps 25 and 30


def test_a_flagged_step_between_log_steps_is_in_the_metrics_file_and_its_update_ratio_is_zero(tmp_path):
    cfg = TrainConfig(workdir=str(tmp_path), steps=SPIKE + 5, log_every=5, ckpt_every=1, max_to_keep=None,
                      quiet=True, health=True, health_warmup=12, inject_spike=SPIKE)
    run = train(cfg)
    assert [e["step"] for e in run["health_events"] if e["event"] == "flagged"] == [SPIKE]
    records = {r["step"]: r for r in tt.read_metrics(run["metrics_path"])}
    assert sorted(records) == [5, 10, 15, 20, 25, SPIKE, 30]  # the flagged step has a line of its own
    spike = records[SPIKE]
    assert spike["flagged"] == 1 and spike["loss"] > records[25]["loss"]
    assert records[30]["flagged"] == 0 and records[30]["flagged_since_log"] == 1
    assert all(records[s]["flagged_since_log"] == 0 for s in (5, 10, 15, 20, 25))
    # Truth for the update: the params saved at SPIKE are those of SPIKE - 1 (skipped), so the update applied
    # is 0, and so are its norm and ratio, global and per module; the discarded one is logged apart.
    ckpts = run["checkpoint_dir"]
    before, after = (tt.flatten(tt.load_parameters(ckpts, s, item="params")) for s in (SPIKE - 1, SPIKE))
    applied = np.sqrt(sum(np.sum((after[k].astype(np.float64) - before[k]) ** 2) for k in after))
    assert applied == 0.0
    update_keys = [k for k in spike if k.split("/")[0] in ("update_norm", "update_ratio")]
    assert len(update_keys) > 2 and all(spike[k] == 0.0 for k in update_keys), update_keys
    recorder = jax.device_get(run["state"]["health"]["recorder"])
    (row,) = [r for r in tt.HealthRecorder.rows(recorder) if r["step"] == SPIKE]
    assert spike["discarded_update_ratio"] > 0 and np.isclose(spike["discarded_update_ratio"],
                                                              row["update_ratio"])
    # Other steps applied their update: the ratio logged is the one the params moved by.
    assert records[30]["update_ratio"] > 0 and records[30]["discarded_update_ratio"] == 0.0


def test_train_writes_tensorboard_events_and_an_offline_wandb_run(tmp_path, monkeypatch, capsys):
    # Issue 47, point 15: `treetools train --tensorboard DIR --wandb PROJECT`, as a user runs it. Every writer gets
    # the records metrics.jsonl gets: TensorBoard's own reader and W&B's own record file give them back.
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("tensorboardX")
    pytest.importorskip("wandb")
    from tests.test_metrics import _wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run is written under WORKDIR/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir, tb = tmp_path / "run", tmp_path / "tb"
    code = cli_main(["train", "--workdir", str(workdir), "--steps", "6", "--log-every", "2", "--ckpt-every", "6",
                     "--quiet", "--tensorboard", str(tb), "--wandb", "treetools-test"])
    assert code == 0, capsys.readouterr().err
    records = tt.read_metrics(str(workdir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 4, 6]
    keys = [k for k in records[0] if k != "step"]
    assert {"loss", "grad_norm", "update_ratio", "grad_norm/layers_0"} <= set(keys)

    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(keys)
    for key in keys:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [2, 4, 6], key
        np.testing.assert_allclose([e.value for e in events], [r[key] for r in records], rtol=1e-6, err_msg=key)

    (run_dir,) = (workdir / "wandb").glob("offline-run-*")
    for _ in range(100):  # W&B's service process may still be writing its file when finish() returns
        if len(history := _wandb_history(run_dir)) >= 3:
            break
        time.sleep(0.1)
    assert [row["_step"] for row in history] == [2, 4, 6]
    for row, record in zip(history, records):
        for key in keys:
            np.testing.assert_allclose(row[key], record[key], rtol=1e-6, err_msg=key)
