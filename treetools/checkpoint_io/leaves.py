"""What one step of a checkpoint holds, as data: ``Leaf``, ``Item``, ``Snapshot``, and the rows of stored arrays.

Formats build these (``array_row``, ``value_row``, ``tree_leaves``,
``stored_path``, ``check_name`` are the helpers for format authors);
everything above the checkpoint layer reads them. No jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from treetools.checkpoint_io.readers import ArrayReader, InMemoryReader
from treetools.shared.errors import CheckpointError
from treetools.shared.rows import Row, dtype_name

DEFAULT_ITEM = "default"
"""Item name of single-tree files (Orbax's name for an unnamed item)."""

NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()
"""The value of a non-array leaf that the metadata does not carry."""


@dataclasses.dataclass(slots=True)
class Leaf:
    """One leaf of a checkpoint: its row (metadata) and, for arrays, a reader.

    ``value`` holds a non-array leaf's value when the metadata carries it
    (JSON items, scalars in a msgpack), else ``NO_VALUE``. ``key`` is the
    format's own name for the leaf where it differs from the row's path (an
    Orbax param name such as ``Dense_0.kernel.value``).
    """

    row: Row
    reader: ArrayReader | None = None
    value: Any = NO_VALUE
    key: Any = None

    @property
    def path(self) -> tuple[str, ...]:
        return self.row.path

    @property
    def name(self) -> str:
        return self.row.name


@dataclasses.dataclass(frozen=True)
class Item:
    """One item of one step: a pytree (arrays) or a JSON value, as leaves.

    ``kind`` is ``"pytree"`` or ``"json"``; ``value`` holds a JSON item's whole
    value (``NO_VALUE`` for a pytree). A format that needs more to read the item
    again (Orbax: its folder and parsed ``_METADATA``) subclasses ``Item``;
    code outside the format never looks at those fields.
    """

    name: str
    kind: str
    leaves: list[Leaf]
    value: Any = NO_VALUE
    positional: bool = False
    """True when the leaves have no stored names, only their order (an Equinox file: ``0``, ``1``, ...): a restore
    target's array leaves are matched to them by position, as the writer's own reader does."""


EMPTY_FOLDER = "its folder holds nothing"
"""How the reason of an ``Unreadable`` item whose folder is empty begins (``Unreadable.empty``)."""


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """An item of a step that treetools cannot read, listed (never dropped in silence): its name, the handler
    that wrote it (Orbax's class name, or what the files are), and why it cannot be read.

    >>> Unreadable("proto", "ProtoCheckpointHandler", "a protocol buffer file").to_json()["handler"]
    'ProtoCheckpointHandler'
    """

    name: str
    handler: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"item": self.name, "handler": self.handler, "reason": self.reason}

    @property
    def empty(self) -> bool:
        """Its folder holds nothing (the writer left it empty): nothing in it went unread, so it does not make
        ``inspect`` or ``diff`` exit 1 (DESIGN.md "Reading, partly"); it is still listed."""
        return self.reason.startswith(EMPTY_FOLDER)

    def sentence(self) -> str:
        """One line naming the item, its handler and the reason (a note, a ``verify`` problem)."""
        return f"item `{self.name}` ({self.handler}) cannot be read: {self.reason}"


