"""Every streaming command against the page-cache floor, in one run (issue 26).

The checkpoint of issue 26: one CheckpointManager root with 2 steps of 64
float32 leaves of (1024, 2048) (512 MiB a step; rows scaled by
TREETOOLS_BENCH_SCALE), saved by Orbax with its default zstd compression; the
same tensors as two ``.safetensors`` files and two Flax msgpack files.

* ``test_streaming_commands_vs_page_cache_floor``: per format, interleaved
  rounds of the floor (``cat`` of the files read), ``inspect --stats``,
  ``verify``, ``diff --values`` (both steps), ``load_parameters``, the engine's
  ordered stream as ``convert`` reads it (blocks dropped, and appended to a file
  in memory, ``/dev/shm``, so the disk's writeback is not what is measured;
  ``tt.convert`` too once it exists), and ``--stats`` again (the A/A control:
  the same command in another slot). Medians; GB/s of logical bytes (a diff reads both steps), beyond the
  metadata-only run, and CPU seconds per GiB (all threads): CPU/wall near the
  core count means every core is busy.
* ``test_what_limits_each_command``: the parts alone, in the same run: decoding
  (TensorStore reads), the statistics and the comparison on in-memory arrays.
* ``test_scaling_with_cores``: whole ``treetools`` processes pinned to 1 core
  and to every core (``taskset``), minus the metadata-only process on the same cores.
* ``test_load_parameters_vs_library_loaders``: ``load_parameters`` against
  ``safetensors.numpy.load_file`` and Orbax's own restore to numpy (targets 1.1 and 1.05).
* ``test_metadata_process_vs_import_jax``: ``treetools inspect`` of every format
  as a whole process against ``python -c "import jax"`` (target 0.3).
"""

from __future__ import annotations

import compileall
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import SCALE

import treetools as tt
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.stream import cores, reduce_blocks, stream_blocks
from treetools.checkpoint_tools.diff import diff_paths, value_diffs
from treetools.checkpoint_tools.report import inspect_path
from treetools.checkpoint_tools.stats import compute_stats
from treetools.checkpoint_tools.verify import verify_path

LEAVES, COLS = 64, 2048
ROWS = max(8, int(round(1024 * SCALE)))
ROUNDS = 5 if SCALE >= 0.25 else 1
REPO = pathlib.Path(__file__).resolve().parents[1]


def _tensors(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {f"layer_{i:02d}": rng.standard_normal((ROWS, COLS), np.float32) for i in range(LEAVES)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from flax import serialization
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("stream_bench")
    run = root / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=run, async_save=False)
    out = {"orbax": {"path": str(run)}, "safetensors": {}, "msgpack": {}}
    for step in (1, 2):
        tensors = _tensors(step)
        tt.save_checkpoint(mngr, step, {"params": tensors}, wait=True, force=True)
        save_file(tensors, str(root / f"step{step}.safetensors"))
        (root / f"step{step}.msgpack").write_bytes(serialization.to_bytes({"params": tensors}))
        out["safetensors"][step] = str(root / f"step{step}.safetensors")
        out["msgpack"][step] = str(root / f"step{step}.msgpack")
        if step == 2:  # the same tensors as a Hugging Face folder of 4 shards with its index
            folder = root / "hf"
            folder.mkdir()
            names = list(tensors)
            shard_of = {k: f"model-{i * 4 // len(names) + 1:05d}-of-00004.safetensors" for i, k in enumerate(names)}
            for shard in sorted(set(shard_of.values())):
                save_file({k: tensors[k] for k in names if shard_of[k] == shard}, str(folder / shard))
            (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard_of}))
            out["hf"] = str(folder)
    mngr.close()
    out["bytes"] = LEAVES * ROWS * COLS * 4
    out["root"] = root
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs]


def _cat(*paths: str) -> None:
    subprocess.run(["cat", *[f for p in paths for f in _files(p)]], stdout=subprocess.DEVNULL, check=True)


