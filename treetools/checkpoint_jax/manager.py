"""Orbax checkpointing for a training loop: a manager on treetools' one step rule, and saving.

``get_checkpoint_manager`` builds an Orbax ``CheckpointManager`` whose notion
of a committed step is ``treetools.checkpoint_io.steps``' (the same one
``load_parameters``, ``restore_checkpoint`` and ``treetools inspect`` use), so
they agree on which step is the latest. ``save_checkpoint`` stores named items
(pytrees with every box replaced by the array it holds: boxes are never
written to disk, ``restore_checkpoint`` puts them back; JSON items as JSON)
and checks before Orbax starts what Orbax would fail on late.

Orbax is imported when a manager is built or a save made, not at import time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping, overload

import jax
import numpy as np

from treetools.checkpoint_io.storage import location
from treetools.checkpoint_io.steps import scan_steps
from treetools.pytree.counting import is_array_like
from treetools.pytree.partitioning import unbox, unbox_tree
from treetools.pytree.paths import leaves_with_paths

if TYPE_CHECKING:  # type hints only; orbax is imported inside functions
    import orbax.checkpoint as ocp

DEFAULT_ITEMS = ("params", "params_ema", "opt_state", "data_iter")
"""Items a manager from ``get_checkpoint_manager`` knows unless told otherwise."""
DEFAULT_JSON_ITEMS = ("data_iter",)
"""Items saved as JSON (a dict of numbers, strings, lists): data iterator / trainer state."""

def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


# --------------------------------------------------------------------------
# Manager and saving
# --------------------------------------------------------------------------

# (item names, JSON item names) of the managers built here; other items are decided by content.
_MANAGER_ITEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _StepNameFormat:
    """Orbax's step ``NameFormat`` with treetools' step rule: Orbax names, treetools' commit rule.

    The manager's ``all_steps()``/``latest_step()`` then list exactly the steps
    ``treetools.steps.scan_steps`` calls committed.
    """

    def __init__(self, step_prefix: str | None, step_format_fixed_length: int | None):
        import orbax.checkpoint as ocp

        self.step_prefix = step_prefix
        self._standard = ocp.step.standard_name_format(
            step_prefix=step_prefix, step_format_fixed_length=step_format_fixed_length
        )

    def __str__(self) -> str:
        return f"treetools step rule over {self._standard}"

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path: Any) -> Iterable[Any]:
        import orbax.checkpoint as ocp
        from etils import epath

        listing = scan_steps(os.fspath(base_path), step_prefix=self.step_prefix)
        return [ocp.step.Metadata(step=s, path=epath.Path(p)) for s, p in listing.committed.items()]

    def find_step(self, base_path: Any, step: int) -> Any:
        for meta in self.find_all(base_path):
            if meta.step == step:
                return meta
        raise ValueError(f"no committed step {step} under {base_path}.")


@overload
def _positive_int(value: Any, name: str, *, optional: Literal[False] = False) -> int: ...
@overload
def _positive_int(value: Any, name: str, *, optional: bool) -> int | None: ...
def _positive_int(value: Any, name: str, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"`{name}` must be a positive integer{' or None' if optional else ''}, got {value!r}.")
    return number


class _DropMessage(logging.Filter):
    """Drops the absl records whose unformatted message is ``message``; lets every other record through."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


# Logged by Orbax's CheckpointManager.__init__ whenever read_only=True: a notice, not a problem, for a manager
# asked to be read-only. Only this exact record is dropped, and only while such a manager is built.
_READ_ONLY_NOTICE = "Given directory is read only=%s"


@contextlib.contextmanager
def _quiet_read_only_notice(read_only: bool) -> Iterator[None]:
    if not read_only:
        yield
        return
    absl_logger, drop = logging.getLogger("absl"), _DropMessage(_READ_ONLY_NOTICE)
    absl_logger.addFilter(drop)
    try:
        yield
    finally:
        absl_logger.removeFilter(drop)


