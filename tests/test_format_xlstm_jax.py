"""xlstm-jax runs (issue 29): Orbax managers whose items `step` and `rng` are ArrayCheckpointHandler saves.

Two writers, both real Orbax configured as xlstm-jax's ``ModelCheckpoint`` (NX-AI/xlstm-jax
xlstm_jax/trainer/callbacks/checkpointing.py, commit 0f3ebc2d73c088e5ed0eeede677fd5c5d5088b1e):

- tests/fixtures/xlstm_jax_orbax_0_6/, written by the Orbax that xlstm-jax pins (0.6.1; make_xlstm_jax.py):
  its `step` and `rng` item folders hold `_sharding` and a `checkpoint/` zarr folder, and no `_METADATA`;
- the same manager run here by the project's Orbax (0.12.8), whose ArrayCheckpointHandler writes `_METADATA`.

An ArrayCheckpointHandler item is one array (stored by Orbax under the handler's checkpoint name, `checkpoint`):
Orbax restores the item as the array itself, so its one leaf is named like the item (`--item rng --show rng`,
issue 37). No item is ever dropped: every view shows all four
array items (and the totals count them). The truth is the writer's own arrays.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf,
                                  check_inspect, check_load_parameters, check_restore, check_show, check_stats,
                                  check_verify, inspect_json, leaves_of, run)

FIXTURES = Path(__file__).parent / "fixtures"
ROOT_0_6 = FIXTURES / "xlstm_jax_orbax_0_6"
ARRAY_ITEMS = ("params", "opt_state", "step", "rng")


def fixture_truth() -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """{step: {item: {path: array in the dtype written}}} from xlstm_jax_truth.npz (bf16 kept as float32 there)."""
    truth: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(FIXTURES / "xlstm_jax_truth.npz") as z:
        for key in z.files:
            if key.startswith("dtype:"):
                continue
            step, item, *path = key.split("/")
            dtype = str(z[f"dtype:{key}"])
            value = z[key].astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else z[key]
            assert str(value.dtype) == dtype, key
            # An ArrayCheckpointHandler item is one array: its leaf is named like the item.
            truth.setdefault(int(step), {}).setdefault(item, {})["/".join(path) or item] = value
    return truth


def write_xlstm_manager(root: Path, steps=(100, 200)) -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """xlstm-jax's ModelCheckpoint manager, run by the project's Orbax; returns the truth as fixture_truth does."""
    import optax
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=2, best_fn=lambda m: m["perplexity"], best_mode="min", step_prefix="checkpoint",
        cleanup_tmp_directories=True, create=True, enable_async_checkpointing=True)
    handlers = {"step": ocp.ArrayCheckpointHandler(), "params": ocp.StandardCheckpointHandler(),
                "rng": ocp.ArrayCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler()}
    truth = {}
    with ocp.CheckpointManager(directory=str(root), item_names=tuple(handlers), item_handlers=handlers,
                               options=options) as manager:
        for step in steps:
            rng = np.random.default_rng(step)
            params = {"xlstm_block_0": {"mlstm": {"kernel": rng.standard_normal((4, 6)).astype(np.float32),
                                                  "bias": (np.arange(6) + step).astype(np.float32)}},
                      "embedding": {"embedding": rng.standard_normal((5, 4)).astype(ml_dtypes.bfloat16)}}
            opt_state = jax.tree.map(lambda x: x + 1, optax.adamw(1e-3).init(jax.tree.map(jnp.asarray, params)))
            key = jax.random.fold_in(jax.random.PRNGKey(42), step)
            manager.save(step, args=ocp.args.Composite(
                step=ocp.args.ArraySave(jnp.asarray(step, jnp.int32)),
                params=ocp.args.StandardSave(jax.tree.map(jnp.asarray, params)),
                rng=ocp.args.ArraySave(key), metadata=ocp.args.JsonSave({"model": {"name": "xlstm"}}),
                opt_state=ocp.args.StandardSave(opt_state)), metrics={"perplexity": 10.0 - step / 100})
            truth[step] = {"params": {k: np.asarray(v) for k, v in tt.flatten(params).items()},
                           "opt_state": {k: np.asarray(v) for k, v in tt.flatten(opt_state).items()},
                           "step": {"step": np.asarray(step, np.int32)},
                           "rng": {"rng": np.asarray(key)}}
        manager.wait_until_finished()
    return truth


@pytest.fixture(scope="module", params=["orbax-0.6.1", "orbax-0.12.8"])
def run_dir(request, tmp_path_factory):
    """(manager root, truth): the fixture xlstm-jax's own Orbax wrote, and the same manager run here."""
    if request.param == "orbax-0.6.1":
        return ROOT_0_6, fixture_truth()
    root = tmp_path_factory.mktemp("xlstm") / "checkpoints"
    return root, write_xlstm_manager(root)


def test_fixture_layout_is_what_orbax_0_6_array_handler_writes():
    # The layout the issue names: `_sharding` and a `checkpoint/` zarr folder, no `_METADATA`.
    for item in ("step", "rng"):
        folder = ROOT_0_6 / "checkpoint_200" / item
        assert sorted(p.name for p in folder.iterdir()) == ["_sharding", "checkpoint"]
        assert (folder / "checkpoint" / ".zarray").is_file()


