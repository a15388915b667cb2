"""``load_parameters`` and ``convert``'s default item find the parameters where trainers keep them (issue 37).

Layouts written by their owners' code: the Flax checkpointing guide's ``{"model": {"params"}, "config", "data"}``
(Orbax StandardCheckpointer), a vit_jax-style tuple ``(params, opt_state, step)`` (flax msgpack), a state under
``state/params`` (Orbax), a train state whose parameters are its one subtree beside ``opt_state`` and ``step``,
and one whose parameters are nowhere known (refused, listing the candidates with their sizes). A note says which
path was taken; ``item=`` still chooses.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.serialization import to_bytes

import treetools as tt
from tests._every_command import (check_convert, check_inspect, check_load_parameters, check_restore, check_show,
                                  check_stats, check_verify, run)


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




def _pax_state(step: int, delta: float = 0.0) -> dict:
    """A praxis ``TrainState(step, mdl_vars, opt_states)`` as a dict: ``mdl_vars`` holds the variables the model
    applies (collection ``params``, and ``non_trainable`` batch statistics), ``opt_states`` one entry per
    optimizer (a list)."""
    rng = np.random.default_rng(step)
    mdl_vars = {"params": {"lm": {"softmax": {"w": rng.standard_normal((4, 6)).astype(np.float32) + delta},
                                  "embedding": {"emb_var": rng.standard_normal((6, 4)).astype(np.float32)}}},
                "non_trainable": {"lm": {"bn": {"moving_mean": np.full(4, step, np.float32)}}}}
    opt = {"count": np.asarray(step, np.int32), "m": {"params": {"lm": {"softmax": {"w": np.zeros((4, 6), np.float32)}}}}}
    return {"step": np.asarray(step, np.int32), "mdl_vars": mdl_vars, "opt_states": [opt]}


def _pax_names(state: dict) -> dict[str, np.ndarray]:
    """paxml's array names (paxml/checkpoints.py ``_extract_nested_prefix_names`` at google/paxml commit
    6bcd8a52fc6a19fd7e2163c4360f1181c1c51ad1, through praxis ``py_utils.extract_prefixed_keys_from_nested_map``
    with ``key_separator='.'``, ``left_separator='_'``, ``right_separator=''``): dict keys joined with ``.``, a
    list's entries as ``<name>_<i>`` (``opt_states_0.count``)."""
    out = {}
    for path, value in _flat(state).items():
        head, *rest = path.split("/")
        if head == "opt_states":
            head, rest = f"opt_states_{rest[0]}", rest[1:]
        out[".".join([head, *rest])] = value
    return out


def write_pax_run(root, steps=(100, 200), *, delta: float = 0.0) -> dict[int, dict]:
    """paxml's GDA checkpoints: ``checkpoint_<step:08d>/`` (paxml's ``checkpoint_name``), one TensorStore array
    per leaf in a folder named by its paxml name, written by jax's own ``async_serialize`` (as paxml's
    ``GlobalAsyncCheckpointManager`` path called it)."""
    from tests.test_format_zarr_tree import _async_serialize

    truth = {}
    for step in steps:
        truth[step] = _pax_state(step, delta)
        for name, value in _pax_names(truth[step]).items():
            _async_serialize(str(root / f"checkpoint_{step:08d}" / name), value)
    return truth


def test_praxis_mdl_vars_are_the_params(tmp_path):
    # Issue 49: a paxml TrainState's parameters are its `mdl_vars` (load_parameters listed it as a candidate and
    # stopped): read by every command, through the zarr-tree reader (per-leaf folders) and Orbax.
    root = tmp_path / "pax"
    truth = write_pax_run(root)
    whole = {name.replace(".", "/"): v for name, v in _pax_names(truth[200]).items()}  # the writer's names
    params = _flat(truth[200]["mdl_vars"])
    report = check_inspect(root, whole)
    assert report["format"] == "zarr-tree" and report["steps"] == [100, 200]
    check_load_parameters(root, params)
    check_load_parameters(root, _flat(truth[100]["mdl_vars"]), step=100)
    check_stats(root, whole)
    check_show(root, whole)
    check_verify(root, "--step", "all")
    rules = tt.Rules(rename=[(r"^mdl_vars/params/lm/", "mdl_vars/params/decoder/")])
    check_restore(root, whole, item="default", rules=rules,
                  expect={k.replace("mdl_vars/params/lm/", "mdl_vars/params/decoder/"): v for k, v in whole.items()})
    check_convert(root, params, tmp_path / "c")  # convert's default item: the same params
    other = tmp_path / "other"
    write_pax_run(other, delta=0.5)
    rc, out, err = run("diff", root, other, "--values", "--format", "json")
    differing = [row["path"] for row in json.loads(out)["values"] if not row["bit_identical"]]
    assert rc == 1 and differing == ["mdl_vars/params/lm/softmax/w"], differing
    # Orbax (newer paxml saves the TrainState as a pytree through Orbax): the same params.
    path = _orbax(tmp_path / "orbax_pax", jax.tree.map(jnp.asarray, truth[200]))
    check_load_parameters(path, params)


