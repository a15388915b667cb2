"""The read context and the storage interface (issue 36): settings built once at the edge and passed down as an
argument, confinement held by the open folder of the checkpoint, one interface for every storage scheme."""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import pathlib
import sys
import threading

import numpy as np
import pytest

import treetools as tt
from treetools.checkpoint_io import storage
from treetools.checkpoint_io.context import DEFAULT_BLOCK_BYTES, DEFAULT_MEMORY_BUDGET, ReadContext
from treetools.checkpoint_io.leaves import Snapshot
from treetools.checkpoint_io.readers import MemoryBudgetError
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.storage.base import Storage
from treetools.checkpoint_io.storage.bucket import BucketStorage, GcsStorage, S3Storage
from treetools.checkpoint_io.storage.local import LocalStorage
from treetools.shared.errors import CheckpointError

PACKAGE = pathlib.Path(tt.__file__).parent


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


# ----------------------------------------------------------------------------- settings: one place, explicit


ENV_READERS = {
    "checkpoint_io/context.py",  # TREETOOLS_MEMORY_BUDGET_MB, TREETOOLS_CHUNK_BYTES, TREETOOLS_WORKERS: the one place
    "checkpoint_io/formats/_ts_kvstore.py",  # the S3 client's own AWS_* variables, handed to TensorStore (which ignores them)
    "checkpoint_io/storage/reach.py",  # the GCS client's own variables (emulator, credentials files, metadata server)
    "checkpoint_jax/distributed.py",  # jax's own JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    "pytree/estimates.py",  # jax's own XLA_PYTHON_CLIENT_MEM_FRACTION / _PREALLOCATE (the allocator's pool)
    "shared/render.py",  # the terminal's COLUMNS (as shutil.get_terminal_size reads it): the width tables fit
}


def test_environment_variables_are_read_in_one_place_and_no_context_variable_exists():
    found = {}
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert "contextvars" not in mods, f"{name} imports contextvars: settings travel as arguments"
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                found.setdefault(name, 0)
                found[name] += 1
    below_cli = {n for n in found if not n.startswith(("cli/", "reference/"))}
    assert below_cli == ENV_READERS, sorted(below_cli ^ ENV_READERS)


def test_the_context_comes_from_the_arguments_then_the_environment():
    env = {"TREETOOLS_MEMORY_BUDGET_MB": "64", "TREETOOLS_CHUNK_BYTES": "4096", "TREETOOLS_WORKERS": "3"}
    ctx = ReadContext.from_env(env)
    assert (ctx.memory_budget, ctx.block_bytes, ctx.workers) == (64 * 2**20, 4096, 3)
    given = ReadContext.from_env(env, memory_budget=10.0 * 2**20, workers=None)  # None: not given
    assert (given.memory_budget, given.block_bytes, given.workers) == (10 * 2**20, 4096, 3)
    plain = ReadContext.from_env({})
    assert (plain.memory_budget, plain.block_bytes, plain.workers) == (DEFAULT_MEMORY_BUDGET, DEFAULT_BLOCK_BYTES, None)
    assert ReadContext.from_env({"TREETOOLS_MEMORY_BUDGET_MB": "inf"}).memory_budget == math.inf
    for var, bad in (("TREETOOLS_MEMORY_BUDGET_MB", "lots"), ("TREETOOLS_MEMORY_BUDGET_MB", "-1"),
                     ("TREETOOLS_CHUNK_BYTES", "12"), ("TREETOOLS_WORKERS", "0")):
        with pytest.raises(CheckpointError, match=var):
            ReadContext.from_env({var: bad})
    # A block size is a whole number of bytes: the value as given is echoed, never truncated to another size.
    assert ReadContext.from_env({"TREETOOLS_CHUNK_BYTES": "1e6"}).block_bytes == 1_000_000
    for bad, why in (("1.5", "a whole number of bytes"), ("4096.5", "a whole number of bytes"),
                     ("inf", "a whole number of bytes"), ("lots", "a whole number of bytes"),
                     ("1000", "at least 1024")):
        with pytest.raises(CheckpointError) as info:
            ReadContext.from_env({"TREETOOLS_CHUNK_BYTES": bad})
        assert str(info.value) == f"`TREETOOLS_CHUNK_BYTES` must be {why}, got {bad!r}."
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.memory_budget = 1  # immutable: a changed setting is a new context
    with pytest.raises(ValueError, match="block_bytes"):
        ReadContext(block_bytes=0)


