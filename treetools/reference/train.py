"""The reference training loop.

Everything treetools offers, used the way a trainer would:

* ``tabulate_params`` with the weight-decay column at start, and ``memory_plan``'s bytes per device, one
  line per part (params, grads, opt_state, params_ema);
* ``get_param_mask_fn`` as ``optax.adamw(mask=...)``;
* ``get_param_label_fn`` + ``optax.multi_transform`` to freeze the embeddings
  behind ``--freeze-embeddings``;
* ``clip_by_global_norm`` on the sharded global norm;
* ``update_ema`` for EMA params;
* ``norm_metrics`` every step inside jit, per module at ``norm_depth`` (by
  default one norm per block: ``grad_norm/layers_<i>`` at depth 1, and with
  ``scan_layers`` ``grad_norm/layers/<i>`` at depth 2, the layer index being a
  path part; the scanned blocks' stacked leaves split in the same pass),
  logged every ``log_every`` steps by ``MetricsLogger`` to ``WORKDIR/metrics.jsonl`` (no host sync in between;
  started afresh by a fresh run, continued after the restored step on resume), and with ``tensorboard=DIR``
  to a ``TensorBoardWriter(DIR)``, with ``wandb_project=NAME`` to a ``WandbWriter(NAME)`` (its files under
  ``WORKDIR/wandb/``): every writer gets the same records;
* ``get_checkpoint_manager`` saving params, params_ema, opt_state and the data
  iterator state, with the step's loss and norms (``save_checkpoint(...,
  metrics=...)``, shown by ``treetools inspect --step all``);
  ``restore_checkpoint`` into ``make_abstract`` targets to resume;
* with ``health`` (``treetools train --health``): per-layer training health
  (``norm_metrics(opt_state=..., abs_max=True)``: update ratios, moments,
  largest |g| and non-finite counts per module), a ``SpikeDetector`` whose
  flagged steps skip the update (``optax.tree.where``, as
  ``optax.apply_if_finite``; such a step logs update norms and ratios of 0, the
  update it discarded as ``discarded_update_ratio``, and a line of its own in
  metrics.jsonl when it is no log step; each log step has ``flagged_since_log``), a ``HealthRecorder`` ring buffer
  on the device (saved with the checkpoint as item ``health``) and a ``HealthDumper`` that
  writes ``WORKDIR/health/health_<step>.json`` a few steps after a flagged
  step; ``inject_spike=STEP`` feeds a deliberately bad batch (every token 0,
  like a batch of padding) at that step, to show the whole loop.

The model is FSDP-sharded over a mesh of all devices (``data`` x ``fsdp``);
batches are split over both axes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterable, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treetools as tt
from treetools.pytree.partitioning import box_spec, mesh_axes_of
from treetools.reference.data import MarkovTask
from treetools.reference.model import LAYERS, ModelConfig, Transformer

WEIGHT_DECAY_EXCLUDE = (r"bias$", r"scale$", r"pos_embed$")
CHECKPOINT_METRICS = ("loss", "grad_norm", "param_norm", "update_ratio")
"""The metrics of its step saved with each checkpoint (``treetools inspect --step all`` shows them per step)."""


@dataclasses.dataclass
class TrainConfig:
    workdir: str = "runs/demo"
    steps: int = 200
    batch_size: int = 32
    seq_len: int = 32
    seed: int = 0
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    ema_decay: float = 0.99
    warmup_steps: int = 10
    decay_steps: int = 2000
    log_every: int = 20
    ckpt_every: int = 100
    max_to_keep: int | None = 3  # None: every checkpoint is kept
    freeze_embeddings: bool = False
    resume: bool = True
    quiet: bool = False
    log: Callable[[str], Any] | None = None  # where progress lines go (None: print); `treetools train` passes its own
    norm_depth: int | None = None  # per-module norms of the first K path parts; None: one per block (see block_depth)
    health: bool = False  # per-layer health, spike/NaN detector (flagged steps skip the update), recorder and dumps
    inject_spike: int | None = None  # feed a bad batch (every token 0) at this step
    health_length: int = 32  # steps the on-device ring holds
    health_after: int = 4  # steps past a flagged step before its dump is written
    health_warmup: int = 20  # steps before the detector may flag a spike (NaN/Inf at once)
    tensorboard: str | None = None  # also write the metrics as TensorBoard event files in this folder
    wandb_project: str | None = None  # also log the metrics to a W&B run of this project (files in WORKDIR/wandb)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    init_from: str | None = None  # a Hugging Face model folder: its config.json is the model, its weights the start


def from_hf_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` whose model is ``cfg.init_from``'s ``config.json`` (``ModelConfig.from_hf``; ``scan_layers`` kept)."""
    if cfg.init_from is None:
        return cfg
    return dataclasses.replace(cfg, model=ModelConfig.from_hf(cfg.init_from, scan_layers=cfg.model.scan_layers))


