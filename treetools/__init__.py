"""PyTree chores for JAX / Flax / Optax / Orbax trainers.

Quickstart, by task (``help(tt.NAME)`` for any name; ``treetools --help`` for the CLI):

    >>> import jax.numpy as jnp
    >>> import treetools as tt
    >>> params = {"Dense_0": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
    ...           "Dense_1": {"kernel": jnp.ones((8, 2)), "bias": jnp.zeros(2)}}

Count and tabulate (arrays, ShapeDtypeStructs, flax boxes, nnx State, TrainState):

    >>> tt.get_num_params(params), tt.get_num_bytes(params)   # per_device=True: one device's share
    (58, 232)
    >>> print(tt.tabulate_params(params, show_weight_decay=True, weight_decay_exclude=[r"bias$"]))
    path            shape    dtype    params    bytes    sharding    weight_decay
    ...
    Dense_0/kernel  (4, 8)   float32  32        128 B                True
    ...
    Total: 58 params, 232 bytes

Will it fit? Per-device memory of a state on any mesh, nothing allocated (``treetools plan CKPT`` for a checkpoint):

    >>> import optax
    >>> plan = tt.memory_plan(params, mesh={"data": 4, "fsdp": 2}, optimizer=optax.adamw(1e-3), device_memory="1KiB")
    >>> plan.by_part, plan.fits   # nothing names a mesh axis: every device holds it all (and Adam's count)
    ({'params': 232, 'grads': 232, 'opt_state': 468}, True)

Norms to log (one jit-safe pass, sharded trees too), written every N steps:

    >>> m = tt.norm_metrics(grads=params, params=params, depth=1)
    >>> sorted(m)
    ['grad_norm', 'grad_norm/Dense_0', 'grad_norm/Dense_1', 'nonfinite_grads', 'nonfinite_grads/Dense_0',
     'nonfinite_grads/Dense_1', 'param_norm', 'param_norm/Dense_0', 'param_norm/Dense_1']
    >>> round(float(m["grad_norm/Dense_1"]), 3)   # sqrt(16 ones)
    4.0
    >>> # log = tt.MetricsLogger("run/metrics.jsonl", every=20); log(step, m)   then: treetools plot run
    >>> # training health (update ratios, Adam moments, a spike/NaN detector, dumps): docs/health.md

Masks and labels from path patterns (``optax.adamw(mask=...)``, ``optax.multi_transform``):

    >>> tt.get_param_mask_fn(exclude=[r"bias$"])(params)["Dense_0"]
    {'bias': False, 'kernel': True}
    >>> tt.get_param_label_fn([(r"^Dense_0/", "frozen")], default="train")(params)["Dense_1"]
    {'bias': 'train', 'kernel': 'train'}

Abstract trees and Orbax checkpoints (restore onto any mesh):

    >>> abstract = tt.make_abstract(params)
    >>> abstract["Dense_0"]["kernel"].shape
    (4, 8)
    >>> import tempfile
    >>> manager = tt.get_checkpoint_manager(100, checkpoint_dir=tempfile.mkdtemp())
    >>> tt.save_checkpoint(manager, 100, {"params": params})
    True
    >>> manager.wait_until_finished()
    >>> restored = tt.restore_checkpoint(manager, "latest", {"params": abstract})["params"]
    >>> float(restored["Dense_1"]["kernel"].sum())
    16.0
    >>> sorted(tt.flatten(tt.load_parameters(manager.directory)))   # no model code needed
    ['Dense_0/bias', 'Dense_0/kernel', 'Dense_1/bias', 'Dense_1/kernel']
    >>> manager.close()

Inspect any checkpoint from the shell (no jax import for metadata):

    treetools inspect CKPT_DIR [--stats] [--format json]
    treetools diff CKPT_A CKPT_B --values
    treetools convert CKPT_DIR hf_model/ --dtype bfloat16 --verify    # safetensors (Hugging Face), streamed
    treetools plot run/metrics.jsonl other/metrics.jsonl -o curves.png

Every leaf is named by one path string, ``Dense_0/kernel`` (``tt.flatten``);
patterns are regexes matched with ``re.search``.
"""

