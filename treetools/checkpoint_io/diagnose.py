"""What a path no format claims is, and the path that would work: the "did you mean" of ``open_source``.

A file or folder inside a checkpoint names that checkpoint; a folder holding
checkpoints (or a file beside them) asks "did you mean ...?"; a PyTorch
pickle is named as one and refused. These probes look around the path, so
they read through the unconfined storage of its scheme (names and a few
bytes), and open a neighbour only confined to itself.
"""

from __future__ import annotations

import difflib
import os
import re
import zipfile
from typing import Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.registry import claiming_format, registered_formats
from treetools.checkpoint_io.source import file_head, Format
from treetools.checkpoint_io.steps import MARKER, TMP_DIR_SUFFIX, commit_evidence
from treetools.checkpoint_io.storage import Storage, backend, is_url, join, normalize
from treetools.checkpoint_io.storage import parent as parent_of
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError

NEAR_LEVELS = {False: 8, True: 4}
"""How many folders up (local, bucket) a path no format claims is looked for inside a checkpoint: an Orbax chunk
file sits four folders below its step (``100/params/ocdbt.process_0/d/<chunk>``)."""

NEAR_ENTRIES = {False: 24, True: 8}
"""How many entries of a folder (or of a file's folder) are asked whether they are a checkpoint, for the
"did you mean": those named like one (``checkpoints``, ``ckpt``, ``model``) first."""

_LIKELY = ("checkpoint", "ckpt", "model", "step", "params", "weights", ".safetensors", ".msgpack")


def _looking(storage: Storage, context: ReadContext | None) -> ReadContext:
    """The context the probes around a path read through: the unconfined storage of its scheme."""
    return (context if context is not None else ReadContext()).within(storage)


def enclosing_checkpoints(path: str, *, include_self: bool = False, levels: int | None = None,
                          context: ReadContext | None = None) -> list[tuple[str, Format]]:
    """The checkpoints ``path`` lies inside: every folder above it (and itself, with ``include_self``) that a
    format claims, nearest first, as ``(location, format)``; ``path`` need not exist.

    ``treetools train`` refuses a workdir that has any (a run written into a step would read as part of it), and
    ``open_source`` names the nearest for a path no format claims (a file inside a step folder).

    Args:
      path: a local path or URL.
      include_self: ask ``path`` itself too.
      levels: how many folders up to look (default ``NEAR_LEVELS``: 8 locally, 4 in a bucket).
      context: the settings of the reads (its storage is not used: the probes read around the path).
    """
    location = normalize(os.fspath(path))
    storage = backend(location)
    looking = _looking(storage, context)
    formats = [f for f in registered_formats() if not f.structural]  # positive evidence only: marker formats
    found = []
    below: str | None = None  # the name, in `current`, of the folder on the way down to `path`
    current: str | None = location
    if not include_self:
        below, current = os.path.basename(location), parent_of(location)
    for _ in range(levels if levels is not None else NEAR_LEVELS[storage.remote]):
        if current is None:
            break
        try:
            fmt = claiming_format(current, formats, context=looking) if storage.isdir(current) else None
            if fmt is not None and _holds(current, fmt, below, looking):
                found.append((current, fmt))
        except (OSError, CheckpointError):  # an unreadable folder above: no evidence either way
            pass
        below, current = os.path.basename(current), parent_of(current)
    return found


def _holds(location: str, fmt: Format, name: str | None, looking: ReadContext) -> bool:
    """Whether the entry ``name`` of ``location`` (a folder ``fmt`` claims; None: ``location`` itself) is part of
    that checkpoint: a step folder of a root (listed, unfinished, or named as its steps are), an item folder or
    a file of a step, anything in an item folder or a single-file checkpoint's folder; not a stranger beside a
    root's steps or a step's items (a run folder in a ``/tmp`` that holds steps). A ``name`` not there yet is part
    of a step that carries its own commit marker, not of a folder taken for a step only because an item folder
    sits in it (a folder holding one ``StandardCheckpointer`` save): a sibling being a checkpoint puts nothing
    new beside it inside one.
    """
    if name is None:
        return True
    storage = looking.storage
    try:
        confined = storage.confine(location, follow_links=looking.follow_links)
        source = fmt.open(location, location, looking.within(confined))
        listing = source.listing
        items = source.item_names(source.step) if listing is None else []
    except (CheckpointError, CheckpointNotFoundError, OSError):
        return True  # claimed by its own files, and unreadable (an unfinished step): a checkpoint all the same
    if listing is None:  # a step's items are folders in it: another folder there is no part of it
        folders = [n for n in items if storage.isdir(join(location, n))]
        entry = join(location, name)
        if name in items or not folders:
            return True
        if storage.lexists(entry):  # a file of the step is part of it; a stranger folder is not
            return not storage.isdir(entry)
        return commit_evidence(location, storage) == MARKER
    # A series none of whose steps is committed holds its unfinished saves (`*.orbax-checkpoint-tmp*`) and
    # nothing else: `run_0/` beside another series' save is a folder named like a step, not part of a checkpoint
    # (pytest's `test_name_0` folders beside an Orbax save made every run folder in them "inside a checkpoint").
    names: set[str] = set()
    for series in listing.every_series().values():
        names |= {os.path.basename(folder) for folder in series.committed.values()}
        names |= {n for n in series.incomplete if series.committed or TMP_DIR_SUFFIX in n}
    names |= {n for n in listing.incomplete if listing.committed or TMP_DIR_SUFFIX in n}
    series_step = re.escape(listing.series) + r"\d+" if listing.series else r"\d+"
    return name in names or (bool(listing.committed) and re.fullmatch(series_step, name) is not None)