def hf_params(cfg: TrainConfig) -> Any:
    """``cfg.init_from``'s weights as the reference model's params (host numpy): read through the preset
    ``FAMILY:hf:reference`` for the family of its ``config.json``, stacked under ``layers`` when scanned."""
    name = f"{cfg.model.family}:hf:reference"
    params = tt.load_parameters(cfg.init_from, rules=tt.preset(name, config=cfg.init_from))
    if cfg.model.scan_layers:
        blocks = [params.pop(f"{LAYERS}_{i}") for i in range(cfg.model.n_layers)]
        params[LAYERS] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
    return params


def block_depth(cfg: TrainConfig) -> int:
    """The norm depth the trainer logs: ``cfg.norm_depth``, else one norm per block.

    A block is ``layers_<i>`` (1 path part) unscanned and ``layers/<i>`` (2 parts: the layer index is a path
    part, as ``norm_metrics`` and ``inspect --unstack --depth`` count it) with ``scan_layers``.
    """
    if cfg.norm_depth is not None:
        return cfg.norm_depth
    return 2 if cfg.model.scan_layers else 1


def make_mesh() -> jax.sharding.Mesh:
    """All devices as ``data`` x ``fsdp`` (fsdp = 2 where the count is even)."""
    n = jax.device_count()
    fsdp = 2 if n % 2 == 0 else 1
    # Auto axes: GSPMD propagates shardings through the model (no explicit out_sharding per op).
    return jax.make_mesh((n // fsdp, fsdp), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    # The schedule must not depend on --steps: a run resumed with a larger
    # --steps has to follow the same curve as one that ran straight through.
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.decay_steps)
    # One exclude list for every family of the reference model: a llama has no bias and no pos_embed.
    decay_mask = tt.get_param_mask_fn(WEIGHT_DECAY_EXCLUDE, allow_unmatched=True)
    adamw = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask)
    rules = [(r"^embed/", "frozen")] if cfg.freeze_embeddings else []
    labels = tt.get_param_label_fn(rules, default="train")
    return optax.chain(
        tt.clip_by_global_norm(cfg.clip_norm),
        optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels),
    )


def _shardings(abstract: Any, mesh: jax.sharding.Mesh) -> Any:
    """Boxed leaves get ``NamedSharding(mesh, their names)`` (flax's own spec of the box), everything else is
    replicated. A dimension its named axes do not divide (GPT-2's vocabulary, 50257, over ``fsdp=2``; a tiny
    model's 61) is kept whole on every device, as ``tt.memory_plan`` plans it, rather than refused."""
    replicated = NamedSharding(mesh, P())

    def place(leaf: Any) -> NamedSharding:
        shape = getattr(tt.unbox(leaf), "shape", None)
        if not tt.is_box(leaf) or shape is None:  # optax's MaskedNode in a box (frozen params' moments) has none
            return replicated
        spec = list(box_spec(leaf) or ())
        for i, entry in enumerate(spec):
            if i < len(shape) and shape[i] % math.prod(mesh.shape[a] for a in mesh_axes_of(entry)):
                spec[i] = None
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(place, abstract, is_leaf=tt.is_box)


def _loss_fn(model: Transformer, params: Any, batch: jax.Array) -> jax.Array:
    logits = cast(jax.Array, model.apply({"params": params}, batch[:, :-1]))  # no mutable=: the output alone
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()


def make_health(cfg: TrainConfig) -> tuple[tt.SpikeDetector, tt.HealthRecorder]:
    """The detector (loss and the global grad norm, attributed per module) and the on-device ring."""
    return (tt.SpikeDetector(keys=("loss", "grad_norm"), modules="grad_norm", k=6.0, warmup=cfg.health_warmup),
            tt.HealthRecorder(length=cfg.health_length))


