"""Orbax checkpoints: CheckpointManager roots, step folders and item folders, read without jax or orbax.

Everything comes from the files Orbax writes:

* ``_CHECKPOINT_METADATA`` (a step): which items exist and their handlers
  (pytree or JSON), the save time, metrics and custom metadata;
* ``_METADATA`` (a pytree item): the key path of every leaf and its value type;
* ``_sharding``: the mesh axes and PartitionSpec each array was saved with;
* each array's zarr header, opened through TensorStore (in parallel, no array data).

So metadata inspection imports neither jax nor orbax. A box that an older
save wrote as a node (``kernel/value``, or nnx State saved by plain Orbax,
``raw_value`` in flax 0.8) is read as one leaf at the box's path: a trailing
``value``/``raw_value`` key that is its parent's only child is dropped.
Array data is read only on request, through TensorStore, one block at a time.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Sequence


from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._tensorstore import (
    Pins,
    first_line,
    subdirs,
)
from treetools.checkpoint_io.formats._ts_kvstore import kvstore_spec
from treetools.checkpoint_io.formats._orbax_items import (  # the items of a step; this module reads roots and steps
    _ORBAX_FILES,
    OCDBT_PROCESS_PREFIX,
    OrbaxItem,
    UnreadableItem,
    _is_item,
    _is_json_item,
    _item_without_metadata,
    _key_notes,
    _listed_item,
    _looks_like_step,
    _short,
    _step_is_item,
    _why_unreadable,
    read_item,
    special_item,
)
from treetools.checkpoint_io.items import MODEL_FILES
from treetools.checkpoint_io.leaves import (DEFAULT_ITEM, Item, Snapshot, Unreadable, UnreadProblem, check_name)
from treetools.checkpoint_io.readers import MemoryBudgetError, read_metadata
from treetools.checkpoint_io.source import Format, ItemLayout, Layout, RootLayout, Source, StepLayout
from treetools.checkpoint_io.storage import SpecialFileError, Storage, normalize
from treetools.checkpoint_io.steps import (
    COMMIT_SUCCESS_FILE,
    PYTREE_METADATA_FILE,
    STEP_METADATA_FILE,
    TMP_DIR_SUFFIX,
    is_committed,
    parse_step_name,
    tmp_step,
)
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, StepDeletedError



class OrbaxSource(Source):
    """An Orbax CheckpointManager root (``RootLayout``), one step folder (``StepLayout``), or one item folder
    (``ItemLayout``: an item of a step, or a standalone save, which is its own item)."""

    format = "orbax"
    record_sharding = True
    layout: Layout

    def __init__(self, display: str, context: ReadContext, layout: Layout):
        super().__init__(display, context, layout=layout)
        self._step_meta: dict[str, Any] = {}

    def item_dir(self, step: int | None, name: str) -> str:
        """The folder of one item of one step (the step folder itself when the step is one item)."""
        whole = self._whole_item(step)
        return whole if whole is not None else os.path.join(self.step_folder(step), name)

    def _whole_item(self, step: int | None) -> str | None:
        """The folder that is the whole of the step's one item: the item folder given, or a step folder that is
        itself the item (a Checkpointer's save per step); None when the step holds item folders."""
        return self.layout.whole_item(self.step_folder(step), self._step_is_item)

    def _step_is_item(self, step_dir: str) -> str | None:
        return step_dir if self.listing is not None and _step_is_item(self.storage, step_dir) else None

    def step_metadata(self, step_dir: str) -> dict[str, Any]:
        """The parsed ``_CHECKPOINT_METADATA`` of a step folder (read once per source), {} when absent."""
        if step_dir not in self._step_meta:
            path = os.path.join(step_dir, STEP_METADATA_FILE)
            meta = read_metadata(self.context, path, what=f"Orbax {STEP_METADATA_FILE}") if self.storage.lexists(path) else {}
            self._step_meta[step_dir] = meta if isinstance(meta, dict) else {}
        return self._step_meta[step_dir]

    def _handlers(self, step_dir: str) -> dict[str, str] | None:
        handlers = self.step_metadata(step_dir).get("item_handlers")
        return {str(k): str(v) for k, v in handlers.items()} if isinstance(handlers, dict) else None

    def item_names(self, step: int | None) -> list[str]:
        return self.layout.item_names(self.step_folder(step), self._listed_items)

    def _listed_items(self, step_dir: str) -> list[str]:
        if self._step_is_item(step_dir) is not None:
            return [DEFAULT_ITEM]
        handlers = self._handlers(step_dir)
        if handlers is not None:
            return sorted(handlers)
        return [d for d in subdirs(self.storage, step_dir) if TMP_DIR_SUFFIX not in d and _is_item(self.storage, os.path.join(step_dir, d))]

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        """Every item asked for, whatever handler wrote it (``read_item``); one that holds nothing treetools
        reads is listed in ``Snapshot.unreadable`` with its handler and the reason, never dropped."""
        notes: list[str] = []
        items: dict[str, Item] = {}
        unreadable: list[Unreadable] = []
        step_dir = self.step_folder(step)
        folder = self._whole_item(step)
        if folder is not None:
            (name,) = names
            try:
                items[name] = read_item(self.context, folder, name, handler=self._own_handler)
            except UnreadableItem as e:
                unreadable.append(e.unreadable)
            return Snapshot(step, items, record_sharding=True, metadata=self._metadata(folder), notes=notes,
                            unreadable=unreadable)
        handlers = self._handlers(step_dir) or {}
        if not handlers and list(names) == self.item_names(step):  # no item is left out without a word
            unreadable += [Unreadable(d, "no handler recorded", _why_unreadable(self.storage, os.path.join(step_dir, d)))
                           for d in subdirs(self.storage, step_dir)
                           if d not in _ORBAX_FILES and not d.startswith(OCDBT_PROCESS_PREFIX) and TMP_DIR_SUFFIX not in d
                           and not _is_item(self.storage, os.path.join(step_dir, d))]
        for name in names:
            check_name(name, where=os.path.join(step_dir, STEP_METADATA_FILE))
            item_dir = os.path.join(step_dir, name)
            if not self.storage.isdir(item_dir):
                gone = self.step_deleted(step)  # a manager pruning the step removes its item folders first
                if gone is not None:
                    raise gone
                unreadable.append(Unreadable(name, _short(handlers.get(name)) or "no handler recorded",
                                             f"listed in {STEP_METADATA_FILE} but it has no folder"))
                continue
            try:
                items[name] = read_item(self.context, item_dir, name, handler=handlers.get(name))
            except UnreadableItem as e:
                unreadable.append(e.unreadable)
                continue
            except SpecialFileError as e:  # a FIFO in this item: this item is not read, the others are
                unreadable.append(special_item(e, name, item_dir, handlers.get(name)))
                continue
            notes += _key_notes(self.storage, item_dir, name)
        return Snapshot(step, items, record_sharding=True, metadata=self._metadata(step_dir), notes=notes,
                        unreadable=unreadable)

    def _own_handler(self) -> str | None:
        """The handler of the item folder given directly, as its step's ``_CHECKPOINT_METADATA`` records it.

        The step folder is above the folder given: ``read_item`` asks only when the answer matters."""
        if self.layout.item is None:
            return None
        parent = os.path.dirname(normalize(self.location))
        return (self._handlers(parent) or {}).get(os.path.basename(normalize(self.location)))

    def _metadata(self, step_dir: str) -> dict[str, Any]:
        meta = self.step_metadata(step_dir)
        out: dict[str, Any] = {}
        ns = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs")
        if isinstance(ns, (int, float)) and 0 < ns < 2**62:  # a time of year 2116 at most: no overflow below
            moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC)
            out["saved_at"] = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
        custom = given if isinstance(given := meta.get("custom_metadata"), dict) else {}
        # save_checkpoint stores metrics in custom metadata: Orbax keeps its own field only with a best_fn.
        metrics = meta.get("metrics") or custom.get("metrics")
        if isinstance(metrics, dict) and metrics:
            out["metrics"] = metrics
        custom = {k: v for k, v in custom.items() if k != "metrics"}
        if custom:
            out["custom"] = custom
        return out


    # -- hooks

    def verify_metadata(self, step: int | None) -> tuple[list[Item], list[str]]:
        """Commit evidence of a step folder given directly; each item read leaf by leaf (a leaf whose array
        cannot be opened is a problem, the others are still checked); arrays ``_METADATA`` does not list."""
        problems: list[str] = []
        given = self.layout.given_step()
        if given is not None and not is_committed(given, self.storage):
            problems.append(f"{self.path}: no commit evidence (commit_success.txt or a committed "
                            "_CHECKPOINT_METADATA); the save may be unfinished.")
        try:
            names = self.item_names(step)
        except CheckpointError as e:
            return [], problems + [str(e)]
        items: list[Item] = []
        for name in names:
            item_dir = self.item_dir(step, name)
            try:
                item = read_item(self.context, item_dir, name, problems, handler=self._handler(step, name))
            except (MemoryBudgetError, StepDeletedError):
                raise
            except UnreadableItem as e:
                if _empty_folder(self.storage, item_dir):  # T5X's `dataset` without an iterator: nothing to check
                    gone = self.step_deleted(step)  # or a manager pruning the step, its files going first
                    if gone is not None:
                        raise gone from None
                    self._note_empty(step, name, e.unreadable.handler)
                else:
                    problems.append(UnreadProblem(f"{self._shown(step)}: {e}."))
                continue
            except SpecialFileError as e:  # a FIFO in this item (never opened): not read, rather than damaged
                problems.append(UnreadProblem(str(e)))
                items.append(Item(name, "pytree", []))
                continue
            except (CheckpointError, CheckpointNotFoundError) as e:
                problems.append(str(e))
                items.append(Item(name, "pytree", []))  # counted as checked, nothing to read
                continue
            items.append(item)
            if isinstance(item, OrbaxItem):
                problems += [p for p in _unlisted_arrays(self.context, item) if p not in problems]
                problems += _strangers(self.storage, item.folder, self._shown(step, name), expected=_item_entries(self.storage, item))
        if self._whole_item(step) is None:
            problems += self._strangers_in_step(step, names)
        return items, problems

    def _handler(self, step: int | None, name: str) -> Any:
        """The handler that wrote item ``name`` as its step records it: the item folder given asks its step's
        ``_CHECKPOINT_METADATA`` only when the answer matters (``_own_handler``, lazily)."""
        if self.layout.item is not None:
            return self._own_handler
        return (self._handlers(self.step_folder(step)) or {}).get(name)

    def _shown(self, step: int | None, item: str | None = None) -> str:
        """The folder of a step (or of one of its items) as the user would write it: below the path they gave."""
        parts = [self.path]
        if self.listing is not None and step is not None:  # a step found below the path given
            parts.append(os.path.basename(self.step_folder(step)))
        if item is not None and self._whole_item(step) is None:
            parts.append(item)
        return "/".join(p.rstrip("/") for p in parts)

    def _note_empty(self, step: int | None, name: str, handler: str) -> None:
        """A note (not a problem) for an item folder its writer left empty: nothing in it to check."""
        note = f"{self._shown(step, name)}: item `{name}` ({handler}) left empty by its writer: not checked."
        if note not in self.notes:
            self.notes.append(note)

    def _strangers_in_step(self, step: int | None, items: Sequence[str]) -> list[str]:
        """A problem naming what a committed step folder holds beside its items and Orbax's own files."""
        step_dir = self.step_folder(step)
        if self._handlers(step_dir) is not None:
            expected = set(items)
        else:  # no list of the step's items (Orbax before 0.6): any folder holding an item's files is one
            expected = {d for d in subdirs(self.storage, step_dir) if _is_item(self.storage, os.path.join(step_dir, d))
                        or _item_without_metadata(self.storage, os.path.join(step_dir, d))
                        or self.storage.lexists(os.path.join(step_dir, d, COMMIT_SUCCESS_FILE))}
        return _strangers(self.storage, step_dir, self._shown(step), expected=expected | _STEP_FILES)