class UnreadProblem(str):
    """A ``verify`` problem that says an item could not be read (``Unreadable.sentence``), not that stored data is
    damaged: with ``allow_unread`` (``--allow-unread``) it is listed as not read instead of failing the check.

    >>> p = UnreadProblem("run/1: item `x` (h) cannot be read: why."); (isinstance(p, str), p == str(p))
    (True, True)
    """

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One checkpoint (one step): the items asked for, in stored order.

    ``metadata`` is the step's saved metadata where the format has it:
    ``saved_at`` (ISO-8601 UTC), ``metrics``, ``custom``.
    """

    step: int | None
    items: dict[str, Item]
    record_sharding: bool = False
    """Whether the format stores shardings (so a missing one means "not sharded")."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    """Diagnostics for stderr (e.g. which reader read the checkpoint)."""
    unreadable: list[Unreadable] = dataclasses.field(default_factory=list)
    """Items of the step that could not be read, each with its handler and the reason: shown by every view,
    a problem for ``verify``; never left out without a word."""



def check_name(name: str, *, where: str) -> None:
    """Refuse a stored name that would point outside the checkpoint.

    A name is refused when it is absolute, has a ``..`` part (``/`` or ``\\``
    separated) or holds a NUL byte: such a key could make a reader open files
    outside PATH, or name a file no system can open.

    >>> check_name("../etc/passwd", where="m.safetensors")
    Traceback (most recent call last):
    ...
    treetools.shared.errors.CheckpointError: m.safetensors: key '../etc/passwd' tries to escape the checkpoint folder;
    refusing to read it.
    """
    if "\0" in name:
        raise CheckpointError(f"{where}: key {name[:200]!r} holds a NUL byte; refusing to read it.")
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointError(f"{where}: key {name!r} tries to escape the checkpoint folder; refusing to read it.")


def array_row(path: Sequence[str], shape: Sequence[int], dtype: Any, *, sharding: Any = None, sep: str = "/") -> Row:
    """The row of one stored array, from its metadata alone: params and bytes follow from shape and dtype.

    >>> import numpy as np
    >>> array_row(("w",), (2, 3), np.float16).bytes
    12
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    return Row(path=tuple(path), shape=shape, dtype=dtype_name(dtype), params=size, bytes=size * dtype.itemsize,
               sharding=sharding, sep=sep)


def value_row(path: Sequence[str], *, sep: str = "/") -> Row:
    """The row of a non-array leaf (a scalar, a string, an object array): no shape, nothing counted."""
    return Row(path=tuple(path), shape=None, dtype=None, params=0, bytes=0, sep=sep)


def _tree_pairs(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path parts, leaf)`` of a tree of dicts and lists (a JSON value, a msgpack state dict), in stored order.

    Iterative: a file nested a thousand levels deep (msgpack allows it) is no RecursionError.

    >>> _tree_pairs({"a": {"b": 1, "c": []}, "d": [2, 3]})
    [(('a', 'b'), 1), (('d', '0'), 2), (('d', '1'), 3)]
    """
    out: list[tuple[tuple[str, ...], Any]] = []
    stack: list[tuple[tuple[str, ...], Any]] = [(prefix, tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((path + (str(k),), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, (list, tuple)):
            stack.extend((path + (str(i),), v) for i, v in reversed(list(enumerate(node))))
        else:
            out.append((path, node))
    return out


def tree_leaves(tree: Any, *, where: str) -> list[Leaf]:
    """Leaves of a decoded tree (a Flax msgpack, an Orbax JSON item), after refusing escaping keys.

    An ``ArrayReader`` (an array left in its file) is an array leaf read
    through it; other arrays (anything with shape and dtype) get an
    ``InMemoryReader``; other leaves keep their value. No jax is imported.

    >>> import numpy as np
    >>> [(l.name, l.row.shape, l.value) for l in tree_leaves({"w": np.ones(2), "epoch": 3}, where="x")]
    [('w', (2,), NO_VALUE), ('epoch', None, 3)]
    """
    leaves = []
    for parts, value in _tree_pairs(tree):
        for p in parts:
            check_name(p, where=where)
        if isinstance(value, ArrayReader):
            leaves.append(Leaf(array_row(parts, value.shape, value.dtype), value))
        elif hasattr(value, "shape") and hasattr(value, "dtype") and not np.dtype(value.dtype).hasobject:
            arr = np.asarray(value)
            leaves.append(Leaf(array_row(parts, arr.shape, arr.dtype), InMemoryReader(arr)))
        else:
            leaves.append(Leaf(value_row(parts), value=value))
    return leaves


def stored_path(name: str) -> tuple[tuple[str, ...], str]:
    """A flat-key format's tensor name as ``(parts, separator)``: kept exactly as stored when joined.

    Names with ``/`` (a flattened pytree) split on ``/``; others (``model.layers.0.weight``) on ``.``.

    >>> stored_path("model.layers.0.weight"), stored_path("Dense_0/kernel")
    ((('model', 'layers', '0', 'weight'), '.'), (('Dense_0', 'kernel'), '/'))
    """
    sep = "/" if "/" in name else "."
    return tuple(name.split(sep)), sep
