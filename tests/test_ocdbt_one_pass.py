"""The zarr headers of an OCDBT item, read in one pass over its b-tree (issue 48, F5 of the scale report).

Metadata ``inspect`` opened every array's header through TensorStore's OCDBT
driver: one b-tree lookup per array, each scanning a leaf that holds the
whole item (Orbax writes one leaf of up to 100 MB), so the headers of an item
cost arrays x leaf and ``inspect`` grew with exponent 1.5 in leaves. Now
``_ocdbt.values`` lists each node of the item's tree once and takes the
headers from it, and TensorStore's own zarr drivers parse them from memory
(``_tensorstore._open_listed``), once per distinct header. Pinned here by
counting (never by a clock), against TensorStore's own lookups and the
per-array opens as the truth; a tree or header that the one pass declines is
opened as before, with the same error.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats import _ocdbt, _tensorstore
from treetools.checkpoint_io.formats._tensorstore import item_stores, open_all, ts_spec
from treetools.shared.errors import CheckpointError


def _context(path) -> ReadContext:
    return ReadContext().confined_to(str(path))


def _tree(n: int) -> dict:
    """``n`` leaves of assorted shapes and dtypes (two of each kind: some headers repeat, some do not)."""
    kinds = [((4, 8), np.float32), ((3,), np.int8), ((2, 5, 7), np.float16), ((), np.int32), ((6, 1), np.bool_),
             ((1000,), np.uint16)]
    out = {}
    for i in range(n):
        shape, dtype = kinds[(i // 2) % len(kinds)]
        out[f"leaf_{i}"] = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
    return out


def _save(path, tree: dict, *, zarr3: bool = False) -> str:
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(str(path), args=ocp.args.PyTreeSave(tree))
    return str(path)


def _specs(item: str, names: list[str], *, zarr3: bool) -> tuple[list[dict], list[str]]:
    from treetools.checkpoint_io.storage import LOCAL

    specs = [ts_spec(LOCAL, item, name, use_ocdbt=True, use_zarr3=zarr3) for name in names]
    return specs, [f"{item}: `{name}`" for name in names]


class Counted:
    """The b-tree nodes ``_ocdbt.values`` lists, every ``ts.open``, and those of a store on an OCDBT database."""

    def __init__(self, monkeypatch):
        self.listed: list[str] = []
        self.ocdbt_opens = self.opens = 0
        real_dump, real_open = ts.ocdbt.dump, ts.open

        def dump(kv, node=None):
            if node is not None and sys._getframe(1).f_code.co_name == "values":
                self.listed.append(node)
            return real_dump(kv, node) if node is not None else real_dump(kv)

        def open_(spec, *args, **kwargs):
            self.opens += 1
            if (spec.get("kvstore") or {}).get("driver") == "ocdbt":
                self.ocdbt_opens += 1
            return real_open(spec, *args, **kwargs)

        monkeypatch.setattr(ts.ocdbt, "dump", dump)
        monkeypatch.setattr(ts, "open", open_)


def _facts(header) -> tuple:
    chunk = header.chunk_layout.read_chunk.shape or ()  # None for a 0-d array
    return tuple(header.shape), np.dtype(header.dtype.numpy_dtype).str, tuple(chunk)


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr", "zarr3"])
def test_headers_in_one_pass_are_the_per_array_opens(tmp_path, monkeypatch, zarr3):
    tree = _tree(24)
    item = _save(tmp_path / "item", tree, zarr3=zarr3)
    names = sorted(tree)
    specs, wheres = _specs(item, names, zarr3=zarr3)
    context = _context(tmp_path)
    truth = open_all(context, specs, wheres)  # no ItemStores: each header opened through the database, as before
    counted = Counted(monkeypatch)
    got = open_all(context, specs, wheres, stores=item_stores(context.storage))
    assert counted.ocdbt_opens == 0  # no header looked up in the database one by one
    assert len(counted.listed) == 1  # Orbax's item: one b-tree leaf, listed once
    assert [_facts(h) for h in got] == [_facts(h) for h in truth]
    for name, header in zip(names, got):  # and both are what was saved
        assert tuple(header.shape) == tree[name].shape and np.dtype(header.dtype.numpy_dtype) == tree[name].dtype


def test_one_pass_does_not_grow_with_the_arrays(tmp_path, monkeypatch):
    # The b-tree nodes listed and the stores opened for the headers of an item of 4 and of 400 arrays: the same.
    counts = []
    for n in (4, 400):
        item = _save(tmp_path / f"item{n}", _tree(n))
        specs, wheres = _specs(item, sorted(_tree(n)), zarr3=False)
        context = _context(tmp_path)
        counted = Counted(monkeypatch)
        headers = open_all(context, specs, wheres, stores=item_stores(context.storage))
        monkeypatch.undo()
        assert None not in headers
        counts.append((len(counted.listed), counted.ocdbt_opens, counted.opens))
    # One leaf listed; no OCDBT open; one parse per distinct header (the 6 kinds of _tree; 2 of them at 4 arrays).
    assert counts == [(1, 0, 2), (1, 0, 6)]


def _database(path, pairs: dict[bytes, bytes]) -> None:
    """An OCDBT database of ``pairs`` written by TensorStore with nodes of at most 512 bytes (a tree of several
    levels) and values over 16 bytes stored out of line, in data files."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/",
                          "config": {"max_decoded_node_bytes": 512, "max_inline_value_bytes": 16}}).result()
    with ts.Transaction() as txn:
        for key, value in pairs.items():
            kv.with_transaction(txn)[key] = value


