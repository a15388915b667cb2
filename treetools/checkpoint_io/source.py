"""The checkpoint layer's plug-in contract: a ``Format`` recognises a checkpoint and opens it as a ``Source``.

Every reader of a checkpoint, the library's ``load_parameters`` and
``restore_checkpoint`` as much as ``treetools inspect``/``diff``/``verify``,
opens it with ``open_source(path)`` (``treetools.checkpoint_io.opening``). A format is
one module under ``treetools/checkpoint_io/formats/`` exposing ``FORMAT = Format(name,
priority, claims, open)``, or a ``Format`` handed to ``register_format``:

* ``claims(location, context)`` is cheap and total (never raises) and needs
  positive evidence: a marker file, magic bytes, an index JSON.
* ``open(location, display, context)`` returns a ``Source``: the committed
  steps (None for a single checkpoint), the incomplete saves (listed, never
  read), and ``snapshot(step, items)``, which reads the metadata of only the
  items asked for and no array data. Each ``Leaf`` carries a ``Row`` (path
  tuple, shape, dtype, counts, sharding) and, for arrays, an ``ArrayReader``.

Both get the ``ReadContext`` (``treetools.checkpoint_io.context``) of the command: the
storage the checkpoint is read through (confined to it), the memory budget,
the block size. A format reads only through ``context.storage`` and gives the
context to every reader it makes.

A source opened at a folder says where that folder sits with a ``Layout``
given to ``Source.__init__``: a ``RootLayout`` (a folder of step folders,
listed once by the base with the format's step names and commit rule), a
``StepLayout`` (one step folder) or an ``ItemLayout`` (one item of a step).
The base decides the steps and the step number from it, and
``Source.step_folder(step)`` is the one step-folder rule of every format.

Format-specific work that other code needs is a hook of ``Source`` with a
generic default (``verify_metadata``: a format's own consistency checks;
``series_of``: the series of steps ``--prefix`` names), so no code outside
a format branches on its name or reads its private state.

Importing this module imports no jax.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import re
import stat as stat_
import time
from typing import Any, Callable, Iterator, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.items import (choose_params_item, item_argument, leaves_below, params_from, part_holder,
                                           part_of, top_level_keys)
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Leaf, Snapshot, UnreadProblem
from treetools.checkpoint_io.readers import MemoryBudgetError, missing_notes
from treetools.checkpoint_io.steps import (StepListing, describe_series, parse_step, parse_step_name, resolve_step,
                                           scan_steps)
from treetools.checkpoint_io.storage import OutsideCheckpointError, Storage, normalize
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError

DELETION_CHECKS, DELETION_CHECK_PAUSE = 6, 0.05
"""After a failed read of a listed step: how many times (and how far apart, in seconds) ``Source.step_deleted``
asks whether the step is still committed before the failure counts as damage."""


@dataclasses.dataclass(frozen=True)
class Layout(abc.ABC):
    """Where the path a format opened sits in a checkpoint: a root of step folders, one step folder, or one item
    of a step. Given to ``Source.__init__``, which lists the steps (``listing``), reads the step number
    (``step``) and finds a step's folder (``step_folder``) through it: no format branches on where it was
    opened.

    Attributes:
      location: the path opened (absolute, or a bucket URL).
    """

    location: str

    @abc.abstractmethod
    def listing(self, scan: Callable[[str], StepListing]) -> StepListing | None:
        """The steps below ``location`` listed by ``scan`` (a root), or None (a single step)."""

    @abc.abstractmethod
    def step(self, parse: Callable[[str], int | None]) -> int | None:
        """The step number of a single step, read from its folder's name by ``parse``; None for a root."""

    @abc.abstractmethod
    def step_folder(self, listing: StepListing | None, step: int | None) -> str:
        """The folder of step ``step``."""

    @property
    def item(self) -> str | None:
        """The name of the one item given directly (``ItemLayout``), else None."""
        return None

    def item_names(self, step_folder: str, listed: Callable[[str], list[str]]) -> list[str]:
        """The items of a step: ``listed(step_folder)``, the format's own listing; the item given for an item."""
        return listed(step_folder)

    def whole_item(self, step_folder: str, find: Callable[[str], str | None]) -> str | None:
        """Where a step that is one item keeps it (the path given, for an item; for a step, what ``find``
        finds in its folder: Orbax's step folder that is itself the item, T5X's ``checkpoint`` file), else None."""
        return find(step_folder)

    def given_step(self) -> str | None:
        """The step folder given directly (no listing checked that it is committed), else None."""
        return None


