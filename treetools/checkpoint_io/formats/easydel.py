"""EasyDeL checkpoints (erfanzar/EasyDeL through eformer's TensorStore serialization), read without jax.

``model.save_pretrained(dir)`` writes ``config.json``, then the model's
parameters through eformer's ``tree_serialize_leaves(dir, params, prefix="model")``:

* every array is a zarr folder written by jax's ``GlobalAsyncCheckpointManager``
  at its key path joined with ``.`` under the prefix and split into folders
  (``model/model/layers/0/self_attn/q_proj/kernel``);
* ``tensorstore_index.json`` = ``{"format": "tensorstore", "version",
  "prefixes": {prefix: [{"path", "shape", "dtype"}]}}`` lists them (one file for
  every prefix saved in the folder; an unprefixed save lists ``"arrays"``);
* ``<prefix>_structure.json`` holds the tree's structure as a *pickled* treedef:
  treetools never reads it (unpickling runs code from the file).

A trainer saves step ``N`` to ``<save_directory>/run-N/``: the optimizer state
under the prefix ``tx``, the model as above, and last ``metadata.json``
(``{"step", "timestamp", "is_temporary", ...}``): a ``run-N`` folder without it
did not finish; it is listed as incomplete and never read.

PATH is a ``save_pretrained`` folder (one checkpoint, no steps), a trainer's
save folder (its ``run-N`` folders are the steps), one ``run-N`` folder, or the
``tensorstore_index.json`` of one of these checkpoint folders (its folder is read). The
items are the index's prefixes: ``model`` (the parameters, what
``load_parameters`` returns) and ``tx``; leaf paths are the index paths below
the prefix. Each entry's shape and dtype are checked against its zarr header;
array data is read on request, one block at a time.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._orbax_items import logical_paths
from treetools.checkpoint_io.formats._tensorstore import array_folders, subdirs, zarr_header, zarr_leaves
from treetools.checkpoint_io.formats.levanter import METADATA_FILE, has_metadata, saved_metadata
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Snapshot, check_name
from treetools.checkpoint_io.readers import np_dtype
from treetools.checkpoint_io.source import Format, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.steps import read_json_file
from treetools.checkpoint_io.storage import Storage, normalize
from treetools.shared.errors import CheckpointError

INDEX_FILE = "tensorstore_index.json"
RUN_NAMES = re.compile(r"^run-(?P<step>\d+)$")
"""``TrainingArguments._get_save_directory_milestone``: ``run-{step}``."""
TRAINER_FILE = "easydel-training-arguments.json"
"""Written first by a trainer save: a folder holding it is a step, complete only with ``metadata.json``."""


def _index(storage: Storage, folder: str) -> dict[str, Any] | None:
    """The parsed ``tensorstore_index.json`` of a folder, None when it is not eformer's."""
    path = os.path.join(folder, INDEX_FILE)
    if not storage.isfile(path):
        return None
    try:
        index = read_json_file(storage, path, what=f"EasyDeL {INDEX_FILE}")
    except CheckpointError:
        return None
    return index if isinstance(index, dict) and index.get("format") == "tensorstore" else None


def _entries(index: dict[str, Any], where: str) -> dict[str, list[dict[str, Any]]]:
    """Item name -> its index entries: each prefix, or ``default`` for an unprefixed save's ``arrays``."""
    prefixes = index.get("prefixes")
    out = dict(prefixes) if isinstance(prefixes, dict) else {}
    if isinstance(index.get("arrays"), list):
        out[DEFAULT_ITEM] = index["arrays"]
    if not out or not all(isinstance(v, list) and all(isinstance(e, dict) for e in v) for v in out.values()):
        raise CheckpointError(f"{where}: corrupt EasyDeL {INDEX_FILE} (no `prefixes` of array lists).")
    return {str(k): v for k, v in out.items()}


def _is_trainer_save(storage: Storage, folder: str) -> bool:
    name = os.path.basename(normalize(folder))
    return RUN_NAMES.match(name) is not None or storage.lexists(os.path.join(folder, TRAINER_FILE))


