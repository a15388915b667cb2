"""The checkpoint layer: formats as plugins, each opening a ``Source``.

Every reader of a checkpoint, the library's ``load_parameters`` and
``restore_checkpoint`` as much as ``treetools inspect``/``diff``/``verify``,
opens it with ``open_source(path)``. A format is one module under
``treetools/ckpt/formats/`` exposing ``FORMAT = Format(name, priority,
claims, open)``, or a ``Format`` handed to ``register_format``:

* ``claims(path)`` is cheap and total (never raises) and needs positive
  evidence: a marker file, magic bytes, an index JSON.
* ``open(path, display)`` returns a ``Source``: the committed steps (None for
  a single checkpoint), the incomplete saves (listed, never read), and
  ``snapshot(step, items)``, which reads the metadata of only the items asked
  for and no array data. Each ``Leaf`` carries a ``Row`` (path tuple, shape,
  dtype, counts, sharding) and, for arrays, an ``ArrayReader``.

Format-specific work that other code needs is a hook of ``Source`` with a
generic default (``restore_arrays``: a format's own fast restore;
``verify_metadata``: a format's own consistency checks), so no code outside
a format branches on its name or reads its private state.

This module is also the one home of item-name knowledge: which item holds the
parameters (``params_item``, ``params_subtree``), in which order items are
shown (``order_items``), whose counts are parameters (``counts_params``).

Importing this module imports no jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import pkgutil
import re
import stat as stat_
import time
import zipfile
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from treetools.ckpt import storage
from treetools.ckpt.readers import ArrayReader, InMemoryReader, MemoryBudgetError, opening
from treetools.ckpt.steps import StepListing, describe_series, file_kind, parse_step, resolve_step
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError
from treetools.shared.rows import Row, dtype_name

DELETION_CHECKS, DELETION_CHECK_PAUSE = 6, 0.05
"""After a failed read of a listed step: how many times (and how far apart, in seconds) ``Source.step_deleted``
asks whether the step is still committed before the failure counts as damage."""

DEFAULT_ITEM = "default"
"""Item name of single-tree files (Orbax's name for an unnamed item)."""

NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()
"""The value of a non-array leaf that the metadata does not carry."""


# ---------------------------------------------------------------------------- item names

ITEM_ORDER = ("params", "params_ema", "ema_params", "target", "model", "opt_state", "state")
"""Items shown first, in this order (params, EMA params, optimizer state); the rest follow as stored."""

MODEL_ITEMS = ("target", "model")
"""Items that hold the model's parameters where no ``params`` item is: T5X's ``target``, Levanter's and EasyDeL's ``model``."""

PARAM_ITEMS = ("params", "params_ema", "ema_params", "target", "model", "default")
"""Items whose element counts are parameters; other items (optimizer moments, state) count "elements"."""

STATE_ITEMS = ("state", "default", "train_state")
"""Items that hold a whole train state (Orbax's legacy and v1 training APIs, a single-item manager)."""

PARAM_SUBTREES = {False: ("params", "target"), True: ("params_ema", "ema_params", "ema")}
"""Where real layouts keep the parameters inside one item holding a whole train state (T5X: ``target``)."""


def order_items(names: Sequence[str]) -> list[str]:
    """Params first, then EMA params, then optimizer state, then the rest in stored order.

    >>> order_items(["data_iter", "opt_state", "params_ema", "params"])
    ['params', 'params_ema', 'opt_state', 'data_iter']
    """
    first = [n for n in ITEM_ORDER if n in names]
    return first + [n for n in names if n not in first]


def non_param_leaves(leaves: Sequence["Leaf"]) -> dict[tuple[str, ...], str]:
    """The leaves of a parameter item that are no parameters, by path: what they are.

    A whole nnx ``State`` saved as one item holds more than ``nnx.Param``s:
    the RNG streams of ``nnx.Rngs`` (``rngs/<stream>/count`` and ``key``, or
    any leaf of a PRNG key dtype) and BatchNorm's running statistics (``mean``
    and ``var`` beside the module's ``scale`` or ``bias``; linen keeps them in
    ``batch_stats``, apart). The checkpoint does not store the variable types:
    these are told by their names, as flax writes them.

    >>> import numpy as np
    >>> tree = {"bn": {"scale": np.ones(2), "bias": np.ones(2), "mean": np.ones(2), "var": np.ones(2)},
    ...         "drop": {"rngs": {"count": np.uint32(0), "key": np.zeros(2, np.uint32)}}, "mean": np.ones(2)}
    >>> sorted(non_param_leaves(tree_leaves(tree, where="x")).items())
    [(('bn', 'mean'), 'batch statistics'), (('bn', 'var'), 'batch statistics'), (('drop', 'rngs', 'count'), 'RNG state'), (('drop', 'rngs', 'key'), 'RNG state')]
    """
    names = {leaf.path for leaf in leaves}
    out: dict[tuple[str, ...], str] = {}
    for leaf in leaves:
        path = leaf.path
        if not path:
            continue
        dtype = str(leaf.row.dtype or "")
        if ("rngs" in path[:-1] and path[-1] in ("count", "key")) or dtype.startswith("key<"):
            out[path] = "RNG state"
        elif path[-1] in ("mean", "var") and len(path) > 1 and (
                (*path[:-1], "scale") in names or (*path[:-1], "bias") in names):
            out[path] = "batch statistics"
    return out


def counts_params(item: str) -> bool:
    """Whether an item's element count is its parameter count (else its table says "elements").

    >>> counts_params("params"), counts_params("opt_state")
    (True, False)
    """
    return item in PARAM_ITEMS


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
      deleting: those of ``incomplete`` being deleted (a manager pruning them; ``StepListing.deleting``).
      step: the step number of a single step folder, when its name says it.
    """

    format: str = "?"
    record_sharding: bool = False
    memory_budget: float | None = None
    """Bytes one read may decode at once (set by ``open_source``); every reader handed out gets it."""
    root: storage.Root | None = None
    """The checkpoint root (set by ``open_source``: the PATH opened): every local file read under it resolves
    inside it (``storage.confine``); None for a bucket."""

    def __init__(self, path: str, *, listing: StepListing | None = None, step: int | None = None):
        self.path = path
        self.step = step
        self.use_listing(listing)

    def use_listing(self, listing: StepListing | None) -> None:
        """Read the steps of ``listing``: its steps, incomplete saves, and notes on what it leaves out."""
        self.listing = listing
        self.steps: list[int] | None = listing.steps if listing is not None else None
        self.incomplete: list[str] = list(listing.incomplete) if listing is not None else []
        self.deleting: list[str] = list(listing.deleting) if listing is not None else []
        self.notes: list[str] = [f"skipped unreadable entry `{n}` under {self.path}" for n in
                                 (listing.skipped if listing is not None else [])]
        if listing is not None and listing.others and listing.conflict is None:
            self.notes.append(
                f"{self.path} also holds the step series {describe_series(listing.others)}; showing the series "
                f"{listing.series!r}: read another with --prefix NAME (prefix= in the library).")

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
            snap = self._snapshot(resolved, items)
        self.hold_to_budget(snap.items.values())
        return snap

    def hold_to_budget(self, items: Iterable[Item]) -> None:
        """Give every reader of ``items`` this source's memory budget and root (``snapshot`` does it for its items)."""
        for item in items:
            for leaf in item.leaves:
                if leaf.reader is not None:
                    leaf.reader.root = self.root
                    if self.memory_budget is not None:
                        leaf.reader.budget = self.memory_budget

    @contextlib.contextmanager
    def reading(self, step: int | None) -> Iterator[None]:
        """Around any read of ``step``: the metadata read under this source's memory budget; an error because
        its folder went since the listing is a ``StepDeletedError``."""
        try:
            with opening(self.memory_budget):
                yield
        except MemoryBudgetError:
            raise  # the reader's own refusal, whatever the step's state
        except (CheckpointError, OSError):
            gone = self.step_deleted(step)
            if gone is not None:
                raise gone from None
            raise

    def step_deleted(self, step: int | None) -> StepDeletedError | None:
        """The error to raise when ``step`` is gone since the steps were listed, else None.

        Gone means its folder is gone, or is no longer a committed step (a
        manager pruning it deletes its files, commit marker included, before the
        folder), asked afresh (``StepListing.still_committed``): a step that is
        still there and committed is never called deleted.
        """
        if step is None or self.listing is None or step not in self.listing.committed:
            return None
        # A manager deletes a step's files from several threads at once: its data may be gone a few
        # milliseconds before its commit marker. Asked a few times over a quarter second before calling
        # the read's failure damage.
        for attempt in range(DELETION_CHECKS):
            storage.forget(self.path)  # ask the bucket again, not what was listed
            if not self.listing.still_committed(step):
                break
            if attempt == DELETION_CHECKS - 1:
                return None
            time.sleep(DELETION_CHECK_PAUSE)
        return StepDeletedError(
            f"{self.path}: step {step} was deleted while it was being read (a manager pruning old steps?); "
            "run again to read the steps present now."
        )

    def _snapshot(self, resolved: int | None, items: Sequence[str] | None) -> Snapshot:
        present = self.item_names(resolved)
        parts: dict[str, str] = {}  # a name asked for that is a top-level key of the item holding it
        if items is None:
            names = present
        else:
            names = []
            for name in dict.fromkeys(items):
                holder = name if name in present else part_holder(present, name)
                if holder is None:
                    raise self.missing_item(name, present, resolved)
                if holder != name:
                    parts[name] = holder
                if holder not in names:
                    names.append(holder)
        snap = self.read_items(resolved, names)
        if items is not None:
            gone = [n for n in names if n not in snap.items]  # skipped by the reader: its folder went, or unreadable
            if gone:
                raise self.missing_item(gone[0], list(snap.items), resolved)
            for name, holder in parts.items():
                below = part_of(snap.items[holder], name)
                if below is None:
                    keys = top_level_keys(snap.items[holder])
                    shown = ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "")
                    raise self.missing_item(name, present, resolved, note=f"`{holder}` holds: {shown or 'nothing'}")
                snap.items[name] = below
            snap.items = {n: snap.items[n] for n in dict.fromkeys(items)}
        snap.step = resolved
        snap.notes = self.notes + snap.notes
        return snap

    def missing_item(self, name: str, present: Sequence[str], step: int | None, *,
                     note: str | None = None) -> CheckpointNotFoundError:
        where = f"{self.path} (step {step})" if step is not None else self.path
        extra = f" {note[0].upper()}{note[1:]}." if note else ""
        return CheckpointNotFoundError(f"{where} has no item `{name}`; items: {', '.join(present) or 'none'}.{extra}")

    # -- hooks: a format's own way of doing something, with a generic default

    def select_series(self, prefix: str) -> None:
        """Read the step series named ``prefix`` of a root holding several (``open_source(path, prefix=...)``).

        The default picks it from the ``StepListing`` (``StepListing.select``);
        a format whose listing holds every series needs nothing more.

        Raises:
          CheckpointError: no such series (the message lists them), or not a root with steps.
        """
        if self.listing is None:
            raise CheckpointError(
                f"{self.path}: a single checkpoint, not a folder of step series; `prefix` (--prefix) picks one "
                "series of step folders or files in a folder that holds several: drop it, or point at that folder."
            )
        self.use_listing(self.listing.select(prefix, where=self.path))

    def restore_arrays(self, item: Item, targets: Mapping[str, Any]) -> dict[str, Any] | None:
        """Read arrays of ``item`` straight into their targets the format's own way; None: the generic way.

        ``targets`` maps a leaf's name (``Leaf.name``) to a ``jax.ShapeDtypeStruct``
        with a sharding; the result maps the same names to ``jax.Array``s. The
        default returns None, and the restore reads each device's block through
        the leaves' ``ArrayReader``s, which works for every format. Orbax
        overrides it to use Orbax's own restore where it can.

        Implementation hint: import jax (and your library) inside this method,
        so metadata reads stay jax-free.
        """
        return None

    def verify_metadata(self, step: int | None) -> tuple[list[Item], list[str]]:
        """For ``treetools verify``: the step's items read for checking, and every problem found doing so.

        A problem is one sentence naming the file or leaf; an item that cannot
        be read at all is a problem, not an error. Arrays are read afterwards,
        by ``verify``, through the returned items' readers. The default reads
        the step's snapshot; a format with more to check (Orbax: commit
        evidence, arrays its metadata does not list) overrides it.
        """
        try:
            snap = self.snapshot(step)
        except (MemoryBudgetError, StepDeletedError):
            raise
        except (CheckpointError, CheckpointNotFoundError) as e:  # corrupt: a problem of this step, not the end
            return [], [str(e)]
        return list(snap.items.values()), []


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it and how to open it.

    Attributes:
      name: short name shown to users (``orbax``, ``safetensors``).
      priority: formats are asked in descending priority; the first that claims a path opens it.
      claims: ``claims(location) -> bool``: cheap, total, positive evidence only.
      open: ``open(location, display) -> Source``: ``display`` is the path as the user gave it, for messages.
      description: what paths it reads, for the "not a checkpoint" error.

    ``location`` is an absolute local path or a ``gs://`` / ``s3://`` URL: a
    format that lists and reads through ``treetools.ckpt.storage`` (``isdir``,
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
    >>> "demo" in [x.name for x in registered_formats()]
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
    """Import every module of ``treetools.ckpt.formats`` once and register its ``FORMAT``."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    package = importlib.import_module("treetools.ckpt.formats")

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if isinstance(fmt, Format):
            _REGISTERED.setdefault(fmt.name, fmt)
    _BUILTINS_LOADED = True


def registered_formats() -> list[Format]:
    """Every registered format, in the order they are asked (descending priority, then name)."""
    _load_builtins()
    return sorted(_REGISTERED.values(), key=lambda f: (-f.priority, f.name))


def _claims(fmt: Format, path: str) -> bool:
    try:
        return bool(fmt.claims(path))
    except OSError:
        return False


def open_source(path: str | os.PathLike, *, memory_budget: float | None = None, prefix: str | None = None) -> Source:
    """Open any checkpoint read-only through the format that claims it.

    Relative and ``~`` paths work; the path is shown as given. The path is the
    checkpoint's root (``storage.confine``): every local file read under it, by
    treetools or by TensorStore, must resolve inside it (docs/untrusted.md).

    Args:
      path: a checkpoint file or folder, local or ``gs://``/``s3://``.
      memory_budget: bytes one read may decode at once (a storage chunk, a
        metadata file parsed whole); every reader of the source is held to it.
        None: ``TREETOOLS_MEMORY_BUDGET_MB``, else 2 GiB; ``math.inf``: no budget.
      prefix: in a folder holding several series of steps (flax's
        ``save_checkpoint(prefix=...)``: ``checkpoint_6`` and ``eval_6``), read
        this one (None: ``checkpoint_``, else the steps named by number alone).

    Raises:
      CheckpointNotFoundError: nothing at ``path``.
      CheckpointError: no format claims it (the message names the checkpoint
        the path lies inside, or those a folder holds, else the readable
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
    location = storage.normalize(display)
    storage.forget(location)  # a bucket is listed afresh each time a checkpoint is opened
    root = storage.confine(location)  # from here on, every read under PATH must resolve inside it
    if not storage.exists(location):
        if storage.islink(location):
            raise CheckpointError(f"{display}: {file_kind(location)}; point at the checkpoint itself.")
        if storage.is_remote(location):
            raise storage.missing(location)
        raise CheckpointNotFoundError(f"{display}: no such file or folder.")
    if not (storage.isdir(location) or storage.isfile(location)):
        raise CheckpointError(f"{display}: not a regular file ({file_kind(location)}); point at a checkpoint file or folder.")
    if storage.isdir(location):
        storage.prefetch_tree(location)  # in a bucket, one LIST answers the probes of every step and item below
    registered = registered_formats()
    for fmt in registered:
        if _claims(fmt, location):
            try:
                with opening(memory_budget):
                    source = fmt.open(location, display)
                    if prefix is not None:
                        source.select_series(prefix)
                source.memory_budget, source.root = memory_budget, root
                return source
            except (CheckpointError, CheckpointNotFoundError) as e:  # name the path as typed, not its absolute form
                if location == display or not str(e).startswith(location):
                    raise
                raise type(e)(display + str(e)[len(location):]) from None
    raise CheckpointError(_not_a_checkpoint(location, display, registered))


# ---------------------------------------------------------------------------- near misses

NEAR_LEVELS = {False: 8, True: 4}
"""How many folders up (local, bucket) a path no format claims is looked for inside a checkpoint: an Orbax chunk
file sits four folders below its step (``100/params/ocdbt.process_0/d/<chunk>``)."""

NEAR_ENTRIES = {False: 24, True: 8}
"""How many entries of a folder (or of a file's folder) are asked whether they are a checkpoint, for the
"did you mean": those named like one (``checkpoints``, ``ckpt``, ``model``) first."""

_LIKELY = ("checkpoint", "ckpt", "model", "step", "params", "weights", ".safetensors", ".msgpack")


def claiming_format(location: str, formats: Sequence[Format] | None = None) -> Format | None:
    """The format that would open ``location`` (the first, in priority order, that claims it), or None."""
    return next((f for f in (formats if formats is not None else registered_formats()) if _claims(f, location)), None)


def _child(folder: str, name: str) -> str:
    """``folder/name``, for a local folder or a bucket's."""
    return f"{folder}/{name}" if storage.is_remote(folder) else os.path.join(folder, name)


def _parent(location: str) -> str | None:
    """The folder holding ``location``; None above a bucket or at the file system's root."""
    if storage.is_remote(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{rest.rpartition('/')[0]}" if "/" in rest else None
    parent = os.path.dirname(location)
    return parent if parent != location else None


def enclosing_checkpoints(path: str, *, include_self: bool = False,
                          levels: int | None = None) -> list[tuple[str, Format]]:
    """The checkpoints ``path`` lies inside: every folder above it (and itself, with ``include_self``) that a
    format claims, nearest first, as ``(location, format)``; ``path`` need not exist.

    ``treetools train`` refuses a workdir that has any (a run written into a step would read as part of it), and
    ``open_source`` names the nearest for a path no format claims (a file inside a step folder).

    Args:
      path: a local path or URL.
      include_self: ask ``path`` itself too.
      levels: how many folders up to look (default ``NEAR_LEVELS``: 8 locally, 4 in a bucket).
    """
    location = storage.normalize(os.fspath(path))
    remote = storage.is_remote(location)
    formats = registered_formats()
    found = []
    below: str | None = None  # the name, in `current`, of the folder on the way down to `path`
    current: str | None = location
    if not include_self:
        below, current = os.path.basename(location), _parent(location)
    for _ in range(levels if levels is not None else NEAR_LEVELS[remote]):
        if current is None:
            break
        try:
            fmt = claiming_format(current, formats) if storage.isdir(current) else None
            if fmt is not None and _holds(current, fmt, below):
                found.append((current, fmt))
        except (OSError, CheckpointError):  # an unreadable folder above: no evidence either way
            pass
        below, current = os.path.basename(current), _parent(current)
    return found


def _holds(location: str, fmt: Format, name: str | None) -> bool:
    """Whether the entry ``name`` of ``location`` (a folder ``fmt`` claims; None: ``location`` itself) is part of
    that checkpoint: a step folder of a root (listed, unfinished, or named as its steps are), an item folder or
    a file of a step, anything in an item folder or a single-file checkpoint's folder; not a stranger beside a
    root's steps or a step's items (a run folder in a ``/tmp`` that holds steps).
    """
    if name is None:
        return True
    try:
        with opening(None):
            source = fmt.open(location, location)
            listing = source.listing
            items = source.item_names(source.step) if listing is None else []
    except (CheckpointError, CheckpointNotFoundError, OSError):
        return True  # claimed by its own files, and unreadable (an unfinished step): a checkpoint all the same
    if listing is None:  # a step's items are folders in it: another folder there is no part of it
        folders = [n for n in items if storage.isdir(_child(location, n))]
        return name in items or not folders or not storage.isdir(_child(location, name))
    names = set(listing.incomplete)
    for series in listing.every_series().values():
        names |= {os.path.basename(folder) for folder in series.committed.values()} | set(series.incomplete)
    series_step = re.escape(listing.series) + r"\d+" if listing.series else r"\d+"
    return name in names or re.fullmatch(series_step, name) is not None


def shown_path(location: str, display: str) -> str:
    """``location`` (a folder above or below the path the user typed as ``display``) written the way they wrote
    theirs: relative when theirs was, ``~/`` when theirs was, else absolute; a URL as it is."""
    if storage.is_remote(location) or os.path.isabs(display):
        return location
    if display.startswith("~"):
        return os.path.join("~", os.path.relpath(location, os.path.expanduser("~")))
    return os.path.relpath(location)


def _checkpoints_beside(folder: str, formats: Sequence[Format], *, skip: str | None = None) -> list[tuple[str, Format]]:
    """Entries of ``folder`` that a format claims (a few, those named like checkpoints asked first)."""
    remote = storage.is_remote(folder)
    try:
        names = [n for n in storage.listdir(folder) if n != skip]
    except (OSError, CheckpointError):
        return []
    names.sort(key=lambda n: (not any(w in n.lower() for w in _LIKELY), n))
    found = []
    for name in names[:NEAR_ENTRIES[remote]]:
        entry = _child(folder, name)
        try:
            fmt = claiming_format(entry, formats)
        except (OSError, CheckpointError):
            fmt = None
        if fmt is not None:
            found.append((entry, fmt))
    return found


TORCH_SUFFIXES = (".bin", ".pt", ".pth")
"""Names of the files ``torch.save`` writes (``pytorch_model.bin``, ``*.pt``): a zip holding ``data.pkl`` (PyTorch
1.6 and later) or a bare pickle. ``is_torch_zip`` tells such a zip from an npz saved under the same name."""

_TORCH_FOLDER_FILE = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?$|.+\.pth?$", re.IGNORECASE)


def is_torch_zip(location: str) -> bool:
    """Whether ``location`` is a zip that ``torch.save`` wrote: one whose members hold ``data.pkl``."""
    try:
        with storage.open(location) as fh, zipfile.ZipFile(fh) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, CheckpointError, zipfile.BadZipFile, ValueError):
        return False


def _torch_pickle(location: str, folder: bool) -> str | None:
    """What names ``location`` as PyTorch's ``torch.save`` output, or None: a folder holding
    ``pytorch_model.bin`` (its shards, its index, a ``.pt`` file), or a ``.bin``/``.pt``/``.pth`` file that is a
    torch zip or a bare pickle."""
    if folder:
        try:
            names = sorted((n for n in storage.listdir(location) if _TORCH_FOLDER_FILE.match(n)),
                           key=lambda n: (not n.endswith(".json"), n))  # an index names the whole model
        except (OSError, CheckpointError):
            return None
        if not names:
            return None
        what = "an index of PyTorch pickles" if names[0].endswith(".json") else "a PyTorch pickle"
        return f"holds {names[0]}, {what}"
    if not os.path.basename(location).lower().endswith(TORCH_SUFFIXES):
        return None
    head = file_head(location, 2)
    # A pickle of protocol 2 to 5 starts with 0x80 and its protocol; torch.save wrote one before PyTorch 1.6.
    if (head[:2] == b"PK" and is_torch_zip(location)) or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03",
                                                                                            b"\x04", b"\x05")):
        return "a PyTorch pickle (torch.save)"
    return None