@dataclasses.dataclass(frozen=True)
class RootLayout(Layout):
    """A folder of step folders (a CheckpointManager root, a run folder): the steps are listed."""

    def listing(self, scan: Callable[[str], StepListing]) -> StepListing | None:
        return scan(self.location)

    def step(self, parse: Callable[[str], int | None]) -> int | None:
        return None

    def step_folder(self, listing: StepListing | None, step: int | None) -> str:
        return listing.folder(step) if listing is not None and step is not None else self.location


@dataclasses.dataclass(frozen=True)
class StepLayout(Layout):
    """One step folder given directly (or one tree without steps): its number, if any, is in its name."""

    def listing(self, scan: Callable[[str], StepListing]) -> StepListing | None:
        return None

    def step(self, parse: Callable[[str], int | None]) -> int | None:
        return parse(os.path.basename(normalize(self.location)))

    def step_folder(self, listing: StepListing | None, step: int | None) -> str:
        return self.location

    def given_step(self) -> str | None:
        return self.location


@dataclasses.dataclass(frozen=True)
class ItemLayout(Layout):
    """One item of a step given directly (an item folder, T5X's ``checkpoint`` file): the step folder is the
    one holding it.

    Attributes:
      name: the item's name.
      numbered: whether the step number is read from the name of the folder holding it (False where that
        folder need not be a step: an Orbax save that is its own item).
    """

    name: str = ""
    numbered: bool = True

    def listing(self, scan: Callable[[str], StepListing]) -> StepListing | None:
        return None

    def step(self, parse: Callable[[str], int | None]) -> int | None:
        return parse(os.path.basename(os.path.dirname(normalize(self.location)))) if self.numbered else None

    def step_folder(self, listing: StepListing | None, step: int | None) -> str:
        return os.path.dirname(normalize(self.location))

    @property
    def item(self) -> str | None:
        return self.name

    def item_names(self, step_folder: str, listed: Callable[[str], list[str]]) -> list[str]:
        return [self.name]

    def whole_item(self, step_folder: str, find: Callable[[str], str | None]) -> str | None:
        return self.location


