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
lists every one, each a sentence naming the file or leaf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from treetools.ckpt.readers import MemoryBudgetError
from treetools.ckpt.source import Item, Source, open_source
from treetools.ckpt.stream import Failed, reduce_blocks
from treetools.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError
from treetools.inspect.options import VerifyOptions, resolve
from treetools.inspect.progress import Progress


@dataclasses.dataclass
class VerifyReport:
    """What ``treetools verify`` found: counts of what was checked, and every problem."""

    path: str
    format: str
    step: int | None
    items: int = 0
    leaves: int = 0
    bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        where = f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")
        if self.ok:
            return f"ok: {where}: {self.items} item(s), {self.leaves} leaves, {self.bytes:,} bytes read and decoded."
        n = len(self.problems)
        return f"FAILED: {where}: {n} problem{'s' * (n != 1)} in {self.items} item(s), {self.leaves} leaves checked."

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "step": self.step, "ok": self.ok, "items": self.items,
                "leaves": self.leaves, "bytes": self.bytes, "problems": self.problems}


def _read_leaves(items: list[Item], report: VerifyReport, chunk_bytes: int, progress: bool | None) -> None:
    """Decode every block of every leaf of ``items`` once, on all cores (the block engine); count what came back."""
    todo = []
    for item in items:
        for leaf in item.leaves:
            report.leaves += 1
            if leaf.reader is not None:
                todo.append((item, leaf))
    bar = Progress(sum(leaf.row.bytes for _, leaf in todo), enabled=progress)
    try:
        counts = reduce_blocks([(leaf.reader,) for _, leaf in todo], lambda j: [0], _count, chunk_bytes=chunk_bytes,
                               progress=bar, labels=[f"{item.name}/{leaf.name}" for item, leaf in todo],
                               errors=(CheckpointError, OSError, ValueError))
    finally:
        bar.close()
    for (item, leaf), parts in zip(todo, counts):
        if isinstance(parts, Failed):
            report.problems.append(f"{item.name}/{leaf.name}: stored data cannot be read ({parts.error}).")
            continue
        got, want = sum(p[0] for p in parts), math.prod(leaf.reader.shape)
        if got != want:
            report.problems.append(f"{item.name}/{leaf.name}: stored data holds {got:,} elements, metadata says {want:,}.")
        report.bytes += got * leaf.reader.dtype.itemsize


def _count(count: list[int], index: Any, blocks: tuple[Any, ...]) -> None:
    count[0] += blocks[0].size


def verify_path(path: str, options: VerifyOptions | None = None, /, **fields: Any) -> VerifyReport:
    """Check one step of a checkpoint end to end; nothing is written.

    The format checks its metadata (``Source.verify_metadata``: Orbax adds
    commit evidence and arrays its ``_METADATA`` does not list); then every
    leaf's stored data is decoded in bounded blocks, each block once, on all
    cores (``treetools.ckpt.stream.reduce_blocks``).

    Args:
      path: anything ``treetools inspect`` reads.
      options: a ``VerifyOptions`` (step, chunk_bytes, memory_budget).
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
    source = _open(path, opts)
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
    opts = resolve(VerifyOptions, options, fields)
    notes: list[str] = []
    for _ in range(3):  # every listed step pruned while checked (a fast manager): list again, a few times
        source = _open(path, opts)
        if isinstance(source, VerifyReport):
            return [source], notes
        if source.steps is None:
            return [_verify(source, source.resolve(None), opts)], notes
        reports = []
        for step in source.steps:
            try:
                reports.append(_verify(source, step, opts))
            except StepDeletedError as e:
                notes.append(f"{e} Not verified.")
        if reports:
            return reports, notes
    raise CheckpointError(f"{source.path}: every listed step was deleted while it was being verified; run again.")


def _open(path: str, opts: VerifyOptions) -> Source | VerifyReport:
    """The source at ``path``, or a failed report when a single-file format finds damage in its header."""
    try:
        return open_source(path, memory_budget=opts.memory_budget, prefix=opts.prefix)
    except (CheckpointNotFoundError, MemoryBudgetError):
        raise
    except CheckpointError as e:  # a single-file format reads its header at open: damage there is a problem too
        report = VerifyReport(path, "?", None)
        report.problems.append(str(e))
        return report


def _verify(source: Source, step: int | None, opts: VerifyOptions) -> VerifyReport:
    report = VerifyReport(source.path, source.format, step)
    with source.reading(step):  # the metadata read under the source's budget; a pruned step named as such
        items, problems = source.verify_metadata(step)
    report.problems += problems
    report.items += len(items)
    _read_leaves(items, report, opts.block_bytes, opts.progress)
    gone = source.step_deleted(step) if report.problems else None
    if gone is not None:  # pruned while it was checked: not damage
        raise gone
    return report