def _refuse_pickle(display: str, what: str) -> str:
    return (f"{display}: {what}; treetools reads no pickles (loading one can run code). Save the weights as "
            "safetensors (`save_pretrained(DIR, safe_serialization=True)`, or "
            "`safetensors.torch.save_file(model.state_dict(), PATH)`) and pass that.")


def _not_a_checkpoint(location: str, display: str, formats: Sequence[Format]) -> str:
    """The one-line error for a path no format claims, with the path that would work where there is one.

    A file or folder inside a checkpoint (``100/_CHECKPOINT_METADATA``, an item's ``manifest.ocdbt``) names that
    checkpoint; a folder holding checkpoints (a ``treetools train`` workdir and its ``checkpoints/``), or a file
    beside them, asks "did you mean ...?". Else the readable formats, by name (``--help`` describes them).
    """
    folder = storage.isdir(location)
    inside = enclosing_checkpoints(location)
    if inside:
        outer, fmt = inside[0]
        what = "folder" if folder else "file"
        return (f"{display}: not a checkpoint but a {what} inside the checkpoint {shown_path(outer, display)} "
                f"({fmt.name}); pass that instead.")
    if folder:
        try:
            empty = not storage.listdir(location)
        except OSError as e:
            raise CheckpointError(f"{display}: cannot list folder ({e.strerror or e}).") from None
        if empty:
            return f"{display}: empty folder, not a checkpoint."
    # A file that is a pickle is named as one; a folder holding checkpoints beside a stray pickle (a Hugging Face
    # Trainer's output_dir) points at the checkpoints first.
    pickle = _torch_pickle(location, folder)
    if pickle is not None and not folder:
        return _refuse_pickle(display, pickle)
    parent = _parent(location)
    near = (_checkpoints_beside(location, formats) if folder else
            _checkpoints_beside(parent, formats, skip=os.path.basename(location)) if parent is not None else [])
    if pickle is not None and not near:
        return _refuse_pickle(display, pickle)
    if near:
        options = " or ".join(f"{shown_path(p, display)} ({f.name})" for p, f in near[:3])
        where = "a folder holding checkpoints" if folder else "a file beside checkpoints"
        return f"{display}: not a checkpoint but {where}; did you mean {options}?"
    return (f"{display}: not a checkpoint that treetools can read. Readable formats: "
            f"{', '.join(f.name for f in formats)} (`treetools inspect --help` says what each reads).")


