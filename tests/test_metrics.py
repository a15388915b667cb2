"""treetools.pytree.metrics: writing metrics files (fresh or resumed) and reading them back."""

from __future__ import annotations

import doctest
import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import treetools as tt
from treetools.pytree import metrics
from treetools.pytree.metrics import JsonlWriter, MetricsLogger, read_metrics


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _log(path, steps, *, every=1, resume_step=None):
    log = MetricsLogger(str(path), every=every, resume_step=resume_step)
    for step in steps:
        log(step, {"loss": jnp.float32(10.0 / step), "nonfinite_grads": jnp.int32(0)})


def test_docstring_examples():
    result = doctest.testmod(metrics, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_a_fresh_logger_starts_the_file_afresh(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    _log(path, range(1, 11), every=2)
    _log(path, range(1, 5), every=2)  # a second, fresh run at the same path: no leftovers of the first
    assert [r["step"] for r in _lines(path)] == [2, 4]
    assert _lines(path)[0] == {"step": 2, "loss": 5.0, "nonfinite_grads": 0}


def test_resume_continues_as_a_straight_run(tmp_path):
    straight = tmp_path / "straight.jsonl"
    _log(straight, range(1, 21), every=2)

    resumed = tmp_path / "resumed.jsonl"
    _log(resumed, range(1, 15), every=2)  # logged up to 14, but the last checkpoint was step 10
    with open(resumed, "a") as f:
        f.write('{"step": 16, "lo')  # and it was killed mid-write
    _log(resumed, range(11, 21), every=2, resume_step=10)
    assert resumed.read_text() == straight.read_text()
    steps = [r["step"] for r in _lines(resumed)]
    assert steps == list(range(2, 21, 2))
    assert sorted(tmp_path.iterdir()) == sorted([resumed, straight])  # rewritten in place, no temporary left


def test_resume_keeps_a_file_with_nothing_after_the_step_as_is(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 5, "loss": 1.0}\n\n{"step": 10, "loss": NaN}\n')
    before = path.stat().st_mtime_ns, path.read_text()
    JsonlWriter(path, resume_step=10)
    assert (path.stat().st_mtime_ns, path.read_text()) == before
    JsonlWriter(path, resume_step=7)
    assert path.read_text() == '{"step": 5, "loss": 1.0}\n'
    JsonlWriter(tmp_path / "new" / "m.jsonl", resume_step=3)(4, {"x": 1.0})  # nothing to resume: starts one
    assert _lines(tmp_path / "new" / "m.jsonl") == [{"step": 4, "x": 1.0}]


def test_resume_refuses_a_file_that_is_not_metrics(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\nmore notes\n")
    with pytest.raises(ValueError, match=r"notes\.txt:1: .*resume_step=None") as e:
        JsonlWriter(path, resume_step=3)
    assert "\n" not in str(e.value)
    assert path.read_text() == "my notes\nmore notes\n"  # untouched
    with pytest.raises(ValueError, match="resume_step"):
        JsonlWriter(tmp_path / "m.jsonl", resume_step=-1)


def test_logger_argument_errors():
    with pytest.raises(ValueError, match="resume_step.*JsonlWriter"):
        MetricsLogger(print, resume_step=3)
    with pytest.raises(ValueError, match="every"):
        MetricsLogger(print, every=0)
    with pytest.raises(TypeError, match="writer"):
        MetricsLogger(3)


def test_logger_writes_host_numbers_on_due_steps(tmp_path):
    seen = []
    log = MetricsLogger(lambda step, m: seen.append((step, m)), every=3)
    assert [log(step, {"x": jnp.float32(step), "n": jnp.int32(step)}) for step in range(7)] == [
        True, False, False, True, False, False, True]
    assert seen == [(0, {"x": 0.0, "n": 0}), (3, {"x": 3.0, "n": 3}), (6, {"x": 6.0, "n": 6})]
    assert type(seen[1][1]["x"]) is float and type(seen[1][1]["n"]) is int
    path = tmp_path / "m.jsonl"
    JsonlWriter(path)(1, {"loss": float("nan"), "g": float("inf")})
    (record,) = read_metrics(path)
    assert np.isnan(record["loss"]) and record["g"] == np.inf


def test_read_metrics_drops_records_a_rerun_superseded(tmp_path):
    # An append-only file (older treetools): steps 2..8, then a rerun resumed from step 4 logged 6 and 8 again.
    path = tmp_path / "metrics.jsonl"
    rows = [(2, 1.0), (4, 2.0), (6, 3.0), (8, 4.0), (6, 30.0), (8, 40.0), (10, 50.0)]
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in rows))
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(2, 1.0), (4, 2.0), (6, 30.0), (8, 40.0),
                                                                     (10, 50.0)]
    assert len(read_metrics(path, drop_superseded=False)) == 7
    # A fresh rerun from step 2 supersedes everything before it.
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 9.0}\n')
    assert read_metrics(tmp_path) == [{"step": 2, "loss": 9.0}]


