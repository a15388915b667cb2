"""One read engine (issue 45): ``restore_checkpoint`` reads every format through the block engine, onto real meshes.

Truth is the writer's own numpy arrays (and numpy slicing/transposing for the
rules); the engine is proved by spies on its entry point
(``stream.read_regions``), on its scheduler (``stream.ordered_map``) and on
the readers (the blocks each one is asked for, the threads that ask, the
reads in flight at once). Every read option of ``read=`` is shown reaching
the reader: the block size, the threads, the memory budget, ``follow_links``.
"""

from __future__ import annotations

import ast
import shutil
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import treetools as tt
from tests.test_rules_restore import WRITERS
from treetools.checkpoint_io import stream
from treetools.checkpoint_io.readers import FileReader, MemoryBudgetError, block_extent
from treetools.checkpoint_io.context import ReadContext
from treetools.shared.errors import CheckpointError

L, D_IN, D_OUT = 4, 32, 48
RULES = tt.Rules(unstack=[r"^layers/"], rename=[(r"^layers/(\d+)/w$", r"blocks/\1/kernel")],
                 transpose=[(r"kernel$", (1, 0))])


def _stored() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(45)
    return {"embed": rng.standard_normal((64, D_IN), np.float32),
            "layers/w": rng.standard_normal((L, D_IN, D_OUT), np.float32),
            "head/b": rng.standard_normal(D_OUT).astype(np.float32),
            "step": np.array(7, np.int32)}


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def _as_stored(mesh) -> tuple[dict, dict[str, np.ndarray] | None, int]:
    """The target of the stored tree; its distinct device blocks counted by hand (4x2 mesh):
    embed P(data, model): 8; layers/w P(None, data, model): 8; head/b P(model): 2 (each on 4 devices); step: 1."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    target = {"embed": jax.ShapeDtypeStruct((64, D_IN), jnp.float32, sharding=s("data", "model")),
              "layers": {"w": jax.ShapeDtypeStruct((L, D_IN, D_OUT), jnp.float32, sharding=s(None, "data", "model"))},
              "head": {"b": jax.ShapeDtypeStruct((D_OUT,), jnp.float32, sharding=s("model"))},
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=s())}
    return target, None, 8 + 8 + 2 + 1


def _ruled(mesh) -> tuple[dict, dict[str, np.ndarray], int]:
    """The target of RULES, the truth by numpy, and its distinct device blocks by hand: blocks/i/kernel
    (D_OUT, D_IN) P(data, model): 8 each, 4 layers: 32; embed 8; head/b 2; step 1."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    flat = _stored()
    target = {"embed": jax.ShapeDtypeStruct((64, D_IN), jnp.float32, sharding=s("data", "model")),
              "blocks": [{"kernel": jax.ShapeDtypeStruct((D_OUT, D_IN), jnp.float32, sharding=s("data", "model"))}
                         for _ in range(L)],
              "head": {"b": jax.ShapeDtypeStruct((D_OUT,), jnp.float32, sharding=s("model"))},
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=s())}
    truth = {"embed": flat["embed"], "head/b": flat["head/b"], "step": flat["step"],
             **{f"blocks/{i}/kernel": flat["layers/w"][i].T for i in range(L)}}
    return target, truth, 32 + 8 + 2 + 1


class _Spy:
    """Records every call of the engine's entry point and scheduler, and each task the engine's threads run: its
    thread, and the most tasks running at once (each made to last 20 ms more, so that threads that exist
    overlap)."""

    def __init__(self, monkeypatch):
        self.entries: list[int] = []
        self.workers: list[int] = []
        self.threads: set[str] = set()
        self.now = self.peak = 0
        self.lock = threading.Lock()
        real_entry, real_map = stream.read_regions, stream.ordered_map

        def entry(regions, then, **kwargs):
            self.entries.append(len(regions))
            return real_entry(regions, then, **kwargs)

        def scheduler(fn, items, *, workers, **kwargs):
            self.workers.append(workers)

            def task(item):
                with self.lock:
                    self.now += 1
                    self.peak = max(self.peak, self.now)
                    self.threads.add(threading.current_thread().name)
                try:
                    time.sleep(0.02)
                    return fn(item)
                finally:
                    with self.lock:
                        self.now -= 1

            return real_map(task, items, workers=workers, **kwargs)

        monkeypatch.setattr("treetools.checkpoint_jax.placing.read_regions", entry)
        monkeypatch.setattr(stream, "ordered_map", scheduler)