# ---------------------------------------------------------------------------- helpers for formats


def check_name(name: str, *, where: str) -> None:
    """Refuse a stored name that would point outside the checkpoint.

    A name is refused when it is absolute, has a ``..`` part (``/`` or ``\\``
    separated) or holds a NUL byte: such a key could make a reader open files
    outside PATH, or name a file no system can open.

    >>> check_name("../etc/passwd", where="m.safetensors")
    Traceback (most recent call last):
    ...
    treetools.shared.errors.CheckpointError: m.safetensors: key '../etc/passwd' tries to escape the checkpoint folder; refusing to read it.
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


def file_head(path: str, n: int) -> bytes:
    """The first ``n`` bytes of a regular file (b"" for anything else): what ``claims`` functions sniff."""
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
    ``positional``: the leaves are named by their index only (``Item.positional``).
    """

    def __init__(self, display: str, format: str, leaves: list[Leaf], *, record_sharding: bool = False,
                 positional: bool = False):
        super().__init__(display)
        self.format = format
        self.record_sharding = record_sharding
        self.positional = positional
        self._leaves = leaves

    def item_names(self, step: int | None) -> list[str]:
        return [DEFAULT_ITEM]

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        return Snapshot(None, {name: Item(name, "pytree", list(self._leaves), positional=self.positional)
                               for name in names}, record_sharding=self.record_sharding)