def test_values_are_tensorstores_own_lookups_in_a_tree_of_several_levels(tmp_path):
    from treetools.checkpoint_io.storage import LOCAL

    pairs = {f"arr_{i}/{name}".encode(): (b"x" * (i % 40)) + str(i).encode()
             for i in range(300) for name in (".zarray", "0.0")}
    _database(tmp_path / "db", pairs)
    base = ts.KvStore.open(f"file://{tmp_path}/db/").result()
    dump = ts.ocdbt.dump(base).result()
    assert max(v["root_height"] for v in dump["versions"]) >= 2  # interior nodes, common prefixes, out-of-line values
    wanted = {k for k in pairs if k.endswith(b"/.zarray")} | {b"arr_7/missing", b"zzz"}
    got = _ocdbt.values(LOCAL, str(tmp_path / "db"), wanted, 2**30)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/db/"}).result()
    truth = {k: kv.read(k).result() for k in wanted}
    assert got == {k: bytes(r.value) for k, r in truth.items() if r.state == "value"}
    assert len(got) == 300


def test_an_item_of_many_more_keys_than_asked_for_is_left_to_the_lookups(tmp_path, monkeypatch):
    # A few arrays stored in many chunks: listing every key costs more than looking a few headers up.
    from treetools.checkpoint_io.storage import LOCAL

    pairs = {f"arr_{i}/{name}".encode(): b"v" for i in range(4) for name in (".zarray", *map(str, range(40)))}
    _database(tmp_path / "db", pairs)
    wanted = {f"arr_{i}/.zarray".encode() for i in range(4)}
    assert len(_ocdbt.values(LOCAL, str(tmp_path / "db"), wanted, 2**30)) == 4  # 164 keys: listed
    monkeypatch.setattr(_ocdbt, "LISTED_ANYWAY", 0)
    monkeypatch.setattr(_ocdbt, "LISTED_PER_KEY", 40)  # 4 keys asked for: at most 160 keys listed
    assert _ocdbt.values(LOCAL, str(tmp_path / "db"), wanted, 2**30) is None
    monkeypatch.setattr(_ocdbt, "LISTED_PER_KEY", 41)
    assert len(_ocdbt.values(LOCAL, str(tmp_path / "db"), wanted, 2**30)) == 4


