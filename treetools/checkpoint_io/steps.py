"""The one step rule: which folders are steps, which are unfinished, and what ``step=`` means.

Standard library only (no jax, no orbax, no numpy): ``treetools inspect`` lists
steps cheaply, and every reader of a checkpoint root (``inspect``, ``diff``,
``load_parameters``, ``restore_checkpoint`` and the Orbax manager that
``get_checkpoint_manager`` builds) asks this module, so they cannot disagree
about which step is the latest.

Step folders are named like Orbax names them: ``100``, zero padded
``000100``, or ``<prefix>_100``. A step is *committed* when

* its name carries no tmp suffix (Orbax's ``300.orbax-checkpoint-tmp-1700000000``,
  T5X's ``checkpoint_300.tmp-1700000000``), and
* it holds Orbax's commit marker ``commit_success.txt``, or a
  ``_CHECKPOINT_METADATA`` whose ``commit_timestamp_nsecs`` is set, or (Orbax
  before step metadata existed) no ``_CHECKPOINT_METADATA`` at all but an
  item folder that Orbax finalized (its ``_METADATA`` or JSON ``metadata``),
  in a root where no step carries a commit marker: where the others do, a
  step folder without one is a copy still in progress.

Everything else is *incomplete*: listed, never read, never the latest. An
incomplete step folder under its final name that holds neither marker file
(no ``commit_success.txt``, no ``_CHECKPOINT_METADATA``) in a series whose
steps carry markers is *being deleted* (``StepListing.deleting``): Orbax's
deleter removes a pruned step's files, its markers among them, before the
folder goes, while a save in progress has its ``_CHECKPOINT_METADATA`` from
the moment Orbax creates its folder (under a tmp name on local disks; in
place, without a commit time, in buckets). A copy into the root that has not
reached the markers yet looks the same. A
format with its own commit evidence (T5X's ``checkpoint`` file) passes its
rule to ``scan_steps(commit_rule=...)``; a format with its own step names
(Levanter's ``step-N``) passes their pattern (``names=``); tmp suffixes stay these.

A root may hold several *series* of steps, told apart by the name before the
number (flax's ``save_checkpoint(prefix=...)``: ``checkpoint_6`` and
``validation_loss_6`` in one folder). One series is read at a time: the one
asked for (``StepListing.select``, ``--prefix``), else ``checkpoint_``, else
the one without a prefix; the others are listed, never mixed in.
Metadata files are checked to be regular files and read with a size cap, so
a FIFO or a huge file in a step folder cannot hang or exhaust a reader.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
import stat
from typing import Any, Callable, Iterable, Sequence

from treetools.checkpoint_io.storage import Storage, backend, map_io, normalize
from treetools.checkpoint_io.storage.base import SpecialFileError, kind_of_mode
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError


# Orbax's on-disk names (its private path.atomicity_types and metadata.checkpoint
# modules), copied so that the rule needs no orbax import;
# tests/test_steps.py checks that they still equal Orbax's.
TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_SUCCESS_FILE = "commit_success.txt"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
PYTREE_METADATA_FILE = "_METADATA"
JSON_ITEM_FILE = "metadata"

MAX_METADATA_BYTES = 64 * 2**20
"""The largest metadata file (JSON, msgpack index, header) a reader parses; real ones are KBs to a few MBs."""

# "N", "000N" or "<prefix>_N" (Orbax's step_prefix joins with an underscore).
_STEP_NAME = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<step>\d+)$")
# T5X saves into "<step name>.tmp-<unix time>" and renames it when done.
_T5X_TMP_NAME = re.compile(r"^(?P<head>.+)\.tmp-\d+$")


def read_file(storage: Storage, path: str, *, what: str, max_bytes: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of a small file, refusing what is not a regular file or is larger than ``max_bytes``.

    A FIFO would block ``open`` forever and ``/dev/zero`` never ends: both are
    refused before they are opened.

    Raises:
      CheckpointNotFoundError: nothing at ``path``.
      CheckpointError: not a regular file, too large, or unreadable.

    >>> read_file(backend("/"), "/", what="Orbax _METADATA")
    Traceback (most recent call last):
    ...
    treetools.checkpoint_io.storage.base.SpecialFileError: /: not a regular file (a folder); cannot read it as
    Orbax _METADATA.
    """
    try:
        st = storage.stat(path)
    except FileNotFoundError:
        if storage.link_target(path) is not None:
            raise CheckpointError(f"{path}: {file_kind(storage, path)}; cannot read it as {what}.") from None
        raise CheckpointNotFoundError(f"{path}: {what} is missing.") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e}).") from None
    if not stat.S_ISREG(st.st_mode):
        kind = kind_of_mode(st.st_mode)
        raise SpecialFileError(f"{path}: not a regular file ({kind}); cannot read it as {what}.", path=path, kind=kind)
    if st.st_size > max_bytes:
        raise CheckpointError(
            f"{path}: {what} is {st.st_size:,} bytes, over the {max_bytes:,}-byte limit for metadata; "
            "the file is corrupt or not what its name says."
        )
    try:
        data = storage.read_range(path, 0, max_bytes + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e}).") from None
    if len(data) > max_bytes:  # grew while we read it
        raise CheckpointError(f"{path}: {what} is over the {max_bytes:,}-byte limit for metadata.")
    return data