class EasyDeLSource(Source):
    """An EasyDeL trainer save folder (``RootLayout``, ``run-N`` steps) or one checkpoint folder (``StepLayout``)."""

    format = "easydel"
    layout: Layout

    def __init__(self, display: str, context: ReadContext, layout: Layout):
        self._indexes: dict[str, dict[str, list[dict[str, Any]]]] = {}
        super().__init__(display, context, layout=layout, names=RUN_NAMES, commit_rule=has_metadata,
                         prefer=("run-",))

    def _items(self, step: int | None) -> dict[str, list[dict[str, Any]]]:
        """The step's index, parsed once."""
        folder = self.step_folder(step)
        if folder not in self._indexes:
            path = os.path.join(folder, INDEX_FILE)
            index = read_json_file(self.storage, path, what=f"EasyDeL {INDEX_FILE}")
            if not isinstance(index, dict):
                raise CheckpointError(f"{path}: corrupt EasyDeL {INDEX_FILE} (not an object).")
            self._indexes[folder] = _entries(index, path)
        return self._indexes[folder]

    def item_names(self, step: int | None) -> list[str]:
        listed = list(self._items(step))
        return listed + [d for d in self._unindexed_folders(step) if d not in listed]

    def _unindexed_folders(self, step: int | None) -> list[str]:
        """Top-level folders of the checkpoint holding zarr arrays that no index prefix names (a prefix whose
        index entry a later save overwrote): items too, read from the arrays themselves."""
        folder = self.step_folder(step)
        listed = self._items(step)
        out = []
        for d in subdirs(self.storage, folder):
            if d in listed or (DEFAULT_ITEM in listed and any(
                    str(e.get("path", "")).replace("\\", "/").split("/")[0] == d for e in listed[DEFAULT_ITEM])):
                continue
            arrays, _ = array_folders(self.storage, os.path.join(folder, d))
            if arrays:
                out.append(d)
        return out

    def _unlisted(self, folder: str, name: str, entries: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], str, str]]:
        """The arrays stored under the prefix folder ``name`` that its index entries do not list:
        ``(leaf path, relative folder, header)``, read from their zarr headers."""
        if name == DEFAULT_ITEM or not self.storage.isdir(os.path.join(folder, name)):
            return []
        listed = {str(e.get("path", "")).replace("\\", "/").strip("/") for e in entries}
        arrays, _ = array_folders(self.storage, os.path.join(folder, name))
        return [(parts, "/".join((name, *parts)), header) for parts, header in arrays
                if parts and "/".join((name, *parts)) not in listed]

    def _read(self, folder: str, name: str, entries: list[dict[str, Any]], problems: list[str] | None,
              notes: list[str] | None = None) -> Item:
        where = os.path.join(folder, INDEX_FILE)
        arrays = []
        for entry in entries:
            rel = str(entry.get("path", "")).replace("\\", "/").strip("/")
            check_name(rel, where=where)
            parts = tuple(rel.split("/"))
            if name != DEFAULT_ITEM and parts[0] == name and len(parts) > 1:
                parts = parts[1:]
            header = zarr_header(self.storage, os.path.join(folder, rel))
            if not rel or header is None:
                message = (f"{where}: `{'/'.join(parts)}` is listed at {rel!r}, which holds no zarr array; the "
                           "folder was copied in part: copy it whole.")
                if problems is None:
                    raise CheckpointError(message)
                problems.append(message)
                continue
            arrays.append((parts, rel, header, entry))
        extra = self._unlisted(folder, name, entries)
        if extra and notes is not None:
            notes.append(
                f"{where}: {len(extra)} array(s) under `{name}/` are not in the index ({', '.join('/'.join(p) for p, _, _ in extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''}); read from their zarr headers.")
        arrays = arrays + [(p, rel, h, {}) for p, rel, h in extra]
        # A box the save wrote as a node (the optimizer's moments of nnx `Param`s: `.../kernel/value`) is one leaf
        # at the box's path, as the params beside it (saved as a pure dict) are: no path ends in `/value`.
        named = logical_paths([parts for parts, _, _, _ in arrays])
        leaves = zarr_leaves(self.context, folder, [(p, rel, h) for p, (_, rel, h, _) in zip(named, arrays)],
                             where=folder, problems=problems)
        out = []
        for (parts, rel, _, entry), leaf in zip(arrays, leaves):
            if leaf is None:  # recorded in `problems`
                continue
            shape, dtype = entry.get("shape"), entry.get("dtype")
            try:
                same = (shape is None or tuple(int(d) for d in shape) == leaf.row.shape) and (
                    dtype is None or np_dtype(str(dtype)).name == leaf.row.dtype)
            except (TypeError, ValueError, AttributeError, OverflowError):  # OverflowError: a shape of 1e999
                same = False
            if not same:
                listed = f"{dtype}{list(shape) if isinstance(shape, list) else shape!r}"[:200]
                message = (f"{where}: `{'/'.join(parts)}` is listed as {listed} but its zarr "
                           f"array {rel!r} is {leaf.row.dtype}{list(leaf.row.shape or [])}; the folder mixes two saves.")
                if problems is None:
                    raise CheckpointError(message)
                problems.append(message)
                continue
            out.append(leaf)
        return Item(name, "pytree", out)

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        folder = self.step_folder(step)
        notes: list[str] = []
        items = {name: self._read(folder, name, self._items(step).get(name, []), None, notes) for name in names}
        metadata = (saved_metadata(self.storage, folder, keys=("is_temporary", "has_optimizer_state"))
                    if has_metadata(folder, self.storage) else {})
        return Snapshot(step, items, metadata=metadata, notes=notes)

    def verify_metadata(self, step: int | None) -> tuple[list[Item], list[str]]:
        """Every index entry checked: a missing array or one that disagrees with the index is a problem, and the
        other arrays are still read; a trainer save given directly needs its ``metadata.json``."""
        problems: list[str] = []
        folder = self.step_folder(step)
        given = self.layout.given_step()  # a listed step's metadata was checked by the listing
        if given is not None and _is_trainer_save(self.storage, given) and not has_metadata(given, self.storage):
            problems.append(f"{self.path}: no {METADATA_FILE} (EasyDeL writes it last); the save may be unfinished.")
        try:
            index = self._items(step)
        except CheckpointError as e:
            return [], problems + [str(e)]
        items = [self._read(folder, name, index.get(name, []), problems) for name in self.item_names(step)]
        return items, problems