def _orbax(tmp_path, w, *, ocdbt=True):
    root = tmp_path / "run"
    if not ocdbt:  # zarr folders of their own, no OCDBT manifest: one 4 MiB chunk is what the budget meets first
        import orbax.checkpoint as ocp

        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
        ckptr.save(root / "1" / "params", {"w": w})
        ckptr.close()
        return root / "1" / "params"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": {"w": w}})
    mngr.close()
    return root


def test_a_source_keeps_the_settings_it_was_opened_with(tmp_path, monkeypatch):
    # The old code read TREETOOLS_MEMORY_BUDGET_MB again at each check that had no budget of its own: a source
    # opened under one budget was read under whatever the variable said later. Now the context is captured.
    w = np.random.default_rng(0).random(2**20, dtype=np.float32)  # 4 MiB: one Orbax chunk
    root = _orbax(tmp_path, w, ocdbt=False)
    monkeypatch.delenv("TREETOOLS_MEMORY_BUDGET_MB", raising=False)
    source = tt.open_source(root)
    monkeypatch.setenv("TREETOOLS_MEMORY_BUDGET_MB", "1")
    (leaf,) = next(iter(source.snapshot().items.values())).leaves
    assert leaf.reader.context is source.context and source.context.memory_budget == DEFAULT_MEMORY_BUDGET
    np.testing.assert_array_equal(leaf.reader.read((slice(0, 8),)), w[:8])
    small = tt.open_source(root)  # opened now: the variable is read at this edge
    (leaf,) = next(iter(small.snapshot().items.values())).leaves
    assert small.context.memory_budget == 2**20
    with pytest.raises(MemoryBudgetError, match="4.00 MiB"):
        leaf.reader.read((slice(0, 8),))


