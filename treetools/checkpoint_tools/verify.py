"""``verify_path``: is a checkpoint whole? Every problem found, never a write.

For the step asked (default: the latest committed one), through the same
checkpoint layer every other reader uses:

* commit evidence: a step folder given directly must be a finished save;
* metadata parses (step metadata, each item's metadata, file headers);
* every leaf's stored data is present and decodes, read chunk by chunk in
  bounded blocks (a missing or truncated chunk, a truncated file);
* the metadata and the stored arrays agree: the array a leaf names exists with
  the metadata's shape, and (Orbax) no stored array goes unlisted by the metadata;
* safetensors and npz offsets and sizes are consistent (checked when the header is read).

Problems are collected, not raised one at a time: ``VerifyReport.problems``
lists every one, each a sentence naming the file or leaf. ``verify_checkpoint``
checks one PATH (one step, or every committed step) and returns a
``VerifyResult``: its step reports, and the unfinished saves a root holds
(named, never read, and not damage).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.readers import MemoryBudgetError
from treetools.checkpoint_io.leaves import Item, UnreadProblem
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_io.stream import Failed, reduce_blocks
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError, StepDeletedError
from treetools.checkpoint_tools.options import VerifyOptions, resolve
from treetools.checkpoint_tools.progress import Progress
from treetools.shared.render import json_object

SCHEMA = 1
"""Version of ``verify``'s JSON object (``VerifyRun.to_json``; ``docs/json-schema.md``)."""


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What ``treetools verify`` found: counts of what was checked, and every problem."""

    path: str
    format: str
    step: int | None
    items: int = 0
    leaves: int = 0
    bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    unread: list[str] = dataclasses.field(default_factory=list)
    """With ``allow_unread``: the items that could not be read, one sentence each (listed, not problems; without
    it they are problems)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        where = f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")
        if self.ok:
            unread = (f"; {len(self.unread)} not read (--allow-unread)"
                      if self.unread else "")
            return (f"ok: {where}: {self.items} item(s), {self.leaves} leaves, {self.bytes:,} bytes read and "
                    f"decoded{unread}.")
        n = len(self.problems)
        return f"FAILED: {where}: {n} problem{'s' * (n != 1)} in {self.items} item(s), {self.leaves} leaves checked."

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "step": self.step, "ok": self.ok, "items": self.items,
                "leaves": self.leaves, "bytes": self.bytes, "problems": self.problems, "unread": self.unread}


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What ``treetools verify`` found at one PATH: a report per step checked, and the unfinished saves there.

    Attributes:
      path: the PATH as given.
      format: the format that read it (``?`` when its header could not be read at all).
      steps: the committed steps of a root, ascending; None for a single checkpoint.
      incomplete: unfinished saves of a root (tmp folders, no commit marker): named, never read, not damage.
      deleting: those of ``incomplete`` being deleted (their commit markers gone: a manager pruning them).
      reports: one ``VerifyReport`` per step checked (the step asked, or every committed one).
      notes: diagnostics for stderr: what the source leaves out (another step series, a weights file beside
        the one read, an unreadable entry) and a step pruned while it was checked.
      error: why nothing could be verified at this PATH (missing, not a checkpoint); None when it was read.
    """

    path: str
    format: str
    steps: list[int] | None = None
    incomplete: list[str] = dataclasses.field(default_factory=list)
    reports: list[VerifyReport] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    deleting: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every step checked is whole (unfinished saves do not count: they are not checkpoints yet)."""
        return self.error is None and all(r.ok for r in self.reports)

    def incomplete_line(self) -> str | None:
        """One line naming the unfinished saves and the steps being deleted, or None when there are none.

        >>> result = VerifyResult("run", "orbax", [2], ["1", "3.orbax-checkpoint-tmp-17"], deleting=["1"])
        >>> print(result.incomplete_line())
        incomplete: 1 unfinished save, not read (not damage): 3.orbax-checkpoint-tmp-17; 1 step being deleted (its
        commit markers are gone: a manager pruning it): 1
        """
        saving = [n for n in self.incomplete if n not in self.deleting]
        deleting = [n for n in self.incomplete if n in self.deleting]
        groups = []
        if saving:
            groups.append(f"{len(saving)} unfinished save{'s' * (len(saving) != 1)}")
        if deleting:
            one = len(deleting) == 1
            groups.append(f"{len(deleting)} step{'' if one else 's'} being deleted ({'its' if one else 'their'} commit "
                          f"markers are gone: a manager pruning {'it' if one else 'them'})")
        if not groups:
            return None
        names = [", ".join(n) for n in (saving, deleting) if n]
        first = f"incomplete: {groups[0]}, not read (not damage): {names[0]}"
        return first if len(groups) == 1 else f"{first}; {groups[1]}: {names[1]}"

    def to_json(self) -> dict[str, Any]:
        """This PATH's entry of the JSON object: the path, its steps and unfinished saves, one entry per step
        (``error`` only where nothing could be verified)."""
        out = {"path": self.path, "format": self.format, "steps": self.steps, "incomplete": self.incomplete,
               "deleting": self.deleting, "ok": self.ok,
               "checkpoints": [{k: v for k, v in r.to_json().items() if k not in ("path", "format")}
                               for r in self.reports]}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclasses.dataclass(frozen=True)