class Source(abc.ABC):
    """An opened checkpoint: what it is and which steps it has; metadata and data are read on demand.

    An abstract base: formats subclass it and implement ``item_names`` and
    ``read_items`` (a subclass missing one cannot be built). A subclass's
    constructor hands ``path``, ``context`` and its ``Layout`` (or, for a
    source with no step folders, its ``listing``) to this one, and nothing is
    set on a source after it is built.

    Attributes:
      path: the path as the user gave it (shown in messages).
      context: how it is read (``ReadContext``: the storage confined to it, the memory budget, the block size);
        every reader it hands out reads with it.
      format: the format's name (``orbax``, ``safetensors``...).
      steps: committed steps of a checkpoint root, ascending; None for a single checkpoint.
      incomplete: names of unfinished saves (never read).
      deleting: those of ``incomplete`` being deleted (a manager pruning them; ``StepListing.deleting``).
      step: the step number of a single step folder, when its name says it.
      layout: where the path opened sits (``RootLayout``, ``StepLayout``, ``ItemLayout``); None for a source
        without step folders (a single file, a folder of step files).
    """

    format: str = "?"
    record_sharding: bool = False

    def __init__(self, path: str, context: ReadContext, *, layout: Layout | None = None,
                 names: re.Pattern[str] | None = None, commit_rule: Callable[[str, Any], bool] | None = None,
                 prefer: Sequence[str] | None = None, listing: StepListing | None = None, step: int | None = None):
        """``layout``: where the path opened sits; the steps of a root are listed with ``scan_steps`` and the
        format's step ``names`` (a pattern with a ``step`` group), ``commit_rule`` and preferred series
        (``prefer``), and a single step's number is read from its folder's name with the same ``names``.
        ``listing``/``step``: given directly by a source without a layout (a folder of step files)."""
        self.path = path
        self.context = context
        self.layout = layout
        if layout is not None:
            self.location = layout.location
            if listing is not None or step is not None:
                raise TypeError("Source: pass a layout or a listing and step, not both")
            named: dict[str, Any] = {"names": names} if names is not None else {}
            scanned = {**named, **({"commit_rule": commit_rule} if commit_rule is not None else {}),
                       **({"prefer": prefer} if prefer is not None else {})}
            listing = layout.listing(lambda root: scan_steps(root, storage=context.storage, **scanned))
            step = layout.step(lambda name: parse_step_name(name, **named))
        self.step = step
        if listing is not None and context.prefix is not None:
            listing = self.series_of(listing, context.prefix)
        elif listing is None and context.prefix is not None:
            raise CheckpointError(
                f"{path}: a single checkpoint, not a folder of step series; `prefix` (--prefix) picks one "
                "series of step folders or files in a folder that holds several: drop it, or point at that folder."
            )
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

    @abc.abstractmethod
    def item_names(self, step: int | None) -> list[str]:
        """The items of one step (cheap: names only)."""

    @abc.abstractmethod
    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        """The metadata of the named items of one step; reads no array data."""

    # -- shared

    def step_folder(self, step: int | None) -> str:
        """The folder of one step: a listed step's folder under a root, else the step folder given (or the one
        holding the item given). The one step-folder rule of every source built with a layout."""
        if self.layout is None:
            raise TypeError(f"{type(self).__name__} was built without a layout: it has no step folders")
        return self.layout.step_folder(self.listing, step)

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
        if any(not u.empty for u in snap.unreadable):  # an item of a step being pruned: the step went, not the item
            gone = self.step_deleted(resolved)
            if gone is not None:
                raise gone
        return snap

    @property
    def storage(self) -> Any:
        """What this checkpoint is read through (``context.storage``, confined to it)."""
        return self.context.storage

    @contextlib.contextmanager
    def reading(self, step: int | None) -> Iterator[None]:
        """Around any read of ``step``: an error because its folder went since the listing is a
        ``StepDeletedError``."""
        try:
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
            self.storage.forget(self.path)  # ask the bucket again, not what was listed
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
        found = dict(snap.items)
        if items is not None:
            gone = [n for n in names if n not in found]  # skipped by the reader: its folder went, or unreadable
            unreadable = {u.name: u for u in snap.unreadable}
            if gone and gone[0] in unreadable:
                where = f"{self.path} (step {resolved})" if resolved is not None else self.path
                raise CheckpointError(f"{where}: {unreadable[gone[0]].sentence()}.")
            if gone:
                raise self.missing_item(gone[0], list(found), resolved)
            for name, holder in parts.items():
                below = part_of(found[holder], name)
                if below is None:
                    keys = top_level_keys(found[holder])
                    shown = ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "")
                    raise self.missing_item(name, present, resolved, note=f"`{holder}` holds: {shown or 'nothing'}")
                found[name] = below
            found = {n: found[n] for n in dict.fromkeys(items)}
        return dataclasses.replace(snap, step=resolved, items=found, notes=self.notes + snap.notes)

    def missing_item(self, name: str, present: Sequence[str], step: int | None, *,
                     note: str | None = None) -> CheckpointNotFoundError:
        where = f"{self.path} (step {step})" if step is not None else self.path
        extra = f" {note[0].upper()}{note[1:]}." if note else ""
        return CheckpointNotFoundError(f"{where} has no item `{name}`; items: {', '.join(present) or 'none'}.{extra}")

    # -- the parameters: which item holds them (``treetools.checkpoint_io.items`` decides from what is read here)

    def params_item(self, step: int | None, *, item: str | None = None, use_ema: bool = False) -> str:
        """The item that holds the parameters of one step: ``item`` when given (it must exist), else
        ``items.choose_params_item`` over the step's items and this format's ``default_item``.

        Raises:
          CheckpointNotFoundError: no such item, or none holds them (the message lists the items).
        """
        names = self.item_names(step)
        if item is not None:
            if item not in names:
                raise self.missing_item(item, names, step)
            return item
        return choose_params_item(names, default=self.default_item(step), use_ema=use_ema, where=self._where(step))

    def find_params(self, step: int | None, *, item: str | None = None,
                    use_ema: bool = False) -> tuple[Item, str | None]:
        """The parameters of one step as one item, and a note saying which path they were taken from (None when
        the item is the parameters): ``params_item``'s item read, narrowed by ``items.params_from`` when it holds
        a whole train state; an item asked for by name (``item``: an item, a top-level key of the one item
        holding a whole state, or ``item/path``) is returned as named.

        Raises:
          CheckpointNotFoundError: no item holds them, or the item holds a train state whose parameters are none
            of the known places (the message lists the candidates with their sizes: pass item=).
        """
        if item is not None:
            return self._named_item(step, item), None
        name = self.params_item(step, use_ema=use_ema)
        found = self.snapshot(step, [name]).items[name]
        several = name == self.default_item(step) and len(self.item_names(step)) > 1
        return params_from(found, chosen_by_format=several, use_ema=use_ema, where=self._where(step))

    def _named_item(self, step: int | None, item: str) -> Item:
        """The item ``item`` names: an item, a top-level key of the one item holding a whole state, or
        ``item/path`` (the leaves below that path, named from there)."""
        names = self.item_names(step)
        name, under = item_argument(names, item)
        if name not in names and part_holder(names, name) is None:
            raise self.missing_item(item, names, step)
        found = self.snapshot(step, [name]).items[name]
        if under is None:
            return found
        below = leaves_below(found, under)
        if below is None:
            raise self.missing_item(item, names, step, note=f"`{name}` has nothing below `{under}`")
        return below

    def _where(self, step: int | None) -> str:
        return f"{self.path} (step {step})" if step is not None else self.path

    # -- hooks: a format's own way of doing something, with a generic default

    def default_item(self, step: int | None) -> str | None:
        """The item that holds the parameters when the format knows it better than the item names say (Flax
        checkpoints named by a metric, ``best_acc_0.625``: the one flax's ``latest_checkpoint`` picks); None: the
        generic rule of ``treetools.checkpoint_io.items.choose_params_item``."""
        return None

    def series_of(self, listing: StepListing, prefix: str) -> StepListing:
        """The step series named ``prefix`` of a root holding several (``ReadContext.prefix``, ``--prefix``).

        The default picks it from the ``StepListing`` (``StepListing.select``);
        a format whose listing holds every series needs nothing more.

        Raises:
          CheckpointError: no such series (the message lists them).
        """
        return listing.select(prefix, where=self.path)

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
        return list(snap.items.values()), [UnreadProblem(f"{self.path}: {u.sentence()}.") for u in snap.unreadable]


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it and how to open it.

    Attributes:
      name: short name shown to users (``orbax``, ``safetensors``).
      priority: formats are asked in descending priority; the first that claims a path opens it.
      claims: ``claims(location, context) -> bool``: cheap, total, positive evidence only.
      open: ``open(location, display, context) -> Source``: ``display`` is the path as the user gave it, for
        messages; the source is built with ``context`` and hands it to every reader it makes.
      description: what paths it reads, for the "not a checkpoint" error.
      suggest: ``suggest(location) -> bool``: whether a path it claims is named in a "did you mean" for a path
        beside it (None: always). A format that reads plain data files too (a lone ``.npy`` array) says no for them.
      structural: a reader by structure alone (any folder of zarr arrays, any msgpack stream), asked last: a
        folder such a reader claims is no evidence that a path below it lies inside a checkpoint, so the "not a
        checkpoint" diagnosis does not name it as the enclosing one.

    ``location`` is an absolute local path or a ``gs://`` / ``s3://`` URL. A
    format lists and reads only through ``context.storage`` (``isdir``,
    ``scandir``, ``open``, ``read_range``; TensorStore's key-value store of a
    folder from ``formats._ts_kvstore.kvstore_spec``), never ``os``: so it reads
    buckets too, and every read stays inside the checkpoint.
    """

    name: str
    priority: int
    claims: Callable[[str, ReadContext], bool]
    open: Callable[[str, str, ReadContext], Source]
    description: str = ""
    suggest: Callable[[str], bool] | None = None
    structural: bool = False


class FileSource(Source):
    """A single-file checkpoint (one tree, no steps): its leaves are item ``default``.

    ``--item NAME`` / ``items=[NAME]`` may also name a top-level key of the
    tree (a msgpack of a whole train state): its leaves keep the paths below it.
    ``positional``: the leaves are named by their index only (``Item.positional``).
    """

    def __init__(self, display: str, context: ReadContext, format: str, leaves: list[Leaf], *,
                 record_sharding: bool = False, positional: bool = False, notes: Sequence[str] = ()):
        super().__init__(display, context)
        self.notes += [*notes, *missing_notes(leaf.reader for leaf in leaves)]
        self.format = format
        self.record_sharding = record_sharding
        self.positional = positional
        self._leaves = leaves

    def item_names(self, step: int | None) -> list[str]:
        return [DEFAULT_ITEM]

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        return Snapshot(None, {name: Item(name, "pytree", list(self._leaves), positional=self.positional)
                               for name in names}, record_sharding=self.record_sharding)




def file_head(storage: Storage, path: str, n: int) -> bytes:
    """The first ``n`` bytes of a regular file (b"" for anything else): what ``claims`` functions sniff."""
    try:
        if not stat_.S_ISREG(storage.stat(path).st_mode):
            return b""
        return storage.read_range(path, 0, n)
    except OutsideCheckpointError:
        raise  # a link out of the checkpoint: refused, naming the opt-in, never taken as "not this format"
    except (OSError, CheckpointError):
        return b""