# ---------------------------------------------------------------------------- which item holds the params


def part_holder(present: Sequence[str], name: str) -> str | None:
    """The item that may hold ``name`` as a top-level key: the one item holding a whole train state (Orbax's
    ``default``/``state``/``train_state``), or the lone item of the step; None when there is no single one.

    >>> part_holder(["default"], "params"), part_holder(["params", "opt_state"], "mu")
    ('default', None)
    """
    holders = [n for n in present if n in STATE_ITEMS] or (list(present) if len(present) == 1 else [])
    return holders[0] if len(holders) == 1 and name not in present else None


def item_argument(present: Sequence[str], item: str) -> tuple[str, str | None]:
    """``--item`` as ``(item to read, path prefix inside it or None)``: any path a command prints works.

    An item name, a top-level key of an item holding a whole train state
    (``params`` of Orbax's ``default``), or ``item/path`` (a group or leaf of an item).
    An unknown name comes back as it is: the snapshot says what is missing, listing the items.

    >>> item_argument(["params", "opt_state"], "params/Dense_0"), item_argument(["default"], "params")
    (('params', 'Dense_0'), ('params', None))
    """
    if item in present or ("/" not in item and part_holder(present, item) is not None):
        return item, None
    head, _, rest = item.partition("/")
    if rest and (head in present or part_holder(present, head) is not None):
        return head, rest
    return item, None