def test_the_budget_follows_the_reader_into_any_thread(tmp_path):
    w = np.random.default_rng(1).random(2**20, dtype=np.float32)
    root = _orbax(tmp_path, w, ocdbt=False)
    small = next(iter(tt.open_source(root, memory_budget=2**20).snapshot().items.values())).leaves[0].reader
    large = next(iter(tt.open_source(root, memory_budget=2**30).snapshot().items.values())).leaves[0].reader
    out: dict[str, object] = {}

    def read(name, reader):
        try:
            out[name] = reader.read((slice(0, 4),))
        except MemoryBudgetError as e:
            out[name] = e

    threads = [threading.Thread(target=read, args=a) for a in (("small", small), ("large", large))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(out["small"], MemoryBudgetError)
    np.testing.assert_array_equal(out["large"], w[:4])


class _Sealed:
    """Records every public attribute set on a Source or a Snapshot outside its own constructor."""

    def __init__(self, monkeypatch):
        self.sets: list[tuple[str, str]] = []
        for cls in (Source, Snapshot):
            monkeypatch.setattr(cls, "__setattr__", self._setattr(cls.__setattr__))

    def _setattr(self, original):
        sets = self.sets

        def setattr_(obj, name, value):
            if not name.startswith("_") and not _inside_init(obj):
                sets.append((type(obj).__name__, name))
            original(obj, name, value)

        return setattr_


def _inside_init(obj) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is obj:
            return True
        frame = frame.f_back
    return False


def test_no_field_is_set_on_a_source_or_a_snapshot_after_it_is_built(tmp_path, monkeypatch, capsys):
    w = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    root = _orbax(tmp_path, w)
    np.savez(tmp_path / "w.npz", **{"params/w": w})
    sealed = _Sealed(monkeypatch)
    from treetools.cli import main

    for argv in (["inspect", str(root), "--stats"], ["inspect", str(root), "--unstack", "w", "--item", "params"],
                 ["inspect", str(root), "--item", "params/w"], ["diff", str(root), str(tmp_path / "w.npz"), "--values"],
                 ["verify", str(root)], ["inspect", str(root), "--show", "params/w[0]"]):
        assert main(argv) in (0, 1), argv
    capsys.readouterr()
    np.testing.assert_array_equal(tt.load_parameters(os.path.relpath(root))["w"], w)
    tt.convert(root, tmp_path / "out.safetensors")
    assert sealed.sets == []


# ----------------------------------------------------------------------------- confinement by the open folder


def test_reads_stay_in_the_folder_that_was_opened_even_when_its_name_is_swapped(tmp_path):
    # The root is held by an open descriptor of the folder opened: renaming it and planting a link to another
    # folder at its name changes nothing for the source already open (the old registry, keyed by the path, would
    # have followed the name).
    from safetensors.numpy import save_file

    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    ckpt.mkdir()
    elsewhere.mkdir()
    save_file({"w": np.arange(4, dtype=np.float32)}, str(ckpt / "model.safetensors"))
    save_file({"w": np.full(4, 7, np.float32)}, str(elsewhere / "model.safetensors"))
    source = tt.open_source(ckpt)
    (leaf,) = source.snapshot().items["default"].leaves
    os.rename(ckpt, tmp_path / "moved")
    os.symlink(elsewhere, ckpt)
    np.testing.assert_array_equal(leaf.reader.read((slice(None),)), np.arange(4, dtype=np.float32))


def test_two_open_checkpoints_keep_their_own_roots(tmp_path):
    # One checkpoint folder inside another's: each source checks against its own root, whichever was opened last
    # (the old registry answered with the innermost root by path, whoever asked).
    outer = tmp_path / "outer"
    (outer / "inner").mkdir(parents=True)
    np.savez(outer / "w.npz", w=np.arange(3.0))
    os.symlink("../w.npz", outer / "inner" / "link.npz")  # inside `outer`, outside `inner`
    # Opened as `outer/inner`'s file: the user named the link, so it reads; the root is `inner`'s folder.
    named = tt.open_source(outer / "inner" / "link.npz")
    np.testing.assert_array_equal(named.snapshot().items["default"].leaves[0].reader.read_all(), np.arange(3.0))
    inner_root = LocalStorage().confine(str(outer / "inner"))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        inner_root.read_range(str(outer / "inner" / "link.npz"), 0, 4)
    outer_root = LocalStorage().confine(str(outer))
    assert outer_root.read_range(str(outer / "inner" / "link.npz"), 0, 4) == b"PK\x03\x04"
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        inner_root.read_range(str(outer / "inner" / "link.npz"), 0, 4)  # still refused: its own root


def test_a_root_closes_its_folder_when_let_go(tmp_path):
    store = LocalStorage().confine(str(tmp_path))
    fd = store.root.fd
    assert os.fstat(fd)
    store.close()
    with pytest.raises(OSError):
        os.fstat(fd)


# ----------------------------------------------------------------------------- one storage interface


def test_every_backend_answers_the_same_interface():
    interface = {n for n, v in vars(Storage).items() if callable(v) and not n.startswith("_")}
    assert {"exists", "isdir", "isfile", "stat", "scandir", "listdir", "walk", "open", "read_range", "confine",
            "create", "write_atomically", "remove"} <= interface
    for cls in (LocalStorage, GcsStorage, S3Storage):
        assert issubclass(cls, Storage)
        assert not getattr(cls, "__abstractmethods__", ()), (cls.__name__, sorted(cls.__abstractmethods__))


def test_a_new_scheme_is_one_class(tmp_path, capsys):
    # fsspec's in-memory file system as a bucket scheme: one class, registered; then every command reads it.
    from fsspec.implementations.memory import MemoryFileSystem

    class MemoryStorage(BucketStorage):
        scheme, package = "memtest", "fsspec"

        def make_client(self):
            return MemoryFileSystem()

        def list_objects(self, bucket, prefix, limit):
            raise AttributeError  # no paged listing: listed folder by folder

        def key(self, url):
            return "/" + super().key(url)

    storage.register_scheme("memtest", lambda url: MemoryStorage())
    try:
        fs = MemoryFileSystem()
        np.savez(tmp_path / "w.npz", w=np.arange(5.0))
        fs.pipe("/bucket/run/w.npz", (tmp_path / "w.npz").read_bytes())
        from treetools.cli import main

        assert main(["inspect", "memtest://bucket/run/w.npz", "--show", "w"]) == 0
        assert "[0. 1. 2. 3. 4.]" in capsys.readouterr().out
        np.testing.assert_array_equal(tt.load_parameters("memtest://bucket/run/w.npz")["w"], np.arange(5.0))
    finally:
        storage.register_scheme("memtest", lambda url: (_ for _ in ()).throw(CheckpointError("gone")))
        MemoryFileSystem.store.clear()


def test_an_unknown_scheme_is_one_line_naming_those_read(capsys):
    from treetools.cli import main

    assert main(["inspect", "ftp://host/ckpt"]) == 1
    err = capsys.readouterr().err
    assert "no storage reads ftp:// URLs" in err and "gs://" in err and "s3://" in err