def _engine_stream(path: str, step: int | None, dst: str | None) -> None:
    """What ``convert`` to safetensors does with the data: every block of the item, in writer order, appended to
    ``dst`` (None: dropped, the read side alone)."""
    source = open_source(path)
    item = next(iter(source.snapshot(step).items.values()))
    readers = [leaf.reader for leaf in item.leaves if leaf.reader is not None]
    f = open(dst, "wb", buffering=0) if dst else None
    try:
        for _, _, block in stream_blocks(readers, block_bytes=8 * 2**20):
            if f is not None:
                f.write(memoryview(np.ascontiguousarray(block).view(np.uint8)))
    finally:
        if f is not None:
            f.close()
            os.unlink(dst)


def _memory_folder(scratch: pathlib.Path) -> str:
    """Where written bytes stay in memory (tmpfs), so a write measures the engine, not the disk's writeback."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(scratch)


def _commands(fmt: str, ck: dict, scratch: pathlib.Path) -> dict[str, tuple]:
    """name -> (function, logical bytes, its metadata-only counterpart, files the floor reads)."""
    n = ck["bytes"]
    shm = os.path.join(_memory_folder(scratch), f"treetools-bench-{os.getpid()}.bin")
    if fmt == "orbax":
        root = ck["orbax"]["path"]
        step_dir = {s: os.path.join(root, str(s)) for s in (1, 2)}
        one = dict(path=root, step=2)
        meta = lambda: inspect_path(root, step=2)  # noqa: E731
        diff_meta = lambda: diff_paths(root, root, step_a=1, step_b=2)  # noqa: E731
        cmds = {
            "inspect --stats": (lambda: inspect_path(root, step=2, stats=True, leaves=True), n, meta, [step_dir[2]]),
            "verify": (lambda: verify_path(root, step=2), n, meta, [step_dir[2]]),
            "diff --values": (lambda: diff_paths(root, root, step_a=1, step_b=2, values=True), 2 * n, diff_meta,
                              [step_dir[1], step_dir[2]]),
            "load_parameters": (lambda: tt.load_parameters(root, step=2), n, meta, [step_dir[2]]),
            "stream_blocks (convert's reads)": (lambda: _engine_stream(root, 2, None), n, meta, [step_dir[2]]),
            "stream_blocks -> file in memory": (lambda: _engine_stream(root, 2, shm), n, meta, [step_dir[2]]),
        }
    else:
        a, b = ck[fmt][1], ck[fmt][2]
        meta = lambda: inspect_path(b)  # noqa: E731
        cmds = {
            "inspect --stats": (lambda: inspect_path(b, stats=True, leaves=True), n, meta, [b]),
            "verify": (lambda: verify_path(b), n, meta, [b]),
            "diff --values": (lambda: diff_paths(a, b, values=True), 2 * n, lambda: diff_paths(a, b), [a, b]),
            "load_parameters": (lambda: tt.load_parameters(b), n, meta, [b]),
            "stream_blocks (convert's reads)": (lambda: _engine_stream(b, None, None), n, meta, [b]),
            "stream_blocks -> file in memory": (lambda: _engine_stream(b, None, shm), n, meta, [b]),
        }
        one = dict(path=b, step=None)
    convert = getattr(tt, "convert", None)
    if convert is not None:  # issue 30's command, once merged
        def run_convert(one=one):
            dst = pathlib.Path(_memory_folder(scratch)) / f"treetools-bench-{os.getpid()}.safetensors"
            kw = {"step": one["step"]} if one["step"] is not None else {}
            convert(one["path"], str(dst), **kw)
            dst.unlink()

        cmds["convert (to safetensors)"] = (run_convert, n, meta, cmds["verify"][3])
    return cmds


def _timed(fn) -> tuple[float, float]:
    """Wall seconds and CPU seconds (every thread of this process) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