def read_json_file(storage: Storage, path: str, *, what: str, max_bytes: int = MAX_METADATA_BYTES) -> Any:
    """Parse a small JSON metadata file (see ``read_file``); a broken one is a ``CheckpointError``.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "m.json"); _ = open(f, "w").write('{"a": 1}')
    >>> read_json_file(backend(f), f, what="test metadata")
    {'a': 1}
    """
    data = read_file(storage, path, what=what, max_bytes=max_bytes)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise CheckpointError(f"{path}: corrupt or truncated {what} ({reason}).") from None


def file_kind(storage: Storage, path: str) -> str:
    """``a folder``, ``a FIFO``, ``a broken symlink``...: what stands at ``path`` instead of a file."""
    target = storage.link_target(path)
    if target is not None and not storage.exists(path):
        return f"a broken or looping symlink to {target!r}"
    try:
        return kind_of_mode(storage.stat(path).st_mode)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def step_series(name: str, *, names: re.Pattern[str] = _STEP_NAME) -> tuple[str, int] | None:
    """``(series, step)`` of a step-folder name: the series is the text before the number.

    >>> step_series("checkpoint_6"), step_series("000100"), step_series("logs")
    (('checkpoint_', 6), ('', 100), None)
    """
    if TMP_DIR_SUFFIX in name:
        return None
    m = names.match(name)
    if m is None:
        return None
    return name[: m.start("step")], int(m.group("step"))


def parse_step_name(name: str, *, step_prefix: str | None = None, names: re.Pattern[str] = _STEP_NAME) -> int | None:
    """The step number in a step-folder name, or None when it is not one.

    Accepts Orbax's names: ``"100"``, zero padded ``"000100"``, prefixed
    ``"ckpt_100"`` / ``"ckpt_000100"``. Orbax tmp folders are not step folders.

    Args:
      name: a folder name.
      step_prefix: only accept this prefix (None: any prefix or none).
      names: a format's own step names (a pattern with a ``step`` group), instead of Orbax's.

    >>> parse_step_name("ckpt_000120"), parse_step_name("300.orbax-checkpoint-tmp-17"), parse_step_name("logs")
    (120, None, None)
    """
    if TMP_DIR_SUFFIX in name:
        return None
    m = names.match(name)
    if m is None or (step_prefix is not None and m.groupdict().get("prefix") != step_prefix):
        return None
    return int(m.group("step"))


def _tmp_head(name: str) -> str | None:
    """The step name a tmp folder was saving (``300`` of ``300.orbax-checkpoint-tmp-17``), else None."""
    head, sep, _ = name.partition(TMP_DIR_SUFFIX)
    if not sep:
        m = _T5X_TMP_NAME.match(name)
        if m is None:
            return None
        head = m.group("head")
    return head


def tmp_step(name: str, *, step_prefix: str | None = None, names: re.Pattern[str] = _STEP_NAME) -> int | None:
    """The step a tmp folder was saving, else None.

    Orbax's tmp folders are ``<step name>.orbax-checkpoint-tmp-<ts>``, T5X's ``<step name>.tmp-<ts>``.

    >>> (tmp_step("ckpt_0300.orbax-checkpoint-tmp-1700000000"), tmp_step("checkpoint_300.tmp-1700000000"),
    ...  tmp_step("300"))
    (300, 300, None)
    """
    head = _tmp_head(name)
    return None if head is None else parse_step_name(head, step_prefix=step_prefix, names=names)


