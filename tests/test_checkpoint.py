"""treetools.checkpoint_jax.manager and treetools.checkpoint_jax.restore on 8 fake CPU devices: save, restore on other meshes, mismatches, load_parameters."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import treetools as ckpt
from treetools.checkpoint_io import steps
from treetools.pytree.abstract import make_abstract
from treetools.pytree.partitioning import unbox
from treetools.pytree.paths import flatten, is_leaf

N_LAYERS = 12
STEPS = (10, 20)


def _mesh(k: int, axis: str) -> jax.sharding.Mesh:
    return jax.make_mesh((k,), (axis,), devices=jax.devices()[:k])


def host_params(seed: int, n_layers: int = N_LAYERS) -> dict:
    """float32 numpy params: a boxed-to-be embedding, a list of layers, a scale."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {
        "embed": f32(16, 8),
        "layers": [{"w": f32(8, 16), "b": f32(16)} for _ in range(n_layers)],
        "scale": f32(8),
    }


def fsdp_params(host: dict) -> dict:
    """On 8 devices: embed boxed and fsdp-sharded on rows, w on columns, the rest replicated."""
    mesh = _mesh(8, "fsdp")
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    return {
        "embed": nn.Partitioned(put(host["embed"], "fsdp", None), names=("fsdp", None)),
        "layers": [{"w": put(layer["w"], None, "fsdp"), "b": put(layer["b"])} for layer in host["layers"]],
        "scale": put(host["scale"]),
    }


def tp_shardings(params: dict, k: int) -> dict:
    """Tensor-parallel specs on a k-device mesh: embed on columns, w on rows, b sharded."""
    mesh = _mesh(k, "tp")
    ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    return {
        "embed": ns(None, "tp"),
        "layers": [{"w": ns("tp", None), "b": ns("tp")} for _ in params["layers"]],
        "scale": ns(),
    }


def host_of(tree) -> dict:
    """``{path: numpy array}`` of any tree, boxes unwrapped."""
    return {p: np.asarray(jax.device_get(unbox(x))) for p, x in flatten(tree).items()}