@pytest.mark.parametrize("fmt", ["orbax", "safetensors", "msgpack"])
def test_streaming_commands_vs_page_cache_floor(ckpts, fmt, tmp_path):
    cmds = _commands(fmt, ckpts, tmp_path)
    for fn, _, meta, files in cmds.values():  # page cache, imports and TensorStore warm
        fn(), meta()
        _cat(*files)
    names = ["floor: cat", *cmds, "inspect --stats (A/A)"]
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    meta_wall = {k: [] for k in cmds}
    for _ in range(ROUNDS):  # interleaved: other load on the machine hits every command alike
        for name in names:
            if name == "floor: cat":
                t = _timed(lambda: _cat(*cmds["diff --values"][3]))
            else:
                fn = cmds["inspect --stats"][0] if name.endswith("(A/A)") else cmds[name][0]
                t = _timed(fn)
                if name in cmds:
                    meta_wall[name].append(_timed(cmds[name][2])[0])
            wall[name].append(t[0])
            cpu[name].append(t[1])
    med = lambda xs: statistics.median(xs)  # noqa: E731
    floor_bytes = cmds["diff --values"][1]
    floor_gbs = floor_bytes / med(wall["floor: cat"]) / 1e9
    print(f"\n[bench] {fmt}: {LEAVES} float32 leaves of ({ROWS}, {COLS}), {ckpts['bytes'] / 2**20:.0f} MiB a step, "
          f"{cores()} cores, {ROUNDS} interleaved rounds, medians", flush=True)
    print(f"[bench]   floor: cat of both steps' files {med(wall['floor: cat']) * 1e3:.1f} ms, {floor_gbs:.2f} GB/s",
          flush=True)
    out = {}
    for name in [*cmds, "inspect --stats (A/A)"]:
        key = "inspect --stats" if name.endswith("(A/A)") else name
        nbytes = cmds[key][1]
        t, c, m = med(wall[name]), med(cpu[name]), med(meta_wall[key])
        gbs, beyond = nbytes / t / 1e9, nbytes / max(t - m, 1e-9) / 1e9
        out[name] = beyond
        print(f"[bench]   {name:40s} {t * 1e3:8.1f} ms  {gbs:5.2f} GB/s  beyond metadata ({m * 1e3:.0f} ms) "
              f"{beyond:5.2f} GB/s  {floor_gbs / beyond:4.1f}x the cat floor  CPU {c / t:3.1f} cores, "
              f"{c / (nbytes / 2**30):.2f} CPU s/GiB", flush=True)
    aa = med(wall["inspect --stats (A/A)"]) / med(wall["inspect --stats"])
    print(f"[bench]   A/A control (--stats in two slots): ratio {aa:.3f}", flush=True)
    if SCALE >= 0.25 and fmt == "orbax" and cores() >= 2:
        for name in ("inspect --stats", "verify", "diff --values"):
            assert out[name] >= 0.5, f"{fmt} {name}: {out[name]:.2f} GB/s"  # loose: the machine may be shared


def test_what_limits_each_command(ckpts):
    """The parts alone: decoding (TensorStore reads to nothing), statistics and comparison of in-memory arrays."""
    root = ckpts["orbax"]["path"]
    source = open_source(root)
    readers = {s: [leaf.reader for leaf in source.snapshot(s).items["params"].leaves] for s in (1, 2)}
    mem_a = [tt.ckpt.InMemoryReader(r.read_all()) for r in readers[1]]
    mem_b = [tt.ckpt.InMemoryReader(r.read_all()) for r in readers[2]]
    rows = lambda rs: [tt.ckpt.Leaf(tt.ckpt.array_row(("w",), r.shape, r.dtype), r) for r in rs]  # noqa: E731
    pairs = [(a, b, "w") for a, b in zip(rows(mem_a), rows(mem_b))]
    n = ckpts["bytes"]
    parts = {
        "decode only (Orbax zstd, TensorStore reads)": (lambda: reduce_blocks(
            [(r,) for r in readers[2]], lambda j: None, lambda acc, ix, bs: None, block_bytes=8 * 2**20), n),
        "statistics only (in memory)": (lambda: compute_stats(mem_b), n),
        "comparison only (in memory, both sides)": (lambda: value_diffs(pairs), 2 * n),
    }
    for fn, _ in parts.values():
        fn()
    times = {k: [] for k in parts}
    for _ in range(ROUNDS):
        for k, (fn, _) in parts.items():
            times[k].append(_timed(fn))
    for k, (_, nbytes) in parts.items():
        t = statistics.median(x[0] for x in times[k])
        c = statistics.median(x[1] for x in times[k])
        print(f"[bench] alone: {k:45s} {nbytes / t / 1e9:6.2f} GB/s on {cores()} cores "
              f"({nbytes / c / 1e9:5.2f} GB/s per CPU second)", flush=True)


def _cli(cpus: str | None, *argv: str) -> list[str]:
    pin = ["taskset", "-c", cpus] if cpus else []
    return [*pin, sys.executable, "-m", "treetools", *argv]