_STEP_FILES = {STEP_METADATA_FILE, COMMIT_SUCCESS_FILE, "descriptor", "_ROOT_METADATA", "orbax.checkpoint",
               *MODEL_FILES}
"""What Orbax writes in a step folder beside the items (``descriptor``: the CompositeCheckpointHandler's; ``orbax.checkpoint``: the v1 API's marker), and a model's config kept with it (``items.MODEL_FILES``)."""


def _empty_folder(storage: Storage, folder: str) -> bool:
    """Whether ``folder`` is a folder holding nothing but Orbax's commit marker (an item its handler wrote nothing
    into: Orbax makes the folder and marks it committed)."""
    try:
        return storage.isdir(folder) and not set(storage.listdir(folder)) - {COMMIT_SUCCESS_FILE}
    except (OSError, CheckpointError):
        return False


def _item_entries(storage: Storage, item: OrbaxItem) -> set[str] | None:
    """What an OCDBT item folder may hold (None: not OCDBT, whose arrays are folders of their own names)."""
    if not item.metadata.get("use_ocdbt", storage.exists(os.path.join(item.folder, "manifest.ocdbt"))):
        return None
    # `checkpoint`: the aggregate msgpack of Orbax before 0.5; a model's config.json kept with its weights (a
    # `convert --preset` to Orbax writes it there)
    return _ORBAX_FILES | {"checkpoint", *MODEL_FILES}


