"""``load_parameters`` and ``convert``'s default item find the parameters where trainers keep them (issue 37).

Layouts written by their owners' code: the Flax checkpointing guide's ``{"model": {"params"}, "config", "data"}``
(Orbax StandardCheckpointer), a vit_jax-style tuple ``(params, opt_state, step)`` (flax msgpack), a state under
``state/params`` (Orbax), a train state whose parameters are its one subtree beside ``opt_state`` and ``step``,
and one whose parameters are nowhere known (refused, listing the candidates with their sizes). A note says which
path was taken; ``item=`` still chooses. Flax checkpoints named by a metric (``best_acc_0.5``) read at the root.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.serialization import to_bytes
from flax.training import checkpoints

import treetools as tt
from tests._every_command import check_convert, check_inspect, check_load_parameters, inspect_json, run


def _params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"Dense_0": {"kernel": rng.standard_normal((3, 2)).astype(np.float32), "bias": np.zeros(2, np.float32)}}


def _flat(tree):
    return {k: np.asarray(v) for k, v in tt.flatten(tree).items()}


def _orbax(path, tree):
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, jax.tree.map(jnp.asarray, tree))
    return path


def test_flax_guide_model_params(tmp_path, caplog):
    # flax's checkpointing guide saves {"model": state, "config": ..., "data": ...}; state.params under model.
    path = _orbax(tmp_path / "guide", {"model": {"params": _params(), "step": np.asarray(3, np.int32)},
                                         "config": {"dimensions": np.asarray([3, 2], np.int32)}, "data": [np.ones(4)]})
    with caplog.at_level(logging.INFO, logger="treetools"):
        check_load_parameters(path, _flat(_params()))
    assert "parameters taken from `model/params` of item `default`" in caplog.text
    rc, out, err = run("convert", path, tmp_path / "out.safetensors")
    assert rc == 0 and "model/params" in err, err
    check_convert(path, _flat(_params()), tmp_path / "c")
    check_load_parameters(path, {"dimensions": np.asarray([3, 2], np.int32)}, item="config")  # item= still chooses


def test_vit_jax_tuple_first_element(tmp_path):
    path = tmp_path / "vit.msgpack"
    opt = {"mu": _params(1)}
    path.write_bytes(to_bytes((_params(), opt, np.asarray(100, np.int32))))  # flax stores a tuple as keys 0, 1, 2
    check_load_parameters(path, _flat(_params()))
    check_load_parameters(path, _flat(opt), item="1")


def test_state_params_and_the_one_subtree_beside_the_bookkeeping(tmp_path):
    path = _orbax(tmp_path / "state", {"state": {"params": _params(), "opt_state": {"mu": _params(2)}}})
    check_load_parameters(path, _flat(_params()))
    path = _orbax(tmp_path / "net", {"net": _params(), "opt_state": {"mu": _params(2)},
                                     "step": np.asarray(5, np.int32)})
    check_load_parameters(path, _flat(_params()))


def test_no_known_place_lists_the_candidates(tmp_path):
    path = _orbax(tmp_path / "two", {"encoder": _params(), "decoder": _params(1), "opt_state": {"mu": _params(2)},
                                     "step": np.asarray(5, np.int32)})
    with pytest.raises(tt.CheckpointNotFoundError) as e:
        tt.load_parameters(path)
    message = str(e.value)
    for part in ("`default/encoder` (8 elements, 32 bytes)", "`default/decoder`", "`default/opt_state`", "item="):
        assert part in message, message
    check_load_parameters(path, _flat(_params(1)), item="decoder")
    check_load_parameters(path, _flat(_params(1)), item="default/decoder")
    rc, out, err = run("convert", path, tmp_path / "out.safetensors")
    assert rc == 1 and "candidates" in err


@pytest.fixture
def flax_mode():
    import flax

    before = flax.config.flax_use_orbax_checkpointing
    yield lambda orbax: flax.config.update("flax_use_orbax_checkpointing", orbax)
    flax.config.update("flax_use_orbax_checkpointing", before)


def test_flax_checkpoints_named_by_a_metric(tmp_path, flax_mode):
    for orbax_mode in (False, True):
        folder = tmp_path / f"best_{orbax_mode}"
        flax_mode(orbax_mode)
        states = {}
        for acc in (0.5, 0.5625, 0.625):  # improving accuracies, saved as they come
            states[acc] = {"params": _params(int(acc * 16)), "step": np.asarray(int(acc * 16), np.int32)}
            checkpoints.save_checkpoint(folder, states[acc], step=acc, prefix="best_acc_", keep=5, overwrite=True)
        latest = checkpoints.latest_checkpoint(folder, prefix="best_acc_")
        assert latest.endswith("best_acc_0.625")  # flax's own choice
        report = inspect_json(folder)
        assert report["format"] == "flax-legacy"
        assert list(report["checkpoints"][0]["items"]) == ["best_acc_0.5", "best_acc_0.5625", "best_acc_0.625"]
        check_load_parameters(folder, _flat(states[0.625]["params"]))
        check_load_parameters(folder, _flat(states[0.5]), item="best_acc_0.5")
        check_inspect(folder, _flat(states[0.5625]), item="best_acc_0.5625")
        assert run("verify", folder)[0] == 0
