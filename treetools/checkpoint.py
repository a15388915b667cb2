"""Orbax checkpoints: a manager, restore into abstract targets on any mesh, load_parameters.

A checkpoint root holds one folder per step (``100``, ``000100``, ``ckpt_100``)
and, inside it, one folder per item: ``params``, ``params_ema`` and
``opt_state`` (pytrees, Orbax ``StandardSave``) and ``data_iter`` (JSON, Orbax
``JsonSave``) by default.

Two layers live here:

* Step-folder scanning (``scan_steps``, ``list_steps``, ``list_incomplete``,
  ``parse_step_name``, ``is_committed_step_dir``): pure Python. This module
  imports neither jax nor orbax at import time, so ``treetools inspect`` can
  list the steps of any manager root cheaply; the Orbax layer below imports
  them inside its functions.
* The Orbax layer: ``get_checkpoint_manager``, ``save_checkpoint``,
  ``restore_checkpoint``, ``load_parameters``.

A step counts as *committed* only when Orbax finished it: its name carries no
Orbax tmp suffix (``300.orbax-checkpoint-tmp-1700000000``) and it holds
Orbax's commit marker (``commit_success.txt``, written by Orbax >= 0.11 on
every file system) or a ``_CHECKPOINT_METADATA`` with a commit timestamp. This
is stricter than Orbax's own listing on a local disk (any folder without the
tmp suffix), so a save killed after its folder got its final name is never
taken for the latest step.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import pathlib
import re
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:  # type hints only; jax and orbax are imported inside functions
    import jax
    import orbax.checkpoint as ocp

__all__ = [
    "CheckpointMismatchError",
    "DEFAULT_ITEMS",
    "DEFAULT_JSON_ITEMS",
    "Mismatch",
    "get_checkpoint_manager",
    "is_committed_step_dir",
    "latest_step",
    "list_incomplete",
    "list_steps",
    "load_parameters",
    "parse_step_name",
    "restore_checkpoint",
    "save_checkpoint",
    "scan_steps",
]

# Orbax's on-disk names (orbax.checkpoint._src.path.atomicity_types and
# _src.metadata.checkpoint); copied so that scanning needs no orbax import.
# tests/test_checkpoint.py checks that they still equal Orbax's.
TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_SUCCESS_FILE = "commit_success.txt"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
PYTREE_METADATA_FILE = "_METADATA"

DEFAULT_ITEMS = ("params", "params_ema", "opt_state", "data_iter")
"""Items a manager from ``get_checkpoint_manager`` knows unless told otherwise."""
DEFAULT_JSON_ITEMS = ("data_iter",)
"""Items saved as JSON (a dict of numbers, strings, lists): data iterator / trainer state."""

# "N", "000N" or "<prefix>_N" (Orbax's step_prefix joins with an underscore).
_STEP_NAME = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<step>\d+)$")
_BOXES_KEY = "treetools_boxes"


# --------------------------------------------------------------------------
# Step folders (pure Python)
# --------------------------------------------------------------------------


def _as_path(path: Any) -> Any:
    """A local ``pathlib.Path``, or an ``etils.epath.Path`` for ``gs://``-style URLs."""
    if hasattr(path, "iterdir"):  # already a Path (pathlib or etils.epath)
        return path
    if isinstance(path, str) and "://" in path:
        from etils import epath  # light, pure Python; ships with orbax

        return epath.Path(path)
    if isinstance(path, (str, os.PathLike)):
        return pathlib.Path(path)
    raise TypeError(f"`checkpoint_dir` must be a path, got {type(path).__name__}.")


def parse_step_name(name: str, *, step_prefix: str | None = None) -> int | None:
    """The step number in a step-folder name, or None when it is not one.

    Accepts Orbax's names: ``"100"``, zero padded ``"000100"``, prefixed
    ``"ckpt_100"`` / ``"ckpt_000100"``. Orbax tmp folders are not step folders.

    Args:
      name: a folder name.
      step_prefix: only accept this prefix (None: any prefix or none).

    >>> parse_step_name("ckpt_000120"), parse_step_name("300.orbax-checkpoint-tmp-17"), parse_step_name("logs")
    (120, None, None)
    """
    if TMP_DIR_SUFFIX in name:
        return None
    m = _STEP_NAME.match(name)
    if m is None or (step_prefix is not None and m.group("prefix") != step_prefix):
        return None
    return int(m.group("step"))