def _wall(argv: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, env=env)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return time.perf_counter() - t0


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset pins a process to cores")
def test_scaling_with_cores(ckpts):
    root, n = ckpts["orbax"]["path"], ckpts["bytes"]
    counts = sorted({1, cores(), *(c for c in (2, 4, 8, 16, 32, 64) if c < cores())})  # 1, 2, 4, ... all
    sets = {f"{c} core{'s' * (c > 1)}": "0" if c == 1 else f"0-{c - 1}" for c in counts}
    load = ("-c", f"import treetools as tt; tt.load_parameters({root!r}, step=2)")
    cmds = {
        "inspect --stats": (("inspect", root, "--step", "2", "--stats"), n),
        "verify": (("verify", root, "--step", "2"), n),
        "diff --values": (("diff", root, "--step", "1", "--step", "2", "--values"), 2 * n),
        "load_parameters": (load, n),
    }
    meta = ("inspect", root, "--step", "2")

    def argv(cpus, args):
        return ([*(["taskset", "-c", cpus]), sys.executable, *args] if args[0] == "-c" else _cli(cpus, *args))

    times = {(c, k): [] for c in sets for k in [*cmds, "metadata"]}
    for cpus in sets.values():
        _wall(_cli(cpus, *meta))
    for _ in range(max(1, ROUNDS - 2)):
        for label, cpus in sets.items():
            times[(label, "metadata")].append(_wall(_cli(cpus, *meta)))
            for k, (args, _) in cmds.items():
                times[(label, k)].append(_wall(argv(cpus, args)))
    med = {key: statistics.median(v) for key, v in times.items()}
    for k, (_, nbytes) in cmds.items():
        spent = {label: med[(label, k)] - med[(label, "metadata")] for label in sets}
        if min(spent.values()) <= 0:  # tiny smoke sizes: nothing beyond start-up to measure
            print(f"[bench] scaling, {k}: no time beyond the metadata-only process at this size", flush=True)
            continue
        rates = {label: nbytes / spent[label] / 1e9 for label in sets}
        line = ", ".join(f"{label} {r:.2f} GB/s" for label, r in rates.items())
        if len(rates) > 1:
            first, last = list(rates.values())[0], list(rates.values())[-1]
            line += f", speedup {last / first:.2f}x"
        print(f"[bench] scaling, whole process, Orbax zstd, {k:16s}: {line}", flush=True)


_TIMED_CALL = "import time\nt = time.perf_counter(); x = f(); print(time.perf_counter() - t)\n"


def _first_call(setup: str) -> float:
    """Seconds of the first ``f()`` in a fresh process (imports not counted): every page of the result is new,
    as when a user loads a checkpoint once (in one long process, freed pages are reused by whoever comes next)."""
    proc = subprocess.run([sys.executable, "-c", setup + _TIMED_CALL], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.split()[-1])