class VerifyRun:
    """What ``treetools verify PATH...`` found: one ``VerifyResult`` per PATH, in the order given."""

    results: list[VerifyResult]

    @property
    def ok(self) -> bool:
        """Every PATH was read and every step checked is whole: the CLI's exit code 0."""
        return all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        """``verify --format json``: one object for any number of PATHs and steps, ``"schema": SCHEMA``.

        >>> VerifyRun([VerifyResult("w.npz", "npz", reports=[VerifyReport("w.npz", "npz", None)])]).to_json()["ok"]
        True
        """
        return json_object(SCHEMA, {"ok": self.ok, "paths": [r.to_json() for r in self.results]})


def _read_leaves(items: list[Item], block_bytes: int, progress: bool | None) -> tuple[int, int, list[str]]:
    """Decode every block of every leaf of ``items`` once, on all cores (the block engine); count what came back:
    ``(leaves checked, bytes read, problems)``."""
    todo = []
    leaves = nbytes = 0
    problems: list[str] = []
    for item in items:
        for leaf in item.leaves:
            leaves += 1
            # A dtype of no bytes (jax's float0: the "gradient" of an integer leaf) stores nothing to read.
            reader = leaf.reader
            if reader is not None and reader.dtype.itemsize > 0:
                todo.append((item, leaf, reader))
    bar = Progress(sum(leaf.row.bytes for _, leaf, _ in todo), enabled=progress)
    try:
        counts = reduce_blocks([(reader,) for _, _, reader in todo], lambda j: [0], _count, block_bytes=block_bytes,
                               progress=bar, labels=[f"{item.name}/{leaf.name}" for item, leaf, _ in todo],
                               errors=(CheckpointError, OSError, ValueError))
    finally:
        bar.close()
    for (item, leaf, reader), parts in zip(todo, counts):
        if isinstance(parts, Failed):
            problems.append(f"{item.name}/{leaf.name}: stored data cannot be read ({parts.error}).")
            continue
        got, want = sum(p[0] for p in parts), math.prod(reader.shape)
        if got != want:
            problems.append(f"{item.name}/{leaf.name}: stored data holds {got:,} elements, metadata says {want:,}.")
        nbytes += got * reader.dtype.itemsize
    return leaves, nbytes, problems


def _count(count: list[int], index: Any, blocks: tuple[Any, ...]) -> None:
    count[0] += blocks[0].size


def verify_path(path: str, options: VerifyOptions | None = None, /, **fields: Any) -> VerifyReport:
    """Check one step of a checkpoint end to end; nothing is written.

    The format checks its metadata (``Source.verify_metadata``: Orbax adds
    commit evidence and arrays its ``_METADATA`` does not list); then every
    leaf's stored data is decoded in bounded blocks, each block once, on all
    cores (``treetools.checkpoint_io.stream.reduce_blocks``).

    Args:
      path: anything ``treetools inspect`` reads.
      options: a ``VerifyOptions`` (step, block_bytes, memory_budget).
      **fields: the same fields as keywords (``verify_path(path, step=100)``), over ``options``.

    Returns:
      A ``VerifyReport``; ``.ok`` is True when no problem was found.

    Raises:
      CheckpointNotFoundError: no such path or step.
      CheckpointError: not a checkpoint at all.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.ones(3))
    >>> verify_path(f).verdict().startswith("ok:")
    True
    """
    opts = resolve(VerifyOptions, options, fields)
    source = _open(path, opts.read_context())
    if isinstance(source, VerifyReport):
        return source
    return _verify(source, source.resolve(opts.step), opts)