def get_checkpoint_manager(
    ckpt_frequency: int,
    max_to_keep: int | None = None,
    *,
    checkpoint_dir: Any,
    keep_period: int | None = None,
    item_names: Iterable[str] = DEFAULT_ITEMS,
    json_items: Iterable[str] = DEFAULT_JSON_ITEMS,
    async_save: bool = True,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    read_only: bool = False,
    save_frequency: int | None = None,
    **options: Any,
) -> "ocp.CheckpointManager":
    """An Orbax ``CheckpointManager`` for params, EMA params, optimizer state and JSON state.

    Saves happen at every multiple of ``ckpt_frequency`` (``manager.save`` on
    other steps is a no-op unless forced); the newest ``max_to_keep`` steps are
    kept, and, with ``keep_period``, every multiple of it is kept for good
    (Orbax's ``LatestN`` + ``EveryNSteps`` preservation).

    Args:
      ckpt_frequency: save every this many steps.
      max_to_keep: keep this many of the newest steps (None: keep all).
      checkpoint_dir: the root folder, required, by keyword (a run's own
        folder, e.g. ``workdir / "checkpoints"``; no shared default that runs
        could clobber).
      keep_period: also keep every step that is a multiple of this, forever
        (Orbax's name for it: ``CheckpointManagerOptions.keep_period``); must
        be a multiple of ``ckpt_frequency`` so that such steps get saved.
      item_names: items the manager saves and restores.
      json_items: those of ``item_names`` stored as JSON (``ocp.args.JsonSave``);
        the others are pytrees (``ocp.args.StandardSave``).
      async_save: write in a background thread (Orbax async checkpointing);
        ``manager.wait_until_finished()`` blocks until the save is committed.
      step_prefix: step folders named ``<prefix>_<step>``.
      step_format_fixed_length: zero-pad step numbers to this many digits.
      read_only: never save or delete (for readers of someone else's run); quiet:
        Orbax's two notices that it switched saving off are not logged.
      save_frequency: the old name of ``keep_period`` (it never set how often
        a save happens); still accepted, with a ``DeprecationWarning``.
      **options: further ``ocp.CheckpointManagerOptions`` fields.

    Returns:
      the manager; use it with ``save_checkpoint`` and ``restore_checkpoint``.

    Raises:
      ValueError: a bad frequency, a ``keep_period`` that is not a multiple of
        ``ckpt_frequency``, ``checkpoint_dir=None``, or a JSON item not in ``item_names``.
      TypeError: no ``checkpoint_dir``, or both ``keep_period`` and ``save_frequency``.

    >>> import tempfile
    >>> mngr = get_checkpoint_manager(100, max_to_keep=3, keep_period=1000, checkpoint_dir=tempfile.mkdtemp())
    >>> mngr.should_save(200), mngr.should_save(250)
    (True, False)
    >>> mngr.close()
    """
    if save_frequency is not None:
        if keep_period is not None:
            raise TypeError("pass `keep_period` alone: `save_frequency` is its old name.")
        warnings.warn("`save_frequency` is renamed `keep_period` (every multiple of it is kept for good; it does "
                      "not set how often a save happens): pass keep_period=.", DeprecationWarning, stacklevel=2)
        keep_period = save_frequency
    ckpt_frequency = _positive_int(ckpt_frequency, "ckpt_frequency")
    max_to_keep = _positive_int(max_to_keep, "max_to_keep", optional=True)
    keep_period = _positive_int(keep_period, "keep_period", optional=True)
    if keep_period is not None and keep_period % ckpt_frequency:
        raise ValueError(
            f"`keep_period` ({keep_period}) must be a multiple of `ckpt_frequency` ({ckpt_frequency}); "
            "steps kept for good must be steps that get saved, e.g. "
            f"keep_period={ckpt_frequency * max(1, round(keep_period / ckpt_frequency))}."
        )
    if checkpoint_dir is None:
        raise ValueError("`checkpoint_dir` is required; pass the run's checkpoint folder, e.g. "
                         "workdir / 'checkpoints'.")
    item_names, json_items = tuple(item_names), frozenset(json_items)
    if not json_items <= set(item_names):
        raise ValueError(f"`json_items` {sorted(json_items - set(item_names))} are not in `item_names` "
                         f"{list(item_names)}.")

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
    if keep_period is not None:
        keep.append(cm.EveryNSteps(interval_steps=keep_period))
    options.setdefault(
        # Orbax's default also saves the first step it sees; a trainer expects multiples only.
        "save_decision_policy",
        cm.AnySavePolicy([cm.FixedIntervalPolicy(ckpt_frequency), cm.PreemptionCheckpointingPolicy()]),
    )
    options.setdefault("preservation_policy", cm.AnyPreservationPolicy(keep))
    options.setdefault("step_name_format", _StepNameFormat(step_prefix, step_format_fixed_length))
    manager_options = ocp.CheckpointManagerOptions(
        # read_only: the values Orbax would otherwise switch (and log that it did).
        save_interval_steps=0 if read_only else ckpt_frequency,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        **options,
    )
    directory = location(checkpoint_dir, name="checkpoint_dir")
    with _quiet_read_only_notice(read_only):
        manager = ocp.CheckpointManager(directory, options=manager_options, handler_registry=registry)
    _MANAGER_ITEMS[manager] = (frozenset(item_names), json_items)
    return manager