def _is_regular(storage: Storage, path: str) -> bool:
    try:
        return stat.S_ISREG(storage.stat(path).st_mode)
    except OSError:
        return False


def _finalized_item(storage: Storage, step_dir: str) -> bool:
    """Whether a step folder without step metadata holds an item Orbax finalized (pre-0.5 Orbax saves)."""
    try:
        with storage.scandir(step_dir) as it:
            subdirs = [e.path for e in it if e.is_dir()]
    except OSError:
        return False
    return any(_is_regular(storage, os.path.join(d, PYTREE_METADATA_FILE))
               or _is_regular(storage, os.path.join(d, JSON_ITEM_FILE)) for d in subdirs)


MARKER = "marker"
"""Commit evidence of a step folder: Orbax's commit marker (``commit_success.txt``, a committed
``_CHECKPOINT_METADATA``)."""
FINALIZED_ITEM = "finalized item"
"""Commit evidence of a step folder without step metadata: an item Orbax finalized (saves before step metadata)."""


def commit_evidence(step_dir: str | os.PathLike, storage: Storage | None = None) -> str | None:
    """How Orbax shows it finished this step folder: ``MARKER``, ``FINALIZED_ITEM``, or None (unfinished).

    ``storage``: the storage to read it through (None: the one of its scheme, unconfined).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "100"; d.mkdir()
    >>> commit_evidence(d) is None
    True
    >>> _ = (d / "commit_success.txt").write_text("ok"); commit_evidence(d)
    'marker'
    """
    step_dir = os.fspath(step_dir)
    storage = storage or backend(step_dir)
    if TMP_DIR_SUFFIX in os.path.basename(normalize(step_dir)) or not storage.isdir(step_dir):
        return None
    if _is_regular(storage, os.path.join(step_dir, COMMIT_SUCCESS_FILE)):
        return MARKER
    meta = os.path.join(step_dir, STEP_METADATA_FILE)
    if storage.lexists(meta):
        try:
            data = read_json_file(storage, meta, what=f"Orbax {STEP_METADATA_FILE}")
        except (CheckpointError, CheckpointNotFoundError):
            return None  # half-written, hostile or unreadable: never taken as a finished save
        return MARKER if isinstance(data, dict) and bool(data.get("commit_timestamp_nsecs")) else None
    return FINALIZED_ITEM if _finalized_item(storage, step_dir) else None


def _lost_markers(storage: Storage, step_dir: str) -> bool:
    """A step folder under its final name with neither marker file: what Orbax's deleter leaves mid-way."""
    if _tmp_head(os.path.basename(step_dir)) is not None or not storage.isdir(step_dir):
        return False
    return not any(storage.lexists(os.path.join(step_dir, name)) for name in (COMMIT_SUCCESS_FILE, STEP_METADATA_FILE))


def is_committed(step_dir: str | os.PathLike, storage: Storage | None = None) -> bool:
    """True when Orbax finished writing this step folder (the rule in this module's docstring).

    A folder alone cannot tell a save from before step metadata from a copy in
    progress that has its items but not yet its marker; ``scan_steps`` tells
    them apart by the root's other steps.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "100"; d.mkdir()
    >>> is_committed(d)
    False
    >>> _ = (d / "commit_success.txt").write_text("ok"); is_committed(d)
    True
    """
    return commit_evidence(step_dir, storage) is not None


DEFAULT_SERIES = ("checkpoint_", "")
"""The series read when a root holds several and none is asked for: flax's default prefix, then bare numbers."""