def test_read_metrics_skips_an_unterminated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a run still writing
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


@pytest.mark.parametrize("name, content, expected", [
    ("w.npz", None, "zip archive"),
    ("blob.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
    ("latin.jsonl", '{"step": 1, "name": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8"),
    ("config.json", b'{\n  "lr": 0.1\n}\n', "not a JSON line"),
    ("nostep.jsonl", b'{"loss": 1.0}\n', "numeric `step`"),
    ("empty.jsonl", b"\n\n", "no records"),
])
def test_read_metrics_not_metrics_is_one_line_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is None:
        np.savez(path, w=np.ones(3))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_metrics(path)
    message = str(e.value)
    assert name in message and expected in message and "\n" not in message
    assert "codec" not in message


def test_read_metrics_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such metrics file"):
        read_metrics(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="folder has no metrics.jsonl"):
        read_metrics(tmp_path)


def test_reading_does_not_import_jax(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n')
    code = (f"import sys; from treetools.pytree.metrics import read_metrics; read_metrics({str(path)!r}); "
            "print('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_reference_trainer_restart_logs_the_same_steps_as_a_straight_run(tmp_path):
    from treetools.reference.train import TrainConfig, train

    def cfg(workdir, steps):
        return TrainConfig(workdir=str(workdir), steps=steps, ckpt_every=8, log_every=2, quiet=True)

    straight = train(cfg(tmp_path / "straight", 16))
    # A run that logged up to step 12 and was killed before its step-12 checkpoint was kept...
    train(cfg(tmp_path / "restarted", 12))
    ckpt_dir = tmp_path / "restarted" / "checkpoints"
    assert tt.list_steps(ckpt_dir) == [8, 12]
    shutil.rmtree(ckpt_dir / "12")
    # ...then resumed from step 8 and run to 16.
    resumed = train(cfg(tmp_path / "restarted", 16))
    assert resumed["start_step"] == 8
    records = read_metrics(resumed["metrics_path"], drop_superseded=False)
    assert [r["step"] for r in records] == list(range(2, 17, 2))  # monotone, each step once
    assert records == read_metrics(straight["metrics_path"], drop_superseded=False)  # resume is bit-identical
    # And a fresh run in a workdir whose metrics file is left from an earlier run (no checkpoints) starts afresh.
    shutil.rmtree(ckpt_dir)
    fresh = train(cfg(tmp_path / "restarted", 4))
    assert [r["step"] for r in read_metrics(fresh["metrics_path"], drop_superseded=False)] == [2, 4]


# --------------------------------------------------------------------------- #
# Issue 40 (and 39.13): strict JSON, arrays, several writers, TensorBoard, W&B, asynchronous transfer
# --------------------------------------------------------------------------- #


def _strict(line: str) -> dict:
    """json.loads as a strict reader (jq, JSON.parse) does it: NaN / Infinity are errors."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def test_nonfinite_values_are_strict_json_null_with_their_kind(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLogger(str(path))
    log(1, {"loss": jnp.float32(np.nan), "g": jnp.float32(np.inf), "h": jnp.float32(-np.inf), "ok": jnp.float32(2)})
    log(2, {"loss": jnp.float32(1.5), "g": jnp.float32(0.5), "h": jnp.float32(0), "ok": jnp.float32(2)})
    first, second = (_strict(line) for line in path.read_text().splitlines())
    assert first == {"step": 1, "loss": None, "g": None, "h": None, "ok": 2.0,
                     "nonfinite": {"loss": "nan", "g": "inf", "h": "-inf"}}
    assert second == {"step": 2, "loss": 1.5, "g": 0.5, "h": 0.0, "ok": 2.0}  # nothing to record: no key
    back = read_metrics(path)
    assert np.isnan(back[0]["loss"]) and back[0]["g"] == np.inf and back[0]["h"] == -np.inf
    assert "nonfinite" not in back[0] and back[1] == second
    # A file of older treetools (bare NaN) reads as before.
    (tmp_path / "old.jsonl").write_text('{"step": 3, "loss": NaN, "g": Infinity}\n')
    (old,) = read_metrics(tmp_path / "old.jsonl")
    assert np.isnan(old["loss"]) and old["g"] == np.inf


def test_treetools_plot_marks_a_step_written_as_null(tmp_path):
    pytest.importorskip("matplotlib")
    from treetools.cli.plot import plot_files

    path = tmp_path / "metrics.jsonl"
    log = MetricsLogger(str(path))
    for step in range(1, 6):
        log(step, {"loss": jnp.float32(np.nan if step == 3 else 1.0 / step)})
    (ax,) = plot_files([path]).axes
    marks = [c for c in ax.collections if c.get_gid() == "nonfinite"]
    assert [float(x) for x, _ in marks[0].get_offsets()] == [3.0]


def test_array_metrics_are_one_key_per_element_and_errors_name_the_key(tmp_path):
    seen = []
    log = MetricsLogger(lambda step, m: seen.append(m))
    log(1, {"v": jnp.array([1.0, 2.0]), "m": jnp.arange(4, dtype=jnp.int32).reshape(2, 2), "one": jnp.ones((1,))})
    assert seen == [{"v/0": 1.0, "v/1": 2.0, "m/0/0": 0, "m/0/1": 1, "m/1/0": 2, "m/1/1": 3, "one/0": 1.0}]
    # 39.13: these raised a bare TypeError from inside a comprehension, naming nothing.
    with pytest.raises(TypeError, match=r"metric `name` is a str.*not a number"):
        log(2, {"loss": jnp.float32(1), "name": "run-a"})
    with pytest.raises(ValueError, match=r"metric `big` has 5000 elements .*log a reduction"):
        log(3, {"big": jnp.ones(5000)})
    with pytest.raises(ValueError, match=r"`nonfinite` is reserved"):
        log(4, {"nonfinite": jnp.int32(0)})
    path = tmp_path / "m.jsonl"
    MetricsLogger(str(path))(5, {"layers": jnp.array([0.5, np.nan])})
    assert _strict(path.read_text()) == {"step": 5, "layers/0": 0.5, "layers/1": None, "nonfinite": {"layers/1": "nan"}}


def test_several_writers_get_the_same_numbers(tmp_path):
    seen = []
    with MetricsLogger([str(tmp_path / "m.jsonl"), lambda step, m: seen.append((step, m))], every=2) as log:
        for step in range(1, 5):
            log(step, {"loss": jnp.float32(step)})
    assert seen == [(2, {"loss": 2.0}), (4, {"loss": 4.0})]
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 2, "loss": 2.0}, {"step": 4, "loss": 4.0}]


def test_one_device_get_per_logged_step_started_early_when_asynchronous(monkeypatch):
    import jax

    gets, started = [], []
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: gets.append(sorted(x)) or real_get(x))
    seen = []
    log = MetricsLogger(lambda step, m: seen.append((step, m)), every=2, asynchronous=True)

    array_type = type(jnp.zeros(()))
    real_copy = array_type.copy_to_host_async
    monkeypatch.setattr(array_type, "copy_to_host_async", lambda self: started.append(float(self)) or real_copy(self))
    metrics = lambda s: {"loss": jnp.float32(s), "g": jnp.float32(10 * s)}  # noqa: E731
    assert log(2, metrics(2)) and seen == [] and gets == []  # queued: nothing waited for...
    assert sorted(started) == [2.0, 20.0]  # ...and both arrays' copies to the host already started
    assert not log(3, metrics(3)) and seen == [(2, {"loss": 2.0, "g": 20.0})]  # written at the next call
    assert gets == [["g", "loss"]]  # one device_get for the whole dict
    log(4, {"x": jnp.float32(4.0)})
    assert started[-1] == 4.0
    log.flush()
    assert seen[-1] == (4, {"x": 4.0}) and len(gets) == 2
    log.flush()
    assert len(seen) == 2  # nothing pending: nothing written twice


def test_asynchronous_logging_writes_what_synchronous_logging_writes(tmp_path):
    for name, asynchronous in (("sync.jsonl", False), ("async.jsonl", True)):
        with MetricsLogger(str(tmp_path / name), every=3, asynchronous=asynchronous) as log:
            for step in range(1, 11):
                log(step, {"loss": jnp.float32(1.0 / step), "layers": jnp.array([step, -step], jnp.float32)})
    assert (tmp_path / "sync.jsonl").read_text() == (tmp_path / "async.jsonl").read_text()
    assert [r["step"] for r in read_metrics(tmp_path / "async.jsonl")] == [3, 6, 9]


def test_tensorboard_events_read_back_with_tensorboards_own_reader(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def scalars(logdir):
        acc = event_accumulator.EventAccumulator(str(logdir))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    logdir = tmp_path / "tb"
    with MetricsLogger([tt.TensorBoardWriter(logdir), str(tmp_path / "m.jsonl")], every=2) as log:
        for step in range(1, 9):
            log(step, {"loss": jnp.float32(1.0 / step), "grad_norm/layers": jnp.array([step, 2 * step], jnp.float32),
                       "nonfinite_grads": jnp.int32(step == 6)})
    got = scalars(logdir)
    assert set(got) == {"loss", "grad_norm/layers/0", "grad_norm/layers/1", "nonfinite_grads"}
    np.testing.assert_allclose([v for _, v in got["loss"]], [1 / 2, 1 / 4, 1 / 6, 1 / 8], rtol=1e-6)
    assert got["grad_norm/layers/1"] == [(2, 4.0), (4, 8.0), (6, 12.0), (8, 16.0)]
    assert got["nonfinite_grads"] == [(2, 0.0), (4, 0.0), (6, 1.0), (8, 0.0)]
    # The JSONL beside it holds the same numbers.
    assert [r["grad_norm/layers/1"] for r in read_metrics(tmp_path / "m.jsonl")] == [4.0, 8.0, 12.0, 16.0]
    # Resumed from step 4: TensorBoard drops the events logged after it by the run that stopped.
    with MetricsLogger(tt.TensorBoardWriter(logdir, resume_step=4), every=2) as log:
        for step in range(5, 9):
            log(step, {"loss": jnp.float32(100.0 + step)})
    assert [(s, round(v, 4)) for s, v in scalars(logdir)["loss"]] == [(2, 0.5), (4, 0.25), (6, 106.0), (8, 108.0)]


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``run-*.wandb`` file with W&B's own Record class.

    The file is W&B's record log: a 7-byte header, then 32 KiB blocks of records, each with a 7-byte header
    (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last), as LevelDB's log format.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    pos, block, chunk, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_log_in_offline_mode(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="treetools-test")
    try:
        with MetricsLogger(lambda step, m: run.log(m, step=step), every=2, asynchronous=True) as log:
            for step in range(1, 7):
                log(step, {"loss": jnp.float32(1.0 / step), "grad_norm/layers": jnp.array([step, 0.5], jnp.float32)})
    finally:
        run.finish()
    import time

    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    for _ in range(100):  # W&B's service process may still be writing its file when finish() returns
        if len(history := _wandb_history(run_dir)) >= 3:
            break
        time.sleep(0.1)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in history]
    assert rows == [{"step": s, "loss": pytest.approx(1.0 / s), "grad_norm/layers/0": s, "grad_norm/layers/1": 0.5}
                    for s in (2, 4, 6)]