def shown_path(location: str, display: str) -> str:
    """``location`` (a folder above or below the path the user typed as ``display``) written the way they wrote
    theirs: relative when theirs was, ``~/`` when theirs was, else absolute; a URL as it is."""
    if is_url(location) or os.path.isabs(display):
        return location
    if display.startswith("~"):
        return os.path.join("~", os.path.relpath(location, os.path.expanduser("~")))
    return os.path.relpath(location)


def did_you_mean(location: str, display: str, storage: Storage) -> str | None:
    """For a path with nothing at it, ``"; did you mean A or B?"`` naming the entries of the nearest folder that
    exists whose names are close to the part missing (``model.safetensor`` -> ``model.safetensors``), the rest of
    the path kept where it exists below them; None when no name is close."""
    rest: list[str] = []
    folder = location
    while True:
        above = parent_of(folder)
        if above is None or above == folder:
            return None
        rest.insert(0, folder[len(above):].strip("/"))
        folder = above
        try:
            if storage.isdir(folder):
                names = storage.listdir(folder)
                break
        except (OSError, CheckpointError):
            return None
    close = difflib.get_close_matches(rest[0], [n for n in names if not n.startswith(".")], n=3, cutoff=0.6)
    options = []
    for name in close:
        full = join(folder, name)
        for part in rest[1:]:
            full = join(full, part)
        try:
            there = full if not rest[1:] or storage.exists(full) else join(folder, name)
        except (OSError, CheckpointError):
            there = join(folder, name)
        options.append(shown_path(there, display))
    return f"; did you mean {' or '.join(options)}?" if options else None


BELOW_LEVELS = {False: 3, True: 1}
"""How many folders down (local, bucket) a folder that is no checkpoint is searched for the checkpoints it holds:
a repository root holds ``runs/demo/checkpoints``."""

BELOW_ENTRIES = {False: 96, True: 8}
"""How many entries in all that search asks whether they are a checkpoint (hidden ones, ``.git``, ``.venv``,
never: below the first level)."""


def _claimed(entry: str, formats: Sequence[Format], looking: ReadContext) -> Format | None:
    """The format that reads ``entry``, as a checkpoint to offer (None for an empty file, whatever its name:
    opened directly, it is "truncated")."""
    storage = looking.storage
    try:
        fmt = claiming_format(entry, formats, context=looking)
        if fmt is not None and ((fmt.suggest is not None and not fmt.suggest(entry))
                                or (not storage.isdir(entry) and storage.getsize(entry) == 0)):
            fmt = None
    except (OSError, CheckpointError):
        fmt = None
    return fmt


def _checkpoints_beside(folder: str, formats: Sequence[Format], looking: ReadContext, *,
                        skip: str | None = None) -> list[tuple[str, Format]]:
    """Entries of ``folder`` that a format claims (a few, those named like checkpoints asked first)."""
    storage = looking.storage
    try:
        names = [n for n in storage.listdir(folder) if n != skip]
    except (OSError, CheckpointError):
        return []
    names.sort(key=lambda n: (not any(w in n.lower() for w in _LIKELY), n))
    found = []
    for name in names[:NEAR_ENTRIES[storage.remote]]:
        entry = join(folder, name)
        fmt = _claimed(entry, formats, looking)
        if fmt is not None:
            found.append((entry, fmt))
    return found


def _checkpoints_below(folder: str, formats: Sequence[Format], looking: ReadContext) -> list[tuple[str, Format]]:
    """The checkpoints ``folder`` holds: its entries a format claims, then (a few levels down, breadth first,
    hidden folders left out) those of its subfolders that are no checkpoint themselves."""
    storage = looking.storage
    found = _checkpoints_beside(folder, formats, looking)
    claimed = {entry for entry, _ in found}
    level, left = [folder], BELOW_ENTRIES[storage.remote]
    for _ in range(BELOW_LEVELS[storage.remote] - 1):
        below = []
        for parent in level:
            try:
                names = sorted(n for n in storage.listdir(parent) if not n.startswith("."))
            except (OSError, CheckpointError):
                continue
            below += [join(parent, n) for n in names
                      if join(parent, n) not in claimed and storage.isdir(join(parent, n))]
        level = []
        for sub in below:
            try:
                names = sorted(n for n in storage.listdir(sub) if not n.startswith("."))
            except (OSError, CheckpointError):
                continue
            for name in names:
                if left <= 0:
                    return found
                left -= 1
                entry = join(sub, name)
                fmt = _claimed(entry, formats, looking)
                if fmt is not None:
                    found.append((entry, fmt))
                    claimed.add(entry)
            level.append(sub)
    return found


