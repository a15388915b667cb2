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
import os
from typing import Any

from treetools import storage
from treetools.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError
from treetools.inspect.arrays import DEFAULT_CHUNK_BYTES, MemoryBudgetError
from treetools.inspect.source import Item, open_source

__all__ = ["VerifyReport", "verify_path"]

_ORBAX_FILES = {"_METADATA", "_sharding", "_CHECKPOINT_METADATA", "commit_success.txt", "array_metadatas", "d",
                "manifest.ocdbt", "descriptor", "metadata"}


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


def _read_leaves(item: Item, report: VerifyReport, chunk_bytes: int) -> None:
    for leaf in item.leaves:
        report.leaves += 1
        reader = leaf.reader
        if reader is None:
            continue
        want = math.prod(reader.shape)
        got = 0
        try:
            for block in reader.storage_blocks(chunk_bytes):
                got += block.size
        except MemoryBudgetError:
            raise  # not damage: the one-line error names the flag that raises the budget
        except (CheckpointError, OSError, ValueError) as e:
            report.problems.append(f"{item.name}/{leaf.name}: stored data cannot be read ({e}).")
            continue
        if got != want:
            report.problems.append(f"{item.name}/{leaf.name}: stored data holds {got:,} elements, metadata says {want:,}.")
        report.bytes += got * reader.dtype.itemsize


def _relative(folder: str, base: str) -> str:
    """``folder`` relative to ``base``, ``/``-separated (local or bucket paths)."""
    if storage.is_remote(folder):
        return storage.normalize(folder)[len(storage.normalize(base)) + 1:]
    return os.path.relpath(folder, base).replace(os.sep, "/")


def _orbax_unlisted(item_dir: str, listed: set[str], use_ocdbt: bool) -> list[str]:
    """Arrays stored in an Orbax item folder that its ``_METADATA`` does not list.

    An array is a zarr header (``<name>/.zarray``, ``<name>/zarr.json``) in the
    OCDBT store or the folder; a name may itself hold ``/`` (a dict key with a slash).
    """
    headers = (".zarray", "zarr.json")
    if use_ocdbt:
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "ocdbt", "base": storage.kvstore_spec(item_dir)}).result()
        keys = [key.decode("utf-8", "replace") for key in kv.list().result()]
        names = {key.rsplit("/", 1)[0] for key in keys if "/" in key and key.rsplit("/", 1)[1] in headers}
    else:
        names = set()
        for top in storage.listdir(item_dir):
            if top in _ORBAX_FILES or not storage.isdir(os.path.join(item_dir, top)):
                continue
            for folder, _, files in storage.walk(os.path.join(item_dir, top)):
                if any(h in files for h in headers):
                    names.add(_relative(folder, item_dir))
    return sorted(names - listed)


def _verify_orbax_item(source: Any, step: int | None, name: str, report: VerifyReport, chunk_bytes: int) -> None:
    from treetools.inspect.formats import orbax

    item_dir = source.item_dir(step, name)
    found: list[str] = []
    try:
        if orbax.is_json_item(item_dir):
            item = orbax.read_json_item(item_dir, name)
        else:
            item = orbax.read_pytree_item(item_dir, name, problems=found)
    except (CheckpointError, CheckpointNotFoundError) as e:
        report.problems.append(str(e))
        return
    report.problems += found
    _read_leaves(item, report, chunk_bytes)
    if item.kind == "pytree":
        meta = item.handle.metadata
        use_ocdbt = bool(meta.get("use_ocdbt", storage.exists(os.path.join(item_dir, "manifest.ocdbt"))))
        try:
            extra = _orbax_unlisted(item_dir, set(item.handle.logical), use_ocdbt)
        except Exception as e:  # tensorstore: a corrupt manifest
            report.problems.append(f"{item_dir}: cannot list the stored arrays ({str(e).splitlines()[0]}).")
            return
        if extra:
            report.problems.append(f"{item_dir}: stores arrays its _METADATA does not list: {', '.join(extra[:10])}"
                                   f"{', ...' if len(extra) > 10 else ''}.")


def verify_path(path: str, *, step: int | str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> VerifyReport:
    """Check one step of a checkpoint end to end; nothing is written.

    Args:
      path: anything ``treetools inspect`` reads.
      step: the step of a checkpoint root (default: the latest committed one).
      chunk_bytes: the block budget for reading the arrays.

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
    from treetools.steps import is_committed

    try:
        source = open_source(path)
    except (CheckpointNotFoundError, MemoryBudgetError):
        raise
    except CheckpointError as e:  # a single-file format reads its header at open: damage there is a problem too
        report = VerifyReport(path, "?", None)
        report.problems.append(str(e))
        return report
    resolved = source.resolve(step)
    report = VerifyReport(source.path, source.format, resolved)
    if source.format == "orbax":
        if source.mode == "step" and not is_committed(source.local):
            report.problems.append(f"{source.path}: no commit evidence (commit_success.txt or a committed "
                                   "_CHECKPOINT_METADATA); the save may be unfinished.")
        try:
            names = source.item_names(resolved)
        except CheckpointError as e:
            report.problems.append(str(e))
            names = []
        for name in names:
            report.items += 1
            _verify_orbax_item(source, resolved, name, report, chunk_bytes)
    else:
        try:
            snap = source.snapshot(resolved)
        except (MemoryBudgetError, StepDeletedError):
            raise
        except (CheckpointError, CheckpointNotFoundError) as e:  # corrupt: a problem of this step, not the end
            report.problems.append(str(e))
        else:
            for item in snap.items.values():
                report.items += 1
                _read_leaves(item, report, chunk_bytes)
    gone = source.step_deleted(resolved) if report.problems else None
    if gone is not None:  # pruned while it was checked: not damage
        raise gone
    return report
