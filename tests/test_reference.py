"""End to end: the reference trainer on 8 fake devices, its checkpoint read by the CLI."""

import json
import re
import shutil

import flax.linen as nn
import jax
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main as cli_main
from treetools.reference.model import ModelConfig
from treetools.reference.train import TrainConfig, train

N = 8


def _cfg(workdir, steps, **kw):
    return TrainConfig(workdir=str(workdir), steps=steps, **{"ckpt_every": N, "log_every": 2, "quiet": True, **kw})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2N steps in one run."""
    return train(_cfg(tmp_path_factory.mktemp("straight"), 2 * N))


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    """A run of N steps that ended there: the run the resume tests continue, each in a copy of its own."""
    return train(_cfg(tmp_path_factory.mktemp("half"), N))


def _copy_of(run, workdir):
    """``run``'s workdir (checkpoints, metrics.jsonl) copied into ``workdir``: a stopped run to resume there."""
    shutil.copytree(run["checkpoint_dir"], workdir / "checkpoints")
    shutil.copy(run["metrics_path"], workdir / "metrics.jsonl")


def _host(tree):
    return jax.tree.leaves(jax.device_get(tt.unbox_tree(tree)))


def test_resume_is_bit_identical(straight, half, tmp_path):
    assert half["start_step"] == 0
    _copy_of(half, tmp_path)
    # progress lines go where `log` says (`treetools train` passes its own, which a closed pipe cannot stop)
    lines: list[str] = []
    resumed = train(_cfg(tmp_path, 2 * N, quiet=False, log=lines.append))
    assert resumed["start_step"] == N
    assert lines and all(isinstance(line, str) for line in lines)
    assert any(re.search(rf"^step +{2 * N}/", line) for line in lines)
    for key in ("params", "params_ema", "opt_state"):
        a, b = _host(straight["state"][key]), _host(resumed["state"][key])
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y, err_msg=key)


def test_params_are_fsdp_sharded_over_all_devices(straight):
    kernel = straight["state"]["params"]["layers_0"]["up"]["kernel"]
    assert isinstance(kernel, nn.Partitioned) and kernel.names == ("fsdp", None)
    value = tt.unbox(kernel)
    assert len(value.sharding.device_set) == 8 and not value.sharding.is_fully_replicated


def test_loss_goes_down_and_metrics_logged(tmp_path):
    result = train(_cfg(tmp_path, 40, decay_steps=40))
    records = [json.loads(line) for line in open(result["metrics_path"])]
    assert [r["step"] for r in records] == list(range(2, 41, 2))
    for key in ("loss", "grad_norm", "param_norm", "update_norm", "update_ratio", "nonfinite_grads"):
        assert key in records[-1], key
    assert records[-1]["nonfinite_grads"] == 0
    np.testing.assert_allclose(records[-1]["update_ratio"], records[-1]["update_norm"] / records[-1]["param_norm"],
                               rtol=1e-5)
    # ln(64) = 4.16 untrained; the task's floor is about 0.73 nats.
    assert records[0]["loss"] > 3.5 and records[-1]["loss"] < 2.0


def test_inspect_reads_the_trainers_checkpoint(straight, capsys):
    code = cli_main(["inspect", straight["checkpoint_dir"], "--format", "json"])
    assert code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "orbax" and out["steps"] == [N, 2 * N] and out["checkpoints"][0]["step"] == 2 * N
    items = out["checkpoints"][0]["items"]
    assert list(items)[:3] == ["params", "params_ema", "opt_state"]
    params = straight["state"]["params"]
    assert items["params"]["total_params"] == tt.get_num_params(params)
    assert items["params"]["total_bytes"] == tt.get_num_bytes(params)
    assert items["opt_state"]["total_params"] == tt.get_num_params(straight["state"]["opt_state"])
    leaves = {leaf["path"]: leaf for leaf in items["params"]["leaves"]}
    live = tt.flatten(params)
    assert set(leaves) == set(live)
    kernel = leaves["layers_0/up/kernel"]
    assert kernel["shape"] == list(tt.unbox(live["layers_0/up/kernel"]).shape)
    assert kernel["sharding"]["spec"][0] == "fsdp" and kernel["sharding"]["mesh"] == {"data": 4, "fsdp": 2}