def _step_metrics(cfg: TrainConfig, grads: Any, params: Any, updates: Any, opt_state: Any,
                  loss: jax.Array) -> dict[str, Any]:
    if cfg.health:
        metrics = tt.norm_metrics(grads=grads, params=params, updates=updates, opt_state=opt_state,
                                  depth=block_depth(cfg), abs_max=True)
    else:
        metrics = tt.norm_metrics(grads=grads, params=params, updates=updates, depth=block_depth(cfg))
    metrics["loss"] = loss
    return metrics


def _skipped_update(metrics: dict[str, Any], flagged: jax.Array) -> dict[str, Any]:
    """The step's logged metrics once its update is decided: a flagged step applied no update, so its
    ``update_norm``/``update_ratio`` (global and per module) are 0, and the update it discarded is logged as
    ``discarded_update_ratio`` (0 on other steps). The recorder keeps the computed ones (the dump shows them)."""
    out = {k: jnp.where(flagged, jnp.zeros_like(v), v) if k.split("/")[0] in ("update_norm", "update_ratio") else v
           for k, v in metrics.items()}
    out["discarded_update_ratio"] = jnp.where(flagged, metrics["update_ratio"], jnp.zeros_like(metrics["update_ratio"]))
    out["flagged"] = flagged.astype(jnp.int32)
    return out


def _loaded(made: Any, weight: Any) -> Any:
    """``weight`` in place of the value ``made`` by ``model.init``: its dtype, and its box where it has one."""
    value = tt.unbox(made)
    new = jnp.asarray(weight, value.dtype).reshape(value.shape)
    return made.replace_boxed(new) if tt.is_box(made) else new


def build(cfg: TrainConfig) -> tuple[Any, Transformer, dict[str, Any], Any, Any, Callable]:
    """Model, optimizer, mesh, sharded initial state and the jitted step.

    With ``cfg.health`` the state holds ``health`` (the detector's and the
    recorder's states) and the step takes the step number; a flagged step
    keeps params, EMA and optimizer state as they were.
    """
    mesh = make_mesh()
    model = Transformer(cfg.model)
    tx = make_optimizer(cfg)
    dummy = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)
    detector, recorder = make_health(cfg)

    start = hf_params(cfg) if cfg.init_from is not None else None

    def init(key: jax.Array) -> dict[str, Any]:
        params = model.init(key, dummy)["params"]
        if start is not None:  # the weights of --init-from, in the dtypes and boxes (partition names) the model makes
            params = jax.tree.map(_loaded, params, start, is_leaf=tt.is_box)
        return {"params": params, "params_ema": params, "opt_state": tx.init(params)}

    def health_init(state: dict[str, Any]) -> dict[str, Any]:
        # The metric names fix the detector's and the recorder's layout (static), from shapes alone.
        metrics = jax.eval_shape(lambda s: _step_metrics(cfg, s["params"], s["params"], s["params"], s["opt_state"],
                                                         jnp.zeros((), jnp.float32)), state)
        return {"detector": detector.init(metrics), "recorder": recorder.init(metrics)}

    abstract_state = jax.eval_shape(init, jax.random.key(cfg.seed))
    if cfg.health:
        abstract_state = {**abstract_state, "health": jax.eval_shape(health_init, abstract_state)}
    state_shardings = _shardings(abstract_state, mesh)
    full_init = (lambda key: {**init(key), "health": health_init(init(key))}) if cfg.health else init
    state = jax.jit(full_init, out_shardings=state_shardings)(jax.random.key(cfg.seed))
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))

    def train_step(state: dict[str, Any], batch: jax.Array, step: jax.Array) -> tuple[dict[str, Any], Any]:
        loss, grads = jax.value_and_grad(lambda p: _loss_fn(model, p, batch))(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = _step_metrics(cfg, grads, params, updates, opt_state, loss)
        ema = tt.update_ema(state["params_ema"], params, cfg.ema_decay)
        new = {"params": params, "params_ema": ema, "opt_state": opt_state}
        if not cfg.health:
            return new, metrics
        health = state["health"]
        det, report = detector.update(health["detector"], metrics)
        rec = recorder.record(health["recorder"], step, metrics, report["flagged"])
        # A flagged step (a spike, or NaN/Inf) leaves the model as it was, as optax.apply_if_finite does.
        old = {k: state[k] for k in new}
        new = optax.tree.where(report["flagged"], old, new)
        metrics = _skipped_update(metrics, report["flagged"])
        return {**new, "health": {"detector": det, "recorder": rec}}, (metrics, report)

    step_fn = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding, None),
                      out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
    return mesh, model, state, state_shardings, batch_sharding, step_fn