def _tmp_step(name: str, step_prefix: str | None) -> int | None:
    """The step an Orbax tmp folder (``<step name>.orbax-checkpoint-tmp-<ts>``) was saving."""
    head, sep, _ = name.partition(TMP_DIR_SUFFIX)
    return parse_step_name(head, step_prefix=step_prefix) if sep else None


def is_committed_step_dir(step_dir: Any) -> bool:
    """True when Orbax finished writing this step folder.

    Committed means: no Orbax tmp suffix in the name, and either Orbax's
    ``commit_success.txt`` or a ``_CHECKPOINT_METADATA`` whose
    ``commit_timestamp_nsecs`` is set. A folder with neither file is a legacy
    Orbax checkpoint (before step metadata existed) and counts as committed
    when it is not empty.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "100"; d.mkdir()
    >>> is_committed_step_dir(d)
    False
    >>> _ = (d / "commit_success.txt").write_text("ok"); is_committed_step_dir(d)
    True
    """
    step_dir = _as_path(step_dir)
    if TMP_DIR_SUFFIX in step_dir.name or not step_dir.is_dir():
        return False
    if (step_dir / COMMIT_SUCCESS_FILE).exists():
        return True
    meta = step_dir / STEP_METADATA_FILE
    if meta.exists():
        try:
            return bool(json.loads(meta.read_text()).get("commit_timestamp_nsecs"))
        except (OSError, ValueError, AttributeError):
            return False  # half-written metadata: the save died while writing it
    return any(True for _ in step_dir.iterdir())


def scan_steps(root: Any, *, step_prefix: str | None = None) -> tuple[dict[int, Any], list[str]]:
    """Committed and incomplete step folders directly under a manager root.

    Reads names and marker files only (no array data, no jax, no orbax), and
    never writes. Files and folders that are not step folders are ignored.

    Args:
      root: the manager's directory (a local path, or ``gs://...`` via etils).
      step_prefix: only folders with this prefix (None: any prefix or none).

    Returns:
      ``(committed, incomplete)``: ``{step: step folder path}`` sorted by step,
      and the names of incomplete folders (Orbax tmp folders and step folders
      without a commit marker), sorted by step. A missing root gives ``({}, [])``.

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for name in ("ckpt_0100", "ckpt_0200.orbax-checkpoint-tmp-17", "logs"):
    ...     (root / name).mkdir()
    >>> _ = (root / "ckpt_0100" / "commit_success.txt").write_text("ok")
    >>> committed, incomplete = scan_steps(root)
    >>> list(committed), incomplete
    ([100], ['ckpt_0200.orbax-checkpoint-tmp-17'])
    """
    root = _as_path(root)
    if not root.is_dir():
        return {}, []
    committed: dict[int, Any] = {}
    incomplete: list[tuple[int, str]] = []
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        name = child.name
        tmp = _tmp_step(name, step_prefix)
        if tmp is not None:
            if child.is_dir():
                incomplete.append((tmp, name))
            continue
        step = parse_step_name(name, step_prefix=step_prefix)
        if step is None or not child.is_dir():
            continue
        if is_committed_step_dir(child):
            committed.setdefault(step, child)
        else:
            incomplete.append((step, name))
    return dict(sorted(committed.items())), [name for _, name in sorted(incomplete)]


def list_steps(checkpoint_dir: Any, *, step_prefix: str | None = None) -> list[int]:
    """Committed steps under a manager root, ascending (incomplete saves left out).

    >>> import tempfile
    >>> list_steps(tempfile.mkdtemp())
    []
    """
    return list(scan_steps(checkpoint_dir, step_prefix=step_prefix)[0])


def list_incomplete(checkpoint_dir: Any, *, step_prefix: str | None = None) -> list[str]:
    """Names of incomplete step folders (Orbax tmp folders, no commit marker).

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "7.orbax-checkpoint-tmp-1").mkdir()
    >>> list_incomplete(root)
    ['7.orbax-checkpoint-tmp-1']
    """
    return scan_steps(checkpoint_dir, step_prefix=step_prefix)[1]


