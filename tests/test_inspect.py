"""treetools.checkpoint_tools and `treetools inspect` on checkpoints written by Orbax, Flax, safetensors and numpy.

Every expected shape, dtype, count, byte total, sharding and statistic is
derived here from the writer's own arrays (numpy float64 for statistics),
never from the inspector.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from treetools.cli import main
from treetools.checkpoint_io.readers import plan_blocks
from treetools.shared.errors import CheckpointError
from treetools.checkpoint_tools.report import inspect_path

STEPS = (100, 200)
TMP_STEP = "ckpt_0300.orbax-checkpoint-tmp-1700000000"
UNCOMMITTED_STEP = "ckpt_0400"
# Which mesh axes each sharded leaf uses on the (data=2, model=4) mesh; None: one device, no NamedSharding.
SPECS = {
    "Dense_0/kernel": P(None, "model"),
    "Dense_0/bias": P("model"),
    "embed": P("data", "model"),
    "layers/0/w": P(("data", "model")),
    "layers/1/w": P(),
    "half": None,
    "scale": None,
}


# ----------------------------------------------------------------------------- writers (shared with the other test files)


def host_tree(seed: int) -> dict:
    """The tree every writer saves: float32, bfloat16, int32, a list, a 0-d scalar."""
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {"kernel": rng.standard_normal((32, 16)).astype(np.float32),
                    "bias": rng.standard_normal(16).astype(np.float32)},
        "embed": (rng.standard_normal((8, 4)) * 3 + 1).astype(np.float32),
        "layers": [{"w": rng.integers(-5, 5, (8,)).astype(np.int32)},
                   {"w": np.array([0, 0, 1, 2, 0, 3, 4, 5], np.int32)}],
        "half": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
        "scale": np.array(0.5, np.float32),
    }


def flat(tree: dict) -> dict[str, np.ndarray]:
    """``{path: array}`` with the DESIGN path strings, built by hand (not by treetools)."""
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}/", v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(f"{prefix}{i}/", v)
        else:
            out[prefix[:-1]] = np.asarray(node)

    walk("", tree)
    return out


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])


def sharded(tree: dict) -> dict:
    """The tree on 8 devices, each leaf laid out per SPECS."""
    m = mesh()
    leaves = flat(tree)
    put = {p: (jax.device_put(x, NamedSharding(m, SPECS[p])) if SPECS[p] is not None else jax.device_put(x))
           for p, x in leaves.items()}
    return {
        "Dense_0": {"kernel": put["Dense_0/kernel"], "bias": put["Dense_0/bias"]},
        "embed": put["embed"],
        "layers": [{"w": put["layers/0/w"]}, {"w": put["layers/1/w"]}],
        "half": put["half"],
        "scale": put["scale"],
    }


def expected_sharding(path: str) -> dict | None:
    spec = SPECS[path]
    if spec is None:
        return None
    return {"mesh": {"data": 2, "model": 4}, "spec": [list(e) if isinstance(e, tuple) else e for e in spec]}


def opt_state_of(tree: dict):
    return optax.adam(1e-3).init({"Dense_0": tree["Dense_0"], "embed": tree["embed"]})


def meta_of(step: int) -> dict:
    return {"lr": 0.001, "step": step, "name": "run"}


def write_run(root: Path) -> Path:
    """A CheckpointManager root: steps 100 and 200 (prefix ``ckpt``, zero padded), plus two broken saves."""
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=4)
    with ocp.CheckpointManager(str(root), options=options) as mgr:
        for i, step in enumerate(STEPS):
            tree = host_tree(i + 1)
            mgr.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(sharded(tree)),
                opt_state=ocp.args.StandardSave(opt_state_of(tree)),
                meta=ocp.args.JsonSave(meta_of(step)),
            ))
        mgr.wait_until_finished()
    # A save that died in its tmp folder, and one without a commit marker.
    # Both are made unreadable, so that reading them would fail the tests.
    last = root / f"ckpt_{STEPS[-1]:04d}"
    for name in (TMP_STEP, UNCOMMITTED_STEP):
        shutil.copytree(last, root / name)
        (root / name / "params" / "_METADATA").write_text("{broken")
    (root / UNCOMMITTED_STEP / "commit_success.txt").unlink()
    meta_file = root / UNCOMMITTED_STEP / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    meta.pop("commit_timestamp_nsecs", None)
    meta_file.write_text(json.dumps(meta))
    (root / "logs").mkdir()
    return root


def write_variant(path: Path, tree: dict, *, ocdbt: bool, zarr3: bool) -> Path:
    """A PyTreeCheckpointHandler save with OCDBT and zarr3 on or off, plus a string and a Python int."""
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3))
    ckptr.save(str(path), args=ocp.args.PyTreeSave({**tree, "count": 7, "tag": "hello"}))
    ckptr.close()
    return path


def write_files(d: Path, tree: dict) -> dict[str, Path]:
    """The same tree as Flax msgpack, safetensors (dotted names) and npz (stored and compressed)."""
    from flax import serialization
    from safetensors.numpy import save_file

    leaves = flat(tree)
    out = {"msgpack": d / "state.msgpack", "safetensors": d / "model.safetensors",
           "npz": d / "params.npz", "npz_compressed": d / "params_c.npz"}
    out["msgpack"].write_bytes(serialization.to_bytes({"params": tree, "step": 3}))
    save_file({p.replace("/", "."): x for p, x in leaves.items()}, str(out["safetensors"]))
    no_bf16 = {p: x for p, x in leaves.items() if x.dtype != ml_dtypes.bfloat16}  # npy stores bfloat16 as void
    np.savez(out["npz"], **no_bf16)
    np.savez_compressed(out["npz_compressed"], **no_bf16)
    return out


# ----------------------------------------------------------------------------- helpers


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def inspect_json(capsys, *argv: str) -> dict:
    rc, out, err = run(capsys, "inspect", *argv, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def one_checkpoint(out: dict) -> dict:
    """The one checkpoint of a schema-2 JSON object (one step, or a single checkpoint)."""
    assert out["schema"] == 2 and "items" not in out and "by_step" not in out and "step" not in out
    (checkpoint,) = out["checkpoints"]
    return checkpoint


def items_of(out: dict) -> dict[str, dict]:
    return one_checkpoint(out)["items"]


def leaves_of(item: dict) -> dict[str, dict]:
    return {leaf["path"]: leaf for leaf in item["leaves"]}


def check_item(item: dict, arrays: dict[str, np.ndarray], *, non_arrays: tuple[str, ...] = ()) -> None:
    """Every leaf's shape/dtype/params/bytes and the totals, against the writer's arrays."""
    got = leaves_of(item)
    assert set(got) == set(arrays) | set(non_arrays)
    by_dtype: dict[str, dict[str, int]] = {}
    for path, x in arrays.items():
        leaf = got[path]
        assert leaf["shape"] == list(x.shape), path
        assert leaf["dtype"] == str(x.dtype), path
        assert leaf["params"] == x.size, path
        assert leaf["bytes"] == x.nbytes, path
        d = by_dtype.setdefault(str(x.dtype), {"params": 0, "bytes": 0})
        d["params"] += x.size
        d["bytes"] += x.nbytes
    for path in non_arrays:
        assert got[path]["shape"] is None and got[path]["params"] == 0 and got[path]["bytes"] == 0, path
    assert item["total_params"] == sum(x.size for x in arrays.values())
    assert item["total_bytes"] == sum(x.nbytes for x in arrays.values())
    assert item["by_dtype"] == dict(sorted(by_dtype.items()))


def numpy_stats(x: np.ndarray) -> dict:
    x = np.asarray(x).astype(np.float64).ravel()
    f = x[np.isfinite(x)]
    return {
        "mean": f.mean(), "std": f.std(), "min": f.min(), "max": f.max(), "l2": np.sqrt(np.sum(f * f)),
        "abs_max": np.abs(f).max(), "zeros": int(np.sum(x == 0)), "nan": int(np.isnan(x).sum()),
        "posinf": int(np.sum(x == np.inf)), "neginf": int(np.sum(x == -np.inf)),
    }


def check_stats(item: dict, arrays: dict[str, np.ndarray]) -> None:
    got = leaves_of(item)
    for path, x in arrays.items():
        want = numpy_stats(x)
        for key, value in want.items():
            if isinstance(value, int):
                assert got[path]["stats"][key] == value, (path, key)
            else:
                np.testing.assert_allclose(got[path]["stats"][key], value, rtol=1e-5, atol=1e-9, err_msg=f"{path} {key}")


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treetools: error: ") and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, devices) -> Path:
    return write_run(tmp_path_factory.mktemp("inspect") / "checkpoints")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return write_files(tmp_path_factory.mktemp("files"), host_tree(7))


# ----------------------------------------------------------------------------- Orbax


def test_manager_root_lists_steps_and_shows_latest(run_dir, capsys):
    out = inspect_json(capsys, run_dir)
    assert out["path"] == str(run_dir) and out["format"] == "orbax"
    assert out["steps"] == list(STEPS)
    assert out["incomplete"] == [TMP_STEP, UNCOMMITTED_STEP]
    checkpoint = one_checkpoint(out)
    assert checkpoint["step"] == STEPS[-1]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", checkpoint["metadata"]["saved_at"])
    items = checkpoint["items"]
    assert list(items) == ["params", "opt_state", "meta"]  # params, opt_state, then the rest
    tree = host_tree(2)  # step 200 was saved from seed 2
    check_item(items["params"], flat(tree))
    opt = flat(jax.tree.map(np.asarray, {"0": {"count": np.zeros((), np.int32),
                                               "mu": {"Dense_0": tree["Dense_0"], "embed": tree["embed"]},
                                               "nu": {"Dense_0": tree["Dense_0"], "embed": tree["embed"]}}}))
    check_item(items["opt_state"], opt)  # adam's EmptyState is no leaf (as in jax)
    check_item(items["meta"], {}, non_arrays=tuple(meta_of(200)))
    assert items["meta"]["value"] == meta_of(200) and "value" not in items["params"]


def test_shardings_from_saved_metadata(run_dir, capsys):
    got = leaves_of(items_of(inspect_json(capsys, run_dir, "--item", "params"))["params"])
    for path in SPECS:
        assert got[path]["sharding"] == expected_sharding(path), path


def test_sharding_read_in_a_one_device_process(run_dir):
    code = (
        "import sys, jax\n"
        "assert jax.device_count() == 1, jax.devices()\n"
        "from treetools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, "inspect", str(run_dir), "--step", "100", "--format", "json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert one_checkpoint(out)["step"] == 100
    got = leaves_of(items_of(out)["params"])
    for path in SPECS:
        assert got[path]["sharding"] == expected_sharding(path), path
    check_item(items_of(out)["params"], flat(host_tree(1)))


def test_explicit_step_all_steps_and_folders(run_dir, capsys):
    assert one_checkpoint(inspect_json(capsys, run_dir, "--step", "100"))["step"] == 100
    every = inspect_json(capsys, run_dir, "--step", "all")  # the same shape, one entry per committed step
    assert "items" not in every and every["steps"] == list(STEPS)
    assert [c["step"] for c in every["checkpoints"]] == list(STEPS)
    for i, checkpoint in enumerate(every["checkpoints"]):
        check_item(checkpoint["items"]["params"], flat(host_tree(i + 1)))
        assert checkpoint["items"]["meta"]["value"] == meta_of(STEPS[i])
    one_step = inspect_json(capsys, run_dir / "ckpt_0100")
    assert one_step["steps"] is None and one_checkpoint(one_step)["step"] == 100
    assert set(items_of(one_step)) == {"params", "opt_state", "meta"}
    item = inspect_json(capsys, run_dir / "ckpt_0100" / "params")
    assert item["steps"] is None and list(items_of(item)) == ["params"]
    check_item(items_of(item)["params"], flat(host_tree(1)))
    meta = inspect_json(capsys, run_dir / "ckpt_0100" / "meta")
    check_item(items_of(meta)["meta"], {}, non_arrays=tuple(meta_of(100)))


@pytest.mark.parametrize("ocdbt", [True, False])
@pytest.mark.parametrize("zarr3", [False, True])
def test_ocdbt_and_zarr3_variants(tmp_path, capsys, ocdbt, zarr3):
    tree = host_tree(3)
    path = write_variant(tmp_path / "ckpt", tree, ocdbt=ocdbt, zarr3=zarr3)
    assert (path / "manifest.ocdbt").exists() == ocdbt
    out = inspect_json(capsys, path, "--stats", "--chunk-mb", "0.001")
    assert out["steps"] is None and list(items_of(out)) == ["default"]
    item = items_of(out)["default"]
    check_item(item, flat(tree), non_arrays=("count", "tag"))
    check_stats(item, flat(tree))


def test_standard_checkpointer_folder_is_item_default(tmp_path, capsys):
    tree = host_tree(4)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(tmp_path / "std"), tree)
    out = inspect_json(capsys, tmp_path / "std")
    check_item(items_of(out)["default"], flat(tree))


def test_orbax_stats_match_numpy_in_small_blocks(run_dir, capsys):
    out = inspect_json(capsys, run_dir, "--step", "100", "--item", "params", "--stats", "--chunk-mb", "0.001")
    check_stats(items_of(out)["params"], flat(host_tree(1)))


def test_metadata_mode_reads_no_array_data(tmp_path, capsys):
    """Non-OCDBT keeps chunks in their own files: without them metadata still reads, --stats cannot."""
    tree = host_tree(5)
    path = write_variant(tmp_path / "ckpt", tree, ocdbt=False, zarr3=False)
    for chunk in path.glob("*/[0-9]*"):
        chunk.unlink()
    check_item(items_of(inspect_json(capsys, path))["default"], flat(tree), non_arrays=("count", "tag"))
    rc, out, err = run(capsys, "inspect", path, "--stats")
    assert rc == 1 and "cannot read array data" in one_error_line(err)


# ----------------------------------------------------------------------------- Flax msgpack, safetensors, npz


def test_flax_msgpack(files, capsys):
    out = inspect_json(capsys, files["msgpack"], "--stats", "--chunk-mb", "0.001")
    assert out["format"] == "msgpack" and out["steps"] is None and one_checkpoint(out)["step"] is None
    arrays = {f"params/{p}": x for p, x in flat(host_tree(7)).items()}
    check_item(items_of(out)["default"], arrays, non_arrays=("step",))
    check_stats(items_of(out)["default"], arrays)


def test_safetensors_names_are_kept_as_stored(files, capsys):
    # The writer stored dotted names ("Dense_0.kernel", "layers.0.w"): they are shown exactly so.
    arrays = {p.replace("/", "."): x for p, x in flat(host_tree(7)).items()}
    out = inspect_json(capsys, files["safetensors"], "--stats", "--chunk-mb", "0.001")
    assert out["format"] == "safetensors"
    check_item(items_of(out)["default"], arrays)
    check_stats(items_of(out)["default"], arrays)
    # --depth splits the stored names on ".": one row per top-level module.
    grouped = leaves_of(items_of(inspect_json(capsys, files["safetensors"], "--depth", "1"))["default"])
    tops: dict[str, list[np.ndarray]] = {}
    for name, x in arrays.items():
        tops.setdefault(name.split(".")[0], []).append(x)
    assert set(grouped) == set(tops) == {"Dense_0", "embed", "layers", "half", "scale"}
    for top, members in tops.items():
        assert grouped[top]["params"] == sum(x.size for x in members), top
        assert grouped[top]["bytes"] == sum(x.nbytes for x in members), top
        assert grouped[top].get("num_leaves", 1) == len(members), top


@pytest.mark.parametrize("key", ["npz", "npz_compressed"])
def test_npz_stored_and_compressed(files, capsys, key):
    arrays = {p: x for p, x in flat(host_tree(7)).items() if x.dtype != ml_dtypes.bfloat16}
    out = inspect_json(capsys, files[key], "--stats", "--chunk-mb", "0.001")
    assert out["format"] == "npz"
    check_item(items_of(out)["default"], arrays)
    check_stats(items_of(out)["default"], arrays)


def test_fortran_ordered_npz_stats(tmp_path, capsys):
    x = np.asfortranarray(np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32))
    for saver in (np.savez, np.savez_compressed):
        f = tmp_path / f"{saver.__name__}.npz"
        saver(f, x=x)
        item = items_of(inspect_json(capsys, f, "--stats", "--chunk-mb", "0.001"))["default"]
        check_item(item, {"x": x})
        check_stats(item, {"x": x})


def test_npz_float0_leaf_is_named_float0(tmp_path, capsys):
    # jax's float0 (integer inputs' gradients) is numpy's zero-size void dtype [('float0', 'V')].
    f = tmp_path / "grads.npz"
    np.savez(f, step=np.zeros(3, dtype=[("float0", "V")]), w=np.ones(2, np.float32))
    got = leaves_of(items_of(inspect_json(capsys, f))["default"])
    assert got["step"]["dtype"] == "float0" and got["step"]["bytes"] == 0 and got["step"]["params"] == 3
    assert got["w"]["dtype"] == "float32"


def test_nonfinite_counts_json_and_exit_code(tmp_path, capsys):
    bad = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, 2.0], np.float32)
    allnan = np.full(3, np.nan, np.float32)
    f = tmp_path / "bad.npz"
    np.savez(f, bad=bad, allnan=allnan, good=np.ones(4, np.float32))
    rc, out, err = run(capsys, "inspect", f, "--stats", "--format", "json")
    assert rc == 0
    got = leaves_of(items_of(json.loads(out))["default"])  # valid JSON: NaN became null
    check_stats({"leaves": [got["bad"]]}, {"bad": bad})
    assert got["allnan"]["stats"]["nan"] == 3 and got["allnan"]["stats"]["mean"] is None
    rc, out, err = run(capsys, "inspect", f, "--fail-on-nonfinite")
    assert rc == 3 and "bad" in err and "allnan" in err and "good" not in err
    clean = tmp_path / "clean.npz"
    np.savez(clean, good=np.ones(4, np.float32))
    assert run(capsys, "inspect", clean, "--fail-on-nonfinite")[0] == 0


# ----------------------------------------------------------------------------- read-only


def _tree_state(root: Path) -> dict[str, tuple]:
    """Every file and folder under root: kind, size, mode and content hash."""
    state = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        state[str(p.relative_to(root))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mode, st_.st_mtime_ns, digest)
    return state


def test_never_writes_under_path(run_dir, files, tmp_path, capsys):
    ro = tmp_path / "ro"
    shutil.copytree(run_dir, ro / "run")
    for f in files.values():
        shutil.copy(f, ro / f.name)
    for p in [ro, *ro.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = _tree_state(ro)
    try:
        assert run(capsys, "inspect", ro / "run")[0] == 0
        assert run(capsys, "inspect", ro / "run", "--step", "all", "--stats")[0] == 0
        assert run(capsys, "inspect", ro / "run" / "ckpt_0100" / "params", "--stats")[0] == 0
        assert run(capsys, "diff", ro / "run", "--step", "100", "--step", "200", "--values")[0] == 1  # they differ
        for f in files.values():
            assert run(capsys, "inspect", ro / f.name, "--stats")[0] == 0
        assert run(capsys, "inspect", ro / "run", "--step", "300")[0] == 1
        assert _tree_state(ro) == before
    finally:
        for p in [ro, *ro.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


# ----------------------------------------------------------------------------- bounded memory


PEAK = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
    "assert p.returncode == 0, p.stderr\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def _child_peak_kib(*argv: str, env: dict) -> int:
    proc = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "treetools", *argv],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip())


def test_stats_peak_memory_is_bounded(tmp_path):
    """--stats on 128 MiB checkpoints with a 2 MiB budget: the child's peak RSS grows by < 48 MiB.

    Loading the array whole would add >= 128 MiB (and a float64 copy 256 MiB).
    The growth measured is 28-35 MiB whatever the size (stats threads, their
    blocks in flight, TensorStore's thread pools), hence the margin.
    Orbax is saved with 1 MiB chunks: TensorStore decompresses a chunk whole,
    so the bound holds for chunks below the budget (Orbax's default chunk is
    one device shard).
    """
    budget = 2 * 2**20
    w = np.random.default_rng(0).random((4096, 8192), dtype=np.float32)  # 128 MiB
    np.savez(tmp_path / "big.npz", w=w)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(tmp_path / "big_orbax"), {"w": w}, save_args={"w": ocp.SaveArgs(chunk_byte_size=2**20)})
    env = dict(os.environ, TREETOOLS_CHUNK_BYTES=str(budget), XLA_FLAGS="--xla_force_host_platform_device_count=1")
    for path in (tmp_path / "big.npz", tmp_path / "big_orbax"):
        base = _child_peak_kib("inspect", str(path), "--format", "json", env=env)
        peak = _child_peak_kib("inspect", str(path), "--stats", "--format", "json", env=env)
        assert peak - base < 48 * 1024, (path.name, base, peak)
    want = numpy_stats(w)
    got = inspect_path(str(tmp_path / "big.npz"), stats=True, block_bytes=budget).by_step[0].items["default"].rows[0]
    np.testing.assert_allclose(got.stats["std"], want["std"], rtol=1e-5)


# ----------------------------------------------------------------------------- bad inputs: one line, exit 1


def _write_zip(path: Path, members: dict[str, np.ndarray]) -> None:
    import io

    with zipfile.ZipFile(path, "w") as zf:
        for name, x in members.items():
            buf = io.BytesIO()
            np.save(buf, x)
            zf.writestr(name, buf.getvalue())


def _corrupt_metadata(run_dir: Path, tmp_path: Path, text: str | None = None, edit=None) -> Path:
    item = tmp_path / "item"
    shutil.copytree(run_dir / "ckpt_0100" / "params", item)
    meta = item / "_METADATA"
    if edit is not None:
        meta.write_text(json.dumps(edit(json.loads(meta.read_text()))))
    else:
        meta.write_text(text if text is not None else meta.read_text()[: len(meta.read_text()) // 2])
    return item


def _escape_key(meta: dict) -> dict:
    key, entry = next(iter(meta["tree_metadata"].items()))
    entry["key_metadata"] = [{"key": "../../outside", "key_type": 2}]
    return meta


BAD_INPUTS = {
    "missing path": (lambda rd, t: t / "nope", "no such file"),
    "not a checkpoint file": (lambda rd, t: (t / "notes.txt", (t / "notes.txt").write_text("hello"))[0], "not a checkpoint"),
    "empty folder": (lambda rd, t: (t / "empty", (t / "empty").mkdir())[0], "empty folder"),
    "folder of other files": (lambda rd, t: (t / "d", (t / "d").mkdir(), (t / "d" / "x.txt").write_text("x"))[0],
                              "not a checkpoint"),
    "truncated _METADATA": (lambda rd, t: _corrupt_metadata(rd, t), "corrupt or truncated Orbax _METADATA"),
    "_METADATA of the wrong shape": (lambda rd, t: _corrupt_metadata(rd, t, '{"foo": 1}'), "corrupt Orbax _METADATA"),
    "orbax key escaping the folder": (lambda rd, t: _corrupt_metadata(rd, t, edit=_escape_key), "tries to escape"),
    "truncated msgpack": (lambda rd, t: (t / "s.msgpack", (t / "s.msgpack").write_bytes(
        __import__("flax.serialization").serialization.to_bytes({"w": np.ones((64, 64))})[:1000]))[0],
        "corrupt or truncated Flax msgpack"),
    "safetensors header not JSON": (lambda rd, t: (t / "m.safetensors", (t / "m.safetensors").write_bytes(
        (10).to_bytes(8, "little") + b"{not json}" + b"\0" * 8))[0], "corrupt safetensors header"),
    "safetensors header truncated": (lambda rd, t: (t / "m.safetensors", (t / "m.safetensors").write_bytes(
        (4096).to_bytes(8, "little") + b'{"w": {"dtype"'))[0], "truncated safetensors header"),
    "safetensors key escaping the folder": (lambda rd, t: (t / "m.safetensors", __import__("safetensors.numpy").numpy.save_file(
        {"../evil": np.ones(2, np.float32)}, str(t / "m.safetensors")))[0], "tries to escape"),
    "npz member escaping the folder": (lambda rd, t: (t / "a.npz", _write_zip(t / "a.npz", {"../evil.npy": np.ones(2)}))[0],
                                       "tries to escape"),
    "truncated npz": (lambda rd, t: (t / "a.npz", np.savez(t / "full.npz", w=np.ones(1000)),
                                     (t / "a.npz").write_bytes((t / "full.npz").read_bytes()[:3000]))[0],
                      "corrupt or truncated npz"),
    "orbax tmp folder": (lambda rd, t: rd / TMP_STEP, "incomplete save"),
    "step folder without commit marker": (lambda rd, t: rd / UNCOMMITTED_STEP, "incomplete save"),
    "root with only incomplete saves": (lambda rd, t: (t / "r", (t / "r").mkdir(), shutil.copytree(rd / TMP_STEP, t / "r" / TMP_STEP))[0],
                                        "no committed checkpoint step"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_1(case, run_dir, tmp_path, capsys):
    make, words = BAD_INPUTS[case]
    path = make(run_dir, tmp_path)
    rc, out, err = run(capsys, "inspect", path)
    assert rc == 1 and out == ""
    assert words in one_error_line(err)


def test_bad_input_from_the_real_entry_point(tmp_path):
    bad = tmp_path / "m.safetensors"
    bad.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    proc = subprocess.run([sys.executable, "-m", "treetools", "inspect", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    one_error_line(proc.stderr)


def test_unknown_and_incomplete_steps_and_items(run_dir, capsys):
    rc, _, err = run(capsys, "inspect", run_dir, "--step", "5")
    assert rc == 1 and "available steps: 100, 200" in one_error_line(err)
    rc, _, err = run(capsys, "inspect", run_dir, "--step", "300")
    assert rc == 1 and "incomplete" in one_error_line(err)
    rc, _, err = run(capsys, "inspect", run_dir, "--item", "nope")
    assert rc == 1 and "meta, opt_state, params" in one_error_line(err)
    rc, _, err = run(capsys, "inspect", run_dir, "--include", "no_such_leaf")
    assert rc == 1 and "no_such_leaf" in one_error_line(err)


def test_library_raises_checkpoint_error(tmp_path):
    from treetools.shared.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="missing: no such file or folder") as e:
        inspect_path(str(tmp_path / "missing"))
    assert isinstance(e.value, FileNotFoundError) and not isinstance(e.value, CheckpointError)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a checkpoint that treetools can read. Readable formats: ") as e:
        inspect_path(str(tmp_path / "notes.txt"))
    assert isinstance(e.value, ValueError) and "orbax, " in str(e.value) and "safetensors, " in str(e.value)


def test_a_mistyped_path_gets_did_you_mean(tmp_path, monkeypatch, capsys):
    # Issue 47 (5): `model.safetensor` was "no such file or folder." with no hint, though a folder holding
    # checkpoints gets a "did you mean". The nearest folder that exists is searched for names close to the part
    # missing; the rest of the path is kept where it exists below the suggestion.
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "runs" / "demo" / "checkpoints" / "100").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cases = {
        "model.safetensor": "did you mean model.safetensors?",  # relative, as typed
        str(tmp_path / "modle.safetensors"): f"did you mean {tmp_path / 'model.safetensors'}?",
        "runs/demo/checkpoint/100": "did you mean runs/demo/checkpoints/100?",  # the rest kept: it exists
        "runs/demo/checkpoint/7": "did you mean runs/demo/checkpoints?",  # it does not: the folder
        "runs/dmeo": "did you mean runs/demo?",
    }
    for typed, hint in cases.items():
        rc, _, err = run(capsys, "inspect", typed)
        assert rc == 1 and one_error_line(err) == f"treetools: error: {typed}: no such file or folder; {hint}", typed
    # No close name: the line as before, no guess.
    rc, _, err = run(capsys, "inspect", "elsewhere/x.npz")
    assert rc == 1 and one_error_line(err) == "treetools: error: elsewhere/x.npz: no such file or folder."


# ----------------------------------------------------------------------------- blocks and docstrings


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=4),
    max_elems=st.integers(1, 60),
    granule=st.one_of(st.none(), st.lists(st.integers(1, 8), min_size=4, max_size=4)),
)
def test_plan_blocks_tiles_every_element_once(shape, max_elems, granule):
    shape = tuple(shape)
    g = tuple(granule[: len(shape)]) if granule is not None else None
    seen = np.zeros(shape, np.int32)
    order = np.arange(math.prod(shape)).reshape(shape)  # each element's C-order position
    last_end = 0
    for index in plan_blocks(shape, max_elems, g):
        seen[index] += 1
        block = order[index].ravel()
        gran = math.prod(min(a, b) for a, b in zip(g, shape)) if g else 1
        assert block.size <= max(max_elems, gran)
        if g is None and block.size:  # one C-contiguous run, front to back (what a stream needs)
            assert np.all(np.diff(block) == 1) and block[0] == last_end
            last_end = block[-1] + 1
    assert np.all(seen == 1)


# ----------------------------------------------------------------------------- review: unreadable files, odd paths


@pytest.fixture
def fifo(tmp_path):
    """Make FIFOs; after 10 s a watchdog keeps unblocking their readers, so a regression fails instead of hanging."""
    import threading

    made: list[Path] = []
    stop = threading.Event()

    def make(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        made.append(path)
        return path

    def unblock():
        if stop.wait(10):
            return
        while not stop.wait(0.05):
            for p in made:
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))  # a blocked reader now sees EOF
                except OSError:
                    pass  # no reader: nothing to unblock

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    yield make
    stop.set()
    watchdog.join()


def _item_copy(run_dir: Path, tmp_path: Path) -> Path:
    item = tmp_path / "item"
    shutil.copytree(run_dir / "ckpt_0100" / "params", item)
    return item


def test_fifo_path_is_an_error_not_a_hang(fifo, tmp_path, capsys):
    for name in ("pipe.npz", "pipe"):
        rc, out, err = run(capsys, "inspect", fifo(tmp_path / name))
        assert rc == 1 and out == "" and "not a regular file" in one_error_line(err)


def test_fifo_metadata_files_are_errors_not_hangs(run_dir, fifo, tmp_path, capsys):
    step = tmp_path / "step"
    shutil.copytree(run_dir / "ckpt_0100", step)
    (step / "_CHECKPOINT_METADATA").unlink()
    fifo(step / "_CHECKPOINT_METADATA")
    rc, out, err = run(capsys, "inspect", step)
    assert rc == 1 and "_CHECKPOINT_METADATA: not a regular file" in one_error_line(err)
    item = _item_copy(run_dir, tmp_path)
    (item / "_METADATA").unlink()
    fifo(item / "_METADATA")
    rc, out, err = run(capsys, "inspect", item)
    assert rc == 1 and "_METADATA: not a regular file" in one_error_line(err)
    data = next(p for p in (run_dir / "ckpt_0100" / "params" / "d").iterdir())
    item2 = tmp_path / "item2"
    shutil.copytree(run_dir / "ckpt_0100" / "params", item2)
    (item2 / "d" / data.name).unlink()
    fifo(item2 / "d" / data.name)
    rc, out, err = run(capsys, "inspect", item2)
    assert rc == 1 and f"d/{data.name}: not a regular file" in one_error_line(err)


@pytest.mark.parametrize("how", ["missing", "folder"])
def test_item_folder_with_a_bad_metadata_file(run_dir, tmp_path, capsys, how):
    """Not "step folder holds no Orbax item" about `ocdbt.process_0` read as step 0: name _METADATA."""
    item = _item_copy(run_dir, tmp_path)
    (item / "_METADATA").unlink()
    if how == "folder":
        (item / "_METADATA").mkdir()
    rc, out, err = run(capsys, "inspect", item)
    line = one_error_line(err)
    assert rc == 1 and "_METADATA" in line and "ocdbt.process" not in line, line
    assert ("not a regular file" if how == "folder" else "no _METADATA") in line


def test_broken_symlink_is_named(tmp_path, capsys):
    (tmp_path / "link.npz").symlink_to(tmp_path / "gone.npz")
    rc, out, err = run(capsys, "inspect", tmp_path / "link.npz")
    assert rc == 1 and "broken or looping symlink" in one_error_line(err) and "gone.npz" in err


def test_data_folder_where_a_file_is_expected_gives_one_line(run_dir, tmp_path):
    """Orbax's async reads fail; TensorStore's late callbacks must not print tracebacks after the error line."""
    item = _item_copy(run_dir, tmp_path)
    for f in (item / "d").iterdir():
        f.unlink()
        f.mkdir()
    proc = subprocess.run([sys.executable, "-m", "treetools", "inspect", str(item)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert proc.returncode == 1 and proc.stdout == ""
    line = one_error_line(proc.stderr)
    # The OCDBT database is checked (its b-tree nodes read and bounded) before TensorStore opens an array.
    assert line.startswith(f"treetools: error: {item}/d/") and "cannot read the node (not a regular file" in line, line


def test_tilde_and_relative_paths(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert items_of(inspect_json(capsys, "~/w.npz"))["default"]["total_params"] == 3
    (tmp_path / "bad.npz").write_text("not a zip")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, "inspect", "bad.npz")
    assert rc == 1 and one_error_line(err).startswith("treetools: error: bad.npz: ")  # the path as typed
    rc, _, err = run(capsys, "inspect", ".")  # a folder of other files, named as typed
    assert rc == 1 and one_error_line(err).startswith("treetools: error: .: not a checkpoint")


def test_item_folder_given_as_dot_keeps_its_name(run_dir, capsys, monkeypatch):
    monkeypatch.chdir(run_dir / "ckpt_0100" / "params")
    assert list(items_of(inspect_json(capsys, "."))) == ["params"]
    monkeypatch.chdir(run_dir / "ckpt_0100")
    assert one_checkpoint(inspect_json(capsys, "."))["step"] == 100


# ----------------------------------------------------------------------------- review: what the table shows


def test_unmatched_pattern_lists_each_nearby_path_once(run_dir, capsys):
    rc, _, err = run(capsys, "inspect", run_dir, "--include", "Dense_0/kernal")
    line = one_error_line(err)
    nearby = re.search(r"nearby paths: (\[.*?\])", line).group(1)
    shown = eval(nearby)  # a Python list literal of strings
    assert len(shown) == len(set(shown)), line


def _nearby(capsys, *argv) -> list[str]:
    rc, _, err = run(capsys, *argv)
    assert rc == 1
    return ast.literal_eval(re.search(r"nearby paths: (\[.*?\])", one_error_line(err)).group(1))


def test_nearby_paths_are_in_one_form_each_pasted_back_shows_its_leaf(run_dir, capsys):
    # Several items: every nearby path is item/path (one leaf), never a mix with bare paths (`Dense_0/bias`,
    # which means a leaf in several items). Pasted into --include, each shows exactly that leaf.
    items = set(items_of(inspect_json(capsys, run_dir)))
    shown = _nearby(capsys, "inspect", run_dir, "--include", "Dense_0/biaz")
    assert shown and all(p.split("/", 1)[0] in items for p in shown), shown
    for path in shown:
        item, leaf = path.split("/", 1)
        got = items_of(inspect_json(capsys, run_dir, "--include", f"^{re.escape(path)}$"))
        assert {name: [x["path"] for x in value["leaves"]] for name, value in got.items()} == {item: [leaf]}
    # One item: the paths as its table shows them.
    shown = _nearby(capsys, "inspect", run_dir, "--item", "opt_state", "--include", "Dense_0/biaz")
    assert shown and not any(p.startswith("opt_state/") for p in shown), shown
    for path in shown:
        got = items_of(inspect_json(capsys, run_dir, "--item", "opt_state", "--include", f"^{re.escape(path)}$"))
        assert [x["path"] for x in got["opt_state"]["leaves"]] == [path]


def test_filter_hides_items_it_empties(run_dir, capsys):
    out = inspect_json(capsys, run_dir, "--include", "^embed$")
    assert list(items_of(out)) == ["params"]  # opt_state's paths are 0/mu/embed..., meta has no embed
    rc, text, _ = run(capsys, "inspect", run_dir, "--include", "^embed$")
    assert "[opt_state]" not in text and "[meta]" not in text and "(no leaves)" not in text


def test_table_shows_mesh_and_json_item_values(run_dir, capsys):
    rc, out, _ = run(capsys, "inspect", run_dir, "--step", "100")
    assert rc == 0
    params = out.split("[params]", 1)[1].split("\n[", 1)[0]
    assert "mesh: data=2, model=4" in params
    meta = out.split("[meta]", 1)[1].split("\n[", 1)[0]
    for key, value in meta_of(100).items():
        assert re.search(rf"^{key}\s+{re.escape(json.dumps(value))}$", meta, re.M), (key, meta)
    assert "Total: 0 params" not in meta  # a JSON item is its values, not a table of zeros
    rc, out, _ = run(capsys, "inspect", run_dir, "--step", "100", "--item", "meta", "--format", "tree")
    assert all(re.search(rf"^{k}\s+{re.escape(json.dumps(v))}$", out, re.M) for k, v in meta_of(100).items()), out


def test_msgpack_scalar_values_are_shown(files, capsys):
    rc, out, _ = run(capsys, "inspect", files["msgpack"])
    assert rc == 0 and re.search(r"^step\s+3$", out, re.M), out


def test_rows_name_their_whole_path_and_every_printed_path_can_be_pasted(tmp_path, capsys):
    """optax.multi_transform states: every path starts with 1/inner_states/train/inner_state/. Issue 24, point 4:
    rows were relative to a prefix in the section header and could not be pasted into --show or --include."""
    prefix = "1/inner_states/train/inner_state/"
    leaves = {f"{prefix}0/mu/w": np.arange(6, dtype=np.float32).reshape(2, 3), f"{prefix}0/nu/w": np.ones((2, 3), np.float32),
              f"{prefix}2/count": np.zeros((), np.int32)}
    np.savez(tmp_path / "opt.npz", **leaves)
    rc, out, _ = run(capsys, "inspect", tmp_path / "opt.npz", "--leaves")
    lines = out.splitlines()
    assert "[default]" in lines
    rows = [line.split()[0] for line in lines if line.startswith(prefix)]
    assert rows == list(leaves)  # the whole path, as JSON, --show and the patterns know it
    for row in rows:  # each pasted into --show, alone and with its item, reads that leaf
        for spec in (row, f"default/{row}"):
            rc, shown, err = run(capsys, "inspect", tmp_path / "opt.npz", "--show", spec)
            assert rc == 0 and shown.startswith(f"default/{row}"), (spec, err)
    rc, out, _ = run(capsys, "inspect", tmp_path / "opt.npz", "--include", f"default/{prefix}0/mu", "--leaves")
    assert [line.split()[0] for line in out.splitlines() if line.startswith(prefix)] == [f"{prefix}0/mu/w"]
    rc, md, _ = run(capsys, "inspect", tmp_path / "opt.npz", "--format", "markdown", "--leaves")
    assert "## default" in md and f"| {prefix}0/mu/w " in md
    item = items_of(inspect_json(capsys, tmp_path / "opt.npz"))["default"]
    assert [leaf["path"] for leaf in item["leaves"]] == list(leaves)  # JSON keeps whole paths


def test_item_selects_a_top_level_key_of_a_single_tree_file(files, capsys):
    """A Flax msgpack of a whole state ({"params": ..., "step": ...}): --item params is its params subtree."""
    out = inspect_json(capsys, files["msgpack"], "--item", "params")
    check_item(items_of(out)["params"], flat(host_tree(7)))
    rc, _, err = run(capsys, "inspect", files["msgpack"], "--item", "opt_state")
    assert rc == 1 and "default" in one_error_line(err) and "params" in err


def test_markdown_tables_follow_a_blank_line(run_dir, capsys):
    """A GFM table right below a paragraph (the mesh line) is read as part of that paragraph."""
    rc, out, _ = run(capsys, "inspect", run_dir, "--format", "markdown")
    lines = out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("| path")]
    assert rc == 0 and len(headers) == 3 and any(line.startswith("## ") and "mesh: " in line for line in lines)
    assert all(lines[i - 1] == "" for i in headers), out


def test_an_nnx_state_counts_its_params_apart_from_rng_state_and_batch_statistics(tmp_path, capsys):
    # Issue 24, point 19: a whole nnx State (one Orbax item) called BatchNorm statistics and RNG counters params.
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(4, 2, rngs=rngs)

    model = Model(nnx.Rngs(0, dropout=1))
    size = lambda *filters: sum(x.size for x in jax.tree.leaves(nnx.state(model, *filters)))  # noqa: E731
    with ocp.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, args=ocp.args.StandardSave(nnx.state(model)))
        mgr.wait_until_finished()
    assert main(["inspect", str(tmp_path / "run"), "--format", "json"]) == 0
    item = json.loads(capsys.readouterr().out)["checkpoints"][0]["items"]["default"]
    # The RNG key is stored as its uint32 data (2 elements for one key): counted as stored, apart from the params.
    assert item["total_params"] - sum(item["not_params"].values()) == size(nnx.Param)  # 34
    assert item["not_params"]["batch statistics"] == size(nnx.BatchStat) and set(item["not_params"]) == {
        "batch statistics", "RNG state"}
    assert main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"Total: {item['total_params']} elements ({size(nnx.Param)} params, " in out  # 34 params of 45 elements
    for fmt in ("table", "tree"):
        assert main(["inspect", str(tmp_path / "run"), "--format", fmt]) == 0
        assert " params " not in capsys.readouterr().out.replace(f"({size(nnx.Param)} params,", "")


def test_stats_reach_rows_by_path_prefix_once_per_leaf_not_rows_times_leaves():
    # Issue 36: `_with_stats` compared every row with every leaf: `--leaves --stats` at 4,000 leaves was 16 million
    # comparisons before any data was read. Counted here: how many (path, statistics) entries it looks at.
    from treetools.checkpoint_tools.report import _with_stats
    from treetools.checkpoint_tools.stats import StatsAccumulator
    from treetools.shared.rows import Row, aggregate_rows

    class Counted(dict):
        looked_at = 0

        def items(self):
            for item in super().items():
                Counted.looked_at += 1
                yield item

    rng = np.random.default_rng(0)
    values = {(f"layers_{i}", f"w{j}"): rng.normal(size=3) for i in range(1000) for j in range(4)}  # 4,000 leaves
    accs = Counted()
    for path, x in values.items():
        acc = StatsAccumulator()
        acc.update(x)
        accs[path] = acc
    leaf_rows = [Row(path, (3,), "float64", 3, 24) for path in values]
    for rows in (leaf_rows, aggregate_rows(leaf_rows, 1)):  # --leaves, then one group per layer (--depth 1)
        Counted.looked_at = 0
        out = _with_stats(rows, accs)
        assert Counted.looked_at == len(values)  # each leaf once, whatever the rows (it was rows x leaves)
        for r in out[:3] + out[-3:]:
            want = np.concatenate([x for p, x in values.items() if p[:len(r.path)] == r.path])
            np.testing.assert_allclose([r.stats["mean"], r.stats["max"], r.stats["l2"]],
                                       [want.mean(), want.max(), np.sqrt((want ** 2).sum())], rtol=1e-12)


def _on_a_terminal(columns: int, *argv) -> str:
    """``treetools ARGV`` in a fresh process whose stdout is a terminal ``columns`` wide (a pseudo-terminal), as a
    user runs it; its output, newlines as the terminal writes them (``\\r\\n``) turned back."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["COLUMNS"] = ""  # unset for the child too (a library may have set it below os.environ in this process)
    proc = subprocess.Popen([sys.executable, "-m", "treetools", *map(str, argv)], stdout=slave,
                            stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait() == 0
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_tables_use_the_terminal_width_and_drop_empty_columns_first(tmp_path, capsys):
    # Issue 47 (21): tables were cut to 100 columns on a 200-column terminal, and the note named an empty
    # `sharding` column among those "left out". On a terminal the width is the terminal's; an empty column goes
    # first, unsaid (it hides nothing). A file or a pipe stays 100 columns.
    long = "transformer/encoder/layers_0/self_attention/query_projection/kernel_weights_"
    np.savez(tmp_path / "w.npz", **{f"{long}{i}": np.ones((64, 64), np.float32) for i in range(3)})
    assert main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "o"), "--to", "orbax"]) == 0
    capsys.readouterr()

    def header(out):
        return next(line for line in out.splitlines() if line.startswith("path ")).split()

    rc, out, _ = run(capsys, "inspect", tmp_path / "o")  # captured stdout: no terminal, 100 columns
    assert rc == 0 and header(out) == ["path", "dtype", "params"]
    assert "(bytes, shape left out to fit 100 columns; --leaves shows every column)" in out
    assert max(len(line) for line in out.splitlines() if long in line) <= 100
    # path 77 + shape 8 + dtype 7 + params 8 + bytes 9 + sharding 8, two spaces between: 127 columns
    out = _on_a_terminal(200, "inspect", tmp_path / "o")
    assert header(out) == ["path", "shape", "dtype", "params", "bytes", "sharding"] and "left out" not in out
    out = _on_a_terminal(110, "inspect", tmp_path / "o")  # 117 with bytes: the empty sharding, then bytes go
    assert header(out) == ["path", "shape", "dtype", "params"] and "(bytes left out to fit 110 columns" in out