@dataclasses.dataclass
class StepListing:
    """The steps of a checkpoint root: ``committed`` step -> folder, ``incomplete`` folder names.

    ``duplicates`` maps a step to the names of every committed folder that
    claims it (``2`` and ``000002``); such a step cannot be read until one goes.
    ``series`` is the name before the number of these steps (``checkpoint_``);
    ``others`` the root's other series, listed but never mixed in (``select``
    reads one of them). ``conflict`` says why no series was chosen (several,
    none of them the default): resolving any step raises it.
    """

    root: str
    committed: dict[int, str]
    incomplete: list[str]
    duplicates: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    """Entries that could not be examined (unreadable, looping symlinks): ignored, reported as notes."""
    series: str = ""
    others: dict[str, "StepListing"] = dataclasses.field(default_factory=dict)
    conflict: str | None = None
    commit_rule: Callable[[str, Storage], bool] | None = None
    """The rule the listing was made with (None: Orbax's ``is_committed``); ``still_committed`` asks it again."""
    storage: Storage | None = dataclasses.field(default=None, compare=False, repr=False)
    """What the root was listed through (None: the unconfined storage of its scheme)."""

    @property
    def store(self) -> Storage:
        return self.storage if self.storage is not None else backend(self.root)
    deleting: list[str] = dataclasses.field(default_factory=list)
    """Those of ``incomplete`` that are being deleted (a manager pruning them), not saves in progress."""

    def still_committed(self, step: int) -> bool:
        """Whether the folder of a listed step is still there and still committed, asked afresh.

        A step a manager is pruning loses its files (its commit marker among
        them) before its folder goes: from the first file it is no longer a
        finished save, and reading it is reading a step being deleted.
        """
        folder, storage = self.committed[step], self.store
        storage.forget(folder)
        rule = self.commit_rule or is_committed
        return storage.exists(folder) and (rule(folder, storage) if storage.isdir(folder) else True)

    @property
    def steps(self) -> list[int]:
        return list(self.committed)

    def folder(self, step: int) -> str:
        """The folder of one committed step; two folders for one step are an error naming both."""
        if self.conflict is not None:
            raise CheckpointError(self.conflict)
        if step in self.duplicates:
            names = " and ".join(self.duplicates[step])
            raise CheckpointError(
                f"{self.root}: step {step} has two committed folders ({names}); remove or rename one."
            )
        return self.committed[step]

    def every_series(self) -> dict[str, "StepListing"]:
        """Every series of the root, this one included (when one was chosen), by name."""
        mine = {} if self.conflict is not None else {self.series: self}
        return dict(sorted({**self.others, **mine}.items()))

    def select(self, prefix: str, *, where: str | None = None) -> "StepListing":
        """The root's series named ``prefix`` (``checkpoint_``; the separator may be left out: ``checkpoint``).

        Raises:
          CheckpointError: no such series (the message lists the series there are).

        >>> evals = StepListing("run", {4: "run/eval_4"}, [], series="eval_")
        >>> root = StepListing("run", {}, [], others={"eval_": evals})
        >>> root.select("eval").steps
        [4]
        """
        every = self.every_series()
        for name in (prefix, prefix + "_", prefix + "-"):
            if name in every:
                chosen = every[name]
                return dataclasses.replace(chosen, skipped=self.skipped,
                                           others={n: s for n, s in every.items() if n != name})
        raise CheckpointError(
            f"{where or self.root}: no step series with the prefix {prefix!r}; series here: {describe_series(every)}."
        )


def describe_series(listings: dict[str, StepListing]) -> str:
    """``checkpoint_ (steps 4, 6), eval_ (step 6)``: each series with its committed steps."""
    def one(name: str, listing: StepListing) -> str:
        steps = listing.steps
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        label = repr(name) if name else "no prefix ('')"
        return f"{label} ({'steps' if len(steps) != 1 else 'step'} {shown or 'none committed'})"

    return "; ".join(one(n, s) for n, s in listings.items()) or "none"


def choose_series(root: str, listings: dict[str, StepListing], skipped: list[str] | None = None, *,
                  prefer: Sequence[str] = DEFAULT_SERIES, storage: Storage | None = None) -> StepListing:
    """The listing a root is read with: its one series, else ``prefer``'s first present, else a conflict.

    Every series gets the others in ``others``, so none is lost from view.
    """
    skipped = list(skipped or [])
    if not listings:
        return StepListing(root, {}, [], skipped=skipped, storage=storage)
    if len(listings) == 1:
        chosen: StepListing | None = next(iter(listings.values()))
    else:
        chosen = next((listings[n] for n in prefer if n in listings), None)
    if chosen is None:
        return StepListing(root, {}, [], skipped=skipped, others=dict(listings), storage=storage, conflict=(
            f"{root}: step folders of several series ({describe_series(listings)}); read one with --prefix NAME "
            "(prefix= in the library)."))
    return dataclasses.replace(chosen, skipped=skipped,
                               others={n: s for n, s in listings.items() if n != chosen.series})


