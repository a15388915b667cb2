"""A checkpoint item seen through ``Rules``: the leaves a user wants, read block by block from the stored ones.

``map_item(item, rules)`` plans the rules over the item's metadata
(``Rules.plan``: nothing is read) and returns an ``Item`` whose leaves are the
target leaves. A leaf the rules only rename keeps its stored reader (and its
format's own name, ``Leaf.key``, so a format's fast restore still finds it);
any other array leaf gets a ``RuledReader``, which reads each block it is
asked for from the matching blocks of its source(s): an unstacked layer reads
its slice of the stacked leaf, a transpose reads the permuted block, a stack
reads the same block of every layer it covers, a cast converts the block.
The rules engine below (``treetools.rules``) plans from metadata only; all
reading of data through rules is here, in the checkpoint layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Mapping

import numpy as np

from treetools.checkpoint_io.leaves import Item, Leaf, array_row, stored_path
from treetools.checkpoint_io.readers import ArrayReader, Index, check_budget
from treetools.rules.blocks import Box, Piece
from treetools.rules.plan import RulesPlan, TargetLeaf
from treetools.rules.spec import Rules
from treetools.shared.errors import RulesError


class RuledReader(ArrayReader):
    """One target leaf of ``Rules``, read block by block from its source leaves' readers.

    ``read(index)`` reads exactly the source blocks the target block needs
    (``treetools.rules.blocks``: the leaf's ``node`` maps the block onto its
    sources): an unstacked layer ``i`` reads ``(slice(i, i + 1), *index)`` of
    its source; a split piece or a slice reads its window; a transpose reads
    the permuted index and transposes; a stack or a concat reads the same
    block of each part the block covers; a reshape reads the source rows that
    hold the block's elements; a permute reads the heads the block touches; a
    pad reads the stored part and makes the new part. The cast is ``astype``
    (bit-exact for a widening cast, numpy's (ml_dtypes') round-to-nearest-even
    for a narrowing one; a complex -> real cast keeps the real part). A source
    that can only stream front to back (a compressed npz member) is read whole
    once, held to the memory budget, when a transform needs random blocks of it.

    Args:
      target: a ``TargetLeaf`` of an array (``Rules.plan``).
      sources: the source leaves' readers by source path (at least those of ``target.pieces``).

    Raises:
      TypeError: ``target`` is not an array (a value passes through as it is).

    >>> from treetools.checkpoint_io.readers import InMemoryReader
    >>> src = {"layers/w": np.arange(24.0).reshape(2, 3, 4)}
    >>> plan = Rules(unstack=["layers"], transpose=[("w$", (1, 0))]).plan(src)
    >>> reader = RuledReader(plan["layers/1/w"], {"layers/w": InMemoryReader(src["layers/w"])})
    >>> reader.shape, np.array_equal(reader.read((slice(1, 3),)), src["layers/w"][1].T[1:3])
    ((4, 3), True)
    """

    def __init__(self, target: TargetLeaf, sources: Mapping[str, ArrayReader]):
        if target.shape is None:
            raise TypeError(f"`{target.path}` is not an array (from `{target.source}`); its value passes through "
                            "as is.")
        self.shape = tuple(target.shape)
        self.dtype = np.dtype(target.dtype)
        self._target = target
        self._sources = {p.path: sources[p.path] for p in target.pieces}
        first = self._sources[target.source]
        self.context = first.context
        self.remote = any(r.remote for r in self._sources.values())
        chunk = target.node.chunk(lambda path: self._sources[path].chunk_shape)
        self.chunk_shape = chunk if chunk is not None and len(chunk) == len(self.shape) else None
        self._whole: dict[str, np.ndarray] = {}
        self.cache: dict[Any, Any] = {}  # what a step makes once per reader (the values `pad` draws)

    @property
    def layout(self) -> tuple[int, ...] | None:
        """The sources' cheapest boxes (``ArrayReader.layout``: stored chunks, or a file's rows) as the rules move
        them: a transposed leaf of a file reads whole source rows in blocks that are whole columns of it."""
        layout = self._target.node.chunk(lambda path: self._sources[path].layout)
        return layout if layout is not None and len(layout) == len(self.shape) else None

    def _read_source(self, path: str, index: Index) -> np.ndarray:
        reader = self._sources[path]
        if not reader.sequential:
            return reader.read(index)
        if path not in self._whole:
            check_budget(math.prod(reader.shape) * reader.dtype.itemsize, budget=self.budget, where=path,
                         what="a compressed leaf read whole (it streams only front to back) to apply the rules,")
            self._whole[path] = np.asarray(reader.read_all())
        return self._whole[path][index]

    def fetch(self, piece: Piece, box: Box) -> np.ndarray:
        """The block ``box`` of one source piece (``treetools.rules.blocks.Reading``)."""
        index = tuple(slice(a, b) for a, b in box)
        if piece.layer is None:
            return np.asarray(self._read_source(piece.path, index))
        a = piece.axis
        block = self._read_source(piece.path, (*index[:a], slice(piece.layer, piece.layer + 1), *index[a:]))
        return np.asarray(block).take(0, axis=a)

    def hold(self, nbytes: int, what: str) -> None:
        """Refuse to make ``nbytes`` at once over the memory budget (``treetools.rules.blocks.Reading``)."""
        check_budget(nbytes, budget=self.budget, where=self._target.path, what=what)

    def read(self, index: Index | None = None) -> np.ndarray:
        """The block ``index`` (a tuple of slices; missing trailing axes are whole) of the target leaf."""
        index = _full_index(index, self.shape)
        spans = [s.indices(n) for s, n in zip(index, self.shape)]
        box = tuple((a, max(a, b)) if step == 1 else (min(range(a, b, step), default=0),
                                                       max(range(a, b, step), default=-1) + 1)
                    for a, b, step in spans)
        block = self._target.node.read(box, self)
        if all(step == 1 for _, _, step in spans):
            return block
        # a strided index: the box that holds it, then every step-th entry
        return block[tuple(slice(None, None, step) for _, _, step in spans)]

    def __repr__(self) -> str:
        return f"RuledReader({self._target.path!r}, shape={self.shape}, dtype={self.dtype})"


def _full_index(index: Any, shape: tuple[int, ...]) -> Index:
    if index is None:
        index = ()
    elif not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise TypeError(f"a block index is a tuple of at most {len(shape)} slices, got {index!r}.")
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


def source_triples(item: Item) -> list[tuple[str, tuple[int, ...] | None, object]]:
    """``(path, shape, dtype)`` of every leaf of ``item``, what ``Rules.plan`` reads (shape None for a value)."""
    out: list[tuple[str, tuple[int, ...] | None, object]] = []
    for leaf in item.leaves:
        if leaf.reader is not None and leaf.row.shape is not None:
            out.append((leaf.name, tuple(leaf.reader.shape), leaf.reader.dtype))
        else:
            out.append((leaf.name, None, None))
    return out


def map_item(item: Item, rules: Rules, *, targets: Collection[str] | None = None,
             num_layers: int | None = None) -> tuple[Item, RulesPlan]:
    """``item`` through ``rules``: the target leaves (metadata now, data on request) and the plan behind them.

    Args:
      item: a snapshot's item.
      rules: the rules.
      targets: the paths a restore target has (checks unstacked layer counts against it).
      num_layers: the layer count every unstack and stack must have.

    Raises:
      RulesError: every problem of the rules, before any data is read.

    >>> from treetools.checkpoint_io.leaves import tree_leaves
    >>> stored = Item("params", "pytree", tree_leaves({"layers": {"w": np.arange(12.0).reshape(2, 3, 2)}}, where="x"))
    >>> mapped, plan = map_item(stored, Rules(unstack=["layers"], transpose=[("w$", (1, 0))]))
    >>> [(leaf.name, leaf.row.shape) for leaf in mapped.leaves]
    [('layers/0/w', (2, 3)), ('layers/1/w', (2, 3))]
    >>> mapped.leaves[1].reader.read((slice(None), slice(0, 2))).tolist()
    [[6.0, 8.0], [7.0, 9.0]]
    """
    plan = rules.plan(source_triples(item), targets=targets, num_layers=num_layers)
    by_name = {leaf.name: leaf for leaf in item.leaves}
    readers = {name: leaf.reader for name, leaf in by_name.items() if leaf.reader is not None}
    leaves = []
    for target in plan:
        source = by_name[target.source]
        parts, sep = stored_path(target.path)
        if target.identity or target.shape is None:  # renamed at most: the stored leaf as it is
            leaves.append(dataclasses.replace(source, row=dataclasses.replace(source.row, path=parts, sep=sep)))
            continue
        row = array_row(parts, target.shape, target.dtype, sep=sep)
        leaves.append(Leaf(row, RuledReader(target, readers)))
    return dataclasses.replace(item, leaves=leaves), plan


def map_items(items: Mapping[str, Item], rules: Rules) -> dict[str, Item]:
    """Every item of a step through the same ``rules`` (``inspect --unstack``, ``diff --rules``).

    A pattern must match a leaf of some item, not of every item (an unstack
    of ``layers/`` applies to ``params`` and ``opt_state`` alike, and a step
    may hold a JSON item it does not touch): each item is planned with
    unmatched patterns allowed, then a pattern that matched in no item is the
    usual error naming it and nearby paths (unless the rules say ``allow_unmatched``).

    >>> from treetools.checkpoint_io.leaves import tree_leaves
    >>> items = {"params": Item("params", "pytree", tree_leaves({"layers": {"w": np.zeros((2, 3))}}, where="x")),
    ...          "meta": Item("meta", "json", tree_leaves({"epoch": 1}, where="y"))}
    >>> [leaf.name for leaf in map_items(items, Rules(unstack=["layers"]))["params"].leaves]
    ['layers/0/w', 'layers/1/w']
    >>> map_items(items, Rules(unstack=["blocks"]))
    Traceback (most recent call last):
    ...
    treetools.shared.errors.RulesError: `unstack` pattern 'blocks' matches no leaf (checkpoint paths after keep/drop);
    nearby paths: ['layers/w']. Fix the pattern, drop it, or pass allow_unmatched=True.
    """
    lenient = Rules(**{**rules.to_dict(), "allow_unmatched": True})
    out, unmatched = {}, None
    for name, item in items.items():
        out[name], plan = map_item(item, lenient)
        here = dict(plan.unmatched)
        unmatched = here if unmatched is None else {k: v for k, v in unmatched.items() if k in here}
    if unmatched and not rules.allow_unmatched:
        raise RulesError(list(unmatched.values()))
    return out