def _strangers(storage: Storage, folder: str, shown: str, *, expected: set[str] | None) -> list[str]:
    """A problem when ``folder`` holds entries that are none of ``expected`` (nor an OCDBT process folder or an
    Orbax tmp name): files or folders something else wrote into a committed save (a run's --workdir inside it).
    ``expected`` None: nothing to check."""
    if expected is None:
        return []
    try:
        names = storage.listdir(folder)
    except OSError as e:
        return [f"{shown}: cannot list it ({e.strerror or e})."]
    extra = sorted(n for n in names if n not in expected and not n.startswith(OCDBT_PROCESS_PREFIX)
                   and TMP_DIR_SUFFIX not in n)
    if not extra:
        return []
    listed = ", ".join(f"`{n}`" for n in extra[:10]) + (", ..." if len(extra) > 10 else "")
    one = len(extra) == 1
    return [f"{shown}: holds {listed}, {'which is' if one else 'which are'} no item of this save and no file "
            f"Orbax writes; something else wrote into the committed save (a run's --workdir inside it?): move "
            f"{'it' if one else 'them'} out."]


def _relative(folder: str, base: str) -> str:
    """``folder`` (below ``base``) relative to ``base``, ``/``-separated (local or bucket paths)."""
    return normalize(folder)[len(normalize(base)) + 1:].replace(os.sep, "/")