def scan_steps(root: str | os.PathLike, *, step_prefix: str | None = None,
               commit_rule: Callable[[str, Storage], bool] | None = None, names: re.Pattern[str] = _STEP_NAME,
               prefer: Sequence[str] = DEFAULT_SERIES, storage: Storage | None = None) -> StepListing:
    """Committed and incomplete step folders directly under ``root``.

    Reads names and marker files only (no array data), and never writes.
    Files and folders that are not step folders are ignored; a missing root
    gives an empty listing. Step folders of several series (names before the
    number) are listed apart: see ``choose_series``.

    Args:
      root: the checkpoint root.
      step_prefix: only accept this step-name prefix (None: any prefix or none).
      commit_rule: a format's own test ``rule(folder, storage)`` of a step folder without a tmp suffix
        (default ``is_committed``, Orbax's commit evidence).
      names: a format's own step-folder names (a pattern with a ``step`` group; default Orbax's).
      prefer: the series read when there are several and none is asked for (Levanter: ``step-``, not ``epoch-``).
      storage: what to list and read through (the checkpoint's confined storage; None: the unconfined one of
        ``root``'s scheme).

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for name in ("ckpt_0100", "ckpt_0200.orbax-checkpoint-tmp-17", "logs"):
    ...     (root / name).mkdir()
    >>> _ = (root / "ckpt_0100" / "commit_success.txt").write_text("ok")
    >>> listing = scan_steps(root)
    >>> listing.steps, listing.incomplete
    ([100], ['ckpt_0200.orbax-checkpoint-tmp-17'])
    """
    root = os.fspath(root)
    storage = storage or backend(root)
    committed: dict[str, dict[int, list[str]]] = {}
    incomplete: dict[str, list[tuple[int, str]]] = {}
    skipped: list[str] = []
    evidence: dict[str, str | None] = {}
    try:
        with storage.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return StepListing(root, {}, [], storage=storage)
    except OSError as e:
        raise CheckpointError(f"{root}: cannot list folder ({e.strerror or e}).") from None
    candidates = _step_candidates(entries, step_prefix, names)

    def judge(candidate: tuple[Any, tuple[str, int], bool]) -> tuple[str, str | None]:
        return _judge_step(candidate, storage, commit_rule)

    # In a bucket each step costs a round trip or two: the steps are judged concurrently.
    for (entry, (series, step), _), (kind, found) in zip(candidates, map_io(storage, judge, candidates)):
        if kind == "skip":
            skipped.append(entry.name)
        elif kind == "step" and found is not None:
            evidence[entry.path] = found
            committed.setdefault(series, {}).setdefault(step, []).append(entry.path)
        elif kind != "other":
            incomplete.setdefault(series, []).append((step, entry.name))
    _drop_unmarked_copies(committed, incomplete, evidence)
    listings = {series: _series_listing(root, series, committed.get(series, {}), incomplete.get(series, []),
                                        evidence, commit_rule, storage)
                for series in sorted({*committed, *incomplete})}
    return choose_series(root, listings, skipped, prefer=prefer, storage=storage)


def _step_candidates(entries: list[Any], step_prefix: str | None,
                     names: re.Pattern[str]) -> list[tuple[Any, tuple[str, int], bool]]:
    """``(entry, (series, step), is a tmp folder)`` of each entry of a root whose name is a step's."""
    candidates = []
    for entry in entries:
        head = _tmp_head(entry.name)
        name = head if head is not None else entry.name
        found = step_series(name, names=names)
        if found is None or (step_prefix is not None
                             and parse_step_name(name, step_prefix=step_prefix, names=names) is None):
            continue
        candidates.append((entry, found, head is not None))
    return candidates


def _judge_step(candidate: tuple[Any, tuple[str, int], bool], storage: Storage,
                commit_rule: Callable[[str, Storage], bool] | None) -> tuple[str, str | None]:
    """``(kind, commit evidence)`` of one step-named entry: kind ``skip``, ``other``, ``tmp`` or ``step``."""
    entry, _, tmp = candidate
    try:
        is_dir = entry.is_dir()
    except OSError:  # a symlink loop, an unreadable entry: junk, not a reason to fail the whole root
        return "skip", None
    if not is_dir:
        return ("skip" if entry.is_symlink() and not storage.exists(entry.path) else "other"), None
    if tmp:
        return "tmp", None
    storage.prefetch(entry.path)  # in a bucket, one listing answers every probe of the step's markers
    if commit_rule is not None:
        return "step", MARKER if commit_rule(entry.path, storage) else None
    return "step", commit_evidence(entry.path, storage)


