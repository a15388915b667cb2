"""Every item of an Orbax step is read, whatever handler wrote it (issue 37): never half-read.

Written by real Orbax (0.12.8): a CheckpointManager step holding ``params`` (StandardSave), ``opt_state``,
``key`` (JaxRandomKeySave of a typed key), ``oldkey`` (of a raw ``PRNGKey``), ``nprng``
(NumpyRandomKeySave of ``np.random.get_state()``), ``step`` (ArraySave), ``cfg`` (ProtoSave), ``meta``
(JsonSave) and ``data_iter`` (Grain's PyGrainCheckpointHandler, tests/_writers/grain.py); the v1 API's
``partial.save`` + ``finalize`` (StatefulCheckpointableHandler) and ``save_checkpointables``; an item no reader
knows, listed by name with its handler and the reason. The truth is the writer's own objects.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_inspect, check_load_parameters, check_restore, check_show,
                                  check_stats, inspect_json, leaves_of, run)
from tests._writers.grain import DatasetIterator, PyGrainCheckpointSave

GRAIN_STATE = {"next_index": 17, "worker_count": 0, "epoch": 2}


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"Dense_0": {"kernel": rng.standard_normal((3, 4)).astype(np.float32),
                        "bias": np.arange(4, dtype=np.float32) + seed}}


def write_manager(root, steps=(1, 2)) -> dict[int, dict]:
    """A manager whose steps hold one item per handler; returns {step: {item: the object saved}}."""
    from google.protobuf import duration_pb2

    truth = {}
    with ocp.CheckpointManager(root) as manager:
        for step in steps:
            params = _params(step)
            key = jax.random.key(step)
            oldkey = jax.random.PRNGKey(100 + step)
            nprng = np.random.RandomState(step).get_state()  # numpy's legacy state tuple; the global one untouched
            manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(jax.tree.map(jnp.asarray, params)),
                opt_state=ocp.args.StandardSave({"mu": jnp.zeros(4), "count": jnp.asarray(step, jnp.int32)}),
                key=ocp.args.JaxRandomKeySave(key),
                oldkey=ocp.args.JaxRandomKeySave(oldkey),
                nprng=ocp.args.NumpyRandomKeySave(nprng),
                step=ocp.args.ArraySave(jnp.asarray(step, jnp.int32)),
                cfg=ocp.args.ProtoSave(duration_pb2.Duration(seconds=step)),
                meta=ocp.args.JsonSave({"lr": 0.1, "step": step}),
                data_iter=PyGrainCheckpointSave(DatasetIterator({**GRAIN_STATE, "next_index": step})),
            ))
            truth[step] = {"params": params, "key": key, "oldkey": oldkey, "nprng": nprng, "step": step}
        manager.wait_until_finished()
    return truth


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax_items") / "run"
    return root, write_manager(root)


ITEMS = {"params", "opt_state", "key", "oldkey", "nprng", "step", "cfg", "meta", "data_iter"}


def test_every_item_is_shown_and_counted(run_dir):
    root, truth = run_dir
    rc, out, err = run("inspect", root)
    assert rc == 0, err
    assert "does not read" not in err and "skipped" not in err and "Not read" not in out, out + err
    for item in ITEMS:
        assert f"[{item}" in out, (item, out)
    assert "Grand total (9 items)" in out
    report = inspect_json(root)
    step = report["checkpoints"][0]
    assert set(step["items"]) == ITEMS and step["unreadable"] == []
    # The typed key is said to be one (its key data is what is stored).
    assert "typed PRNG key" in err and "`key`" in err


def test_single_array_items_are_the_arrays_themselves(run_dir):
    root, truth = run_dir
    # ArraySave and JaxRandomKeySave: Orbax restores the item as the array: its one leaf is named like the item.
    want = {"step": {"step": np.asarray(2, np.int32)},
            "key": {"key": np.asarray(jax.random.key_data(truth[2]["key"]))},
            "oldkey": {"oldkey": np.asarray(truth[2]["oldkey"])}}
    for item, leaves in want.items():
        check_inspect(root, leaves, item=item)
        check_show(root, leaves, item=item)
        check_load_parameters(root, leaves, item=item)
        check_inspect(root / "2" / item, leaves)  # the item folder given directly
    # Orbax's own restore of the typed key: the same key data.
    with ocp.CheckpointManager(root) as manager:
        theirs = manager.restore(2, args=ocp.args.Composite(key=ocp.args.JaxRandomKeyRestore()))["key"]
    np.testing.assert_array_equal(tt.load_parameters(root, item="key")["key"], jax.random.key_data(theirs))
    # restore_checkpoint onto a typed key target gives the key again.
    restored = tt.restore_checkpoint(str(root), 2, {"key": {"key": jax.eval_shape(lambda: jax.random.key(0))}})
    assert jax.dtypes.issubdtype(restored["key"]["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]["key"]), jax.random.key_data(truth[2]["key"]))


def test_an_item_folder_given_directly_asks_its_step_for_the_handler_only_when_it_matters(run_dir, tmp_path):
    # The handler (in the step's _CHECKPOINT_METADATA, outside the folder given) decides only whether an item of
    # one leaf `checkpoint` is the array itself: any other item reads without it (a bucket: no request above the
    # folder, tests/test_remote.py). Shown by a corrupt step metadata: refused where it is read, and only there.
    root, truth = run_dir
    step = tmp_path / "2"
    shutil.copytree(root / "2", step)
    (step / "_CHECKPOINT_METADATA").write_text("{ not json")
    leaves = leaves_of(inspect_json(step / "params"))
    assert set(leaves) == {"Dense_0/kernel", "Dense_0/bias"}
    assert leaves["Dense_0/kernel"]["shape"] == list(truth[2]["params"]["Dense_0"]["kernel"].shape)
    rc, out, err = run("inspect", step / "step")
    assert rc == 1 and "_CHECKPOINT_METADATA: corrupt" in err, err


def test_a_bare_leaf_target_restores_a_one_array_item(run_dir):
    # Orbax restores these items as the array itself, and users write their targets so: {"key": jax.random.key(0)}.
    root, truth = run_dir
    with ocp.CheckpointManager(root) as manager:
        theirs = manager.restore(2, args=ocp.args.Composite(key=ocp.args.JaxRandomKeyRestore(),
                                                            oldkey=ocp.args.JaxRandomKeyRestore()))
    targets = {"key": jax.random.key(0), "oldkey": jax.random.PRNGKey(0), "step": jnp.asarray(0, jnp.int32)}
    plan = tt.plan_restore(str(root), 2, targets)
    assert plan.ok, str(plan)
    assert [(leaf.path, leaf.source) for leaf in plan.items["key"].leaves] == [("key", "key")]
    ours = tt.restore_checkpoint(str(root), 2, targets)
    # a typed key target: the key again (Orbax's own restore gives the typed key too)
    assert jax.dtypes.issubdtype(ours["key"].dtype, jax.dtypes.prng_key) and ours["key"].shape == ()
    np.testing.assert_array_equal(jax.random.key_data(ours["key"]), jax.random.key_data(theirs["key"]))
    # a raw PRNGKey target: the raw uint32 key data, as Orbax restores a raw key
    assert ours["oldkey"].dtype == np.uint32 and theirs["oldkey"].dtype == np.uint32
    np.testing.assert_array_equal(np.asarray(ours["oldkey"]), np.asarray(theirs["oldkey"]))
    assert int(ours["step"]) == 2
    # A typed key target for the raw key's item, a raw target for the typed key's: the same key data either way.
    swapped = tt.restore_checkpoint(str(root), 2, {"key": jax.random.PRNGKey(0), "oldkey": jax.random.key(0)})
    np.testing.assert_array_equal(np.asarray(swapped["key"]), jax.random.key_data(truth[2]["key"]))
    np.testing.assert_array_equal(jax.random.key_data(swapped["oldkey"]), np.asarray(truth[2]["oldkey"]))
    # load_parameters(item=...) with a bare target: the same, and a wrong one names the leaf as inspect does
    got = tt.load_parameters(root, 2, item="key", target=jax.random.key(0))
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(truth[2]["key"]))
    wrong = jax.ShapeDtypeStruct((3,), jnp.uint32)
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.load_parameters(root, 2, item="key", target=wrong)
    assert [(p.path, p.kind) for p in info.value.problems] == [("key", "shape")]
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.restore_checkpoint(str(root), 2, {"key": wrong})
    assert [(p.path, p.kind) for p in info.value.problems] == [("key/key", "shape")]
    # A bare target for an item of several leaves is not taken for one of them: the item is named, once.
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.restore_checkpoint(str(root), 2, {"opt_state": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert {(p.path, p.kind) for p in info.value.problems} == {
        ("opt_state", "missing"), ("opt_state/mu", "unexpected"), ("opt_state/count", "unexpected")}


def test_numpy_random_state_json_proto_and_grain_values(run_dir):
    root, truth = run_dir
    algorithm, words, pos, has_gauss, cached = truth[2]["nprng"]
    leaves = leaves_of(inspect_json(root, "--item", "nprng"), "nprng")
    assert set(leaves) == {"0", "1", "2", "3", "4"}
    assert leaves["1"]["shape"] == [624] and leaves["1"]["dtype"] == "uint32"
    got = tt.load_parameters(root, item="nprng")  # numpy's state tuple, as a list (Orbax restores a tuple)
    assert got[0] == algorithm
    np.testing.assert_array_equal(got[1], words)
    assert int(got[2]) == pos and int(got[3]) == has_gauss and float(got[4]) == cached
    rc, out, _ = run("inspect", root, "--item", "nprng", "--show", "0", "--format", "json")
    assert rc == 0 and json.loads(out)["value"] == algorithm  # the string Orbax keeps in _strings.json
    report = inspect_json(root)["checkpoints"][0]["items"]
    assert report["meta"]["value"] == {"lr": 0.1, "step": 2}
    assert report["data_iter"]["value"] == {**GRAIN_STATE, "next_index": 2}  # Grain's state, as Grain restores it
    assert report["cfg"]["value"] == "seconds: 2\n"  # the proto's text format


def test_stats_diff_verify_restore_convert(run_dir, tmp_path):
    root, truth = run_dir
    params = {k: v for k, v in tt.flatten(truth[2]["params"]).items()}
    check_stats(root, params, item="params")
    check_stats(root, {"1": truth[2]["nprng"][1]}, item="nprng")
    check_restore(root, params, item="params")
    check_convert(root, params, tmp_path)  # the default item: the params
    rc, out, err = run("verify", root, "--step", "all")
    assert rc == 0, out + err
    for line in out.splitlines():
        assert "9 item(s)" in line, out
    # Step 1 -> 2: every item whose values changed is reported, the single-array ones included.
    rc, out, err = run("diff", root, "--step", 1, "--step", 2, "--values", "--format", "json")
    assert rc == 1, out + err
    differing = {row["path"] for row in json.loads(out)["values"] if not row["bit_identical"]}
    assert {"step/step", "key/key", "oldkey/oldkey", "nprng/1", "params/Dense_0/bias"} <= differing, differing


def test_v1_partial_save_and_checkpointables(tmp_path):
    from orbax.checkpoint.experimental.v1 import partial
    import orbax.checkpoint.experimental.v1 as v1

    path = tmp_path / "partial"
    first = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    second = {"opt_state": {"mu": np.ones(3, np.float32)}, "step": np.asarray(7, np.int32)}
    partial.save(str(path), jax.tree.map(jnp.asarray, first))
    partial.save(str(path), jax.tree.map(jnp.asarray, second))
    partial.finalize(str(path))
    whole = {**tt.flatten(first), **tt.flatten(second)}
    check_inspect(path, whole, item="state")
    check_show(path, whole, item="state")
    check_load_parameters(path, tt.flatten(first["params"]))  # the params of the one `state` item
    check_restore(path, whole, item="state")
    assert run("verify", path)[0] == 0
    # save_checkpointables: each checkpointable an item.
    cps = tmp_path / "cps"
    v1.save_checkpointables(str(cps), {"state": jax.tree.map(jnp.asarray, first),
                                       "extra": {"a": jnp.arange(3)}})
    report = inspect_json(cps)["checkpoints"][0]
    assert set(report["items"]) == {"state", "extra"} and report["unreadable"] == []


class _BlobHandler(ocp.CheckpointHandler):
    """A handler that writes a file no reader knows (a user's own)."""

    def save(self, directory, args=None):
        (directory / "blob.bin").write_bytes(b"\x00\x01")

    def restore(self, directory, args=None):
        return (directory / "blob.bin").read_bytes()

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(_BlobHandler, for_save=True)
class _BlobSave(ocp.args.CheckpointArgs):
    pass


@ocp.args.register_with_handler(_BlobHandler, for_restore=True)
class _BlobRestore(ocp.args.CheckpointArgs):
    pass


def test_an_unreadable_item_is_listed_with_its_handler_and_reason(tmp_path):
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": jnp.ones(2)}), blob=_BlobSave()))
        manager.wait_until_finished()
    # Issue 49: a partial read exits 1 after printing all that was read (as du and ls do); --allow-unread: 0.
    rc, out, err = run("inspect", root)
    assert rc == 1 and err.splitlines() == [
        "treetools: error: 1 item could not be read (`blob`): listed with the reason above; --allow-unread exits 0 "
        "on a partial read"], err
    assert "Not read (1 item):" in out and "`blob` (_BlobHandler): its folder holds `blob.bin`" in out, out
    assert "Grand total (1 of 2 items read)" in out and "w " in out  # the item read is printed all the same
    rc, allowed, err = run("inspect", root, "--allow-unread")
    assert rc == 0 and allowed == out and not err, err
    unreadable = inspect_json(root, "--allow-unread")["checkpoints"][0]["unreadable"]
    assert unreadable == [{"item": "blob", "handler": "_BlobHandler", "reason": unreadable[0]["reason"]}]
    assert "blob.bin" in unreadable[0]["reason"]
    rc, out, err = run("verify", root)
    assert rc == 1 and "item `blob` (_BlobHandler) cannot be read" in out + err
    rc, out, err = run("verify", root, "--allow-unread")  # listed as not read; what was read is whole
    assert rc == 0 and "not read: " in out and "item `blob` (_BlobHandler) cannot be read" in out, out + err
    assert "problem:" not in out and "1 not read (--allow-unread)" in out, out
    rc, out, err = run("inspect", root, "--item", "blob")
    assert rc == 1 and "item `blob` (_BlobHandler) cannot be read" in err
    check_load_parameters(root, {"w": np.ones(2, np.float32)})  # the params still read


class DatasetCheckpointHandler(ocp.CheckpointHandler):
    """T5X's handler of the `dataset` item (t5x.checkpoints.DatasetCheckpointHandler) for a run that checkpoints no
    dataset iterator (`checkpoint_dataset=False`): it writes nothing; Orbax makes the item's folder all the same."""

    def save(self, directory, args=None):
        pass

    def restore(self, directory, args=None):
        return None

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass


@ocp.args.register_with_handler(DatasetCheckpointHandler, for_save=True)
class _DatasetSave(ocp.args.CheckpointArgs):
    pass


@ocp.args.register_with_handler(DatasetCheckpointHandler, for_restore=True)
class _DatasetRestore(ocp.args.CheckpointArgs):
    pass


def test_an_item_its_writer_left_empty_is_not_checked_not_a_problem(tmp_path):
    # Issue 47 (16): T5X's Orbax-mode checkpoints hold an empty `dataset` item; `verify` failed them ("cannot be
    # read: its folder holds nothing"). An item folder left empty is a note, "not checked"; the step is ok.
    root = tmp_path / "t5x"
    with ocp.CheckpointManager(root) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"target": {"w": jnp.ones(2)}}),
                                                dataset=_DatasetSave()))
        manager.wait_until_finished()
    # What Orbax wrote: the folder and its commit marker, nothing else.
    assert [p.name for p in (root / "1" / "dataset").iterdir()] == ["commit_success.txt"]
    rc, out, err = run("verify", root)
    assert rc == 0 and out.startswith("ok: ") and "1 leaves" in out, out + err
    assert f"treetools: note: {root}/1/dataset: item `dataset` (DatasetCheckpointHandler) left empty by its writer: " \
           "not checked." in err
    # Without the step's list of items (Orbax before 0.6) the empty item is no stranger either.
    meta = root / "1" / "_CHECKPOINT_METADATA"
    listed = meta.read_text()
    meta.write_text(json.dumps({k: v for k, v in json.loads(listed).items() if k != "item_handlers"}))
    rc, out, err = run("verify", root)
    assert rc == 0 and "dataset" not in out + err, out + err  # marked committed by Orbax: an item, with nothing to read
    # Not empty, a listed item is still a problem: something is there that nothing read.
    meta.write_text(listed)
    (root / "1" / "dataset" / "train_ds-1.index").write_bytes(b"\x00")
    rc, out, err = run("verify", root)
    assert rc == 1 and "dataset" in out + err
