"""The TensorStore readers of one item share one context and the item's pinned folders (``ItemStores``).

Issue 48 (F1 of the scale report): each leaf's store was opened with a fresh,
cache-less TensorStore context, and its folders pinned and checked again, so
an OCDBT item's manifest and b-tree were read and decoded once per leaf open
and once per block read (``--stats`` 4.8 ms a leaf at 5,000 leaves, growing
with the item). Pinned here by counting, never by a clock: one context and one
pinned folder per OCDBT item, one store open per leaf however many blocks it
is read in; and the guarantees the per-open pins gave still hold.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from safetensors.numpy import load_file

import treetools as tt
from treetools.checkpoint_io import open_source
from treetools.checkpoint_io.formats import _ts_folders
from treetools.shared.errors import CheckpointError
from tests._every_command import inspect_json, leaves_of

LEAVES = 9  # per item
ROWS, COLS = 256, 8  # 8 KiB of float32 a leaf: 8 row bands of 1 KiB when converted with TREETOOLS_CHUNK_BYTES=1024


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f"layer_{i}": {"w": rng.standard_normal((ROWS, COLS)).astype(np.float32)} for i in range(LEAVES)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A CheckpointManager root, step 1: ``params`` and ``opt_state``, each an OCDBT item of ``LEAVES`` leaves."""
    path = tmp_path_factory.mktemp("items") / "run"
    params, opt_state = _tree(0), _tree(1)
    with ocp.CheckpointManager(str(path), item_names=("params", "opt_state")) as mgr:
        mgr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                            opt_state=ocp.args.StandardSave(opt_state)))
        mgr.wait_until_finished()
    truth = {f"{item}/{name}/w": tree[name]["w"] for item, tree in (("params", params), ("opt_state", opt_state))
             for name in tree}
    return path, truth


class Counted:
    """Every store ``TensorStoreReader._open`` opens (by the array it names, with the context it passes), apart from
    the headers ``open_all`` opens, and every folder pinned for array data."""

    def __init__(self, monkeypatch):
        self.opens: list[tuple[str, object]] = []
        self.header_opens: list[tuple[str, object]] = []
        self.header_drivers: list[str] = []
        self.data_pins: list[str] = []
        real_open, real_pin = ts.open, _ts_folders.Pins._open

        def open_(spec, *args, **kwargs):
            header = sys._getframe(1).f_code.co_name in ("_open_shared", "_open_batch", "_open_listed")  # open_all's
            (self.header_opens if header else self.opens).append((spec["kvstore"]["path"], kwargs["context"]))
            if header:
                self.header_drivers.append(spec["kvstore"]["driver"])
            return real_open(spec, *args, **kwargs)

        def pin(pins, folder, ocdbt):
            if pins._data:
                self.data_pins.append(folder)
            return real_pin(pins, folder, ocdbt)

        monkeypatch.setattr(ts, "open", open_)
        monkeypatch.setattr(_ts_folders.Pins, "_open", pin)

    def contexts(self) -> int:
        return len({id(context) for _, context in self.opens})  # the contexts are held in self.opens: ids stay unique


def test_stats_opens_one_context_and_pins_one_folder_per_item(root, monkeypatch):
    path, truth = root
    counted = Counted(monkeypatch)
    report = inspect_json(path, "--stats")
    assert sorted(name for name, _ in counted.opens) == sorted([f"layer_{i}.w" for i in range(LEAVES)] * 2)  # each once
    assert counted.contexts() == 2  # params and opt_state: one each, not one per leaf (18 before)
    # The headers are read in one pass over each item's b-tree and parsed from memory: no lookup in the database
    # per header, and one parse per distinct header (every leaf here is float32 (256, 8): one per item).
    assert counted.header_drivers == ["memory", "memory"]
    assert sorted(os.path.basename(f) for f in counted.data_pins) == ["opt_state", "params"]  # the OCDBT folders
    stats = {f"{item}/{name}": leaf["stats"] for item in ("params", "opt_state")
             for name, leaf in leaves_of(report, item).items()}
    assert sorted(stats) == sorted(truth)
    for name, want in truth.items():  # the values read through the shared context are the saved ones
        w = want.astype(np.float64)
        assert stats[name]["mean"] == pytest.approx(float(w.mean()), rel=1e-6, abs=1e-6), name  # the JSON report rounds
        assert stats[name]["max"] == pytest.approx(float(w.max())), name