def top_level_keys(item: Item) -> list[str]:
    """The first path parts of an item's leaves, in stored order."""
    return list(dict.fromkeys(leaf.path[0] for leaf in item.leaves if leaf.path))


def part_of(item: Item, key: str) -> Item | None:
    """The leaves below top-level key ``key`` of ``item`` as an item named ``key`` (paths below it); None if none.

    >>> import numpy as np
    >>> state = Item("default", "pytree", tree_leaves({"params": {"w": np.ones(2)}, "step": 3}, where="x"))
    >>> [leaf.name for leaf in part_of(state, "params").leaves], part_of(state, "opt") is None
    (['w'], True)
    """
    if any(leaf.row.sep != "/" for leaf in item.leaves):  # flat stored names (safetensors): no parts
        return None
    below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:]))
             for leaf in item.leaves if len(leaf.path) > 1 and leaf.path[0] == key]
    return dataclasses.replace(item, name=key, leaves=below) if below else None


def train_state_parts(name: str, item: Item, present: Sequence[str]) -> list[str] | None:
    """The top-level keys of an item that holds a whole train state (``params`` or T5X's ``target`` beside
    other keys: ``opt_state``, ``step``...), else None. Shown part by part, each counted for what it is.

    >>> import numpy as np
    >>> tree = {"step": 3, "opt_state": {"mu": {"w": np.ones(2)}}, "params": {"w": np.ones(2)}}
    >>> train_state_parts("default", Item("default", "pytree", tree_leaves(tree, where="x")), ["default"])
    ['params', 'opt_state', 'step']
    """
    if part_holder(present, "\0") != name or item.kind != "pytree":
        return None
    keys = top_level_keys(item)
    if len(keys) < 2 or not set(keys) & set(PARAM_SUBTREES[False]):
        return None
    if any(leaf.row.sep != "/" for leaf in item.leaves):
        return None
    return order_items(keys)