FORMATS = ["orbax", "safetensors", "npz", "npz-compressed", "msgpack"]


@pytest.mark.parametrize("rules", [False, True], ids=["as-stored", "with-rules"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_restore_from_every_format_goes_through_the_block_engine_and_equals_the_source(fmt, rules, tmp_path,
                                                                                       devices, monkeypatch):
    flat = _stored()
    path, item = WRITERS[fmt](tmp_path, flat)
    mesh = _mesh()
    target, truth, regions = (_ruled if rules else _as_stored)(mesh)
    truth = truth if truth is not None else flat
    spy = _Spy(monkeypatch)
    out = tt.restore_checkpoint(str(path), None, {item: target}, rules=RULES if rules else None,
                                read=tt.ReadOptions(workers=4))[item]
    got = tt.flatten(out)
    assert sorted(got) == sorted(truth)
    for p, value in truth.items():
        assert got[p].dtype == value.dtype, p
        np.testing.assert_array_equal(np.asarray(got[p]), value, err_msg=p)  # bit for bit
    flat_target = tt.flatten(target)
    for p in truth:
        assert got[p].sharding == flat_target[p].sharding, p
    # One call of the engine for the item, every distinct device block one region, read on 4 threads at once.
    assert spy.entries == [regions]
    assert spy.workers == [4]
    assert spy.peak >= 2 and all(name.startswith("treetools-restore") for name in spy.threads), spy.threads


def test_a_device_block_is_read_once_and_a_replicated_one_once_for_all_its_devices(tmp_path, devices, monkeypatch):
    from safetensors.numpy import save_file

    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    save_file({"w": w}, tmp_path / "m.safetensors")
    seen: list[tuple] = []
    real = FileReader.read

    def read(self, index):
        seen.append(block_extent(index, self.shape))
        return real(self, index)

    monkeypatch.setattr(FileReader, "read", read)
    mesh = _mesh()
    # P("model"): rows split in 2, each half on the 4 devices of its `model` column: 2 reads, not 8.
    target = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("model")))}
    out = tt.restore_checkpoint(str(tmp_path / "m.safetensors"), None, {"default": target})["default"]["w"]
    assert sorted(seen) == [((0, 0), (32, 16)), ((32, 0), (32, 16))]
    np.testing.assert_array_equal(np.asarray(out), w)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])


# ----------------------------------------------------------------------------- each read option reaches the reader


def _big_safetensors(tmp_path) -> tuple[Path, np.ndarray]:
    from safetensors.numpy import save_file

    big = np.random.default_rng(1).standard_normal((512, 256)).astype(np.float32)  # 512 KiB
    save_file({"big": big}, tmp_path / "big.safetensors")
    return tmp_path / "big.safetensors", big


def _fsdp_target(shape) -> dict:
    mesh = jax.make_mesh((8,), ("fsdp",))
    return {"big": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))}


@pytest.mark.parametrize("as_context", [False, True], ids=["ReadOptions", "ReadContext"])
def test_the_block_size_is_what_the_reader_is_asked_for(as_context, tmp_path, devices, monkeypatch):
    path, big = _big_safetensors(tmp_path)
    sizes: list[int] = []
    real = FileReader.read

    def read(self, index):
        sizes.append(int(np.prod(block_extent(index, self.shape)[1])) * 4)
        return real(self, index)

    monkeypatch.setattr(FileReader, "read", read)
    block = 8 * 1024  # a device block is 64 rows of 1 KiB (64 KiB): 8 reads of 8 rows each, 64 reads in all
    read_with = ReadContext(block_bytes=block) if as_context else tt.ReadOptions(block_bytes=block)
    out = tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)}, read=read_with)
    np.testing.assert_array_equal(np.asarray(out["default"]["big"]), big)
    assert sizes == [block] * (512 * 256 * 4 // block)
    sizes.clear()  # the default block size (8 MiB) holds a device block whole: one read each
    tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)})
    assert sizes == [64 * 1024] * 8