def test_convert_opens_each_store_once_however_many_blocks(root, tmp_path, monkeypatch):
    # convert reads each leaf in C-contiguous row bands of TREETOOLS_CHUNK_BYTES through TensorStoreReader.read: 8
    # bands of a leaf were 8 opens (and 8 decodes of the item's b-tree); the store is now opened once a leaf.
    path, truth = root
    monkeypatch.setenv("TREETOOLS_CHUNK_BYTES", "1024")
    counted = Counted(monkeypatch)
    dst = tmp_path / "params.safetensors"
    tt.convert(str(path), str(dst))
    assert sorted(name for name, _ in counted.opens) == sorted(f"layer_{i}.w" for i in range(LEAVES))
    assert counted.contexts() == 1 and len(counted.data_pins) == 1
    got = load_file(str(dst))  # safetensors' own reader
    want = {k.removeprefix("params/").replace("/", "."): v for k, v in truth.items() if k.startswith("params/")}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_load_parameters_through_one_context(root, monkeypatch):
    path, truth = root
    counted = Counted(monkeypatch)
    got = tt.flatten(tt.load_parameters(str(path)))
    assert counted.contexts() == 1 and len(counted.opens) == LEAVES and len(counted.data_pins) == 1
    for name, value in truth.items():
        if name.startswith("params/"):
            np.testing.assert_array_equal(got[name.removeprefix("params/")], value, err_msg=name)


def test_a_link_added_to_the_item_after_its_check_refuses_the_next_read(root, tmp_path, monkeypatch):
    # The item's folder is pinned and checked once, then handed out again only while no folder below it has
    # changed: a link to a file outside, put in among the data files between two reads, is seen by the second.
    import shutil

    path = tmp_path / "run"
    shutil.copytree(root[0], path)
    (tmp_path / "secret").write_bytes(b"42" * 100)
    counted = Counted(monkeypatch)
    leaves = [leaf for leaf in open_source(str(path)).snapshot(None).items["params"].leaves if leaf.reader is not None]
    counted.data_pins.clear()  # the item's folders were pinned and checked as its headers were read
    whole = (slice(None), slice(None))
    np.testing.assert_array_equal(leaves[0].reader.read(whole), root[1]["params/layer_0/w"])
    os.symlink(tmp_path / "secret", path / "1" / "params" / "d" / "stolen")
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint"):
        leaves[1].reader.read(whole)
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint"):
        leaves[2].reader.read(whole)  # the item's folder refused: every array in it, without checking it again
    assert counted.contexts() == 1 and len(counted.data_pins) == 1  # the change retired the context: pinned anew
    os.unlink(path / "1" / "params" / "d" / "stolen")
    again = [leaf for leaf in open_source(str(path)).snapshot(None).items["params"].leaves if leaf.reader is not None]
    np.testing.assert_array_equal(again[1].reader.read(whole), root[1]["params/layer_1/w"])  # checked afresh


def test_per_folder_arrays_rotate_contexts_and_close_their_folders(tmp_path, monkeypatch):
    # Without OCDBT every array is a folder of its own, pinned (one descriptor each) for its context: a context
    # holds at most PINS_PER_CONTEXT of them, and a retired one closes them once its last store is closed.
    monkeypatch.setattr(_ts_folders, "PINS_PER_CONTEXT", 4)
    tree = {k: v["w"] for k, v in _tree(2).items()}  # 9 leaves
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    ckptr.save(str(tmp_path / "ckpt"), args=ocp.args.PyTreeSave(tree))
    counted = Counted(monkeypatch)
    leaves = [leaf for leaf in open_source(str(tmp_path / "ckpt")).snapshot(None).items["default"].leaves]
    before = len(os.listdir("/proc/self/fd"))
    for leaf in leaves:
        np.testing.assert_array_equal(leaf.reader.read((slice(None), slice(None))), tree[leaf.name], err_msg=leaf.name)
    assert len(counted.opens) == len(tree) == len(counted.data_pins)
    assert counted.contexts() == math.ceil(len(tree) / 4)  # 4 + 4 + 1 folders
    assert len(os.listdir("/proc/self/fd")) - before <= 4  # the current context's folders, no more