def params_item(source: Source, step: int | None, *, item: str | None = None, use_ema: bool = False) -> str:
    """The item that holds the parameters of one step.

    ``item`` when given (it must exist); else ``params`` (``params_ema`` with
    ``use_ema``; T5X: ``target``; Levanter, EasyDeL: ``model``); else the one item of a single-item step;
    else the one item holding a whole train state beside others (a ``best_fn``
    manager's ``metrics`` item).

    Raises:
      CheckpointNotFoundError: no such item, or none of these (the message lists the items).
    """
    names = source.item_names(step)
    if item is not None:
        if item not in names:
            raise source.missing_item(item, names, step)
        return item
    wanted = "params_ema" if use_ema else "params"
    if wanted in names:
        return wanted
    model = [n for n in MODEL_ITEMS if n in names]  # T5X: `target`; Levanter, EasyDeL: `model`
    if not use_ema and model:
        return model[0]
    if len(names) == 1:  # a single-tree file, or a standalone Orbax save (item `default`)
        return names[0]
    whole = [n for n in names if n in STATE_ITEMS]
    if len(whole) == 1:
        return whole[0]
    where = f"{source.path} (step {step})" if step is not None else source.path
    raise CheckpointNotFoundError(
        f"{where} has no item {wanted!r}; items present: {', '.join(names) or 'none'}; pass item=NAME."
    )