def latest_step(checkpoint_dir: Any, *, step_prefix: str | None = None) -> int | None:
    """The highest committed step, or None when there is none.

    >>> import tempfile
    >>> latest_step(tempfile.mkdtemp()) is None
    True
    """
    steps = list_steps(checkpoint_dir, step_prefix=step_prefix)
    return steps[-1] if steps else None


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int (numpy and jax integer scalars too), or None; bools are not steps."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _no_steps_error(root: Any, incomplete: list[str]) -> FileNotFoundError:
    """Why there is no committed step under ``root``, with the fix."""
    if not root.exists():
        return FileNotFoundError(f"`checkpoint_dir` {root} does not exist; pass the checkpoint manager's root folder.")
    if not root.is_dir():
        return FileNotFoundError(f"`checkpoint_dir` {root} is not a directory; pass the checkpoint manager's root folder.")
    if incomplete:
        return FileNotFoundError(f"no committed checkpoint step under {root} (incomplete, never read: {incomplete}).")
    return FileNotFoundError(
        f"no checkpoint steps under {root}; pass the checkpoint manager's root folder (the one holding step folders)."
    )


def _step_number(step: Any) -> int | None:
    """The asked step as an int, or None for the latest (None, -1, "latest")."""
    if step is None or (isinstance(step, str) and step == "latest"):
        return None
    number = None if isinstance(step, str) else _as_int(step)
    if number is None:
        raise TypeError(f"`step` must be an int, -1, None or 'latest', got {step!r}.")
    return None if number == -1 else number


def _resolve_step(root: Any, step: Any) -> tuple[int, Any]:
    """``(step, step folder)`` for a committed step; None/-1/"latest" mean the latest one."""
    step = _step_number(step)
    committed, incomplete = scan_steps(root)
    if not committed:
        raise _no_steps_error(root, incomplete)
    if step is None:
        step = max(committed)
    if step not in committed:
        note = f" (incomplete, never read: {incomplete})" if incomplete else ""
        raise FileNotFoundError(
            f"checkpoint step {step} not found under {root}; available steps: {list(committed)}{note}."
        )
    return step, committed[step]


def _step_folder(path: Any, step: Any) -> tuple[int, Any] | None:
    """``(step, path)`` when ``path`` is itself a committed step folder rather than a manager root."""
    own = parse_step_name(path.name)
    if own is None or not is_committed_step_dir(path) or scan_steps(path) != ({}, []):
        return None
    asked = _step_number(step)
    if asked not in (None, own):
        raise ValueError(
            f"`checkpoint_dir` {path} is the folder of step {own}, but `step`={step!r} was asked; "
            f"pass the manager root {path.parent} instead."
        )
    return own, path


def _items_present(step_dir: Any) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir() if p.is_dir())


# --------------------------------------------------------------------------
# Manager and saving
# --------------------------------------------------------------------------

# (item names, JSON item names) of the managers built here; other items are decided by content.
_MANAGER_ITEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _positive_int(value: Any, name: str, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"`{name}` must be a positive integer{' or None' if optional else ''}, got {value!r}.")
    return number