def test_load_parameters_vs_library_loaders(ckpts):
    st, root, hf = ckpts["safetensors"][2], ckpts["orbax"]["path"], ckpts["hf"]
    shards = sorted(os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors"))
    # The library imported as far as a call needs (its format plugins too: the first open_source registers them).
    ours = ("import treetools as tt, treetools.checkpoint_jax.restore, treetools.checkpoint_io\ntreetools.checkpoint_io.registered_formats()\n"
            "f = lambda: tt.load_parameters({!r}{})\n")
    orbax_numpy = (
        "import numpy as np, jax, orbax.checkpoint as ocp\nfrom etils import epath\n"
        f"item = {os.path.join(root, '2', 'params')!r}\n"
        "def f():\n"
        "    handler = ocp.PyTreeCheckpointHandler()\n"
        "    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray),\n"
        "                        handler.metadata(epath.Path(item)).tree)\n"
        "    with ocp.Checkpointer(handler) as ckptr:\n"
        "        return ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))\n")
    pairs = {
        "safetensors file": (ours.format(st, ""), f"from safetensors.numpy import load_file\nf = lambda: load_file({st!r})\n",
                             "safetensors.numpy.load_file", "<= 1.1"),
        "safetensors folder (4 shards + index)": (
            ours.format(hf, ""), f"from safetensors.numpy import load_file\nf = lambda: {{k: v for p in {shards!r} "
            "for k, v in load_file(p).items()}\n", "load_file of each shard", "<= 1.1"),
        # TensorStore is imported by the first TensorStore read (metadata mode of other formats never needs it);
        # imported here as the anchor's setup imports it, so neither side times an import.
        "Orbax step (zstd)": ("import tensorstore\n" + ours.format(root, ", step=2"), orbax_numpy,
                              "Orbax's restore to numpy", "<= 1.05"),
    }
    for name, (ours_code, anchor_code, anchor_name, target) in pairs.items():
        t = {"ours": [], "anchor": [], "anchor2": []}
        for _ in range(ROUNDS + 2 if SCALE >= 0.25 else 1):  # interleaved; the anchor twice (A/A control)
            for key, code in (("anchor", anchor_code), ("ours", ours_code), ("anchor2", anchor_code)):
                t[key].append(_first_call(code))
        ratio = statistics.median(a / b for a, b in zip(t["ours"], t["anchor"]))
        aa = statistics.median(a / b for a, b in zip(t["anchor2"], t["anchor"]))
        print(f"[bench] load_parameters, {name}, first call in a fresh process: ours "
              f"{statistics.median(t['ours']) * 1e3:.1f} ms, {anchor_name} {statistics.median(t['anchor']) * 1e3:.1f} ms, "
              f"paired ratio {ratio:.3f} (target {target}); A/A {aa:.3f}", flush=True)


@pytest.fixture(scope="module")
def small_formats(tmp_path_factory):
    """One small checkpoint of every format (metadata mode reads headers: the size does not matter)."""
    from flax import serialization
    from safetensors.numpy import save_file

    sys.path.insert(0, str(REPO))
    from tests import _t5x_writer

    d = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(0)
    params = {f"layer_{i}": {"w": rng.standard_normal((64, 64), np.float32), "b": np.zeros(64, np.float32)}
              for i in range(24)}
    flat = {f"{k}.{n}": v for k, layer in params.items() for n, v in layer.items()}
    save_file(flat, str(d / "model.safetensors"))
    np.savez(d / "model.npz", **{k.replace(".", "/"): v for k, v in flat.items()})
    (d / "model.msgpack").write_bytes(serialization.to_bytes({"params": params, "step": 3}))
    (d / "hf").mkdir()
    keys = list(flat)
    shards = {k: f"model-0000{1 + (i >= len(keys) // 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in sorted(set(shards.values())):
        save_file({k: flat[k] for k in keys if shards[k] == shard}, str(d / "hf" / shard))
    (d / "hf" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    _t5x_writer.save_t5x(d / "t5x", 100, {"target": params, "state": {"step": np.int32(100)}})
    orbax = d / "orbax"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=orbax, async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True, force=True)
    mngr.close()
    return {"orbax": orbax, "t5x": d / "t5x", "msgpack": d / "model.msgpack",
            "safetensors": d / "model.safetensors", "hf sharded": d / "hf", "npz": d / "model.npz"}


def test_metadata_process_vs_import_jax(small_formats):
    # An installed package has its bytecode compiled; an editable checkout compiles it here once (as pip does).
    compileall.compile_dir(str(REPO / "treetools"), quiet=1)
    jax_cmd = [sys.executable, "-c", "import jax"]
    # The command users run: the installed `treetools` script (`python -m treetools` where there is none).
    script = pathlib.Path(sys.executable).parent / "treetools"
    program = [str(script)] if script.exists() else [sys.executable, "-m", "treetools"]
    for name, path in small_formats.items():
        ours_cmd = [*program, "inspect", str(path)]
        _wall(ours_cmd), _wall(jax_cmd)
        ours, anchor = [], []
        for _ in range(11 if SCALE >= 0.25 else 2):
            anchor.append(_wall(jax_cmd))
            ours.append(_wall(ours_cmd))
        ratio = statistics.median(ours) / statistics.median(anchor)
        print(f"[bench] treetools inspect, {name} metadata (whole process): ours {statistics.median(ours) * 1e3:.0f} ms, "
              f'python -c "import jax" {statistics.median(anchor) * 1e3:.0f} ms, ratio {ratio:.3f} (target <= 0.3)',
              flush=True)