def _say(cfg: TrainConfig, msg: str) -> None:
    if cfg.quiet:
        return
    if cfg.log is not None:
        cfg.log(msg)
    else:
        print(msg, flush=True)


def _check_run(cfg: TrainConfig, ckpt_dir: str) -> int | None:
    """The step to resume from (None: a fresh run); ``ValueError`` for settings that cannot work.

    Checked before anything is built, so a mistake costs no compile.
    """
    if cfg.steps < 1 or cfg.ckpt_every < 1 or cfg.log_every < 1 or cfg.batch_size < 1:
        raise ValueError("`--steps`, `--batch-size`, `--log-every` and `--ckpt-every` must be positive integers.")
    n = jax.device_count()
    if cfg.batch_size % n:
        raise ValueError(f"--batch-size {cfg.batch_size} does not split over {n} devices; use a multiple of {n}.")
    latest = tt.latest_step(ckpt_dir)
    if latest is not None and not cfg.resume:
        raise ValueError(f"{ckpt_dir} already holds checkpoints up to step {latest}; --no-resume would mix two runs "
                         "there. Pick a new --workdir, or drop --no-resume to continue that run.")
    return latest


def _saved_layout(cfg: TrainConfig, ckpt_dir: str, step: int) -> TrainConfig:
    """``cfg`` with the saved run's ``scan_layers``: a resumed run keeps its setting, whatever the flag says.

    The checkpoint's params metadata says which it is (no array is read): the scanned blocks are one
    ``layers`` module (``layers/qkv/kernel``), the unscanned ones ``layers_0`` ... (``layers_0/qkv/kernel``).
    A change is said on stderr.
    """
    params = tt.open_source(ckpt_dir).snapshot(step, ["params"]).items["params"]
    tops = {leaf.path[0] for leaf in params.leaves if leaf.path}
    scanned, unscanned = LAYERS in tops, f"{LAYERS}_0" in tops
    if scanned == unscanned or scanned == cfg.model.scan_layers:
        return cfg  # as asked, or neither layout: the restore names what differs
    how, paths = ("with", f"{LAYERS}/...") if scanned else ("without", f"{LAYERS}_0/...")
    print(f"treetools: note: {ckpt_dir} was saved {how} --scan-layers (its params are {paths}); resuming it {how} "
          "--scan-layers (a run keeps its setting; use a new --workdir to train the other way).", file=sys.stderr)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=scanned))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) for ``cfg.steps`` total steps; returns a summary dict."""
    ckpt_dir = os.path.abspath(os.path.join(cfg.workdir, "checkpoints"))
    metrics_path = os.path.join(cfg.workdir, "metrics.jsonl")
    latest = _check_run(cfg, ckpt_dir)
    if latest is not None and latest >= cfg.steps:
        print(f"treetools: note: {ckpt_dir} is already at step {latest} >= --steps {cfg.steps}; nothing to train "
              "(raise --steps to continue).", file=sys.stderr)
        return {"state": None, "first_loss": None, "last_loss": None, "checkpoint_dir": ckpt_dir,
                "metrics_path": metrics_path, "optimal_loss": None, "start_step": latest}
    cfg = from_hf_model(cfg)
    if latest is not None:  # a resumed run: the model is --init-from's, the weights the checkpoint's
        cfg = _saved_layout(dataclasses.replace(cfg, init_from=None), ckpt_dir, latest)
    elif cfg.init_from is not None:  # the model's config.json for the way back (convert --preset F:reference:hf)
        os.makedirs(cfg.workdir, exist_ok=True)
        with open(os.path.join(cfg.workdir, "config.json"), "w") as f:
            json.dump(cfg.model.to_hf(), f, indent=2)
    mesh, model, state, state_shardings, batch_sharding, step_fn = build(cfg)
    data = MarkovTask(cfg.model.vocab, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    manager = tt.get_checkpoint_manager(cfg.ckpt_every, max_to_keep=cfg.max_to_keep, checkpoint_dir=ckpt_dir)

    _say(cfg, f"mesh {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s)")
    _say(cfg, tt.memory_plan(state, mesh=mesh).summary())  # the fullest device, part by part (grads included)
    _say(cfg, tt.tabulate_params(state["params"], show_weight_decay=True,
                                 weight_decay_exclude=list(WEIGHT_DECAY_EXCLUDE), allow_unmatched=True, depth=None))
    start = 0
    if latest is not None:
        state = _resume(cfg, ckpt_dir, latest, manager, state, data)
        start = latest

    # A fresh run starts metrics.jsonl afresh; a resumed one keeps the records up to the restored
    # step and drops those logged after it (they are about to be logged again).
    jsonl = tt.JsonlWriter(metrics_path, resume_step=latest)
    writers = [jsonl, *_extra_writers(cfg, latest)]

    def record(step: int, host: dict[str, float]) -> None:
        for writer in writers:
            writer(step, host)
    losses: list[float] = []
    tick = [time.perf_counter(), start]

    def write(step: int, host: dict[str, float]) -> None:
        # MetricsLogger hands over host floats once per log step: the file and
        # the progress line share that one device-to-host transfer.
        record(step, host)
        losses.append(host["loss"])
        now = time.perf_counter()
        rate = (step - tick[1]) / max(now - tick[0], 1e-9)
        tick[:] = [now, step]
        _say(cfg, f"step {step:>5}/{cfg.steps}  loss {host['loss']:.4f}  grad_norm {host['grad_norm']:.4f}  "
                  f"update_ratio {host['update_ratio']:.2e}  {rate:.1f} steps/s")

    logger = tt.MetricsLogger(write, every=cfg.log_every)
    flag_log = tt.MetricsLogger(record, every=1)  # a flagged step between log steps gets its own line
    unread: dict[int, Any] = {}  # metrics of the steps whose flags the dumper has not read yet
    flags = [0, start]  # flagged steps since the last log step, and that step
    detector, _ = make_health(cfg)
    dumper = tt.HealthDumper(os.path.join(cfg.workdir, "health"), detector, after=cfg.health_after,
                             within=cfg.workdir) \
        if cfg.health else None
    events: list[dict[str, Any]] = []
    # On CPU, several steps in flight gain nothing and XLA:CPU's in-process
    # collectives (fake devices) can deadlock when many collective programs
    # queue up; there, wait for each step. Accelerators keep running ahead.
    one_in_flight = jax.default_backend() == "cpu"
    for step in range(start + 1, cfg.steps + 1):
        batch = jax.device_put(_next_batch(cfg, data, step), batch_sharding)
        state, metrics, report = _take_step(cfg, step_fn, state, batch, step, one_in_flight)
        if dumper is not None:  # before the logger: the flags of every earlier step are read by then
            unread[step] = metrics
            events += _health_events(cfg, dumper(step, state["health"]["recorder"], state["health"]["detector"],
                                                 report), unread, flag_log, flags)
            metrics = _after_health(cfg, step, metrics, unread, flags)
        logger(step, metrics)
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            if dumper is not None and step == cfg.steps:
                events += _health_events(cfg, dumper.close(), unread, flag_log, flags)
            tt.save_checkpoint(manager, step, _checkpoint_items(cfg, state, data), force=step == cfg.steps,
                               metrics={k: float(metrics[k]) for k in CHECKPOINT_METRICS})  # a save step's sync
    manager.wait_until_finished()
    manager.close()
    _close_writers(writers)
    _say(cfg, f"checkpoints: {ckpt_dir}\nmetrics:     {os.path.abspath(metrics_path)}")
    _say(cfg, f"inspect with: treetools inspect {ckpt_dir}")
    return {"state": state, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "checkpoint_dir": ckpt_dir,
            "metrics_path": metrics_path, "optimal_loss": data.optimal_loss(), "start_step": start,
            "health_events": events}


def _resume(cfg: TrainConfig, ckpt_dir: str, latest: int, manager: Any, state: dict[str, Any],
            data: MarkovTask) -> dict[str, Any]:
    """``state`` with what step ``latest`` saved restored into it (``data`` set to its saved position)."""
    parts = ("params", "params_ema", "opt_state")
    targets = tt.make_abstract({k: state[k] for k in parts})
    # A run saved without --health has no `health` item: its detector and recorder start afresh.
    has_health = cfg.health and "health" in tt.open_source(ckpt_dir).item_names(latest)
    if has_health:
        targets["health"] = tt.make_abstract(state["health"])
    restored = tt.restore_checkpoint(manager, latest, {**targets, "data_iter": None})
    state = {**state, **{k: restored[k] for k in (*parts, *(["health"] if has_health else []))}}
    data.set_state(restored["data_iter"])
    _say(cfg, f"resumed from step {latest} in {ckpt_dir}")
    return state


def _take_step(cfg: TrainConfig, step_fn: Callable, state: Any, batch: Any, step: int,
               one_in_flight: bool) -> tuple[Any, Any, Any]:
    """One training step: the new state, its metrics, and the health report (None without ``--health``)."""
    report = None
    if cfg.health:
        state, (metrics, report) = step_fn(state, batch, step)
    else:
        state, metrics = step_fn(state, batch, step)
    if one_in_flight:
        jax.block_until_ready(metrics)
    return state, metrics, report


def _next_batch(cfg: TrainConfig, data: MarkovTask, step: int) -> np.ndarray:
    """The batch of ``step``: the task's next, or at ``--inject-spike`` a deliberately bad one."""
    batch = next(data)
    if step == cfg.inject_spike:
        batch = np.zeros_like(batch)  # a deliberately bad batch: every token 0 (a batch of padding)
        _say(cfg, f"step {step}: injecting a bad batch (every token 0)")
    return batch