TORCH_SUFFIXES = (".bin", ".pt", ".pth")
"""Names of the files ``torch.save`` writes (``pytorch_model.bin``, ``*.pt``): a zip holding ``data.pkl`` (PyTorch
1.6 and later) or a bare pickle. ``is_torch_zip`` tells such a zip from an npz saved under the same name."""

_TORCH_FOLDER_FILE = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?$|.+\.pth?$", re.IGNORECASE)


def is_torch_zip(location: str, storage: Storage) -> bool:
    """Whether ``location`` is a zip that ``torch.save`` wrote: one whose members hold ``data.pkl``."""
    try:
        with storage.open(location) as fh, zipfile.ZipFile(fh) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, CheckpointError, zipfile.BadZipFile, ValueError):
        return False


def _torch_pickle(location: str, folder: bool, looking: ReadContext) -> str | None:
    """What names ``location`` as a pickle, or None: a folder holding ``pytorch_model.bin`` (its shards, its
    index, a ``.pt`` file); a ``.bin``/``.pt``/``.pth`` file that is a torch zip or a bare pickle (PyTorch's
    ``torch.save``); any other file that opens with a pickle's magic bytes, or is named ``.pkl``/``.pickle``
    (Haiku's ``params.pkl``)."""
    storage = looking.storage
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
    name = os.path.basename(location).lower()
    try:
        head = file_head(storage, location, 2)
    except (OSError, CheckpointError):
        return None
    # A pickle of protocol 2 to 5 starts with 0x80 and its protocol; torch.save wrote one before PyTorch 1.6.
    magic = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if name.endswith(TORCH_SUFFIXES):
        if (head[:2] == b"PK" and is_torch_zip(location, storage)) or magic:
            return "a PyTorch pickle (torch.save)"
        return None
    if magic or name.endswith(PICKLE_SUFFIXES):  # Haiku's params.pkl, any pickle.dump, whatever its name
        return "a Python pickle (pickle.dump: Haiku's params.pkl and others)"
    return None


PICKLE_SUFFIXES = (".pkl", ".pickle")
"""Names of pickles whatever their protocol (protocols 0 and 1 have no magic bytes)."""


def _refuse_pickle(display: str, what: str) -> str:
    if "PyTorch" in what:
        fix = ("Save the weights as safetensors (`save_pretrained(DIR, safe_serialization=True)`, or "
               "`safetensors.torch.save_file(model.state_dict(), PATH)`) and pass that.")
    else:
        fix = ("Where you trust it, load it yourself and save the arrays as safetensors "
               "(`safetensors.numpy.save_file(tt.flatten(params), PATH)`) or an Orbax checkpoint, "
               "and pass that.")
    return f"{display}: {what}; treetools reads no pickles (loading one can run code). {fix}"


def not_a_checkpoint(location: str, display: str, formats: Sequence[Format], context: ReadContext | None = None) -> str:
    """The one-line error for a path no format claims, with the path that would work where there is one.

    A file or folder inside a checkpoint (``100/_CHECKPOINT_METADATA``, an item's ``manifest.ocdbt``) names that
    checkpoint; a folder holding checkpoints (a ``treetools train`` workdir and its ``checkpoints/``), or a file
    beside them, asks "did you mean ...?". Else the readable formats, by name (``--help`` describes them).
    """
    storage = backend(location)
    looking = _looking(storage, context)
    folder = storage.isdir(location)
    inside = enclosing_checkpoints(location, context=context)
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
    pickle = _torch_pickle(location, folder, looking)
    if pickle is not None and not folder:
        return _refuse_pickle(display, pickle)
    parent = parent_of(location)
    near = (_checkpoints_below(location, formats, looking) if folder else
            _checkpoints_beside(parent, formats, looking, skip=os.path.basename(location)) if parent is not None
            else [])
    if pickle is not None and not near:
        return _refuse_pickle(display, pickle)
    if near:
        options = " or ".join(f"{shown_path(p, display)} ({f.name})" for p, f in near[:3])
        where = "a folder holding checkpoints" if folder else "a file beside checkpoints"
        return f"{display}: not a checkpoint but {where}; did you mean {options}?"
    return (f"{display}: not a checkpoint that treetools can read. Readable formats: "
            f"{', '.join(f.name for f in formats)} (`treetools inspect --help` says what each reads).")