def _as_json(name: str, tree: Any) -> Any:
    """``tree`` as it will read back from JSON: numpy / jax numbers and arrays become Python ones.

    Checked here, before Orbax starts: its JSON writer runs in a background
    thread, where a ``np.int64`` epoch counter fails late and leaves a tmp folder.
    """
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
    empty = [p for p, x in leaves_with_paths(tree) if is_array_like(x) and 0 in unbox(x).shape]
    if empty:
        raise ValueError(
            f"`items[{name!r}]` has zero-size arrays, which Orbax cannot save: {empty[:5]}; "
            "drop those leaves or replace them with None."
        )


def _is_json_item(manager: Any, name: str, tree: Any) -> bool:
    """JSON when the manager registered ``name`` as JSON; else a dict without arrays."""
    names, json_names = _MANAGER_ITEMS.get(manager, ((), ()))
    if name in names:
        return name in json_names
    return isinstance(tree, Mapping) and not any(is_array_like(x) for x in jax.tree.leaves(tree))


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
    processes) go through ``ocp.args.StandardSave`` with every box replaced by
    the array it holds (boxes are never written to disk; ``restore_checkpoint``
    puts them back); JSON items through ``ocp.args.JsonSave``, numpy / jax
    numbers in them stored as Python ones. Which is which: the manager's
    ``json_items`` when it came from ``get_checkpoint_manager``, otherwise a
    dict with no array leaves is JSON. ``None`` items are skipped. Every
    process must call this (Orbax coordinates multi-process saves).

    What happens, and what it returns:

    * ``True``: the step was saved (or, with an async manager, the save started;
      ``wait=True`` blocks until it is committed).
    * ``False``, silently: ``step`` is not a save step of the manager's policy
      (not a multiple of ``ckpt_frequency``), which a training loop that calls
      this every step relies on. ``force=True`` saves anyway.
    * ``False`` with a warning: the step is already saved (e.g. after a resume).

    Args:
      manager: from ``get_checkpoint_manager`` (or any Orbax ``CheckpointManager``).
      step: the training step.
      items: name -> pytree or JSON dict.
      force: save even when ``step`` is not a multiple of ``ckpt_frequency``.
      wait: block until the save is committed.
      metrics: numbers stored with the step (in its ``_CHECKPOINT_METADATA``),
        shown by ``treetools inspect``; stored whether or not the manager has a ``best_fn``.

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

    number = _as_int(step)
    if number is None or number < 0:
        raise TypeError(f"`step` must be a non-negative integer, got {step!r}.")
    args = {}
    for name, tree in items.items():
        if tree is None:
            continue
        if _is_json_item(manager, name, tree):
            args[name] = ocp.args.JsonSave(_as_json(name, tree))
        else:
            _check_savable(name, tree)
            args[name] = ocp.args.StandardSave(unbox_tree(tree))
    stored_metrics = _as_json("metrics", dict(metrics)) if metrics is not None else None
    if number in (manager.all_steps() or ()):
        warnings.warn(f"step {number} is already saved under {manager.directory}; not saved again "
                      "(restore it, or save at a later step).", stacklevel=2)
        return False
    saved = manager.save(number, args=ocp.args.Composite(**args), force=force, metrics=stored_metrics,
                         custom_metadata={"metrics": stored_metrics} if stored_metrics else None)
    if wait:
        manager.wait_until_finished()
    return bool(saved)