def _after_health(cfg: TrainConfig, step: int, metrics: dict[str, Any], unread: dict[int, Any],
                  flags: list[int]) -> dict[str, Any]:
    """Once the dumper has read ``step``'s flags: the earlier steps' metrics forgotten, and a log step's
    ``metrics`` with ``flagged_since_log`` (the count then starts again)."""
    for s in [s for s in unread if s < step]:
        del unread[s]
    if step % cfg.log_every == 0:
        metrics = {**metrics, "flagged_since_log": metrics["flagged"] + flags[0]}
        flags[:] = [0, step]
    return metrics


def _health_events(cfg: TrainConfig, new: Iterable[dict[str, Any]], unread: dict[int, Any], flag_log: Any,
                   flags: list[int]) -> list[dict[str, Any]]:
    """The dumper's ``new`` events, each said on stderr and its flagged step logged (``_log_flagged``)."""
    events = []
    for event in new:
        events.append(event)
        _say_event(cfg, event)
        _log_flagged(cfg, event, unread, flag_log, flags)
    return events


def _checkpoint_items(cfg: TrainConfig, state: dict[str, Any], data: MarkovTask) -> dict[str, Any]:
    """The items a checkpoint of the run saves."""
    items = {"params": state["params"], "params_ema": state["params_ema"], "opt_state": state["opt_state"],
             "data_iter": data.get_state()}
    if cfg.health:
        items["health"] = state["health"]
    return items


