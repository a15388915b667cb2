"""Levanter checkpoints (stanford-crfm/levanter, haliax's TensorStore serialization), read without jax.

Levanter's ``Checkpointer`` saves step ``N`` of a run to ``<base_path>/step-N/``
(``checkpoints/<run_id>/step-N``; ``EpochCheckpointer`` to ``epoch-N/``):

* every array leaf of the trainer state is a zarr folder written by jax's
  ``GlobalAsyncCheckpointManager``, at its key path (``leaf_key_paths``: dict
  keys, indices, field names joined with ``.``) split into folders:
  ``model/transformer/blocks/stacked/attn/c_attn/weight``, ``opt_state/0/mu/...``,
  ``step``, ``training_key``; bfloat16 is stored as bfloat16;
* ``metadata.json`` = ``{"step", "timestamp", "is_temporary"}`` is written in the
  commit callback, after every array: it is the step's completion evidence. A
  ``step-N`` folder without it (a preempted save) is listed as incomplete and
  never read, as Levanter's own ``discover_latest_checkpoint`` skips it.

PATH is the run folder (its ``step-N`` folders are the steps; ``epoch-N``
folders are another series, read with ``--prefix epoch-``), one step folder,
or one item folder (``step-N/model``). ``save_checkpoint(tree, step, path)``
called alone (an export: ``save_checkpoint({"model": model}, 0,
"export/step-0")``) writes the same ``metadata.json`` beside ``model/`` but no
array at the step's top: read the same way, at ``export/``, ``export/step-0/``
and ``export/step-0/model/``. Each top-level entry of a step is an
item: ``model`` (the parameters, what ``load_parameters`` returns),
``opt_state``, ``step``, ``training_key``; an entry that is one array (``step``)
is an item of one leaf named like the item. Shapes and dtypes come from the
zarr headers; array data is read on request, one block at a time. Levanter
keeps no index of its leaves: a folder that ends without an array (one lost in
a partial copy) is a note in ``inspect`` and a problem in ``verify``.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._orbax_items import logical_paths
from treetools.checkpoint_io.formats._tensorstore import array_folders, subdirs, zarr_header, zarr_leaves
from treetools.checkpoint_io.leaves import Item, Snapshot, check_name
from treetools.checkpoint_io.readers import MemoryBudgetError
from treetools.checkpoint_io.source import Format, ItemLayout, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.steps import read_json_file
from treetools.checkpoint_io.storage import Storage, normalize
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError

METADATA_FILE = "metadata.json"
"""Written last, in the commit callback: the step is complete (Levanter's ``_save_metadata``)."""

STEP_NAMES = re.compile(r"^(?:step|epoch)-(?P<step>\d+)$")
"""``Checkpointer`` saves ``step-N``; ``EpochCheckpointer`` saves ``epoch-N`` (another series)."""

INDEX_FILES = ("tensorstore_index.json",)
"""Files of other formats that write ``metadata.json`` too (EasyDeL): a folder holding one is not Levanter's."""


def has_metadata(folder: str, storage: Storage) -> bool:
    """Whether the completion file ``metadata.json`` is there (a regular file)."""
    return storage.isfile(os.path.join(folder, METADATA_FILE))


def saved_metadata(storage: Storage, folder: str, *, keys: Sequence[str] = ("is_temporary",)) -> dict[str, Any]:
    """A step's ``saved_at`` (``metadata.json``'s ``timestamp``, in UTC) and the ``keys`` of it, as ``custom``."""
    try:
        meta = read_json_file(storage, os.path.join(folder, METADATA_FILE), what=f"{METADATA_FILE}")
    except (CheckpointError, CheckpointNotFoundError):
        return {}
    if not isinstance(meta, dict):
        return {}
    out: dict[str, Any] = {}
    try:  # isoformat(), local time without a zone (Levanter) or with one (EasyDeL)
        moment = datetime.datetime.fromisoformat(str(meta.get("timestamp")))
        out["saved_at"] = moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        pass
    custom = {k: meta[k] for k in keys if k in meta}
    if custom:
        out["custom"] = custom
    return out


def _is_array(storage: Storage, folder: str) -> bool:
    return zarr_header(storage, folder) is not None


def _other_format(storage: Storage, folder: str) -> bool:
    return any(storage.lexists(os.path.join(folder, f)) for f in INDEX_FILES)


PROBE_FOLDERS = 64
"""Folders looked into (breadth first) for a first zarr array below a step's entries: a claim stays cheap."""


def _holds_array(storage: Storage, folders: Sequence[str]) -> bool:
    """Whether a zarr array is at or below one of ``folders``, looking into at most ``PROBE_FOLDERS`` folders."""
    pending, seen = list(folders), 0
    while pending and seen < PROBE_FOLDERS:
        folder = pending.pop(0)
        seen += 1
        if _is_array(storage, folder):
            return True
        try:
            pending.extend(os.path.join(folder, d) for d in subdirs(storage, folder))
        except CheckpointError:
            continue
    return False


def _levanter_metadata(storage: Storage, folder: str) -> bool:
    """``metadata.json`` as Levanter's ``_save_metadata`` writes it: an object with ``step`` and ``timestamp``."""
    if not has_metadata(folder, storage):
        return False
    try:
        meta = read_json_file(storage, os.path.join(folder, METADATA_FILE), what=METADATA_FILE)
    except (CheckpointError, CheckpointNotFoundError):
        return False
    return isinstance(meta, dict) and "step" in meta and "timestamp" in meta


def _is_step(storage: Storage, folder: str) -> bool:
    """A Levanter step folder: ``metadata.json`` beside array folders, or a ``step-N`` folder holding arrays
    without it (a preempted save: claimed, to be refused as incomplete). A bare ``save_checkpoint({"model": m},
    step, path)`` export has no array at its top (``model/`` holds them, further down): its ``metadata.json``
    (``step``, ``timestamp``) says it is one."""
    if not storage.isdir(folder) or _other_format(storage, folder):
        return False
    try:
        children = [os.path.join(folder, d) for d in subdirs(storage, folder)]
    except CheckpointError:
        return False
    if not any(_is_array(storage, c) for c in children):  # the Checkpointer always saves `step` and `training_key`
        return bool(children) and _levanter_metadata(storage, folder) and _holds_array(storage, children)
    return has_metadata(folder, storage) or STEP_NAMES.match(os.path.basename(normalize(folder))) is not None


class LevanterSource(Source):
    """A Levanter run folder (``RootLayout``), one step folder (``StepLayout``), or one item folder of a step
    (``ItemLayout``)."""

    format = "levanter"
    layout: Layout

    def __init__(self, display: str, context: ReadContext, layout: Layout):
        super().__init__(display, context, layout=layout, names=STEP_NAMES, commit_rule=has_metadata,
                         prefer=("step-",))

    def item_names(self, step: int | None) -> list[str]:
        return self.layout.item_names(self.step_folder(step), lambda folder: subdirs(self.storage, folder))

    def _read(self, step: int | None, name: str, notes: list[str], problems: list[str] | None = None) -> Item:
        step_dir = self.step_folder(step)
        check_name(name, where=step_dir)
        folder = os.path.join(step_dir, name)
        arrays, empty = array_folders(self.storage, folder)
        for parts in empty:
            notes.append(f"{folder}: `{'/'.join(parts) or name}` is a folder without an array (no .zarray): "
                         "an array lost in a partial copy? Copy the whole step folder.")
        # Paths below the item; an item that is one array (`step`) is one leaf named like the item.
        named = logical_paths([parts or (name,) for parts, _ in arrays])  # no path ends in `/value`
        entries = [(path, "/".join((name, *parts)), header) for path, (parts, header) in zip(named, arrays)]
        leaves = zarr_leaves(self.context, step_dir, entries, where=folder, problems=problems)
        return Item(name, "pytree", [leaf for leaf in leaves if leaf is not None])

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        notes: list[str] = []
        items = {name: self._read(step, name, notes) for name in names}
        return Snapshot(step, items, metadata=saved_metadata(self.storage, self.step_folder(step)), notes=notes)

    def verify_metadata(self, step: int | None) -> tuple[list[Item], list[str]]:
        """Every item read leaf by leaf: an array that cannot be opened, or a folder that ends without an
        array, is a problem; the other arrays are still checked."""
        problems: list[str] = []
        items = []
        for name in self.item_names(step):
            try:
                item = self._read(step, name, problems, problems)
            except (MemoryBudgetError, StepDeletedError):
                raise
            except (CheckpointError, CheckpointNotFoundError) as e:
                problems.append(str(e))
                continue
            items.append(item)
        return items, problems


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    if not storage.isdir(path):
        return False
    if _is_step(storage, path):
        return True
    parent = os.path.dirname(normalize(path))
    if parent != normalize(path) and _is_step(storage, parent):  # an item folder of a step
        return True
    try:
        return any(STEP_NAMES.match(d) and _is_step(storage, os.path.join(path, d)) for d in subdirs(storage, path))
    except CheckpointError:
        return False


def _open(location: str, display: str, context: ReadContext) -> LevanterSource:
    storage = context.storage
    if _is_step(storage, location):
        if not has_metadata(location, storage):
            raise CheckpointError(f"{display}: incomplete save (no {METADATA_FILE}, which Levanter writes after "
                                  "every array); it is never read.")
        return LevanterSource(display, context, StepLayout(location))
    parent = os.path.dirname(normalize(location))
    if _is_step(storage, parent) and not any(STEP_NAMES.match(d) for d in subdirs(storage, location)):
        if not has_metadata(parent, storage):
            raise CheckpointError(f"{display}: part of an incomplete save (no {METADATA_FILE} in its step folder); "
                                  "it is never read.")
        return LevanterSource(display, context, ItemLayout(location, name=os.path.basename(normalize(location))))
    return LevanterSource(display, context, RootLayout(location))


FORMAT = Format(
    name="levanter",
    priority=47,
    claims=_claims,
    open=_open,
    description="a Levanter run folder of step-N/ folders (metadata.json, one zarr folder per leaf), a step "
                "folder or one of its items",
)