def _maxtext_quantized(delta: float = 0.0) -> dict:
    """What MaxText's engine saves for AQT-quantized serving (AI-Hypercomputer/maxtext ``MaxText/maxengine.py``
    ``load_params`` at commit afdb4ba2c09d4e1fcae3403d59c9c7ca1fa3d74a): ``{"aqt": new_vars["aqt"], "params":
    remove_quantized_params(params, aqt)}``; each quantized kernel's ``AqtDotGeneral_0/qrhs/frozen`` holds AQT's
    ``QTensor`` (``qvalue`` int8, ``scale`` a list of float32 arrays), and ``remove_quantized_params`` puts ``{}``
    where the kernel was (``MaxText/layers/quantizations.py``)."""
    rng = np.random.default_rng(0)

    def frozen(shape):
        return {"AqtDotGeneral_0": {"qrhs": {"frozen": {
            "qvalue": rng.integers(-127, 128, shape, dtype=np.int8),
            "scale": [(rng.random((1, shape[1])) + delta).astype(np.float32)]}}}}

    attention = {"query": frozen((4, 8)), "key": frozen((4, 8)), "out": frozen((8, 4))}
    params = {"decoder": {"layers": {
        "self_attention": {"query": {"kernel": {}}, "key": {"kernel": {}}, "out": {"kernel": {}}},
        "pre_self_attention_layer_norm": {"scale": np.ones(4, np.float32)},
        "mlp": {"wi": {"kernel": rng.standard_normal((4, 16)).astype(np.float32)}}},
        "decoder_norm": {"scale": np.ones(4, np.float32)}},
        "token_embedder": {"embedding": rng.standard_normal((11, 4)).astype(np.float32)}}
    return {"aqt": {"decoder": {"layers": {"self_attention": attention}}}, "params": params}


def test_maxtext_aqt_quantized_params_are_read_as_stored(tmp_path):
    # Issue 49: the quantized values and scales under `aqt/` were missing from load_parameters (it took
    # `params/params`, 6 of the leaves): a variables dict with collections beside `params` is the params, whole.
    # MaxText's `save_params_to_path(dir, params)` saves {"params": params} through
    # `ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=True)` (MaxText/checkpointing.py).
    quantized = _maxtext_quantized()
    path = tmp_path / "quantized"
    with ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=True) as ckptr:
        ckptr.save(path, jax.tree.map(jnp.asarray, {"params": quantized}))
    truth = _flat(quantized)  # the `{}` left where a kernel was holds no array
    assert sum(k.startswith("aqt/") for k in truth) == 6 and len(truth) == 10
    assert truth["aqt/decoder/layers/self_attention/query/AqtDotGeneral_0/qrhs/frozen/qvalue"].dtype == np.int8
    check_load_parameters(path, truth)
    whole = {f"params/{k}": v for k, v in truth.items()}
    check_inspect(path, whole)
    check_stats(path, whole)
    check_show(path, whole)
    check_verify(path)
    rules = tt.Rules(rename=[(r"/AqtDotGeneral_0/qrhs/frozen/", "/int8/")])
    check_restore(path, whole, item="default", rules=rules,
                  expect={k.replace("/AqtDotGeneral_0/qrhs/frozen/", "/int8/"): v for k, v in whole.items()})
    check_convert(path, truth, tmp_path / "c")  # convert's default item: the same tree, int8 values and scales
    other = tmp_path / "other"
    with ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=True) as ckptr:
        ckptr.save(other, jax.tree.map(jnp.asarray, {"params": _maxtext_quantized(delta=0.5)}))
    rc, out, err = run("diff", path, other, "--values", "--format", "json")
    differing = sorted(row["path"] for row in json.loads(out)["values"] if not row["bit_identical"])
    assert rc == 1 and len(differing) == 3 and all(p.endswith("/qrhs/frozen/scale/0") for p in differing), differing
    # A params-only MaxText checkpoint (no quantization: one collection) still gives its `params` collection.
    plain = {"params": {"decoder": {"decoder_norm": {"scale": np.ones(4, np.float32)}}}}
    check_load_parameters(_orbax(tmp_path / "plain", {"params": plain}), _flat(plain["params"]))