def get_checkpoint_manager(
    ckpt_frequency: int,
    max_to_keep: int | None = None,
    save_frequency: int | None = None,
    checkpoint_dir: Any = None,
    *,
    item_names: Iterable[str] = DEFAULT_ITEMS,
    json_items: Iterable[str] = DEFAULT_JSON_ITEMS,
    async_save: bool = True,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    read_only: bool = False,
    **options: Any,
) -> "ocp.CheckpointManager":
    """An Orbax ``CheckpointManager`` for params, EMA params, optimizer state and JSON state.

    Saves happen at every multiple of ``ckpt_frequency`` (``manager.save`` on
    other steps is a no-op unless forced); the newest ``max_to_keep`` steps are
    kept, and, with ``save_frequency``, every multiple of it is kept for good
    (Orbax's ``LatestN`` + ``EveryNSteps`` preservation).

    Args:
      ckpt_frequency: save every this many steps.
      max_to_keep: keep this many of the newest steps (None: keep all).
      save_frequency: also keep every step that is a multiple of this, forever;
        must be a multiple of ``ckpt_frequency`` so that such steps get saved.
      checkpoint_dir: the root folder; required (a run's own folder, e.g.
        ``workdir / "checkpoints"``; no shared default that runs could clobber).
      item_names: items the manager saves and restores.
      json_items: those of ``item_names`` stored as JSON (``ocp.args.JsonSave``);
        the others are pytrees (``ocp.args.StandardSave``).
      async_save: write in a background thread (Orbax async checkpointing);
        ``manager.wait_until_finished()`` blocks until the save is committed.
      step_prefix: step folders named ``<prefix>_<step>``.
      step_format_fixed_length: zero-pad step numbers to this many digits.
      read_only: never save or delete (for readers of someone else's run).
      **options: further ``ocp.CheckpointManagerOptions`` fields.

    Returns:
      the manager; use it with ``save_checkpoint`` and ``restore_checkpoint``.

    Raises:
      ValueError: a bad frequency, a ``save_frequency`` that is not a multiple of
        ``ckpt_frequency``, no ``checkpoint_dir``, or a JSON item not in ``item_names``.

    >>> import tempfile
    >>> mngr = get_checkpoint_manager(100, max_to_keep=3, save_frequency=1000, checkpoint_dir=tempfile.mkdtemp())
    >>> mngr.should_save(200), mngr.should_save(250)
    (True, False)
    >>> mngr.close()
    """
    ckpt_frequency = _positive_int(ckpt_frequency, "ckpt_frequency")
    max_to_keep = _positive_int(max_to_keep, "max_to_keep", optional=True)
    save_frequency = _positive_int(save_frequency, "save_frequency", optional=True)
    if save_frequency is not None and save_frequency % ckpt_frequency:
        raise ValueError(
            f"`save_frequency` ({save_frequency}) must be a multiple of `ckpt_frequency` ({ckpt_frequency}); "
            f"steps kept for good must be steps that get saved, e.g. save_frequency={ckpt_frequency * max(1, round(save_frequency / ckpt_frequency))}."
        )
    if checkpoint_dir is None:
        raise ValueError("`checkpoint_dir` is required; pass the run's checkpoint folder, e.g. workdir / 'checkpoints'.")
    item_names, json_items = tuple(item_names), frozenset(json_items)
    if not json_items <= set(item_names):
        raise ValueError(f"`json_items` {sorted(json_items - set(item_names))} are not in `item_names` {list(item_names)}.")

    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as cm

    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in item_names:
        if name in json_items:
            handler, save, restore = ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore
        else:
            handler, save, restore = ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore
        registry.add(name, save, handler)
        registry.add(name, restore, handler)

    keep = [cm.LatestN(n=max_to_keep)]
    if save_frequency is not None:
        keep.append(cm.EveryNSteps(interval_steps=save_frequency))
    options.setdefault(
        # Orbax's default also saves the first step it sees; a trainer expects multiples only.
        "save_decision_policy",
        cm.AnySavePolicy([cm.FixedIntervalPolicy(ckpt_frequency), cm.PreemptionCheckpointingPolicy()]),
    )
    options.setdefault("preservation_policy", cm.AnyPreservationPolicy(keep))
    manager_options = ocp.CheckpointManagerOptions(
        save_interval_steps=ckpt_frequency,
        enable_async_checkpointing=async_save,
        step_prefix=step_prefix,
        step_format_fixed_length=step_format_fixed_length,
        create=not read_only,
        read_only=read_only,
        **options,
    )
    directory = checkpoint_dir if "://" in str(checkpoint_dir) else os.path.abspath(os.fspath(checkpoint_dir))
    manager = ocp.CheckpointManager(directory, options=manager_options, handler_registry=registry)
    _MANAGER_ITEMS[manager] = (frozenset(item_names), json_items)
    return manager


def _is_json_item(manager: Any, name: str, tree: Any) -> bool:
    """JSON when the manager registered ``name`` as JSON; else a dict without arrays."""
    names, json_names = _MANAGER_ITEMS.get(manager, ((), ()))
    if name in names:
        return name in json_names
    import jax

    from treetools.counting import is_array_like

    return isinstance(tree, Mapping) and not any(is_array_like(x) for x in jax.tree.leaves(tree))


def _box_record(tree: Any) -> dict[str, str]:
    """``{box path: path of its array inside the box}`` (e.g. ``{"Dense_0/kernel": "value"}``).

    Stored as custom metadata next to the item, so that ``load_parameters``
    without model code can drop the box level that Orbax stores as a folder.
    """
    import jax

    from treetools.partitioning import is_box
    from treetools.paths import leaves_with_paths, path_str

    out = {}
    for path, leaf in leaves_with_paths(tree):
        if is_box(leaf):
            inner = jax.tree_util.tree_leaves_with_path(leaf)
            if len(inner) == 1:
                out[path] = path_str(inner[0][0])
    return out