def test_each_checkpoint_holds_its_steps_metrics_and_inspect_step_all_shows_them(straight, capsys):
    # Issue 39.4: the README says `inspect --step all` shows "saved, metrics, params, size", but the trainer saved
    # no metrics, so the demo had no metrics column. Truth: the MetricsLogger's own records of the saved steps.
    from treetools.reference.train import CHECKPOINT_METRICS
    from treetools.shared.render import format_stat

    with open(straight["metrics_path"]) as f:
        logged = {r["step"]: r for r in map(json.loads, f)}
    root = straight["checkpoint_dir"]
    assert cli_main(["inspect", root, "--step", "all", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in data["checkpoints"]] == [N, 2 * N]
    for checkpoint in data["checkpoints"]:
        want = {k: logged[checkpoint["step"]][k] for k in CHECKPOINT_METRICS}
        assert checkpoint["metadata"]["metrics"] == want
    assert cli_main(["inspect", root, "--step", "all"]) == 0  # the demo's view, as the README shows it
    lines = capsys.readouterr().out.splitlines()
    header = next(line.split() for line in lines if line.startswith("step "))
    assert header == ["step", "saved", *CHECKPOINT_METRICS, "params", "size"]
    for step in (N, 2 * N):
        row = next(line.split() for line in lines if line.split()[:1] == [str(step)])
        assert row[2:2 + len(CHECKPOINT_METRICS)] == [format_stat(logged[step][k]) for k in CHECKPOINT_METRICS]


def test_load_parameters_matches_live_ema(straight):
    loaded = tt.load_parameters(straight["checkpoint_dir"], use_ema_params=True)
    live = tt.flatten(tt.unbox_tree(straight["state"]["params_ema"]))
    flat = tt.flatten(loaded)
    assert set(flat) == set(live)
    for path, value in live.items():
        np.testing.assert_array_equal(np.asarray(flat[path]), np.asarray(value), err_msg=path)


def test_plot_writes_a_png(straight, tmp_path):
    out = tmp_path / "norms.png"
    assert cli_main(["plot", straight["metrics_path"], "-o", str(out)]) in (0, None)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0  # not a blank canvas


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "missing.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("treetools: error:") and "missing.jsonl" in err and "\n" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    assert cli_main(["plot", str(bad)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_freeze_embeddings_keeps_them_exactly(tmp_path):
    from treetools.reference.train import build

    cfg = _cfg(tmp_path, 4, freeze_embeddings=True)
    made = build(cfg)[2]["params"]  # the initial params, as the run starts from them
    initial = jax.device_get(tt.unbox(made["embed"]["embedding"]))
    start = jax.device_get(tt.unbox(made["layers_0"]["up"]["kernel"]))
    result = train(cfg)
    params = result["state"]["params"]
    np.testing.assert_array_equal(np.asarray(tt.unbox(params["embed"]["embedding"])), initial)
    # Everything else trained: the first block's kernel moved.
    assert not np.array_equal(np.asarray(tt.unbox(params["layers_0"]["up"]["kernel"])), start)


# --------------------------------------------------------------------------- #
# --scan-layers: the blocks under nn.scan, norms logged per layer
# --------------------------------------------------------------------------- #


def _scan_cfg(workdir, steps):
    return _cfg(workdir, steps, model=ModelConfig(scan_layers=True))


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
    """2N steps of the scanned model in one run."""
    return train(_scan_cfg(tmp_path_factory.mktemp("scanned"), 2 * N))


def _records(result):
    return [json.loads(line) for line in open(result["metrics_path"])]


def test_scanned_blocks_are_stacked_leaves_with_the_layers_name(scanned):
    n_layers, d = ModelConfig().n_layers, ModelConfig().d_model
    params = scanned["state"]["params"]
    assert not any(k.startswith("layers_") for k in params)
    kernel = params["layers"]["qkv"]["kernel"]
    # nn.scan put the partition name `layers` at the stacked axis; the rules keep it replicated.
    assert kernel.names == ("layers", "fsdp", None) and tt.unbox(kernel).shape == (n_layers, d, 3 * d)
    assert tt.unbox(kernel).sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    # The same parameters as the unscanned model, stacked: the same count.
    from treetools.reference.train import build

    assert tt.get_num_params(params) == tt.get_num_params(jax.eval_shape(lambda: build(_cfg("unused", 1))[2]["params"]))


def test_per_layer_norms_are_logged_both_ways(straight, scanned):
    n_layers = ModelConfig().n_layers
    flat, stacked = _records(straight)[-1], _records(scanned)[-1]
    for kind in ("grad_norm", "param_norm", "update_norm"):
        assert {f"{kind}/layers_{i}" for i in range(n_layers)} <= set(flat)
        assert not any(k.startswith(f"{kind}/layers/") for k in flat)
        assert {f"{kind}/layers/{i}" for i in range(n_layers)} <= set(stacked)
        assert not any(k.startswith(f"{kind}/layers_") for k in stacked)
        # Per layer and per module add up to the global norm (sqrt of summed squares).
        for record in (flat, stacked):
            parts = [v for k, v in record.items() if k.startswith(f"{kind}/")]
            np.testing.assert_allclose(np.sqrt(np.sum(np.square(parts))), record[kind], rtol=1e-5)
    # The logged param norms of each layer are those of the live params' slices (float64 by hand).
    params = tt.flatten(tt.unbox_tree(scanned["state"]["params"]))
    for i in range(n_layers):
        want = np.sqrt(sum(np.sum(np.asarray(v, np.float64)[i] ** 2)
                           for k, v in params.items() if k.startswith("layers/")))
        np.testing.assert_allclose(stacked[f"param_norm/layers/{i}"], want, rtol=1e-5)


def test_per_layer_heatmap_of_the_scanned_run(scanned, tmp_path):
    import matplotlib.image

    out = tmp_path / "layers.png"
    assert cli_main(["plot", scanned["metrics_path"], "--heatmap", r"grad_norm/layers/(\d+)$", "-o", str(out)]) == 0
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 100 and img.shape[1] > 300 and img.std() > 0
    assert cli_main(["plot", scanned["metrics_path"], "-o", str(tmp_path / "norms.png")]) == 0  # per-layer panels too


def test_scanned_resume_is_bit_identical(scanned, tmp_path):
    first = train(_scan_cfg(tmp_path, N))
    resumed = train(_scan_cfg(tmp_path, 2 * N))
    assert (first["start_step"], resumed["start_step"]) == (0, N)
    for key in ("params", "params_ema", "opt_state"):
        a, b = _host(scanned["state"][key]), _host(resumed["state"][key])
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y, err_msg=key)
    # The checkpoint holds the stacked leaves, read back without model code.
    loaded = tt.flatten(tt.load_parameters(resumed["checkpoint_dir"]))
    live = tt.flatten(tt.unbox_tree(resumed["state"]["params"]))
    assert set(loaded) == set(live) and loaded["layers/up/kernel"].shape[0] == ModelConfig().n_layers
    for path, value in live.items():
        np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(value), err_msg=path)


