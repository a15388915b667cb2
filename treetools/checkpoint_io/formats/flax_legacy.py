"""Flax's legacy ``flax.training.checkpoints.save_checkpoint`` in msgpack mode: a folder of ``checkpoint_<N>`` files.

With ``flax.config.flax_use_orbax_checkpointing`` off, ``save_checkpoint(dir,
target, step, prefix="checkpoint_")`` writes ``flax.serialization.to_bytes``
of the target to ``<prefix>tmp`` and renames it to ``<prefix><step>``; the
step is in the file name. PATH is that folder: every ``<prefix><N>`` file
holding a msgpack map is a committed step, ``<prefix>tmp`` is an unfinished
save (listed as incomplete, never read, refused when PATH names it). Multi-process ``_gda`` folders are
not read. Each step is one item, ``default``, read like a single Flax msgpack
file (see ``msgpack.py``); one file is a ``msgpack`` checkpoint by itself.

In Orbax mode (the default in Flax 0.8 and later; tested with 0.8.5 and 0.12.8) ``save_checkpoint`` writes
``checkpoint_<N>/`` folders, each one Orbax item: the ``orbax`` format reads
that root (its steps' item is ``default``). A folder holding both (a run
resumed with the other backend) is read here: its Orbax-mode folders are
steps too, read through ``orbax.py``; one step saved both ways is an error
naming both.

A step may be a float: ``save_checkpoint(dir, target, step=0.625, prefix="best_acc_")`` (a metric as the step)
writes ``best_acc_0.625`` (a file, or a folder in Orbax mode). Such numbers are the steps of their series, in
flax's order (``natural_sort``, by number; the latest is what ``latest_checkpoint`` picks); ``--step 0.5`` reads
another. A folder holding them is read here in either mode; Orbax-mode ``checkpoint_<N>/`` folders beside them are
another series.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats.msgpack import is_msgpack_map, read_msgpack
from treetools.checkpoint_io.formats._orbax_items import read_pytree_item
from treetools.checkpoint_io.leaves import DEFAULT_ITEM, Item, Snapshot
from treetools.checkpoint_io.source import Format, Source
from treetools.checkpoint_io.steps import PYTREE_METADATA_FILE, StepListing, choose_series, is_committed
from treetools.shared.errors import CheckpointError


# Flax joins prefix and step with nothing in between (``checkpoint_`` + ``100``, ``f"{prefix}{step}"``): an int, or
# a float (``save_checkpoint(..., step=0.625, prefix="best_acc_")`` names it ``best_acc_0.625``; ``1e-05`` as Python
# writes it).
_STEP_FILE = re.compile(r"^(?P<prefix>.*?\D)?(?P<step>\d+(?:\.\d+)?(?:e[-+]\d+)?)$")
_DEFAULT_PREFIX = "checkpoint_"
_TMP = "tmp"  # flax.training.checkpoints._get_checkpoint_paths: ``<prefix>tmp``


def _step_files(context: ReadContext, folder: str) -> dict[str, dict[int, str]]:
    """prefix -> {step: file path} of the msgpack step files directly under ``folder``."""
    try:
        with context.storage.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return {}
    found: dict[str, dict[int | float, str]] = {}
    for entry in entries:
        m = _STEP_FILE.match(entry.name)
        if m is None or not entry.is_file() or not is_msgpack_map(context.storage, entry.path):
            continue
        found.setdefault(m.group("prefix") or "", {}).setdefault(step_number(m.group("step")), entry.path)
    return found  # type: ignore[return-value]  # flax's float steps (0.625) pass as steps typed int


def step_number(text: str) -> int | float:
    """The step a name's number says: an int (``100``) or, as flax saves a float step, a float (``0.625``).

    >>> step_number("100"), step_number("0.625"), step_number("1e-05")
    (100, 0.625, 1e-05)
    """
    return int(text) if text.isdigit() else float(text)


def scan_files(context: ReadContext, folder: str) -> tuple[str, StepListing]:
    """The prefix and the steps of a legacy Flax checkpoint folder.

    Each prefix is a series of steps (``steps.choose_series``): ``checkpoint_``
    is read unless another is selected; the others are listed.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> for name in ("checkpoint_10", "checkpoint_2", "eval_2", "checkpoint_tmp"):
    ...     _ = open(os.path.join(d, name), "wb").write(bytes([0x80]))
    >>> prefix, listing = scan_files(ReadContext().confined_to(d), d)
    >>> prefix, listing.steps, listing.incomplete, list(listing.others)
    ('checkpoint_', [2, 10], ['checkpoint_tmp'], ['eval_'])
    """
    storage = context.storage
    found = _step_files(context, folder)
    pending = _tmp_files(context, folder)
    # Orbax-mode folders of every prefix (the float steps' series, and `checkpoint_<N>/` beside them): each
    # prefix is a series, as the msgpack files' prefixes are.
    floats = [_STEP_FILE.match(name) for name in _orbax_step_folders(context, folder, None, floats_only=False)]
    if not found and not pending and not floats:
        raise CheckpointError(f"{folder}: no Flax checkpoint files (<prefix><step> msgpack files) in it.")
    listings = {}
    for prefix in sorted({*found, *(name[: -len(_TMP)] for name in pending),
                          *(m.group("prefix") or "" for m in floats if m is not None)}):
        committed = dict(found.get(prefix, {}))
        duplicates: dict[Any, list[str]] = {}
        for step, path in _orbax_step_folders(context, folder, prefix).items():  # a run resumed with the other Flax backend
            if step in committed:
                duplicates[step] = [os.path.basename(committed[step]), os.path.basename(path) + "/"]
            committed[step] = path
        tmp = prefix + _TMP
        incomplete = [tmp] if storage.lexists(os.path.join(folder, tmp)) else []
        listings[prefix] = StepListing(folder, dict(sorted(committed.items())), incomplete, duplicates=duplicates,
                                       series=prefix, storage=storage)
    listing = choose_series(folder, listings, storage=storage)
    return listing.series, listing


def _orbax_step_folders(context: ReadContext, folder: str, prefix: str | None, *,
                        floats_only: bool = True) -> dict[Any, str]:
    """Committed ``<prefix><N>/`` Orbax-mode folders (each one Orbax item) beside the msgpack files, by step; with
    ``prefix=None``, those of every prefix whose step is a float (``best_acc_0.625/``; ``floats_only=False``: any
    step), by name."""
    storage = context.storage
    out: dict[Any, str] = {}
    try:
        with storage.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        m = _STEP_FILE.match(entry.name)
        if m is None or (prefix is not None and (m.group("prefix") or "") != prefix):
            continue
        if prefix is None and floats_only and m.group("step").isdigit():
            continue
        if entry.is_dir() and is_committed(entry.path, storage) and storage.lexists(
                os.path.join(entry.path, PYTREE_METADATA_FILE)):
            out[entry.name if prefix is None else step_number(m.group("step"))] = entry.path
    return out


class FlaxLegacySource(Source):
    """A folder of ``<prefix><N>`` msgpack files; each step is item ``default``."""

    format = "flax-legacy"

    def __init__(self, location: str, display: str, context: ReadContext):
        self.location = location
        _, listing = scan_files(context, location)
        super().__init__(display, context, listing=listing)

    def item_names(self, step: int | None) -> list[str]:
        return [DEFAULT_ITEM]

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        if self.listing is None or step is None:  # always a root of steps: `resolve` gives one of them
            raise CheckpointError(f"{self.path}: a legacy Flax checkpoint is read one step at a time; name a step.")
        path = self.listing.folder(step)
        if self.storage.isdir(path):  # an Orbax-mode step folder: one Orbax item
            return Snapshot(step, {name: read_pytree_item(self.context, path, name) for name in names})
        leaves = read_msgpack(self.context, path)
        return Snapshot(step, {name: Item(name, "pytree", list(leaves)) for name in names})


def _is_tmp_file(context: ReadContext, path: str) -> bool:
    """``<prefix>tmp``, a save flax has not renamed yet: ``checkpoint_tmp``, any ``<prefix>tmp`` beside that
    prefix's step files, or a msgpack map named ``..._tmp`` / ``...-tmp`` / ``....tmp`` (a first save)."""
    name = os.path.basename(path)
    if not name.endswith(_TMP) or not context.storage.isfile(path):
        return False
    prefix = name[: -len(_TMP)]
    if prefix == _DEFAULT_PREFIX or prefix in _step_files(context, os.path.dirname(path)):
        return True
    return prefix[-1:] in ("_", "-", ".") and is_msgpack_map(context.storage, path)


def _tmp_files(context: ReadContext, folder: str) -> list[str]:
    """Names of the unfinished saves (``<prefix>tmp``) directly under ``folder``."""
    try:
        names = sorted(context.storage.listdir(folder))
    except OSError:
        return []
    return [n for n in names if _is_tmp_file(context, os.path.join(folder, n))]


def _claims(path: str, context: ReadContext) -> bool:
    return ((context.storage.isdir(path) and bool(_step_files(context, path) or _tmp_files(context, path)
                                                  or _orbax_step_folders(context, path, None)))
            or _is_tmp_file(context, path))


def _open(location: str, display: str, context: ReadContext) -> Source:
    if context.storage.isfile(location):  # claimed as an unfinished save
        raise CheckpointError(f"{display}: an unfinished Flax save (save_checkpoint renames it to <prefix><step> "
                              "when done); it is never read.")
    return FlaxLegacySource(location, display, context)


FORMAT = Format(
    name="flax-legacy",
    priority=52,  # before orbax (50): a folder with msgpack step files may also hold Orbax-mode step folders
    claims=_claims,
    open=_open,
    description="a folder of checkpoint_<step> msgpack files from flax.training.checkpoints.save_checkpoint",
)