def verify_steps(path: str, options: VerifyOptions | None = None, /,
                 **fields: Any) -> tuple[list[VerifyReport], list[str]]:
    """Check every committed step of a checkpoint root, from one listing (``treetools verify --step all``).

    A step a manager prunes while it is checked is not damage: it is left out,
    with a note naming it. A single checkpoint is checked as ``verify_path`` does.

    Returns:
      ``(one VerifyReport per step checked, notes)``.

    Raises:
      CheckpointError: every listed step went while it was checked, or not a checkpoint at all.
    """
    reports, notes, _ = _verify_steps(path, resolve(VerifyOptions, options, fields))
    return reports, notes


def _verify_steps(path: str, opts: VerifyOptions) -> tuple[list[VerifyReport], list[str], Source | VerifyReport]:
    """``verify_steps``, and the source it listed last (or the failed report of a damaged single file)."""
    notes: list[str] = []
    context = opts.read_context()
    for _ in range(3):  # every listed step pruned while checked (a fast manager): list again, a few times
        source = _open(path, context)
        if isinstance(source, VerifyReport):
            return [source], notes, source
        if source.steps is None:
            return [_verify(source, source.resolve(None), opts)], notes, source
        reports = []
        for step in source.steps:
            try:
                reports.append(_verify(source, step, opts))
            except StepDeletedError as e:
                notes.append(f"{e} Not verified.")
        if reports:
            return reports, notes, source
    raise CheckpointError(f"{source.path}: every listed step was deleted while it was being verified; run again.")


def verify_checkpoint(path: str, options: VerifyOptions | None = None, /, **fields: Any) -> VerifyResult:
    """Check one PATH: the step ``options.step`` names (None: the latest committed one; ``"all"``: every
    committed one, as ``verify_steps``), and name the unfinished saves of a root; nothing is written.

    Returns:
      A ``VerifyResult``; ``.ok`` is True when every step checked is whole.

    Raises:
      CheckpointNotFoundError: no such path or step.
      CheckpointError: not a checkpoint at all.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.ones(3))
    >>> r = verify_checkpoint(f); (r.ok, r.steps, r.incomplete, len(r.reports))
    (True, None, [], 1)
    """
    opts = resolve(VerifyOptions, options, fields)
    if opts.step == "all":
        reports, notes, source = _verify_steps(path, dataclasses.replace(opts, step=None))
    else:
        source = _open(path, opts.read_context())
        notes = []
        reports = [source if isinstance(source, VerifyReport) else _verify(source, source.resolve(opts.step), opts)]
    if isinstance(source, VerifyReport):  # a single file whose header is damaged
        return VerifyResult(path, source.format, None, [], reports, notes)
    # What the source leaves out, as inspect says it: another step series, a weights file beside the one read.
    notes = list(dict.fromkeys([*source.notes, *notes]))
    return VerifyResult(path, source.format, source.steps, list(source.incomplete), reports, notes,
                        deleting=list(source.deleting))


def _open(path: str, context: ReadContext) -> Source | VerifyReport:
    """The source at ``path``, or a failed report when a single-file format finds damage in its header."""
    try:
        return open_source(path, context)
    except (CheckpointNotFoundError, MemoryBudgetError, NotACheckpointError):  # nothing to check: an error line
        raise
    except CheckpointError as e:  # a single-file format reads its header at open: damage there is a problem too
        return VerifyReport(path, "?", None, problems=[str(e)])


def _verify(source: Source, step: int | None, opts: VerifyOptions) -> VerifyReport:
    with source.reading(step):  # a step pruned while it is read: named as such
        items, problems = source.verify_metadata(step)
    unread: list[str] = []
    if opts.allow_unread:  # listed, not failed: what was read is checked as usual
        unread = [str(p) for p in problems if isinstance(p, UnreadProblem)]
        problems = [p for p in problems if not isinstance(p, UnreadProblem)]
    leaves, nbytes, damaged = _read_leaves(items, source.context.block_bytes, opts.progress)
    report = VerifyReport(source.path, source.format, step, items=len(items), leaves=leaves, bytes=nbytes,
                          problems=[str(p) for p in problems] + damaged, unread=unread)
    gone = source.step_deleted(step) if report.problems else None
    if gone is not None:  # pruned while it was checked: not damage
        raise gone
    return report