def _index_file(storage: Storage, path: str) -> bool:
    """``path`` is the ``tensorstore_index.json`` of a checkpoint folder (given as PATH: the folder is read)."""
    return (os.path.basename(normalize(path)) == INDEX_FILE and storage.isfile(path)
            and _index(storage, os.path.dirname(normalize(path))) is not None)


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    if _index_file(storage, path):
        return True
    if not storage.isdir(path):
        return False
    if _index(storage, path) is not None:
        return True
    try:
        return any(RUN_NAMES.match(d) and _index(storage, os.path.join(path, d)) is not None for d in subdirs(storage, path))
    except CheckpointError:
        return False


def _open(location: str, display: str, context: ReadContext) -> EasyDeLSource:
    storage = context.storage
    if _index_file(storage, location):  # the index given as PATH: the checkpoint it indexes, its folder
        location = os.path.dirname(normalize(location))
    if _index(storage, location) is None:
        return EasyDeLSource(display, context, RootLayout(location))
    if _is_trainer_save(storage, location) and not has_metadata(location, storage):
        raise CheckpointError(f"{display}: incomplete save (an EasyDeL trainer save without {METADATA_FILE}, which "
                              "it writes last); it is never read.")
    return EasyDeLSource(display, context, StepLayout(location))


FORMAT = Format(
    name="easydel",
    priority=48,  # before levanter (47): a trainer's run-N folder holds a metadata.json too
    claims=_claims,
    open=_open,
    description="an EasyDeL save_pretrained folder (tensorstore_index.json, zarr arrays), a trainer's save folder "
                "of run-N/ folders, or one of them",
)