def _recorded_boxes(meta: Any) -> dict[str, str]:
    """The ``_box_record`` that ``save_checkpoint`` stored with an item's Orbax metadata ({} when none)."""
    custom = getattr(meta, "custom_metadata", None)
    boxes = custom.get(_BOXES_KEY) if isinstance(custom, Mapping) else None
    if not isinstance(boxes, Mapping):
        return {}
    return {str(box): inner for box, inner in boxes.items() if isinstance(inner, str)}


def _as_json(name: str, tree: Any) -> Any:
    """``tree`` as it will read back from JSON: numpy / jax numbers and arrays become Python ones.

    Checked here, before Orbax starts: its JSON writer runs in a background
    thread, where a ``np.int64`` epoch counter fails late and leaves a tmp folder.
    """
    import numpy as np

    from treetools.counting import is_array_like

    def plain(x: Any) -> Any:
        if is_array_like(x):
            return np.asarray(x).tolist()
        raise TypeError(f"`{type(x).__name__}` values are not JSON")

    try:
        return json.loads(json.dumps(tree, default=plain))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`items[{name!r}]` is saved as JSON, but {e}; keep it to numbers, strings, lists and dicts, "
            "or save it as a pytree item."
        ) from None


def _check_savable(name: str, tree: Any) -> None:
    """Raise before Orbax starts (and leaves a tmp folder behind) on leaves it cannot save."""
    from treetools.counting import is_array_like
    from treetools.partitioning import unbox
    from treetools.paths import leaves_with_paths

    empty = [p for p, x in leaves_with_paths(tree) if is_array_like(x) and 0 in unbox(x).shape]
    if empty:
        raise ValueError(
            f"`items[{name!r}]` has zero-size arrays, which Orbax cannot save: {empty[:5]}; "
            "drop those leaves or replace them with None."
        )


def save_checkpoint(
    manager: "ocp.CheckpointManager",
    step: int,
    items: Mapping[str, Any],
    *,
    force: bool = False,
    wait: bool = False,
    metrics: Mapping[str, Any] | None = None,
) -> bool:
    """Save named items at ``step`` through ``manager``; returns whether it saved.

    Pytrees (params, EMA, optimizer state; arrays may be sharded across
    processes, boxes are kept) go through ``ocp.args.StandardSave``; JSON items
    through ``ocp.args.JsonSave``, numpy / jax numbers in them stored as Python
    ones. Which is which: the manager's ``json_items`` when it came from
    ``get_checkpoint_manager``, otherwise a dict with no array leaves is JSON.
    ``None`` items are skipped. Every process must call this (Orbax
    coordinates multi-process saves).

    Args:
      manager: from ``get_checkpoint_manager``.
      step: the training step.
      items: name -> pytree or JSON dict.
      force: save even when ``step`` is not a multiple of ``ckpt_frequency``.
      wait: block until the save is committed (async managers return at once
        otherwise; the next save or ``restore_checkpoint`` waits anyway).
      metrics: optional metrics stored with the step.

    Raises:
      ValueError: a pytree item holds zero-size arrays (Orbax cannot save them).
      TypeError: a JSON item holds something JSON cannot store.
      Both are raised before anything is written.

    >>> import tempfile, numpy as np
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=tempfile.mkdtemp())
    >>> save_checkpoint(mngr, 1, {"params": {"w": np.ones(2)}, "data_iter": {"epoch": 0}}, wait=True)
    True
    >>> mngr.close()
    """
    import orbax.checkpoint as ocp

    args = {}
    for name, tree in items.items():
        if tree is None:
            continue
        if _is_json_item(manager, name, tree):
            args[name] = ocp.args.JsonSave(_as_json(name, tree))
        else:
            _check_savable(name, tree)
            boxes = _box_record(tree)
            args[name] = ocp.args.StandardSave(tree, custom_metadata={_BOXES_KEY: boxes} if boxes else None)
    saved = manager.save(step, args=ocp.args.Composite(**args), force=force, metrics=metrics)
    if wait:
        manager.wait_until_finished()
    return bool(saved)