def assert_tree_equal(tree, expected_host: dict) -> None:
    got = host_of(tree)
    assert got.keys() == expected_host.keys()
    for path, value in expected_host.items():
        assert got[path].dtype == value.dtype, path
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def train_state(seed: int) -> dict:
    """Everything a trainer saves at one step, plus the host copies to compare with."""
    host = host_params(seed)
    params = fsdp_params(host)
    ema_host = jax.tree.map(lambda x: x * np.float32(0.5), host)
    tx = optax.adamw(1e-3)
    plain = nn.unbox(params)
    opt_state = tx.init(plain)
    _, opt_state = tx.update(plain, opt_state, plain)  # non-zero mu / nu / count
    data_iter = {"epoch": seed, "position": [seed, 7], "name": "shard-0", "done": None, "lr": 0.5}
    return {
        "items": {"params": params, "params_ema": fsdp_params(ema_host), "opt_state": opt_state, "data_iter": data_iter},
        "host": {"params": flatten(host), "params_ema": flatten(ema_host), "opt_state": host_of(opt_state)},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory, devices):
    """A checkpoint root with steps 10 and 20 (async manager, 8 devices)."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    states = {step: train_state(step) for step in STEPS}
    mngr = ckpt.get_checkpoint_manager(10, max_to_keep=5, checkpoint_dir=root)
    for step in STEPS:
        assert ckpt.save_checkpoint(mngr, step, states[step]["items"])
    mngr.wait_until_finished()
    mngr.close()
    return root, states


@pytest.fixture
def manager(saved):
    mngr = ckpt.get_checkpoint_manager(10, checkpoint_dir=saved[0])
    yield mngr
    mngr.close()


def _host_params_values(saved, step: int, item: str = "params") -> dict:
    return {p: np.asarray(v) for p, v in saved[1][step]["host"][item].items()}


# --- manager -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ckpt_frequency=10, keep_period=25), r"`keep_period` \(25\).*`ckpt_frequency` \(10\)"),
        (dict(ckpt_frequency=0), "ckpt_frequency"),
        (dict(ckpt_frequency=10, max_to_keep=0), "max_to_keep"),
        (dict(ckpt_frequency=10, json_items=("trainer",)), "json_items"),
    ],
)
def test_manager_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ckpt.get_checkpoint_manager(checkpoint_dir=tmp_path, **kwargs)


def test_manager_requires_a_directory():
    # Issue 39, point 18: the required folder was the 4th positional argument, with a default of None.
    with pytest.raises(TypeError, match="checkpoint_dir"):
        ckpt.get_checkpoint_manager(10)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ckpt.get_checkpoint_manager(10, checkpoint_dir=None)
    # No positional slot is left for it: ckpt_frequency and max_to_keep are the only positional arguments.
    with pytest.raises(TypeError, match="positional"):
        ckpt.get_checkpoint_manager(10, 3, None, "/tmp/run")


def test_save_frequency_is_the_deprecated_name_of_keep_period(tmp_path):
    # Issue 39, point 18: `save_frequency` said "how often to save"; it is "keep every multiple for good".
    with pytest.warns(DeprecationWarning, match="`save_frequency` is renamed `keep_period`") as caught:
        old = ckpt.get_checkpoint_manager(2, max_to_keep=1, save_frequency=4, checkpoint_dir=tmp_path / "old",
                                          async_save=False)
    assert caught[0].filename == __file__  # stacklevel=2: the caller's line
    new = ckpt.get_checkpoint_manager(2, max_to_keep=1, keep_period=4, checkpoint_dir=tmp_path / "new",
                                      async_save=False)
    for mngr in (old, new):
        for step in range(1, 11):
            ckpt.save_checkpoint(mngr, step, {"params": {"w": np.full(2, step, np.float32)}})
        mngr.close()
    # Orbax's own listing: the newest save (10) plus every multiple of 4 that was saved (4, 8).
    assert ckpt.list_steps(tmp_path / "old") == ckpt.list_steps(tmp_path / "new") == [4, 8, 10]
    with pytest.raises(TypeError, match="keep_period"):
        ckpt.get_checkpoint_manager(2, keep_period=4, save_frequency=4, checkpoint_dir=tmp_path / "both")


def test_read_only_manager_logs_no_notices_and_hides_no_other_warning(tmp_path, caplog):
    # Issue 39, point 18: read_only=True printed two absl warnings (save_interval_steps=0, "directory is read only").
    from absl import logging as absl_logging

    from treetools.checkpoint_jax.manager import _quiet_read_only_notice

    mngr = ckpt.get_checkpoint_manager(1, checkpoint_dir=tmp_path, async_save=False)
    ckpt.save_checkpoint(mngr, 1, {"params": {"w": np.ones(2, np.float32)}})
    mngr.close()
    with caplog.at_level(logging.INFO, logger="absl"):
        reader = ckpt.get_checkpoint_manager(1, checkpoint_dir=tmp_path, read_only=True)
        assert reader.all_steps() == [1]
        reader.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # Only that one notice is dropped, and only while the manager is built: other absl warnings still show.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        with _quiet_read_only_notice(True):
            absl_logging.warning("Given directory is read only=%s", "x")
            absl_logging.warning("something else, %s", "kept")
        absl_logging.warning("Given directory is read only=%s", "after")
    assert [r.getMessage() for r in caplog.records] == ["something else, kept", "Given directory is read only=after"]


def test_interval_max_to_keep_and_keep_period(tmp_path):
    mngr = ckpt.get_checkpoint_manager(2, max_to_keep=2, keep_period=6, checkpoint_dir=tmp_path)
    saved_steps = [
        step for step in range(1, 15) if ckpt.save_checkpoint(mngr, step, {"params": {"w": np.full(3, step, np.float32)}})
    ]
    mngr.wait_until_finished()
    assert saved_steps == [s for s in range(1, 15) if s % 2 == 0]
    # The newest max_to_keep=2 saves (12, 14) plus every multiple of keep_period=6 (6, 12).
    expected = sorted(set(saved_steps[-2:]) | {s for s in saved_steps if s % 6 == 0})
    assert ckpt.list_steps(tmp_path) == expected == [6, 12, 14]
    assert sorted(mngr.all_steps()) == expected
    for step in expected:
        np.testing.assert_array_equal(ckpt.load_parameters(tmp_path, step)["w"], np.full(3, step, np.float32))
    mngr.close()


def test_max_to_keep_alone_and_forced_save(tmp_path):
    mngr = ckpt.get_checkpoint_manager(5, max_to_keep=1, checkpoint_dir=tmp_path, async_save=False)
    assert ckpt.save_checkpoint(mngr, 5, {"params": {"w": np.zeros(2)}})
    assert not ckpt.save_checkpoint(mngr, 7, {"params": {"w": np.ones(2)}})  # not a multiple of 5
    assert ckpt.save_checkpoint(mngr, 7, {"params": {"w": np.ones(2)}}, force=True)
    assert ckpt.list_steps(tmp_path) == [7]
    mngr.close()


# --- restore ---------------------------------------------------------------


def test_roundtrip_into_live_trees(saved, manager):
    # Targets are the live trees of step 10; values must come from step 20.
    targets = dict(saved[1][10]["items"], data_iter=None)
    out = ckpt.restore_checkpoint(manager, 20, targets)
    for item in ("params", "params_ema", "opt_state"):
        assert_tree_equal(out[item], _host_params_values(saved, 20, item))
        assert jax.tree.structure(out[item], is_leaf=is_leaf) == jax.tree.structure(targets[item], is_leaf=is_leaf)
        for got, want in zip(jax.tree.leaves(out[item]), jax.tree.leaves(targets[item])):
            assert got.sharding == want.sharding
    assert out["data_iter"] == saved[1][20]["items"]["data_iter"]
    embed = out["params"]["embed"]
    assert isinstance(embed, nn.Partitioned) and embed.names == ("fsdp", None)
    assert embed.value.sharding.spec == P("fsdp", None)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_restore_onto_fewer_devices_and_tensor_parallel(saved, manager, k):
    live = saved[1][20]["items"]["params"]
    target = make_abstract(live, tp_shardings(live, k))
    out = ckpt.restore_checkpoint(manager, "latest", {"params": target})["params"]
    assert_tree_equal(out, _host_params_values(saved, 20))
    assert isinstance(out["embed"], nn.Partitioned) and out["embed"].names == ("fsdp", None)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(target)):
        assert got.sharding == want.sharding
        assert got.sharding.device_set == set(jax.devices()[:k])
    # tensor parallel, not the saved fsdp layout: embed is split on its columns now
    if k > 1:
        assert {s.data.shape for s in out["embed"].value.addressable_shards} == {(16, 8 // k)}


def test_one_sharding_for_every_leaf(saved, manager):
    rep = NamedSharding(_mesh(2, "x"), P())
    live = saved[1][10]["items"]
    out = ckpt.restore_checkpoint(manager, 10, {"params": live["params"], "opt_state": live["opt_state"]}, sharding=rep)
    for item in ("params", "opt_state"):
        assert_tree_equal(out[item], _host_params_values(saved, 10, item))
        assert all(x.sharding == rep for x in jax.tree.leaves(out[item]))
    # A tree of shardings for one item must sit under the item's name; bare, it was silently ignored.
    with pytest.raises(ValueError, match=r"`sharding` keys \['embed', 'layers', 'scale'\] are not in `items`"):
        ckpt.restore_checkpoint(manager, 10, {"params": live["params"]}, sharding=tp_shardings(live["params"], 2))
    out = ckpt.restore_checkpoint(manager, 10, {"params": live["params"]},
                                  sharding={"params": tp_shardings(live["params"], 2)})
    assert unbox(out["params"]["embed"]).sharding.spec == P(None, "tp")


def test_target_without_sharding_is_replicated(saved, manager):
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved[1][10]["items"]["params"])
    out = ckpt.restore_checkpoint(manager, 10, {"params": target})["params"]
    assert_tree_equal(out, _host_params_values(saved, 10))
    for x in jax.tree.leaves(out):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8


def test_mismatch_lists_every_offending_path(saved, manager):
    host = host_params(0, n_layers=16)  # 16-layer target vs the 12-layer checkpoint
    del host["scale"]  # in the checkpoint, not in the target
    host["layers"][0]["w"] = np.zeros((8, 32), np.float32)
    host["layers"][1]["b"] = host["layers"][1]["b"].astype(jnp.bfloat16)
    target = make_abstract(host)
    target["embed"] = nn.Partitioned(jax.ShapeDtypeStruct((16, 4), jnp.float32), names=("fsdp", None))
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(manager, 20, {"params": target})
    expected = (
        {(f"params/layers/{i}/{leaf}", "missing") for i in range(12, 16) for leaf in ("w", "b")}
        | {("params/layers/0/w", "shape"), ("params/embed", "shape")}
        | {("params/layers/1/b", "dtype"), ("params/scale", "unexpected")}
    )
    assert {(p.path, p.kind) for p in info.value.problems} == expected
    message = str(info.value)
    for path, _ in expected:
        assert f"  {path}: " in message
    assert "/value" not in message  # a box is one leaf: its path ends at the box
    shape = {p.path: p for p in info.value.problems}["params/layers/0/w"]
    assert (shape.expected, shape.found) == ("(8, 32)", "(8, 16)")
    assert isinstance(info.value, ValueError) and "allow_dtype_cast=True" in message

    # A box the target lacks is reported at the box too (Orbax stores it as embed/value).
    no_embed = make_abstract({k: v for k, v in saved[1][20]["items"]["params"].items() if k != "embed"})
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(manager, 20, {"params": no_embed})
    assert [(p.path, p.kind, p.found) for p in info.value.problems] == [("params/embed", "unexpected", "float32[16, 8]")]


def test_missing_item_is_reported(tmp_path):
    mngr = ckpt.get_checkpoint_manager(1, checkpoint_dir=tmp_path)
    ckpt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(2)}})
    targets = {"params": {"w": jnp.ones(2), "v": jnp.ones(3)}, "params_ema": {"w": jnp.ones(2)}}
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(mngr, None, targets)
    assert {(p.path, p.kind) for p in info.value.problems} == {("params/v", "missing"), ("params_ema", "missing")}
    assert "params_ema: missing in checkpoint (target expects item 'params_ema'; checkpoint has items ['params'])" \
        in str(info.value)
    # None is how JSON items are asked for; for a pytree item it gets our message, not Orbax's handler error.
    ckpt.save_checkpoint(mngr, 2, {"params": {"w": jnp.ones(2)}, "batch_stats": {"m": jnp.ones(2)}}, wait=True)
    with pytest.raises(ValueError, match=r"`items\['batch_stats'\]` is None, but 'batch_stats' is a pytree item; pass the live tree or make_abstract"):
        ckpt.restore_checkpoint(mngr, 2, {"batch_stats": None})
    mngr.close()


def test_a_typed_key_the_checkpoint_lacks_is_a_mismatch(tmp_path):
    # A trainer's state target holding a typed PRNG key (dtype key<fry>, no numpy dtype) that the save lacks.
    with ocp.CheckpointManager(tmp_path, item_names=("state",)) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2, np.float32)})))
        mngr.wait_until_finished()
    target = {"state": {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "key": jax.random.key(0)}}
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(str(tmp_path), -1, target)
    assert [(p.path, p.kind, p.expected) for p in info.value.problems] == [("state/key", "missing", "key<fry>[]")]
    plan = ckpt.plan_restore(str(tmp_path), -1, target)
    assert plan.problems == info.value.problems and "state/key: missing in checkpoint" in str(plan)
    assert "state/key  <- MISSING  ()     key<fry>" in plan.describe()
    # fill_missing gives the key (a typed key offered for a typed key target)
    out = ckpt.restore_checkpoint(str(tmp_path), -1, target, fill_missing={"key": jax.random.key(7)})["state"]
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(7)))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.ones(2, np.float32))
    # ... and from its key data; a typed key offered for a raw PRNGKey target gives its key data
    data = np.asarray(jax.random.key_data(jax.random.key(7)))
    out = ckpt.restore_checkpoint(str(tmp_path), -1, target, fill_missing={"key": data})["state"]
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), data)
    raw = {"state": {**target["state"], "key": jax.random.PRNGKey(0)}}
    out = ckpt.restore_checkpoint(str(tmp_path), -1, raw, fill_missing={"key": jax.random.key(7)})["state"]
    assert out["key"].dtype == np.uint32
    np.testing.assert_array_equal(np.asarray(out["key"]), data)


def test_dtype_cast_only_when_asked(saved, manager):
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), saved[1][20]["items"]["params"]
    )
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(manager, 20, {"params": target})
    want = _host_params_values(saved, 20)
    assert {p.path for p in info.value.problems} == {f"params/{p}" for p in want}
    assert {(p.kind, p.expected, p.found) for p in info.value.problems} == {("dtype", "bfloat16", "float32")}

    out = ckpt.restore_checkpoint(manager, 20, {"params": target}, allow_dtype_cast=True)["params"]
    assert_tree_equal(out, {p: v.astype(jnp.bfloat16) for p, v in want.items()})


# --- load_parameters ---------------------------------------------------------


def test_load_parameters_numpy_without_model_code(saved):
    root = saved[0]
    latest = ckpt.load_parameters(root)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(latest))
    assert isinstance(latest["layers"], list) and isinstance(latest["embed"], np.ndarray)  # box dropped
    assert_tree_equal(latest, _host_params_values(saved, 20))
    assert_tree_equal(ckpt.load_parameters(root, 10), _host_params_values(saved, 10))
    assert_tree_equal(ckpt.load_parameters(root, 10, use_ema_params=True), _host_params_values(saved, 10, "params_ema"))
    assert_tree_equal(ckpt.load_parameters(root, item="opt_state"), _host_params_values(saved, 20, "opt_state"))


def test_load_parameters_unknown_step_lists_available(saved):
    with pytest.raises(FileNotFoundError, match=r"no step 15; available steps: 10, 20\."):
        ckpt.load_parameters(saved[0], 15)
    with pytest.raises(FileNotFoundError, match=r"has no item `weights`; items: .*params"):
        ckpt.load_parameters(saved[0], item="weights")
    with pytest.raises(FileNotFoundError, match=r"nowhere: no such file or folder"):
        ckpt.load_parameters(saved[0] / "nowhere")


def test_load_parameters_names_what_is_wrong_with_the_folder(saved, tmp_path):
    # Not a checkpoint: one error that lists the formats treetools reads (from the registry).
    from treetools.checkpoint_io.registry import registered_formats as formats

    (tmp_path / "logs").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"not a checkpoint that treetools can read\. Readable formats: ") as info:
        ckpt.load_parameters(tmp_path)
    assert all(f.name in str(info.value) for f in formats())
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match=r"notes.txt: not a checkpoint"):
        ckpt.load_parameters(tmp_path / "notes.txt")


def test_load_parameters_from_one_step_folder(saved):
    # A step folder instead of the root (what `ls` shows a user): that step is read.
    step_dir = saved[0] / "10"
    assert_tree_equal(ckpt.load_parameters(step_dir), _host_params_values(saved, 10))
    assert_tree_equal(ckpt.load_parameters(step_dir, 10, use_ema_params=True),
                      _host_params_values(saved, 10, "params_ema"))
    with pytest.raises(ValueError, match=r"10 is a single checkpoint \(step 10\), not a checkpoint root with steps; step 20 cannot be chosen"):
        ckpt.load_parameters(step_dir, 20)


def test_numpy_and_jax_integer_steps(saved, manager, tmp_path):
    # Trainers hold the step as np.int64 / a jax scalar (state.step); Orbax saves with those too.
    want = _host_params_values(saved, 10)
    for step in (np.int64(10), np.int32(10), jnp.asarray(10)):
        assert_tree_equal(ckpt.load_parameters(saved[0], step), want)
        out = ckpt.restore_checkpoint(manager, step, {"data_iter": None})
        assert out["data_iter"] == saved[1][10]["items"]["data_iter"]
    for bad in (True, "ten", -2.5):
        with pytest.raises(TypeError, match="`step` must be"):
            ckpt.load_parameters(saved[0], bad)
    # A float is a step too (flax saves `step=0.625` as `<prefix>0.625`; `available_steps(step_type=float)`):
    # 10.0 is step 10, and 10.5 a step this root does not have.
    assert_tree_equal(ckpt.load_parameters(saved[0], 10.0), want)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no step 10.5"):
        ckpt.load_parameters(saved[0], 10.5)
    mngr = ckpt.get_checkpoint_manager(np.int64(10), max_to_keep=np.int32(2), checkpoint_dir=tmp_path)
    assert mngr.should_save(20) and not mngr.should_save(25)
    mngr.close()


def test_json_item_with_numpy_and_jax_numbers(tmp_path):
    # Data-iterator state often holds np.int64 / jax scalars; Orbax's JSON writer fails on them
    # in its background thread, late, leaving a tmp folder. They are stored as Python numbers.
    mngr = ckpt.get_checkpoint_manager(1, checkpoint_dir=tmp_path)
    state = {"epoch": np.int64(3), "order": np.arange(3), "step": jnp.asarray(7), "lr": np.float32(0.5), "tag": None}
    assert ckpt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(2)}, "data_iter": state}, wait=True)
    got = ckpt.restore_checkpoint(mngr, 1, {"data_iter": None})["data_iter"]
    assert got == {"epoch": 3, "order": [0, 1, 2], "step": 7, "lr": 0.5, "tag": None}
    assert type(got["epoch"]) is int and type(got["lr"]) is float
    with pytest.raises(TypeError, match=r"`items\['data_iter'\]` is saved as JSON, but `object` values are not JSON"):
        ckpt.save_checkpoint(mngr, 2, {"data_iter": {"rng": object()}})
    assert ckpt.list_steps(tmp_path) == [1] and ckpt.list_incomplete(tmp_path) == []
    mngr.close()


def test_zero_size_array_is_refused_before_orbax_starts(tmp_path):
    mngr = ckpt.get_checkpoint_manager(1, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match=r"`items\['params'\]` has zero-size arrays.*\['extra/e'\]"):
        ckpt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(2), "extra": {"e": np.zeros((0, 3))}}})
    assert list(tmp_path.iterdir()) == []  # no tmp folder left behind
    assert ckpt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(2)}}, wait=True)
    assert ckpt.list_steps(tmp_path) == [1]
    mngr.close()


def test_load_parameters_into_target(saved):
    live = saved[1][10]["items"]["params"]
    target = make_abstract(live, tp_shardings(live, 2))
    out = ckpt.load_parameters(saved[0], 10, target=target)
    assert_tree_equal(out, _host_params_values(saved, 10))
    assert isinstance(out["embed"], nn.Partitioned)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(target)):
        assert got.sharding == want.sharding
    bigger = make_abstract(fsdp_params(host_params(0, n_layers=13)))
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load_parameters(saved[0], 10, target=bigger)
    # The target is the params tree itself: its paths, as `flatten(load_parameters(...))` spells them.
    assert {(p.path, p.kind) for p in info.value.problems} == {("layers/12/w", "missing"), ("layers/12/b", "missing")}


def test_load_parameters_mismatch_names_the_targets_own_paths(tmp_path):
    # The reader's internal item name (`default` for a file) is no part of what the user passed or gets back.
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"dense.kernel": np.ones((2, 3), np.float32), "dense.bias": np.ones(3, np.float32)}, str(path))
    assert sorted(flatten(ckpt.load_parameters(path))) == ["dense.bias", "dense.kernel"]
    target = {"dense.kernel": np.zeros((2, 4), np.float32), "head": np.zeros(3, np.float32)}
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load_parameters(path, target=target)
    assert {(p.path, p.kind) for p in info.value.problems} == {
        ("dense.kernel", "shape"), ("head", "missing"), ("dense.bias", "unexpected")}
    assert "default" not in str(info.value)
    # Rules that do not fit are named as the rules' problem, not as an item the user never named.
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load_parameters(path, target=target, rules=ckpt.Rules(drop=["^nomatch$"]))
    assert [(p.path, p.kind) for p in info.value.problems] == [("rules", "rules")]
    # restore_checkpoint's items are keyed by item: there the item stays in the path.
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.restore_checkpoint(path, -1, {"default": target})
    assert {p.path for p in info.value.problems} == {"default/dense.kernel", "default/head", "default/dense.bias"}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_load_parameters_on_read_only_dir(saved, tmp_path):
    root = tmp_path / "ro"
    shutil.copytree(saved[0], root)
    before = _snapshot(root)
    for p in [root, *root.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        assert_tree_equal(ckpt.load_parameters(root), _host_params_values(saved, 20))
        live = saved[1][20]["items"]["params"]
        ckpt.load_parameters(root, target=make_abstract(live, tp_shardings(live, 4)))
    finally:
        for p in [root, *root.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert _snapshot(root) == before  # nothing written, created or touched (also when run as root)


# --- incomplete saves and step folders ----------------------------------------


def test_killed_save_is_never_latest(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved[0], root)
    # A save killed before Orbax renamed its tmp folder ...
    tmp = root / "30.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(root / "20", tmp)
    (tmp / "commit_success.txt").unlink()
    # ... and one killed after its folder got the final name (commit-file protocol, e.g. GCS):
    # step metadata without a commit timestamp, no commit_success.txt, half an item.
    killed = root / "40"
    (killed / "params").mkdir(parents=True)
    (killed / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": 1}))
    (killed / "params" / "_METADATA").write_text("{")

    assert ckpt.list_steps(root) == [10, 20]
    assert ckpt.list_incomplete(root) == ["30.orbax-checkpoint-tmp-1700000000", "40"]
    assert ckpt.latest_step(root) == 20
    assert_tree_equal(ckpt.load_parameters(root, -1), _host_params_values(saved, 20))
    with pytest.raises(FileNotFoundError, match=r"step 40 is an incomplete save \(40\); it is never read\. Committed steps: 10, 20"):
        ckpt.load_parameters(root, 40)

    mngr = ckpt.get_checkpoint_manager(10, checkpoint_dir=root)
    live = saved[1][10]["items"]
    for step in (None, "latest", -1):
        out = ckpt.restore_checkpoint(mngr, step, {"params": live["params"], "data_iter": None})
        assert_tree_equal(out["params"], _host_params_values(saved, 20))
        assert out["data_iter"] == saved[1][20]["items"]["data_iter"]
    mngr.close()


def test_scan_steps_name_formats(tmp_path):
    mngr = ckpt.get_checkpoint_manager(
        3, checkpoint_dir=tmp_path, step_prefix="ckpt", step_format_fixed_length=6, async_save=False
    )
    for step in (3, 12):
        ckpt.save_checkpoint(mngr, step, {"params": {"w": np.arange(step, dtype=np.float32)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000003", "ckpt_000012"]
    (tmp_path / "ckpt_000015.orbax-checkpoint-tmp-5").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "ckpt_7").write_text("a file, not a step folder")

    listing = steps.scan_steps(tmp_path)
    committed, incomplete = {s: Path(p) for s, p in listing.committed.items()}, listing.incomplete
    assert committed == {3: tmp_path / "ckpt_000003", 12: tmp_path / "ckpt_000012"}
    assert incomplete == ["ckpt_000015.orbax-checkpoint-tmp-5"]
    assert list(committed) == sorted(mngr.all_steps())
    # Orbax's own utilities agree on which folders are temporary / finalized.
    assert ocp.path.step.is_path_temporary(tmp_path / incomplete[0])
    assert all(ocp.path.step.is_path_finalized(p) for p in committed.values())
    assert steps.scan_steps(tmp_path, step_prefix="other").committed == {}
    np.testing.assert_array_equal(ckpt.load_parameters(tmp_path, 12)["w"], np.arange(12, dtype=np.float32))
    mngr.close()


@pytest.mark.parametrize(
    "name, step",
    [("100", 100), ("000100", 100), ("ckpt_100", 100), ("my_run_0042", 42), ("0", 0), ("logs", None),
     ("100.orbax-checkpoint-tmp-3", None), ("ckpt_", None), ("_100", None)],
)
def test_parse_step_name(name, step):
    # Orbax's own parser agrees on every committed name it accepts.
    assert steps.parse_step_name(name) == step
    if step is not None:
        assert ocp.path.step.step_from_checkpoint_name(name) == step


def test_constants_match_orbax():
    from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as pytree_handler
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata
    from orbax.checkpoint._src.path import atomicity_types

    assert steps.TMP_DIR_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
    assert steps.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE
    assert steps.STEP_METADATA_FILE == step_metadata._STEP_METADATA_FILENAME
    assert steps.PYTREE_METADATA_FILE == pytree_handler.PYTREE_METADATA_FILE


def test_scanning_imports_neither_jax_nor_orbax(saved):
    code = (
        "import sys, treetools as c\n"
        f"assert c.list_steps({str(saved[0])!r}) == [10, 20]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'orbax', 'jaxlib')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