def _close_writers(writers: list[Any]) -> None:
    for writer in writers:
        close = getattr(writer, "close", None)
        if callable(close):
            close()


def _extra_writers(cfg: TrainConfig, resume_step: int | None) -> list[Any]:
    """The writers besides metrics.jsonl: TensorBoard event files, a W&B run; each continues after ``resume_step``."""
    writers: list[Any] = []
    if cfg.tensorboard is not None:
        writers.append(tt.TensorBoardWriter(cfg.tensorboard, resume_step=resume_step))
    if cfg.wandb_project is not None:
        config = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                  if isinstance(getattr(cfg, f.name), (int, float, str, bool))}
        writers.append(tt.WandbWriter(cfg.wandb_project, dir=cfg.workdir, config=config, resume_step=resume_step))
    return writers


def _log_flagged(cfg: TrainConfig, event: dict[str, Any], unread: dict[int, Any], flag_log: Any,
                 flags: list[int]) -> None:
    """A flagged step leaves a trace in metrics.jsonl: its own line when it is no log step (a log step's line
    has ``flagged`` 1 already), and a count in the next log step's ``flagged_since_log``."""
    step = event["step"]
    if event["event"] != "flagged" or step % cfg.log_every == 0 or step <= flags[1]:
        return
    flags[0] += 1
    if step in unread:
        flag_log(step, unread[step])


def _say_event(cfg: TrainConfig, event: dict[str, Any]) -> None:
    """A health event as the run's log shows it."""
    if event["event"] == "flagged":
        jumps = ", ".join(f"{m} ({r:.0f}x its running mean)" for m, r in event["ratios"].items())
        _say(cfg, f"step {event['step']}: flagged: {'; '.join(event['reasons'])}; largest jump: {jumps}; "
                  "update skipped")
    elif event["event"] == "dump":
        _say(cfg, f"health dump ({event['reason']}): {event['path']}  (draw it: treetools plot {event['path']})")