def test_a_tree_out_of_order_is_declined():
    # TensorStore finds a key by searching each node's sorted keys: a leaf whose keys are out of order, or outside
    # the range its parent gives it, does not read as a walk would; the one pass declines it.
    with pytest.raises(_ocdbt.NotPlain):
        _ocdbt._entries({"entries": [{"key": b"b"}, {"key": b"a"}]}, b"", b"", None)
    with pytest.raises(_ocdbt.NotPlain):
        _ocdbt._entries({"entries": [{"key": b"a"}, {"key": b"q"}]}, b"", b"", b"p")
    assert [k for k, _ in _ocdbt._entries({"entries": [{"key": b"1"}, {"key": b"2"}]}, b"x/", b"x/", b"x/3")] \
        == [b"x/1", b"x/2"]


def test_a_node_over_the_budget_is_declined_and_opened_as_before(tmp_path, monkeypatch):
    from treetools.checkpoint_io.storage import LOCAL

    tree = _tree(6)
    item = _save(tmp_path / "item", tree)
    assert _ocdbt.values(LOCAL, item, {b"leaf_0/.zarray"}, 16) is None  # a node over 16 bytes: not listed
    context = _context(tmp_path)
    monkeypatch.setattr(_ocdbt, "values", lambda *a, **k: None)
    monkeypatch.setattr(_tensorstore, "ocdbt_values", lambda *a, **k: None)
    specs, wheres = _specs(item, sorted(tree), zarr3=False)
    headers = open_all(context, specs, wheres, stores=item_stores(context.storage))
    assert [tuple(h.shape) for h in headers] == [tree[n].shape for n in sorted(tree)]


def _rewrite(item: str, key: bytes, value: bytes) -> None:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    kv[key] = value


@pytest.mark.parametrize("header", [b"{not json", json.dumps({"zarr_format": 2, "shape": [4], "chunks": [4],
                                                                "dtype": "|V0", "compressor": None, "fill_value": None,
                                                                "order": "C", "filters": None}).encode()],
                         ids=["not-json", "void-dtype"])
def test_a_damaged_header_says_what_the_per_array_open_says(tmp_path, monkeypatch, header):
    tree = _tree(6)
    item = _save(tmp_path / "item", tree)
    _rewrite(item, b"leaf_2/.zarray", header)
    names = sorted(tree)
    specs, wheres = _specs(item, names, zarr3=False)
    context = _context(tmp_path)
    before: list[str] = []
    now: list[str] = []
    truth = open_all(context, specs, wheres, before)
    counted = Counted(monkeypatch)
    got = open_all(context, specs, wheres, now, stores=item_stores(context.storage))
    assert counted.ocdbt_opens == 1  # the others parsed from the one pass; the damaged one opened as before
    assert now == before and len(now) == 1 and "`leaf_2`" in now[0]  # the same one-line problem, for that array
    assert [h is None for h in got] == [h is None for h in truth] == [n == "leaf_2" for n in names]
    with pytest.raises(CheckpointError) as raised:
        open_all(context, specs, wheres, stores=item_stores(context.storage))
    assert str(raised.value) == before[0]


# Array data (issue 48): the chunks of tiny arrays are stored inline in the b-tree leaf the one pass lists, so
# they are read from there (TensorStore's zarr driver decoding them from memory), not looked up one by one.

def _orbax_restore(item: str) -> dict:
    """Orbax's own restore of a PyTree item to host numpy: the truth the values are compared with."""
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(item)).tree
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in meta}
    with ocp.Checkpointer(handler) as ckptr:
        return ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))


def _load(item: str) -> dict:
    import treetools as tt

    return tt.flatten(tt.load_parameters(item))


def _same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        value = np.asarray(value)
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr", "zarr3"])
def test_tiny_arrays_data_comes_from_the_one_pass_bit_for_bit(tmp_path, monkeypatch, zarr3):
    import ml_dtypes

    rng = np.random.default_rng(0)
    tree = {"f32": rng.standard_normal((4, 8)).astype(np.float32),
            "bf16": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
            "i8": np.arange(-3, 3, dtype=np.int8), "mask": np.array([[True], [False], [True]]),
            "scalar": np.asarray(-7, np.int32), "f16": rng.standard_normal((2, 5, 7)).astype(np.float16),
            "big": rng.standard_normal(4096).astype(np.float32)}  # 16 KiB of noise: stored out of line
    item = _save(tmp_path / "item", tree, zarr3=zarr3)
    want = _orbax_restore(item)
    _same_bits({k: np.asarray(v) for k, v in want.items()}, tree)  # Orbax gives back what was saved
    counted = Counted(monkeypatch)
    got = _load(item)
    monkeypatch.undo()
    _same_bits(got, want)
    assert counted.ocdbt_opens == 1  # only "big" looked up in the database; the 6 tiny ones read from the pass