def test_a_budget_below_one_device_block_refuses_before_any_read_and_bounds_the_blocks_in_flight(
        tmp_path, devices, monkeypatch):
    path, big = _big_safetensors(tmp_path)
    device_block = 64 * 1024
    spy = _Spy(monkeypatch)
    with pytest.raises(MemoryBudgetError) as info:
        tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)},
                              read=tt.ReadOptions(memory_budget=device_block // 2))
    message = str(info.value)
    assert "default/big: one device's block ([64, 256] float32)" in message
    assert "over the memory budget of 32.00 KiB" in message and "read=tt.ReadOptions(memory_budget=...)" in message
    assert spy.peak == 0  # refused before any read
    # Four device blocks of budget, on 4 threads: the budget less the largest block (the window) holds three, one
    # of them being placed: two read at once. Three blocks of budget: one read at once (and one being placed).
    for blocks, reads in ((4, 2), (3, 1)):
        spy.peak = 0
        out = tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)},
                                    read=tt.ReadOptions(memory_budget=blocks * device_block, workers=4))
        np.testing.assert_array_equal(np.asarray(out["default"]["big"]), big)
        assert spy.peak == reads, blocks
    spy.peak = 0
    tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)}, read=tt.ReadOptions(workers=4))
    assert spy.peak >= 3  # the default budget holds all 8 blocks: the 4 threads overlap
    # load_parameters with a target, the same engine and the same refusal
    with pytest.raises(MemoryBudgetError, match=r"big: one device's block"):
        tt.load_parameters(str(path), target=_fsdp_target(big.shape), read=tt.ReadOptions(memory_budget=1024 * 16))


def test_one_worker_reads_in_the_calling_thread(tmp_path, devices, monkeypatch):
    path, big = _big_safetensors(tmp_path)
    spy = _Spy(monkeypatch)
    out = tt.restore_checkpoint(str(path), None, {"default": _fsdp_target(big.shape)}, read=tt.ReadOptions(workers=1))
    np.testing.assert_array_equal(np.asarray(out["default"]["big"]), big)
    assert spy.workers == [1] and spy.peak == 1 and spy.threads == {threading.current_thread().name}


def test_follow_links_reaches_the_reader_through_read(tmp_path, devices):
    # run/2 -> volume2/2: a step folder kept on another volume, a link out of the checkpoint.
    w = np.arange(8.0, dtype=np.float32)
    mngr = tt.get_checkpoint_manager(2, checkpoint_dir=tmp_path / "run")
    for step in (1, 2):
        tt.save_checkpoint(mngr, step, {"params": {"w": w + step}}, wait=True)
    mngr.close()
    run, volume = tmp_path / "run", tmp_path / "volume2"
    volume.mkdir()
    shutil.move(run / "2", volume / "2")
    (run / "2").symlink_to(volume / "2")
    mesh = jax.make_mesh((8,), ("fsdp",))
    target = {"params": {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))}}
    for call in (lambda **kw: tt.restore_checkpoint(run, 2, target, **kw),
                 lambda **kw: tt.plan_restore(run, 2, target, **kw),
                 lambda **kw: tt.load_parameters(run, 2, **kw)):
        with pytest.raises(CheckpointError, match=r"resolves outside the checkpoint.*follow_links=True"):
            call()
        with pytest.raises(CheckpointError, match=r"resolves outside the checkpoint"):
            call(read=tt.ReadOptions(workers=2))  # options without follow_links: still refused
        assert call(read=tt.ReadOptions(follow_links=True)) is not None
        assert call(read=ReadContext(follow_links=True)) is not None
        assert call(read=tt.ReadOptions(), follow_links=True) is not None  # the keyword still works, over `read`
    out = tt.restore_checkpoint(run, 2, target, read=tt.ReadOptions(follow_links=True))["params"]["w"]
    np.testing.assert_array_equal(np.asarray(out), w + 2)
    np.testing.assert_array_equal(tt.load_parameters(run, 2, read=tt.ReadOptions(follow_links=True))["w"], w + 2)
    assert tt.plan_restore(run, 2, target, read=tt.ReadOptions(follow_links=True)).ok


def test_read_must_be_options_or_a_context(tmp_path):
    np.savez(tmp_path / "w.npz", w=np.ones(2, np.float32))
    with pytest.raises(TypeError, match="`read` must be a tt.ReadOptions, a ReadContext or None, got dict"):
        tt.load_parameters(tmp_path / "w.npz", read={"workers": 2})


# ----------------------------------------------------------------------------- no private Orbax module


def test_no_module_of_treetools_imports_a_private_orbax_module():
    root = Path(tt.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "orbax.checkpoint._src" in text:
            found.append(f"{path.relative_to(root)}: names orbax.checkpoint._src")
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith("orbax") else []
            found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                      if n.startswith("orbax") and "._" in n]
    assert root.name == "treetools" and len(list(root.rglob("*.py"))) > 50  # the walk saw the package
    assert found == []
