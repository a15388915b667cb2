"""The checkpoint layer: formats as plugins, each opening a ``Source``.

Every reader of a checkpoint, the library's ``load_parameters`` and
``restore_checkpoint`` as much as ``treetools inspect``/``diff``/``verify``,
opens it with ``open_source(path)``. A format is one module under
``treetools/inspect/formats/`` exposing ``FORMAT = Format(name, priority,
claims, open)``, or a ``Format`` handed to ``register_format``:

* ``claims(path)`` is cheap and total (never raises) and needs positive
  evidence: a marker file, magic bytes, an index JSON.
* ``open(path, display)`` returns a ``Source``: the committed steps (None for
  a single checkpoint), the incomplete saves (listed, never read), and
  ``snapshot(step, items)``, which reads the metadata of only the items asked
  for and no array data. Each ``Leaf`` carries a ``Row`` (path tuple, shape,
  dtype, counts, sharding) and, for arrays, an ``ArrayReader``.

Importing this module imports no jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pkgutil
from typing import Any, Callable, Iterator, Sequence

from treetools import storage
from treetools.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError
from treetools.inspect.arrays import ArrayReader, InMemoryReader
from treetools.rows import Row, dtype_name
from treetools.steps import StepListing, file_kind, parse_step, resolve_step

__all__ = [
    "DEFAULT_ITEM",
    "Format",
    "Item",
    "Leaf",
    "NO_VALUE",
    "Snapshot",
    "Source",
    "array_row",
    "check_name",
    "formats",
    "jsonable",
    "open_source",
    "register_format",
    "tree_leaves",
    "value_row",
]

DEFAULT_ITEM = "default"
"""Item name of single-tree files (Orbax's name for an unnamed item)."""

NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()
"""The value of a non-array leaf that the metadata does not carry."""


def jsonable(value: Any) -> Any:
    """A non-array leaf's value as JSON can hold it (numpy scalars as Python numbers, others as text).

    >>> import numpy as np
    >>> jsonable(np.float32(1.5)), jsonable({"a": [1, 2]})
    (1.5, {'a': [1, 2]})
    """
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


@dataclasses.dataclass
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


@dataclasses.dataclass
class Item:
    """One item of one step: a pytree (arrays) or a JSON value, as leaves.

    ``handle`` is what the format needs to read the item again (an Orbax item
    folder and its parsed ``_METADATA``); other code treats it as opaque.
    """

    name: str
    kind: str
    leaves: list[Leaf]
    handle: Any = None


@dataclasses.dataclass
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
    """Diagnostics for stderr (e.g. an item kind the reader skips)."""


class Source:
    """An opened checkpoint: what it is and which steps it has; metadata and data are read on demand.

    Formats subclass it and implement ``item_names`` and ``read_items``.

    Attributes:
      path: the path as the user gave it (shown in messages).
      format: the format's name (``orbax``, ``safetensors``...).
      steps: committed steps of a checkpoint root, ascending; None for a single checkpoint.
      incomplete: names of unfinished saves (never read).
      step: the step number of a single step folder, when its name says it.
    """

    format: str = "?"
    record_sharding: bool = False

    def __init__(self, path: str, *, listing: StepListing | None = None, step: int | None = None):
        self.path = path
        self.listing = listing
        self.steps: list[int] | None = listing.steps if listing is not None else None
        self.incomplete: list[str] = list(listing.incomplete) if listing is not None else []
        self.step = step
        self.notes: list[str] = [f"skipped unreadable entry `{n}` under {path}" for n in
                                 (listing.skipped if listing is not None else [])]

    # -- what formats implement

    def item_names(self, step: int | None) -> list[str]:
        """The items of one step (cheap: names only)."""
        raise NotImplementedError

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        """The metadata of the named items of one step; reads no array data."""
        raise NotImplementedError

    # -- shared

    def resolve(self, step: Any = None) -> int | None:
        """``None``/``-1``/``"latest"`` -> the latest committed step; an int must be a committed one.

        Raises:
          CheckpointNotFoundError: unknown or incomplete step (the message lists the steps).
          CheckpointError: ``step`` names a step of a single checkpoint that is not a root.
        """
        asked = parse_step(step)
        if self.listing is None:
            if asked is not None and asked != self.step:
                raise CheckpointError(
                    f"{self.path} is a single checkpoint{f' (step {self.step})' if self.step is not None else ''}, "
                    f"not a checkpoint root with steps; step {asked} cannot be chosen here: drop the step, or "
                    "point at the folder that holds the step folders."
                )
            return self.step
        return resolve_step(self.listing, asked, where=self.path)

    def snapshot(self, step: Any = None, items: Sequence[str] | None = None) -> Snapshot:
        """The metadata of one step (default: the latest), only of ``items`` when given.

        Raises:
          CheckpointNotFoundError: an unknown step, or an item the step does not have
            (the message lists the items present).
        """
        resolved = self.resolve(step)
        with self.reading(resolved):
            return self._snapshot(resolved, items)

    @contextlib.contextmanager
    def reading(self, step: int | None) -> Iterator[None]:
        """Around any read of ``step``: an error because its folder went since the listing is a ``StepDeletedError``."""
        try:
            yield
        except (CheckpointError, OSError):
            gone = self.step_deleted(step)
            if gone is not None:
                raise gone from None
            raise

    def step_deleted(self, step: int | None) -> StepDeletedError | None:
        """The error to raise when ``step``'s folder is gone since the steps were listed, else None."""
        if step is None or self.listing is None or step not in self.listing.committed:
            return None
        storage.forget(self.path)  # ask the bucket again, not what was listed
        if storage.isdir(self.listing.committed[step]):
            return None
        return StepDeletedError(
            f"{self.path}: step {step} was deleted while it was being read (a manager pruning old steps?); "
            "run again to read the steps present now."
        )

    def _snapshot(self, resolved: int | None, items: Sequence[str] | None) -> Snapshot:
        present = self.item_names(resolved)
        if items is None:
            names = present
        else:
            missing = [n for n in items if n not in present]
            if missing:
                raise self.missing_item(missing[0], present, resolved)
            names = list(dict.fromkeys(items))
        snap = self.read_items(resolved, names)
        if items is not None:
            gone = [n for n in names if n not in snap.items]  # skipped by the reader: its folder went, or unreadable
            if gone:
                raise self.missing_item(gone[0], list(snap.items), resolved)
        snap.step = resolved
        snap.notes = self.notes + snap.notes
        return snap

    def missing_item(self, name: str, present: Sequence[str], step: int | None) -> CheckpointNotFoundError:
        where = f"{self.path} (step {step})" if step is not None else self.path
        return CheckpointNotFoundError(f"{where} has no item `{name}`; items: {', '.join(present) or 'none'}.")


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it and how to open it.

    Attributes:
      name: short name shown to users (``orbax``, ``safetensors``).
      priority: formats are asked in descending priority; the first that claims a path opens it.
      claims: ``claims(local_path) -> bool``: cheap, total, positive evidence only.
      open: ``open(local_path, display_path) -> Source``.
      description: what paths it reads, for the "not a checkpoint" error.

    ``local_path`` is an absolute local path or a ``gs://`` / ``s3://`` URL: a
    format that lists and reads through ``treetools.storage`` (``isdir``,
    ``scandir``, ``open``, ``read_range``, and ``kvstore_spec`` for TensorStore)
    instead of ``os`` reads buckets too.
    """

    name: str
    priority: int
    claims: Callable[[str], bool]
    open: Callable[[str, str], Source]
    description: str = ""


_REGISTERED: dict[str, Format] = {}
_BUILTINS_LOADED = False


def register_format(fmt: Format) -> Format:
    """Add (or replace, by name) a format; ``inspect``, ``diff``, ``verify`` and ``load_parameters`` then read it.

    >>> f = register_format(Format("demo", -100, lambda p: False, lambda p, d: Source(d)))
    >>> "demo" in [x.name for x in formats()]
    True
    >>> unregister_format("demo")
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"`fmt` must be a treetools Format, got {type(fmt).__name__}.")
    _REGISTERED[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format registered by ``register_format`` (tests use it to clean up)."""
    _REGISTERED.pop(name, None)


def _load_builtins() -> None:
    """Import every module of ``treetools.inspect.formats`` once and register its ``FORMAT``."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    package = importlib.import_module("treetools.inspect.formats")

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if isinstance(fmt, Format):
            _REGISTERED.setdefault(fmt.name, fmt)
    _BUILTINS_LOADED = True


def formats() -> list[Format]:
    """Every registered format, in the order they are asked (descending priority, then name)."""
    _load_builtins()
    return sorted(_REGISTERED.values(), key=lambda f: (-f.priority, f.name))


def _claims(fmt: Format, path: str) -> bool:
    try:
        return bool(fmt.claims(path))
    except OSError:
        return False


def open_source(path: str | os.PathLike) -> Source:
    """Open any checkpoint read-only through the format that claims it.

    Relative and ``~`` paths work; the path is shown as given.

    Raises:
      CheckpointNotFoundError: nothing at ``path``.
      CheckpointError: no format claims it (the message lists the readable
        formats), or the format finds it corrupt or unreadable.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> np.savez(f, w=np.ones(3, np.float32))
    >>> src = open_source(f)
    >>> src.format, src.steps, [l.row.params for l in src.snapshot().items["default"].leaves]
    ('npz', None, [3])
    """
    display = os.fspath(path)
    if not display:
        raise CheckpointNotFoundError("empty path: pass a checkpoint folder or file.")
    local = storage.normalize(display)
    storage.forget(local)  # a bucket is listed afresh each time a checkpoint is opened
    if not storage.exists(local):
        if storage.islink(local):
            raise CheckpointError(f"{display}: {file_kind(local)}; point at the checkpoint itself.")
        if storage.is_remote(local):
            raise storage.missing(local)
        raise CheckpointNotFoundError(f"{display}: no such file or folder.")
    if not (storage.isdir(local) or storage.isfile(local)):
        raise CheckpointError(f"{display}: not a regular file ({file_kind(local)}); point at a checkpoint file or folder.")
    registered = formats()
    for fmt in registered:
        if _claims(fmt, local):
            try:
                return fmt.open(local, display)
            except (CheckpointError, CheckpointNotFoundError) as e:  # name the path as typed, not its absolute form
                if local == display or not str(e).startswith(local):
                    raise
                raise type(e)(display + str(e)[len(local):]) from None
    if storage.isdir(local):
        try:
            empty = not storage.listdir(local)
        except OSError as e:
            raise CheckpointError(f"{display}: cannot list folder ({e.strerror or e}).") from None
        if empty:
            raise CheckpointError(f"{display}: empty folder, not a checkpoint.")
    readable = "; ".join(f"{f.name} ({f.description})" if f.description else f.name for f in registered)
    raise CheckpointError(f"{display}: not a checkpoint that treetools can read. Readable formats: {readable}.")


# ---------------------------------------------------------------------------- helpers for formats


def check_name(name: str, *, where: str) -> None:
    """Refuse a stored name that would point outside the checkpoint.

    A name is refused when it is absolute or has a ``..`` part (``/`` or ``\\``
    separated): such a key could make a reader open files outside PATH.

    >>> check_name("../etc/passwd", where="m.safetensors")
    Traceback (most recent call last):
    ...
    treetools.errors.CheckpointError: m.safetensors: key '../etc/passwd' tries to escape the checkpoint folder; refusing to read it.
    """
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointError(f"{where}: key {name!r} tries to escape the checkpoint folder; refusing to read it.")


def array_row(path: Sequence[str], shape: Sequence[int], dtype: Any, *, sharding: Any = None, sep: str = "/") -> Row:
    """The row of one stored array, from its metadata alone: params and bytes follow from shape and dtype.

    >>> import numpy as np
    >>> array_row(("w",), (2, 3), np.float16).bytes
    12
    """
    import math

    import numpy as np

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
    """Leaves of a tree already in memory (a Flax msgpack, an Orbax JSON item), after refusing escaping keys.

    Arrays (anything with shape and dtype) get an ``InMemoryReader``; other
    leaves keep their value. No jax is imported.

    >>> import numpy as np
    >>> [(l.name, l.row.shape, l.value) for l in tree_leaves({"w": np.ones(2), "epoch": 3}, where="x")]
    [('w', (2,), NO_VALUE), ('epoch', None, 3)]
    """
    import numpy as np

    leaves = []
    for parts, value in _tree_pairs(tree):
        for p in parts:
            check_name(p, where=where)
        if hasattr(value, "shape") and hasattr(value, "dtype") and not np.dtype(value.dtype).hasobject:
            arr = np.asarray(value)
            leaves.append(Leaf(array_row(parts, arr.shape, arr.dtype), InMemoryReader(arr)))
        else:
            leaves.append(Leaf(value_row(parts), value=value))
    return leaves


def file_head(path: str, n: int) -> bytes:
    """The first ``n`` bytes of a regular file (b"" for anything else): what ``claims`` functions sniff."""
    import stat as stat_

    try:
        if not stat_.S_ISREG(storage.stat(path).st_mode):
            return b""
        return storage.read_range(path, 0, n)
    except OSError:
        return b""


def stored_path(name: str) -> tuple[tuple[str, ...], str]:
    """A flat-key format's tensor name as ``(parts, separator)``: kept exactly as stored when joined.

    Names with ``/`` (a flattened pytree) split on ``/``; others (``model.layers.0.weight``) on ``.``.

    >>> stored_path("model.layers.0.weight"), stored_path("Dense_0/kernel")
    ((('model', 'layers', '0', 'weight'), '.'), (('Dense_0', 'kernel'), '/'))
    """
    sep = "/" if "/" in name else "."
    return tuple(name.split(sep)), sep


class FileSource(Source):
    """A single-file checkpoint (one tree, no steps): its leaves are item ``default``.

    ``--item NAME`` / ``items=[NAME]`` may also name a top-level key of the
    tree (a msgpack of a whole train state): its leaves keep the paths below it.
    """

    def __init__(self, display: str, format: str, leaves: list[Leaf], *, record_sharding: bool = False):
        super().__init__(display)
        self.format = format
        self.record_sharding = record_sharding
        self._leaves = leaves

    def item_names(self, step: int | None) -> list[str]:
        return [DEFAULT_ITEM]

    def top_level_keys(self) -> list[str]:
        return list(dict.fromkeys(leaf.path[0] for leaf in self._leaves if leaf.path))

    def snapshot(self, step: Any = None, items: Sequence[str] | None = None) -> Snapshot:
        self.resolve(step)
        out: dict[str, Item] = {}
        for name in items if items is not None else [DEFAULT_ITEM]:
            if name == DEFAULT_ITEM:
                out[name] = Item(name, "pytree", list(self._leaves))
                continue
            below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:]))
                     for leaf in self._leaves if len(leaf.path) > 1 and leaf.path[0] == name]
            if not below:
                keys = self.top_level_keys()
                shown = ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "")
                raise CheckpointNotFoundError(
                    f"{self.path} has no item `{name}`; items: {DEFAULT_ITEM} (top-level keys: {shown or 'none'})."
                )
            out[name] = Item(name, "pytree", below)
        return Snapshot(None, out, record_sharding=self.record_sharding, notes=list(self.notes))