def _stored_arrays(context: ReadContext, item_dir: str, use_ocdbt: bool) -> set[str]:
    """The arrays stored in an Orbax item folder: every zarr header (``<name>/.zarray``, ``<name>/zarr.json``)
    in the OCDBT store or the folder; a name may itself hold ``/`` (a dict key with a slash)."""
    storage = context.storage
    headers = (".zarray", "zarr.json")
    if use_ocdbt:
        import tensorstore as ts

        # the database checked and pinned, as for any read of it
        with Pins(storage, data=False, budget=context.memory_budget, where=item_dir) as pins:
            base = pins.folder(item_dir, ocdbt=True).path
            try:
                kv = ts.KvStore.open({"driver": "ocdbt", "base": kvstore_spec(storage, base)}).result()
                keys = [key.decode("utf-8", "replace") for key in kv.list().result()]
            except Exception as e:  # tensorstore: a corrupt database, named as the checkpoint names its folder
                raise CheckpointError(f"{item_dir}: cannot list the stored arrays "
                                      f"({pins.shown(first_line(e))}).") from None
        return {key.rsplit("/", 1)[0] for key in keys if "/" in key and key.rsplit("/", 1)[1] in headers}
    names = set()
    for top in storage.listdir(item_dir):
        if top in _ORBAX_FILES or not storage.isdir(os.path.join(item_dir, top)):
            continue
        for folder, _, files in storage.walk(os.path.join(item_dir, top)):
            if any(h in files for h in headers):
                names.add(_relative(folder, item_dir))
    return names