def test_a_resumed_run_keeps_its_scan_setting_whatever_the_flag(straight, half, tmp_path, capsys):
    # Issue 39, point 10: `train --workdir RUN --scan-layers` on a run saved without it failed with a
    # 144-problem, 15k-character line. The run keeps the layout its checkpoint has, and a note says so.
    _copy_of(half, tmp_path)  # a run of N steps saved without --scan-layers
    capsys.readouterr()
    argv = ["train", "--workdir", str(tmp_path), "--steps", str(2 * N), "--ckpt-every", str(N), "--log-every", "2",
            "--quiet"]
    assert cli_main([*argv, "--scan-layers"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"treetools: note: {tmp_path / 'checkpoints'} was saved without --scan-layers (its params are "
                   "layers_0/...); resuming it without --scan-layers (a run keeps its setting; use a new --workdir "
                   "to train the other way)."]
    # Unscanned to the end: step 2N is the straight run's step 2N, bit for bit; the logs are per block.
    loaded = tt.flatten(tt.load_parameters(tmp_path / "checkpoints", 2 * N))
    live = tt.flatten(tt.unbox_tree(straight["state"]["params"]))
    assert set(loaded) == set(live) and "layers_0/up/kernel" in loaded
    for path, value in live.items():
        np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(value), err_msg=path)
    last = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert last["step"] == 2 * N and "grad_norm/layers_0" in last
def test_the_trainer_prints_its_memory_plan_one_line_per_part(tmp_path, capsys):
    # Issue 41: at start, the fullest device's bytes of each part of the trainer's own state, grads included.
    from treetools.shared.rows import human

    result = train(TrainConfig(workdir=str(tmp_path), steps=1, ckpt_every=1, log_every=1))
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("memory per device, mesh data=4 x fsdp=2"))
    lines = {line.split()[0]: line.split()[1:3] for line in out[start + 1:start + 6]}
    assert list(lines) == ["params", "grads", "opt_state", "params_ema", "total"]
    state = result["state"]
    held = {}
    for part in ("params", "opt_state", "params_ema"):  # the truth: jax's own shards of what was trained
        per_device: dict = {}
        for leaf in jax.tree.leaves(tt.unbox_tree(state[part])):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        held[part] = max(per_device.values())
    for part in ("params", "opt_state", "params_ema"):
        assert " ".join(lines[part]) == human(held[part], "B"), part
    assert lines["grads"] == lines["params"]  # float32 params: grads alike
# --------------------------------------------------------------------------- #
# Issue 40: --health and --inject-spike
# --------------------------------------------------------------------------- #

SPIKE = 28