def test_data_lookups_do_not_grow_with_the_arrays(tmp_path, monkeypatch):
    # _tree's kinds but the 1,000-element one (its chunk may be stored out of line): 0 lookups at 4 and at 400
    # arrays; with nothing kept from the pass (LISTED_DATA_BYTES 0), one open through the database per array, as
    # before, and the same values.
    counts = []
    for n in (4, 400):
        tree = {k: v for k, v in _tree(n).items() if v.size < 1000}
        item = _save(tmp_path / f"item{n}", tree)
        counted = Counted(monkeypatch)
        got = _load(item)
        monkeypatch.undo()
        _same_bits(got, tree)
        counts.append(counted.ocdbt_opens)
        monkeypatch.setattr(_tensorstore, "LISTED_DATA_BYTES", 0)
        counted = Counted(monkeypatch)
        _same_bits(_load(item), tree)
        assert counted.ocdbt_opens == len(tree)
        monkeypatch.undo()
    assert counts == [0, 0]


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_a_damaged_or_missing_chunk_says_what_the_lookup_says(tmp_path, monkeypatch, damage):
    from treetools.checkpoint_io.formats import _ts_folders

    tree = {k: v for k, v in _tree(6).items() if v.size < 1000}
    errors = []
    for listed in (True, False):
        item = _save(tmp_path / f"item_{listed}", tree)
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
        if damage == "garbage":
            kv[b"leaf_0/0.0"] = b"not a zstd frame"
        else:
            del kv[b"leaf_0/0.0"]
        if not listed:
            monkeypatch.setattr(_ts_folders.ItemStores, "listed_spec", lambda self, spec: None)
        with pytest.raises(CheckpointError) as raised:
            _load(item)
        errors.append(str(raised.value).replace(f"item_{listed}", "item"))
    assert errors[0] == errors[1] and "`leaf_0`" in errors[0]


def test_an_item_changed_after_the_pass_is_read_as_it_is_now(tmp_path):
    # The one pass keeps chunks; once a folder of the item changes (a new value written: a new data file, a new
    # manifest), the readers let go of what it kept and read through the database: the new value, not the old.
    from treetools.checkpoint_io.formats._tensorstore import TensorStoreReader

    tree = {k: v for k, v in _tree(6).items() if v.size < 1000}
    item = _save(tmp_path / "item", tree)
    names = sorted(tree)
    specs, wheres = _specs(item, names, zarr3=False)
    context = _context(tmp_path)
    stores = item_stores(context.storage)
    headers = open_all(context, specs, wheres, stores=stores)
    assert len(stores.listed) == len(names)  # every array's chunks kept from the pass

    def read(i: int) -> np.ndarray:
        h = headers[i]
        assert h is not None
        reader = TensorStoreReader(context, specs[i], tuple(h.shape), np.dtype(h.dtype.numpy_dtype),
                                   tuple(h.chunk_layout.read_chunk.shape or ()) or None, where=wheres[i],
                                   shared=stores)
        return reader.read_all()

    np.testing.assert_array_equal(read(0), tree[names[0]])  # from the pass
    new = (tree[names[1]] + 1).astype(tree[names[1]].dtype)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:  # the same array, saved anew: its chunk bytes
        ckptr.save(str(tmp_path / "other"), args=ocp.args.PyTreeSave({names[1]: new}))
    other = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/other/"}).result()
    _rewrite(item, f"{names[1]}/0.0".encode(), bytes(other.read(f"{names[1]}/0.0".encode()).result().value))
    np.testing.assert_array_equal(read(1), new)
    assert not stores.listed  # let go of when the item changed
