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

Format-specific work that other code needs is a hook of ``Source`` with a
generic default (``verify_metadata``: a format's own consistency checks;
``series_of``: the series of steps ``--prefix`` names), so no code outside
a format branches on its name or reads its private state.

Importing this module imports no jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import stat as stat_
import time
from typing import Any, Callable, Iterator, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.items import part_holder, part_of, top_level_keys
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Leaf, Snapshot, UnreadProblem
from treetools.checkpoint_io.readers import MemoryBudgetError, missing_notes
from treetools.checkpoint_io.steps import StepListing, describe_series, parse_step, resolve_step
from treetools.checkpoint_io.storage import OutsideCheckpointError, Storage
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError

DELETION_CHECKS, DELETION_CHECK_PAUSE = 6, 0.05
"""After a failed read of a listed step: how many times (and how far apart, in seconds) ``Source.step_deleted``
asks whether the step is still committed before the failure counts as damage."""


class Source:
    """An opened checkpoint: what it is and which steps it has; metadata and data are read on demand.

    Formats subclass it and implement ``item_names`` and ``read_items``; a
    subclass's constructor hands ``path``, ``context`` and its ``listing`` to
    this one, and nothing is set on a source after it is built.

    Attributes:
      path: the path as the user gave it (shown in messages).
      context: how it is read (``ReadContext``: the storage confined to it, the memory budget, the block size);
        every reader it hands out reads with it.
      format: the format's name (``orbax``, ``safetensors``...).
      steps: committed steps of a checkpoint root, ascending; None for a single checkpoint.
      incomplete: names of unfinished saves (never read).
      deleting: those of ``incomplete`` being deleted (a manager pruning them; ``StepListing.deleting``).
      step: the step number of a single step folder, when its name says it.
    """

    format: str = "?"
    record_sharding: bool = False

    def __init__(self, path: str, context: ReadContext, *, listing: StepListing | None = None,
                 step: int | None = None):
        self.path = path
        self.context = context
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

    # -- hooks: a format's own way of doing something, with a generic default

    def default_item(self, step: int | None) -> str | None:
        """The item that holds the parameters when the format knows it better than the item names say (Flax
        checkpoints named by a metric, ``best_acc_0.625``: the one flax's ``latest_checkpoint`` picks); None: the
        generic rule of ``treetools.checkpoint_io.items.params_item``."""
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
    ``scandir``, ``open``, ``read_range``, and ``kvstore_spec`` for
    TensorStore), never ``os``: so it reads buckets too, and every read stays
    inside the checkpoint.
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