def _drop_unmarked_copies(committed: dict[str, dict[int, list[str]]], incomplete: dict[str, list[tuple[int, str]]],
                          evidence: dict[str, str | None]) -> None:
    """In a series whose steps carry Orbax's commit marker, a step that has only finalized items (a copy in
    progress, which copied the items before the marker) is not finished either: moved to ``incomplete``."""
    for series, steps in committed.items():
        if MARKER not in (evidence[p] for paths in steps.values() for p in paths):
            continue
        for step, paths in list(steps.items()):
            unmarked = [p for p in paths if evidence.get(p) == FINALIZED_ITEM]
            incomplete.setdefault(series, []).extend((step, os.path.basename(p)) for p in unmarked)
            steps[step] = [p for p in paths if p not in unmarked]
            if not steps[step]:
                del steps[step]


def _series_listing(root: str, series: str, committed: dict[int, list[str]], incomplete: list[tuple[int, str]],
                    evidence: dict[str, str | None], commit_rule: Callable[[str, Storage], bool] | None,
                    storage: Storage) -> StepListing:
    """The ``StepListing`` of one series: its committed step folders and its incomplete saves."""
    ordered = dict(sorted(committed.items()))
    names = [name for _, name in sorted(incomplete)]
    marked = commit_rule is None and MARKER in (evidence[p] for paths in committed.values() for p in paths)
    return StepListing(
        root,
        {s: paths[0] for s, paths in ordered.items()},
        names,
        {s: [os.path.basename(p) for p in paths] for s, paths in ordered.items() if len(paths) > 1},
        series=series,
        commit_rule=commit_rule,
        storage=storage,
        deleting=[n for n in names if marked and _lost_markers(storage, os.path.join(root, n))],
    )


def list_steps(checkpoint_dir: str | os.PathLike, *, step_prefix: str | None = None) -> list[int]:
    """Committed steps under a checkpoint root, ascending (incomplete saves left out).

    >>> import tempfile
    >>> list_steps(tempfile.mkdtemp())
    []
    """
    return scan_steps(os.path.expanduser(os.fspath(checkpoint_dir)), step_prefix=step_prefix).steps


def list_incomplete(checkpoint_dir: str | os.PathLike, *, step_prefix: str | None = None) -> list[str]:
    """Names of incomplete step folders (Orbax tmp folders, no commit evidence).

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "7.orbax-checkpoint-tmp-1").mkdir()
    >>> list_incomplete(root)
    ['7.orbax-checkpoint-tmp-1']
    """
    return scan_steps(os.path.expanduser(os.fspath(checkpoint_dir)), step_prefix=step_prefix).incomplete


def latest_step(checkpoint_dir: str | os.PathLike, *, step_prefix: str | None = None) -> int | None:
    """The highest committed step, or None when there is none.

    >>> import tempfile
    >>> latest_step(tempfile.mkdtemp()) is None
    True
    """
    steps = list_steps(checkpoint_dir, step_prefix=step_prefix)
    return steps[-1] if steps else None


