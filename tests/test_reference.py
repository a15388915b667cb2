"""End to end: the reference trainer on 8 fake devices, its checkpoint read by the CLI."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main as cli_main
from treetools.reference.train import TrainConfig, train

N = 8


def _cfg(workdir, steps, **kw):
    return TrainConfig(workdir=str(workdir), steps=steps, ckpt_every=N, log_every=2, quiet=True, **kw)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2N steps in one run."""
    return train(_cfg(tmp_path_factory.mktemp("straight"), 2 * N))


def _host(tree):
    return jax.tree.leaves(jax.device_get(tt.unbox_tree(tree)))


def test_resume_is_bit_identical(straight, tmp_path):
    first = train(_cfg(tmp_path, N))
    assert first["start_step"] == 0
    resumed = train(_cfg(tmp_path, 2 * N))
    assert resumed["start_step"] == N
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
    initial = jax.device_get(tt.unbox(build(cfg)[2]["params"]["embed"]["embedding"]))
    result = train(cfg)
    params = result["state"]["params"]
    np.testing.assert_array_equal(np.asarray(tt.unbox(params["embed"]["embedding"])), initial)
    # Everything else trained: the first block's kernel moved.
    start = jax.device_get(tt.unbox(build(cfg)[2]["params"]["layers_0"]["up"]["kernel"]))
    assert not np.array_equal(np.asarray(tt.unbox(params["layers_0"]["up"]["kernel"])), start)