# --------------------------------------------------------------------------
# Restoring
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One leaf where a restore target and the checkpoint disagree.

    ``kind`` is ``"missing"`` (the target has it, the checkpoint does not),
    ``"unexpected"`` (the checkpoint has it, the target does not), ``"shape"``
    or ``"dtype"``; ``path`` is the leaf's path in ``items`` (``params/layers/3/w``).
    """

    path: str
    kind: str
    expected: str
    found: str

    def __str__(self) -> str:
        if self.kind == "missing":
            has = "" if self.found == "nothing" else f"; checkpoint has {self.found}"
            return f"{self.path}: missing in checkpoint (target expects {self.expected}{has})"
        if self.kind == "unexpected":
            return f"{self.path}: in checkpoint as {self.found} but not in the target"
        return f"{self.path}: {self.kind} mismatch, target {self.expected} vs checkpoint {self.found}"


class CheckpointMismatchError(ValueError):
    """A restore target does not match the checkpoint; ``problems`` lists every leaf."""

    def __init__(self, step: int, root: Any, problems: list[Mismatch]):
        self.step, self.root, self.problems = step, root, problems
        hint = "fix the target (model config, layer count, dtypes) or restore a matching step"
        if any(p.kind == "dtype" for p in problems):
            hint += "; pass allow_dtype_cast=True for a deliberate dtype change"
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(
            f"checkpoint step {step} under {root} does not match the restore target "
            f"({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}\n{hint}."
        )


def _describe(x: Any) -> str:
    import numpy as np

    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def _compare(
    item: str, target: Any, meta_tree: Any, boxes: Mapping[str, str], *, allow_dtype_cast: bool
) -> list[Mismatch]:
    """Every leaf where ``target`` and the checkpoint's metadata tree disagree.

    Orbax stores a box's array one level down (``kernel/value``); the target is
    flattened the same way to line leaves up, and paths are reported at the box
    (``kernel``), as everywhere in treetools.
    """
    import jax
    import numpy as np

    from treetools.paths import is_leaf, path_str

    expected: dict[str, tuple[str, Any]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(target, is_leaf=is_leaf):
        for sub, x in jax.tree_util.tree_leaves_with_path(leaf):
            expected[path_str(path + sub)] = (path_str(path), x)
    found = {path_str(p): m for p, m in jax.tree_util.tree_leaves_with_path(meta_tree)}
    stored_box = {f"{box}/{inner}": box for box, inner in boxes.items()}

    problems = []
    for key, (shown, x) in expected.items():
        if key not in found:
            problems.append(Mismatch(f"{item}/{shown}", "missing", _describe(x), "nothing"))
            continue
        meta = found[key]
        if not (hasattr(x, "shape") and hasattr(meta, "shape")):
            continue
        if tuple(x.shape) != tuple(meta.shape):
            problems.append(Mismatch(f"{item}/{shown}", "shape", str(tuple(x.shape)), str(tuple(meta.shape))))
        elif getattr(meta, "dtype", None) is not None and np.dtype(x.dtype) != np.dtype(meta.dtype):
            if not allow_dtype_cast:
                problems.append(
                    Mismatch(f"{item}/{shown}", "dtype", np.dtype(x.dtype).name, np.dtype(meta.dtype).name)
                )
    for key in found.keys() - expected.keys():
        problems.append(Mismatch(f"{item}/{stored_box.get(key, key)}", "unexpected", "nothing", _describe(found[key])))
    return sorted(problems, key=lambda p: (p.kind != "missing", p.path))


def _default_sharding() -> "jax.sharding.Sharding":
    """Replicated over every device of every process: valid single- and multi-process."""
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _abstract_target(item: str, target: Any, sharding: Any) -> Any:
    """The target as ``ShapeDtypeStruct``s with a sharding on every array (boxes kept)."""
    import jax

    from treetools.abstract import make_abstract

    if isinstance(sharding, Mapping):
        sharding = sharding.get(item)
    abstract = make_abstract(target, sharding)
    default = None

    def fill(x: Any) -> Any:
        nonlocal default
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            default = default or _default_sharding()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default)
        return x

    return jax.tree.map(fill, abstract)


def _restores_as_json(manager: Any, name: str, target: Any, step_dir: Any) -> bool:
    """Whether item ``name`` is restored as JSON.

    A None target asks for JSON, unless the step stored ``name`` as a pytree
    (Orbax's ``_METADATA``); then ``_prepare`` says what to pass, rather than
    Orbax's "no registered handler" error.
    """
    if target is None:
        return not (step_dir / name / PYTREE_METADATA_FILE).exists() and _is_json_item(manager, name, {})
    return _is_json_item(manager, name, target)


def _tree_metadata(manager: Any, step: int, step_dir: Any, name: str) -> Any:
    """Orbax's TreeMetadata of one pytree item, or None when the step lacks it."""
    import orbax.checkpoint as ocp

    if not (step_dir / name).is_dir():
        return None
    meta = None
    if manager is not None:
        try:
            meta = manager.item_metadata(step)[name]
        except (KeyError, ValueError, TypeError):
            meta = None
    if meta is None:  # an item the manager has no handler for: read it directly
        meta = ocp.PyTreeCheckpointHandler().metadata(step_dir / name)
    return meta


def _prepare(
    manager: Any, step: int, step_dir: Any, name: str, target: Any, sharding: Any, allow_dtype_cast: bool
) -> tuple[Any, list[Mismatch]]:
    """``(abstract target, problems)`` for one pytree item."""
    if target is None:
        raise ValueError(
            f"`items[{name!r}]` is None; pass the live tree or make_abstract(...) to restore into, "
            "or use load_parameters() for host numpy arrays."
        )
    abstract = _abstract_target(name, target, sharding)
    meta = _tree_metadata(manager, step, step_dir, name)
    if meta is None:
        return abstract, [Mismatch(name, "missing", f"item {name!r}", f"items {_items_present(step_dir)}")]
    return abstract, _compare(name, abstract, meta.tree, _recorded_boxes(meta), allow_dtype_cast=allow_dtype_cast)


def restore_checkpoint(
    manager: "ocp.CheckpointManager",
    step: int | str | None,
    items: Mapping[str, Any],
    *,
    sharding: Any = None,
    allow_dtype_cast: bool = False,
) -> dict[str, Any]:
    """Restore named items of a step into their targets' structure, dtypes and shardings.

    Each pytree target may be the live tree (arrays), an abstract one
    (``make_abstract``), or boxed (flax ``nn.Partitioned``: boxes come back as
    boxes). Every array is read straight into its target sharding, so each
    process reads only the shards its devices hold (Orbax ``ArrayRestoreArgs``
    over tensorstore), on any mesh or device count: a checkpoint saved from 8
    devices restores onto 1, 2 or 4, or from fsdp onto tensor-parallel specs.
    Arrays whose target has no sharding are replicated over all devices.

    Before reading anything, every target is checked against the checkpoint's
    metadata; all missing, unexpected, mis-shaped and (unless
    ``allow_dtype_cast``) mis-typed leaves are reported in one error.

    Args:
      manager: from ``get_checkpoint_manager`` (any Orbax ``CheckpointManager``).
      step: a committed step; None, -1 or ``"latest"`` for the latest committed
        one (incomplete saves are never picked).
      items: name -> target tree; JSON items (``data_iter``) may map to None and
        come back as dicts.
      sharding: one ``Sharding`` for every array, or ``{name: Sharding or tree
        of Shardings}``; overrides the targets' own shardings.
      allow_dtype_cast: let a target dtype differ from the stored one (e.g. bf16
        params from an fp32 checkpoint); values are converted on read.

    Returns:
      name -> restored tree (JSON items as dicts).

    Raises:
      FileNotFoundError: no such committed step (the message lists them).
      ValueError: ``sharding`` is a dict whose keys are not item names.
      CheckpointMismatchError: (a ``ValueError``) targets do not match.

    >>> import tempfile, numpy as np, jax
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=tempfile.mkdtemp())
    >>> _ = save_checkpoint(mngr, 1, {"params": {"w": jax.numpy.arange(4.0)}, "data_iter": {"epoch": 2}})
    >>> out = restore_checkpoint(mngr, "latest", {"params": {"w": jax.numpy.zeros(4)}, "data_iter": None})
    >>> out["params"]["w"].tolist(), out["data_iter"]
    ([0.0, 1.0, 2.0, 3.0], {'epoch': 2})
    >>> mngr.close()
    """
    import orbax.checkpoint as ocp

    if isinstance(sharding, Mapping) and not set(sharding) <= set(items):
        raise ValueError(
            f"`sharding` keys {sorted(set(sharding) - set(items))} are not in `items` {list(items)}; "
            "pass one Sharding, or {item name: Sharding or tree of Shardings}."
        )
    manager.wait_until_finished()  # a pending async save may be the latest step
    step, step_dir = _resolve_step(manager.directory, step)
    args, problems = {}, []
    for name, target in items.items():
        if _restores_as_json(manager, name, target, step_dir):
            if not (step_dir / name).is_dir():
                problems.append(Mismatch(name, "missing", f"item {name!r}", "nothing"))
            args[name] = ocp.args.JsonRestore()
            continue
        abstract, item_problems = _prepare(manager, step, step_dir, name, target, sharding, allow_dtype_cast)
        problems += item_problems
        args[name] = ocp.args.StandardRestore(abstract)
    if problems:
        raise CheckpointMismatchError(step, manager.directory, problems)
    restored = manager.restore(step, args=ocp.args.Composite(**args))
    return {name: restored[name] for name in items}


def _numpy_tree(item_dir: Any) -> Any:
    """The stored tree of one pytree item as host numpy arrays, boxes dropped."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from treetools.paths import path_str

    meta = ocp.PyTreeCheckpointHandler().metadata(item_dir)

    def restore_arg(m: Any) -> Any:
        # Host numpy: no device, mesh or topology of the saving run is needed.
        is_array = isinstance(m, ocp.metadata.ArrayMetadata)
        return ocp.RestoreArgs(restore_type=np.ndarray) if is_array else ocp.RestoreArgs()

    restore_args = jax.tree.map(restore_arg, meta.tree)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        tree = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    boxes = _recorded_boxes(meta)
    if not boxes:
        return tree

    def is_stored_box(x: Any) -> bool:
        return isinstance(x, Mapping) and len(x) == 1 and next(iter(x)) in set(boxes.values())

    def unbox(path: Any, x: Any) -> Any:
        return x[boxes[path_str(path)]] if is_stored_box(x) and path_str(path) in boxes else x

    return jax.tree_util.tree_map_with_path(unbox, tree, is_leaf=is_stored_box)


def load_parameters(
    checkpoint_dir: Any,
    step: int | str | None = -1,
    *,
    use_ema_params: bool = False,
    target: Any = None,
    item: str | None = None,
    sharding: Any = None,
    allow_dtype_cast: bool = False,
) -> Any:
    """The params (or EMA params) of one step, without a manager or model code.

    With ``target=None`` the result is the stored tree as nested dicts/lists of
    host ``numpy`` arrays (boxes dropped: ``Dense_0/kernel`` is an array),
    readable on any machine, whatever devices or topology saved it. With a
    ``target`` (live or ``make_abstract`` tree, boxes allowed) it is restored
    like ``restore_checkpoint``: checked, then placed per the target's
    shardings (or ``sharding``). Reads only; nothing under ``checkpoint_dir``
    is written.

    Args:
      checkpoint_dir: the manager's root folder, or one committed step folder
        in it (then that step is read).
      step: a committed step; -1 (or None / "latest") for the latest one.
        Incomplete saves are never picked.
      use_ema_params: read ``params_ema`` instead of ``params``.
      target: optional tree to restore into.
      item: read this item instead (overrides ``use_ema_params``).
      sharding: with ``target``: one ``Sharding`` for every array, or a tree.
      allow_dtype_cast: with ``target``: allow a dtype change on read.

    Raises:
      FileNotFoundError: no such folder, no checkpoint in it, an unknown step
        (the message lists the available steps), or the step has no such item.
      ValueError: ``checkpoint_dir`` is one step folder and ``step`` names another.
      CheckpointMismatchError: ``target`` does not match the checkpoint.

    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> mngr = get_checkpoint_manager(1, checkpoint_dir=root)
    >>> _ = save_checkpoint(mngr, 5, {"params": {"w": np.arange(3.0)}}, wait=True); mngr.close()
    >>> load_parameters(root)["w"]
    array([0., 1., 2.])
    """
    import orbax.checkpoint as ocp

    root = _as_path(checkpoint_dir)
    step, step_dir = _step_folder(root, step) or _resolve_step(root, step)
    name = item or ("params_ema" if use_ema_params else "params")
    if not (step_dir / name).is_dir():
        raise FileNotFoundError(
            f"step {step} under {root} has no item {name!r}; items present: {_items_present(step_dir)}."
        )
    if target is None:
        return _numpy_tree(step_dir / name)
    abstract, problems = _prepare(None, step, step_dir, name, target, {name: sharding}, allow_dtype_cast)
    if problems:
        raise CheckpointMismatchError(step, root, problems)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        return ckptr.restore(step_dir / name, args=ocp.args.StandardRestore(abstract))