FLOAT_STEP = re.compile(r"^\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
"""A step written as a number that need not be an int: flax's ``save_checkpoint(..., step=0.625)``."""


def parse_step(step: Any, *, allow_all: bool = False, name: str = "step") -> int | float | str | None:
    """The one parser of step specs: None for the latest, a number, or ``"all"``.

    Accepts ``None``, ``-1`` and ``"latest"`` (the latest committed step), an
    int (Python, numpy or jax integer scalar) or a string of digits, a finite
    float >= 0 or its text (flax names a checkpoint saved with ``step=0.625``
    ``<prefix>0.625``; such steps are floats), and with ``allow_all`` the
    string ``"all"``.

    Raises:
      TypeError: anything else (the message names the argument).

    >>> parse_step(None), parse_step(-1), parse_step("latest"), parse_step("200"), parse_step("all", allow_all=True)
    (None, None, None, 200, 'all')
    >>> parse_step("0.625"), parse_step(0.5)
    (0.625, 0.5)
    """
    if step is None:
        return None
    if isinstance(step, str):
        step = _step_text(step, allow_all, name)
        if step is None or step == "all":
            return step
    if isinstance(step, bool):
        raise TypeError(f"`{name}` must be an int, -1, None or 'latest'; got {step!r}.")
    if isinstance(step, float) or type(step).__name__ in ("float16", "float32", "float64"):
        return _float_step(step, name)
    try:
        number = operator.index(step)
    except TypeError:
        raise TypeError(f"`{name}` must be an int, -1, None or 'latest'; got {step!r}.") from None
    if number == -1:
        return None
    if number < 0:
        raise TypeError(f"`{name}` must be a step number >= 0, or -1 for the latest; got {number}.")
    return number


def _step_text(step: str, allow_all: bool, name: str) -> int | float | str | None:
    """``parse_step`` of a string: None for ``latest``, ``"all"`` (with ``allow_all``), else its number."""
    text = step.strip()
    if text == "latest":
        return None
    if text == "all" and allow_all:
        return "all"
    if text.lstrip("-").isdigit():
        return int(text)
    if FLOAT_STEP.match(text):
        return float(text)
    options = "an int, -1, None, 'latest'" + (" or 'all'" if allow_all else "")
    raise TypeError(f"`{name}` must be {options}; got {step!r}.")


def _float_step(step: Any, name: str) -> int | float | None:
    """``parse_step`` of a float (numpy's too): None for -1, an int when it is whole, else the float."""
    value = float(step)
    if value == -1:
        return None
    if not (value >= 0 and value != float("inf")):
        raise TypeError(f"`{name}` must be a step number >= 0, or -1 for the latest; got {step!r}.")
    return int(value) if value.is_integer() else value


def _list(values: Iterable[Any]) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if values else "none"


def _number_of(name: str) -> int | None:
    """The step an incomplete save's name carries (``300.orbax-checkpoint-tmp-17``, ``step-30``), if any."""
    m = re.search(r"(\d+)$", _tmp_head(name) or name)
    return int(m.group(1)) if m else None


def resolve_step(listing: StepListing, step: Any, *, where: str | None = None) -> int:
    """The committed step that ``step`` names in ``listing`` (None/-1/"latest": the latest).

    Raises:
      CheckpointNotFoundError: no committed step at all, or not this one; the
        message lists the committed steps and says when the step is an
        incomplete save.
      CheckpointError: two committed folders claim the step.

    >>> listing = StepListing("run", {100: "run/100", 200: "run/200"}, ["300.orbax-checkpoint-tmp-1"])
    >>> resolve_step(listing, "latest"), resolve_step(listing, 100)
    (200, 100)
    >>> resolve_step(listing, 300)
    Traceback (most recent call last):
    ...
    treetools.shared.errors.CheckpointNotFoundError: run: step 300 is an incomplete save (300.orbax-checkpoint-tmp-1);
    it is never read. Committed steps: 100, 200.
    """
    where = where or listing.root
    asked = parse_step(step)
    if listing.conflict is not None:
        raise CheckpointError(listing.conflict)
    if not listing.committed:
        if not listing.store.exists(listing.root):
            raise CheckpointNotFoundError(f"{where}: no such file or folder.")
        note = f" (incomplete, never read: {_list(listing.incomplete)})" if listing.incomplete else ""
        raise CheckpointNotFoundError(f"{where}: no committed checkpoint step{note}.")
    if asked is None:
        asked = max(listing.committed)
    elif asked not in listing.committed:
        partial = [n for n in listing.incomplete if _number_of(n) == asked]
        if partial:
            raise CheckpointNotFoundError(
                f"{where}: step {asked} is an incomplete save ({', '.join(partial)}); it is never read. "
                f"Committed steps: {_list(listing.committed)}."
            )
        raise CheckpointNotFoundError(f"{where}: no step {asked}; available steps: {_list(listing.committed)}.")
    # asked: an int, or one of flax's float steps (0.625), which pass through the step API typed int
    listing.folder(asked)  # type: ignore[arg-type]  # two folders for one step: an error naming both
    return asked  # type: ignore[return-value]
