"""Checkpoints written by older Orbax and Flax (fixtures from tests/fixtures/make_orbax_0_6.py).

orbax-checkpoint 0.6.4 / jax 0.4.31 / flax 0.8.5 wrote them; the truth is the arrays that script saved
(``orbax_0_6_truth.npz``). The current Orbax in .venv must not be needed to read them, and every reader
(inspect, --stats, load_parameters, restore_checkpoint, verify) must agree with the truth.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_tools.report import inspect_path

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MANAGER, PYTREE, NNX = (FIXTURES / f"orbax_0_6_{name}" for name in ("manager", "pytree", "nnx"))


@pytest.fixture(scope="module")
def truth():
    with np.load(FIXTURES / "orbax_0_6_truth.npz") as z:
        return {name: z[name] for name in z.files}


def _below(truth, prefix):
    return {k[len(prefix):]: v for k, v in truth.items() if k.startswith(prefix)}


def _assert_matches(flat, want):
    assert sorted(flat) == sorted(want)
    for path, value in want.items():
        np.testing.assert_array_equal(np.asarray(flat[path], np.float32) if value.dtype == np.float32
                                      and flat[path].dtype != np.float32 else flat[path], value, err_msg=path)


def _assert_stats(leaves, want):
    assert sorted(leaves) == sorted(want)
    for path, value in want.items():
        stats = leaves[path]["stats"]
        assert leaves[path]["shape"] == list(value.shape)
        assert stats["max"] == pytest.approx(float(value.max()), rel=1e-6), path
        assert stats["min"] == pytest.approx(float(value.min()), rel=1e-6), path
        assert stats["mean"] == pytest.approx(float(value.astype(np.float64).mean()), rel=1e-5, abs=1e-7), path


def _json_leaves(rep, item, i=0):
    return {leaf["path"]: leaf for leaf in rep["checkpoints"][i]["items"][item]["leaves"]}


def test_fixtures_are_small():
    for folder in (MANAGER, PYTREE, NNX):
        assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 200_000


def test_manager_two_items_inspect_stats_and_metadata(truth):
    rep = inspect_path(str(MANAGER), step="all", stats=True).to_json()
    assert rep["format"] == "orbax" and rep["steps"] == [1, 2] and rep["incomplete"] == []
    for i, step in enumerate((1, 2)):
        ckpt = rep["checkpoints"][i]
        assert ckpt["step"] == step and set(ckpt["items"]) == {"params", "extra"}
        assert ckpt["items"]["extra"]["value"] == {"epoch": step, "name": "run"}
        assert ckpt["metadata"]["saved_at"].startswith("2026-")
        _assert_stats(_json_leaves(rep, "params", i), _below(truth, f"manager/{step}/"))


def test_manager_load_parameters_restore_and_verify(truth):
    for step in (1, 2):
        _assert_matches(tt.flatten(tt.load_parameters(MANAGER, step=step)), _below(truth, f"manager/{step}/"))
    latest = tt.load_parameters(MANAGER)
    _assert_matches(tt.flatten(latest), _below(truth, "manager/2/"))
    restored = tt.restore_checkpoint(str(MANAGER), 1, {"params": tt.make_abstract(latest)})["params"]
    _assert_matches(tt.flatten(restored), _below(truth, "manager/1/"))
    assert main(["verify", str(MANAGER), "--step", "all"]) == 0


def test_pytree_checkpointer_folder_with_bf16(truth):
    want = _below(truth, "pytree/")
    leaves = _json_leaves(inspect_path(str(PYTREE), stats=True).to_json(), "default")
    assert leaves["h"]["dtype"] == "bfloat16" and leaves["w"]["dtype"] == "float32"
    _assert_stats(leaves, want)
    loaded = tt.flatten(tt.load_parameters(PYTREE))
    assert str(loaded["h"].dtype) == "bfloat16"
    _assert_matches(loaded, want)
    assert main(["verify", str(PYTREE)]) == 0


def test_flax_0_8_nnx_state_raw_value_is_dropped(truth, capsys):
    want = _below(truth, "nnx/")
    assert b"raw_value" in (NNX / "_METADATA").read_bytes()  # what flax 0.8's VariableState wrote
    rep = inspect_path(str(NNX), stats=True).to_json()
    leaves = _json_leaves(rep, "default")
    assert sorted(leaves) == ["bias", "kernel"]
    _assert_stats(leaves, want)
    loaded = tt.load_parameters(NNX)
    _assert_matches(tt.flatten(loaded), want)
    restored = tt.restore_checkpoint(str(NNX), None, {"default": tt.make_abstract(loaded)})["default"]
    _assert_matches(tt.flatten(restored), want)
    assert main(["inspect", str(NNX), "--show", "kernel[0]"]) == 0
    out = capsys.readouterr().out
    assert "raw_value" not in out and f"{want['kernel'][0, 0]:.4g}"[:5] in out