def _unlisted_arrays(context: ReadContext, item: OrbaxItem) -> list[str]:
    """A problem when the item folder stores arrays its ``_METADATA`` does not list."""
    storage = context.storage
    use_ocdbt = bool(item.metadata.get("use_ocdbt", storage.exists(os.path.join(item.folder, "manifest.ocdbt"))))
    try:
        extra = sorted(_stored_arrays(context, item.folder, use_ocdbt) - {leaf.key for leaf in item.leaves} - _listed(item))
    except CheckpointError as e:  # the database refused (outside the checkpoint, over the budget): said as such
        return [str(e)]
    except Exception as e:  # tensorstore: a corrupt manifest
        return [f"{item.folder}: cannot list the stored arrays ({first_line(e)})."]
    if not extra:
        return []
    return [f"{item.folder}: stores arrays its _METADATA does not list: {', '.join(extra[:10])}"
            f"{', ...' if len(extra) > 10 else ''}."]


def _listed(item: OrbaxItem) -> set[str]:
    """Every param name ``_METADATA`` lists (leaves left out of the view, such as skipped ones, included)."""
    tree = item.metadata.get("tree_metadata")
    if not isinstance(tree, dict):
        return set()
    out = set()
    for entry in tree.values():
        try:
            out.add(".".join(str(k["key"]) for k in entry["key_metadata"]))
        except (KeyError, TypeError):
            continue
    return out


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    if not storage.isdir(path):
        return False
    name = os.path.basename(path)
    if TMP_DIR_SUFFIX in name:
        return True
    if name.startswith(OCDBT_PROCESS_PREFIX) and _is_item(storage, os.path.dirname(path)):
        return False  # one process's part of an item's OCDBT database, no checkpoint of its own (its item is)
    if any(storage.lexists(os.path.join(path, f)) for f in (PYTREE_METADATA_FILE, STEP_METADATA_FILE)):
        return True
    if (_is_json_item(storage, path) or _looks_like_step(storage, path) or _item_without_metadata(storage, path)
            or _listed_item(storage, path)):
        return True
    # A root: some step folder (or Orbax tmp folder) with Orbax's own evidence in it.
    for child in subdirs(storage, path):
        if TMP_DIR_SUFFIX in child and tmp_step(child) is not None:
            return True
        if parse_step_name(child) is not None:
            folder = os.path.join(path, child)
            if storage.lexists(os.path.join(folder, COMMIT_SUCCESS_FILE)) or _looks_like_step(storage, folder):
                return True
    return False


def _open(location: str, display: str, context: ReadContext) -> OrbaxSource:
    storage = context.storage
    name = os.path.basename(location)
    if TMP_DIR_SUFFIX in name or (parse_step_name(name) is not None and _looks_like_step(storage, location)
                                  and not _is_item(storage, location) and not is_committed(location, storage)):
        raise CheckpointError(f"{display}: incomplete save (an Orbax tmp folder or no commit marker); it is never read.")
    if _is_item(storage, location) or _item_without_metadata(storage, location) or _listed_item(storage, location):
        # A standalone save (its own step metadata) is item `default` and must be committed; an item folder of a
        # manager's step (a single unnamed item is `<step>/default/`) is committed when its step folder is.
        standalone = storage.lexists(os.path.join(location, STEP_METADATA_FILE))
        name = "default" if standalone else os.path.basename(location) or "default"
        committed = (is_committed(location, storage) if standalone
                     else is_committed(os.path.dirname(location), storage))
        if name == "default" and not committed:
            raise CheckpointError(f"{display}: incomplete save (no commit marker); it is never read.")
        # No step number from the folder above: a standalone save's folder need not be a step.
        return OrbaxSource(display, context, ItemLayout(location, name=name, numbered=False))
    if _looks_like_step(storage, location):
        return OrbaxSource(display, context, StepLayout(location))
    return OrbaxSource(display, context, RootLayout(location))


FORMAT = Format(
    name="orbax",
    priority=50,
    claims=_claims,
    open=_open,
    description="an Orbax CheckpointManager root (step folders N, 000N, prefix_N), one step folder or item folder, "
                "a StandardCheckpointer or PyTreeCheckpointer save; Orbax 0.5 onward, OCDBT or not, zarr2 or zarr3",
)