def params_of_step(source: Source, step: int | None, *, item: str | None = None, use_ema: bool = False) -> Item:
    """The parameters of one step as one item: ``params_item``'s item, narrowed by ``params_subtree``
    when it holds a whole train state (an item asked for by name is returned whole)."""
    name = params_item(source, step, item=item, use_ema=use_ema)
    found = source.snapshot(step, [name]).items[name]
    if item is None and name not in ("params", "params_ema", "model"):
        found = params_subtree(found, use_ema=use_ema)
    return found


def params_subtree(item: Item, *, use_ema: bool = False) -> Item:
    """The ``params`` (or EMA) subtree of an item holding a whole train state; the item itself when it has none.

    Leaves keep their ``key`` (the format's own name), so a format's hooks
    still find them; their paths lose the subtree's name.

    Raises:
      CheckpointNotFoundError: ``use_ema`` and the item holds no EMA parameters.

    >>> import numpy as np
    >>> state = tree_leaves({"params": {"w": np.ones(2)}, "step": 3}, where="x")
    >>> [leaf.name for leaf in params_subtree(Item("default", "pytree", state)).leaves]
    ['w']
    """
    if any(leaf.row.sep != "/" for leaf in item.leaves):  # flat stored names (safetensors): never split
        return item
    tops = [leaf.path[0] for leaf in item.leaves if len(leaf.path) > 1]
    for key in PARAM_SUBTREES[use_ema]:
        if key in tops:
            leaves = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:]))
                      for leaf in item.leaves if len(leaf.path) > 1 and leaf.path[0] == key]
            return dataclasses.replace(item, leaves=leaves)
    if use_ema:
        raise CheckpointNotFoundError(
            f"item `{item.name}` holds no EMA parameters (looked for {', '.join(PARAM_SUBTREES[True])}); "
            f"its top-level keys: {', '.join(dict.fromkeys(leaf.path[0] for leaf in item.leaves if leaf.path))}."
        )
    return item