def test_every_array_item_is_shown_with_its_values_and_counted(run_dir):
    root, truth = run_dir
    rc, out, err = run("inspect", root)
    assert rc == 0, err
    assert "skipped" not in err and "does not read" not in err, err
    for item in ARRAY_ITEMS:
        assert f"[{item}]" in out, out
    report = inspect_json(root)
    assert report["steps"] == [100, 200]
    items = report["checkpoints"][0]["items"]
    assert set(ARRAY_ITEMS) <= set(items)
    for item in ARRAY_ITEMS:
        check_inspect(root, truth[200][item], item=item)
    # Totals: every element the writer saved, the two one-array items included (2 + 1 of them).
    want = sum(v.size for item in ARRAY_ITEMS for v in truth[200][item].values())
    got = sum(leaf["params"] for item in ARRAY_ITEMS for leaf in items[item]["leaves"])
    assert got == want


@pytest.mark.parametrize("step", [100, 200])
def test_step_and_rng_values_per_step(run_dir, step):
    root, truth = run_dir
    for item in ("step", "rng"):
        check_show(root, truth[step][item], item=item, args=("--step", step))
        check_stats(root, truth[step][item], item=item, args=("--step", step))
    assert int(tt.load_parameters(root, step=step, item="step")["step"]) == step
    check_load_parameters(root, truth[step]["rng"], step=step, item="rng")


def test_params_and_opt_state_every_command(run_dir, tmp_path):
    root, truth = run_dir
    check_load_parameters(root, truth[200]["params"])  # the params item, bf16 leaf kept bf16
    check_load_parameters(root, truth[100]["opt_state"], step=100, item="opt_state")
    check_stats(root, truth[200]["params"], item="params")
    check_show(root, truth[200]["params"], item="params")


def test_convert_the_params(run_dir, tmp_path):
    root, truth = run_dir
    check_convert(root, truth[200]["params"], tmp_path, item="params")
    check_convert(root, truth[200]["rng"], tmp_path / "rng", item="rng")


def test_restore_with_rules(run_dir):
    root, truth = run_dir
    rules = tt.Rules(rename=[(r"^xlstm_block_0/", "blocks/0/")])
    renamed = {k.replace("xlstm_block_0/", "blocks/0/", 1): v for k, v in truth[200]["params"].items()}
    check_restore(root, truth[200]["params"], item="params", rules=rules, expect=renamed)


def test_an_array_item_folder_given_directly_is_read_not_called_old_orbax(run_dir):
    root, truth = run_dir
    for item in ("step", "rng"):
        folder = root / "checkpoint_200" / item
        rc, out, err = run("inspect", folder)
        assert rc == 0, err
        assert "older than 0.5" not in err
        check_inspect(folder, truth[200][item])
        check_show(folder, truth[200][item])
        check_load_parameters(folder, truth[200][item])
        check_verify(folder)


def test_verify_reads_every_item_of_every_step(run_dir):
    root, truth = run_dir
    out = check_verify(root, "--step", "all")
    assert out.count("ok:") == 2, out  # one line per step
    for step in (100, 200):
        # Every array byte the writer saved is read, the one-array items `step` (4 B) and `rng` (8 B) included.
        want = sum(v.nbytes for item in ARRAY_ITEMS for v in truth[step][item].values())
        line = next(line for line in out.splitlines() if f"(step {step})" in line)
        assert f"{want:,} bytes read and decoded" in line, line


def test_diff_sees_the_array_items(run_dir, tmp_path):
    root, truth = run_dir
    # Step 100 -> 200: the `step` item's one array differs by exactly 100.
    rc, out, err = run("diff", root, "--step", 100, "--step", 200, "--values", "--item", "step", "--format", "json")
    assert rc == 1, out + err
    values = {row["path"]: row for row in json.loads(out)["values"]}
    assert set(values) == {"step"} and values["step"]["max_abs_diff"] == 100
    # A copy of the run whose `rng` the writer changed in one step: diff names that leaf.
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    key = np.asarray(truth[200]["rng"]["rng"])
    changed = key.copy()
    changed[1] += 7
    zarr = copy / "checkpoint_200" / "rng" / "checkpoint"
    ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(zarr)}}).result().write(changed).result()
    # A key's words are ~2**31: diff's default rtol (1e-5) would call 7 apart close; compare the bits exactly.
    check_diff_names_the_changed_leaf(root, copy, "rng", 7.0, item="rng", args=("--rtol", "0"))


def test_restore_checkpoint_of_the_array_items(run_dir):
    root, truth = run_dir
    for item in ("step", "rng", "params"):
        check_restore(root, truth[200][item], item=item, step=200)
    restored = tt.restore_checkpoint(str(root), 100, {"step": tt.make_abstract({"step": jnp.zeros((), jnp.int32)})})
    assert isinstance(restored["step"]["step"], jax.Array) and int(restored["step"]["step"]) == 100


def test_a_step_folder_no_reader_knows_is_named_not_dropped(tmp_path):
    # The rule: never drop an item without a word. A folder of an Orbax 0.6 step (no item_handlers in
    # _CHECKPOINT_METADATA) that is no item treetools reads is listed as not read, with the reason (issue 37: in
    # the view itself, the JSON's `unreadable`, and the totals).
    root = tmp_path / "run"
    shutil.copytree(ROOT_0_6, root)
    (root / "checkpoint_200" / "custom_state").mkdir()
    rc, out, err = run("inspect", root)
    assert rc == 0, err
    assert "Not read (1 item):" in out and "`custom_state` (no handler recorded): its folder holds nothing" in out, out
    assert "(6 of 7 items read)" in out, out  # params, opt_state, step, rng, metadata, metrics
    report = inspect_json(root)
    assert report["checkpoints"][0]["unreadable"] == [
        {"item": "custom_state", "handler": "no handler recorded", "reason": report["checkpoints"][0]["unreadable"][0]["reason"]}]