def test_inject_spike_is_detected_attributed_dumped_skipped_and_plotted(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from treetools.checkpoint_tools.healthplot import read_health_dump

    # Checkpoints at every step from SPIKE - 1 on: the steps before and at the bad batch, read back below.
    cfg = dict(log_every=4, health=True, health_warmup=12, ckpt_every=1, max_to_keep=None)
    spiked = train(_cfg(tmp_path / "spiked", SPIKE + 6, inject_spike=SPIKE, **cfg))
    flagged = [e for e in spiked["health_events"] if e["event"] == "flagged"]
    assert [e["step"] for e in flagged] == [SPIKE]  # detected, and nothing else flagged
    (event,) = flagged
    assert "spike in grad_norm" in event["reasons"][0] and event["attributed"][0].startswith("layers_")
    assert min(event["ratios"].values()) > 5  # every module's gradient jumped; the first named jumped most
    assert event["ratios"][event["attributed"][0]] == max(event["ratios"].values())
    (dump_event,) = [e for e in spiked["health_events"] if e["event"] == "dump"]
    assert dump_event["step"] == SPIKE + 4 and dump_event["path"].endswith(f"health_{SPIKE + 4:08d}.json")
    dump = read_health_dump(dump_event["path"])
    assert [r["step"] for r in dump["records"]] == list(range(SPIKE + 4 - 31, SPIKE + 5))  # the ring: 32 steps
    assert [r["step"] for r in dump["records"] if r["flagged"]] == [SPIKE]
    assert dump["flagged"][0]["attributed"] == event["attributed"]
    # The update was skipped: the run's params, EMA and moments saved at SPIKE are those saved at SPIKE - 1 (and
    # the step before changed them: a skip, not a run that stopped learning).
    ckpts = spiked["checkpoint_dir"]
    for key in ("params", "params_ema", "opt_state"):
        at = {s: tt.flatten(tt.load_parameters(ckpts, s, item=key)) for s in (SPIKE - 2, SPIKE - 1, SPIKE)}
        assert set(at[SPIKE]) == set(at[SPIKE - 1])
        for path in at[SPIKE]:
            np.testing.assert_array_equal(at[SPIKE][path], at[SPIKE - 1][path], err_msg=f"{key}/{path}")
        assert any(not np.array_equal(at[SPIKE - 1][p], at[SPIKE - 2][p]) for p in at[SPIKE] if "count" not in p)
    # Per-layer health in the metrics file, logged every 4 steps.
    record = tt.read_metrics(spiked["metrics_path"])[-1]
    for key in ("update_ratio/layers_0", "nonfinite_grads/layers_1", "grad_abs_max/embed", "mu_norm/layers_0",
                "nu_norm", "flagged"):
        assert key in record, key
    # The plot of the dump names the layer.
    png = tmp_path / "spike.png"
    assert cli_main(["plot", dump_event["path"], "-o", str(png)]) == 0 and png.read_bytes().startswith(b"\x89PNG")


def test_a_short_health_run_passes_the_nonfinite_check(tmp_path, capsys):
    # Fewer steps than the ring holds: its empty rows are in the checkpoint, and are no NaN (README's check).
    run = train(_cfg(tmp_path, 4, ckpt_every=4, health=True, health_length=8, health_warmup=2))
    recorder = jax.device_get(run["state"]["health"]["recorder"])
    assert [r["step"] for r in tt.HealthRecorder.rows(recorder)] == [1, 2, 3, 4]  # 4 of 8 rows written
    capsys.readouterr()
    rc = cli_main(["inspect", run["checkpoint_dir"], "--item", "health", "--stats", "--fail-on-nonfinite",
                   "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    leaves = {leaf["path"]: leaf for leaf in json.loads(out)["checkpoints"][0]["items"]["health"]["leaves"]}
    assert leaves["recorder/values"]["shape"][0] == 8 and leaves["recorder/values"]["stats"]["nan"] == 0


def test_health_resume_continues_the_detector_and_the_ring(tmp_path):
    cfg = dict(health=True, health_warmup=4, health_length=8)
    straight = train(_cfg(tmp_path / "straight", 2 * N, **cfg))
    train(_cfg(tmp_path / "resumed", N, **cfg))
    resumed = train(_cfg(tmp_path / "resumed", 2 * N, **cfg))
    assert resumed["start_step"] == N
    a, b = jax.device_get(straight["state"]["health"]), jax.device_get(resumed["state"]["health"])
    assert [r["step"] for r in tt.HealthRecorder.rows(b["recorder"])] == list(range(2 * N - 7, 2 * N + 1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)  # bit-identical to the straight run: the ring and the statistics