# Names are re-exported lazily (PEP 562, __getattr__ below) so that `import treetools` and
# `treetools --help` do not import jax. Adding a public name is one line in _EXPORTS.
# Module-level helpers are underscored and dir() lists only __all__, so dir(tt),
# `from treetools import *` and help(treetools) show the public API and nothing else.
import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

_EXPORTS = {  # public name -> module under treetools
    # partitioning
    "is_partitioned": "pytree.partitioning",
    "is_box": "pytree.partitioning",
    "unbox": "pytree.partitioning",
    "unbox_tree": "pytree.partitioning",
    "leaf_sharding": "pytree.partitioning",
    "LeafSharding": "shared.rows",
    "params_of": "pytree.partitioning",
    # paths
    "flatten": "pytree.paths",
    "unflatten": "pytree.paths",
    "leaves_with_paths": "pytree.paths",
    "map_with_path": "pytree.paths",
    "path_str": "pytree.paths",
    # counting
    "get_num_params": "pytree.counting",
    "get_num_bytes": "pytree.counting",
    # table
    "tabulate_params": "pytree.table",
    # memory: will it fit?
    "memory_plan": "pytree.memory",
    "MemoryPlan": "pytree.memory",
    "plan_checkpoint": "checkpoint_jax.memory",
    "Row": "shared.rows",
    "rows_from_tree": "pytree.table",
    # norms
    "get_sharded_norm_logits": "pytree.norms",
    "get_sharded_global_norm": "pytree.norms",
    "get_grad_norms": "pytree.norms",
    "get_param_norms": "pytree.norms",
    "norm_metrics": "pytree.norms",
    "clip_by_global_norm": "pytree.norms",
    # metrics
    "MetricsLogger": "pytree.metrics",
    "JsonlWriter": "pytree.metrics",
    "read_metrics": "pytree.metrics",
    "TensorBoardWriter": "pytree.metrics",
    "WandbWriter": "pytree.metrics",
    # training health: spike/NaN detector, on-device recorder, dumps
    "SpikeDetector": "pytree.health",
    "DetectorState": "pytree.health",
    "HealthRecorder": "pytree.health",
    "RecorderState": "pytree.health",
    "HealthDumper": "pytree.health",
    "write_health_dump": "pytree.health",
    "every_n": "pytree.health",
    # masks
    "get_param_mask_fn": "pytree.masks",
    "get_param_label_fn": "pytree.masks",
    "flattened_traversal": "pytree.masks",
    # abstract
    "make_abstract": "pytree.abstract",
    "replicate": "pytree.abstract",
    "update_ema": "pytree.abstract",
    # checkpointing: a manager and saving; restore and load from any checkpoint
    "get_checkpoint_manager": "checkpoint_jax.manager",
    "save_checkpoint": "checkpoint_jax.manager",
    "restore_checkpoint": "checkpoint_jax.restore",
    "plan_restore": "checkpoint_jax.restore",
    "RestorePlan": "checkpoint_jax.restore_plan",
    "load_parameters": "checkpoint_jax.restore",
    "connect_processes": "checkpoint_jax.distributed",
    # the checkpoint layer (treetools.checkpoint_io has the rest, for format authors)
    "list_steps": "checkpoint_io.steps",
    "list_incomplete": "checkpoint_io.steps",
    "latest_step": "checkpoint_io.steps",
    "open_source": "checkpoint_io.opening",
    "ReadOptions": "checkpoint_io.context",
    "register_format": "checkpoint_io.registry",
    "Format": "checkpoint_io.source",
    # commands over checkpoints
    "inspect_path": "checkpoint_tools.report",
    "diff_paths": "checkpoint_tools.diff",
    "convert": "checkpoint_tools.convert",
    # figures (matplotlib: the plot extra)
    "plot_metrics": "checkpoint_tools.plot",
    "plot_stats": "checkpoint_tools.plot",
    # errors: every one a user can meet (docs/errors.md), all under TreetoolsError
    "TreetoolsError": "shared.errors",
    "CheckpointError": "shared.errors",
    "NotACheckpointError": "shared.errors",
    "CheckpointMismatchError": "shared.errors",
    "CheckpointNotFoundError": "shared.errors",
    "StepDeletedError": "shared.errors",
    "PatternError": "shared.errors",
    "RulesError": "shared.errors",
    "UsageError": "shared.errors",
    "LinkRefusedError": "shared.files",
    "MemoryBudgetError": "checkpoint_io.readers",
    "OutsideCheckpointError": "checkpoint_io.storage.base",
    "SpecialFileError": "checkpoint_io.storage.base",
    "RemoteStorageError": "checkpoint_io.storage.reach",
    "RemoteNotFoundError": "checkpoint_io.storage.bucket",
    "MsgpackError": "checkpoint_io.formats._msgpack",
    "NpyHeaderError": "checkpoint_io.formats.npz",
    "OutputError": "shared.errors",
    # rules: rename, drop, cast, transpose, stack/unstack a checkpoint's leaves
    "Rules": "rules.spec",
    "presets": "rules.presets",
    "preset": "rules.presets",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> _typing.Any:
    if name == "ckpt":  # `tt.ckpt.open_source(...)`: the format authors' module, loaded on first use
        return _importlib.import_module("treetools.ckpt")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treetools' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"treetools.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)


if _typing.TYPE_CHECKING:
    from treetools.checkpoint_io.context import ReadOptions
    from treetools.checkpoint_io.formats._msgpack import MsgpackError
    from treetools.checkpoint_io.formats.npz import NpyHeaderError
    from treetools.checkpoint_io.opening import open_source
    from treetools.checkpoint_io.readers import MemoryBudgetError
    from treetools.checkpoint_io.registry import register_format
    from treetools.checkpoint_io.source import Format
    from treetools.checkpoint_io.steps import latest_step, list_incomplete, list_steps
    from treetools.checkpoint_io.storage.base import OutsideCheckpointError, SpecialFileError
    from treetools.checkpoint_io.storage.bucket import RemoteNotFoundError
    from treetools.checkpoint_io.storage.reach import RemoteStorageError
    from treetools.checkpoint_jax.distributed import connect_processes
    from treetools.checkpoint_jax.manager import get_checkpoint_manager, save_checkpoint
    from treetools.checkpoint_jax.memory import plan_checkpoint
    from treetools.checkpoint_jax.restore import load_parameters, plan_restore, restore_checkpoint
    from treetools.checkpoint_jax.restore_plan import RestorePlan
    from treetools.checkpoint_tools.convert import convert
    from treetools.checkpoint_tools.diff import diff_paths
    from treetools.checkpoint_tools.plot import plot_metrics, plot_stats
    from treetools.checkpoint_tools.report import inspect_path
    from treetools.pytree.abstract import make_abstract, replicate, update_ema
    from treetools.pytree.counting import get_num_bytes, get_num_params
    from treetools.pytree.health import (
        DetectorState,
        HealthDumper,
        HealthRecorder,
        RecorderState,
        SpikeDetector,
        every_n,
        write_health_dump,
    )
    from treetools.pytree.masks import flattened_traversal, get_param_label_fn, get_param_mask_fn
    from treetools.pytree.memory import MemoryPlan, memory_plan
    from treetools.pytree.metrics import JsonlWriter, MetricsLogger, TensorBoardWriter, WandbWriter, read_metrics
    from treetools.pytree.norms import (
        clip_by_global_norm,
        get_grad_norms,
        get_param_norms,
        get_sharded_global_norm,
        get_sharded_norm_logits,
        norm_metrics,
    )
    from treetools.pytree.partitioning import is_box, is_partitioned, leaf_sharding, params_of, unbox, unbox_tree
    from treetools.pytree.paths import flatten, leaves_with_paths, map_with_path, path_str, unflatten
    from treetools.pytree.table import rows_from_tree, tabulate_params
    from treetools.rules.presets import preset, presets
    from treetools.rules.spec import Rules
    from treetools.shared.errors import (
        CheckpointError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        NotACheckpointError,
        OutputError,
        PatternError,
        RulesError,
        StepDeletedError,
        TreetoolsError,
        UsageError,
    )
    from treetools.shared.files import LinkRefusedError
    from treetools.shared.rows import LeafSharding, Row
