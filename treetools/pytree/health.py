"""Training health inside the step: a spike/NaN detector, an on-device recorder, and the host side that dumps it.

Three pieces, each a small pytree updated inside the jitted step (no host
callback, no host sync), and one host object:

* ``SpikeDetector``: running mean and variance of chosen metrics (the global
  ``grad_norm`` and ``loss`` by default) and of each module's norm. A step is
  *flagged* when a metric is more than ``k`` running standard deviations
  above its running mean (after ``warmup`` steps), or when any watched value
  is NaN/Inf. Its report names, as indices into the static module list, the
  modules whose norm jumped most relative to their own running mean (the
  attribution) and those holding non-finite values. Flagged steps do not
  move the running statistics. Skip the update on a flagged step as
  ``optax.apply_if_finite`` does: ``optax.tree.where(report["flagged"], old, new)``.
* ``HealthRecorder``: a ring buffer of the last ``length`` steps of chosen
  metrics (per layer: ``grad_norm/<module>``, ``update_ratio/<module>``, ...),
  kept on the device and written into at each step.
* ``HealthDumper`` (host): reads the flags of recent steps (small, one step
  late, or every ``check_every`` steps) and writes the ring to a JSON file
  ``after`` steps past a flagged step, or every ``every`` steps: the file
  ``treetools plot`` draws as a per-layer heatmap around the spike, the
  attributed modules marked (``treetools.checkpoint_tools.healthplot``).
* ``every_n(step, n, fn, ...)``: per-layer work only on every n-th step, behind
  ``lax.cond`` (measured against the plain reductions in ``benchmarks/``: a
  win on CPU; on GPU a conditional makes the step wait for its predicate).

>>> import jax, jax.numpy as jnp
>>> detector = SpikeDetector(keys=("grad_norm",), k=4.0, warmup=3)
>>> metrics = lambda g, a: {"grad_norm": jnp.float32(g), "grad_norm/a": jnp.float32(a), "grad_norm/b": jnp.float32(1.0)}
>>> state = detector.init(metrics(1.0, 1.0))
>>> update = jax.jit(detector.update)
>>> for step in range(10):
...     state, report = update(state, metrics(1.0 + 0.01 * (step % 2), 1.0))
>>> state, report = update(state, metrics(9.0, 8.0))   # a spike, mostly in module `a`
>>> detector.explain(state, report)["attributed"]
['a', 'b']
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treetools.shared.files import refuse_link_out, replace_file
from treetools.shared.records import encode_record

DUMP_KIND = "treetools.health_dump"
DUMP_SCHEMA = 1
_F32 = jnp.float32


def _names(metrics: Mapping[str, Any] | Sequence[str]) -> list[str]:
    return list(metrics) if not isinstance(metrics, Mapping) else list(metrics.keys())


def _check_names(who: str, names: Sequence[str], metrics: Mapping[str, Any]) -> None:
    missing = [n for n in names if n not in metrics]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"{who} state was made for metrics this step's dict lacks ({shown}); make the state with "
                         "`init` from a dict with the same keys as the one the step passes.")


# --------------------------------------------------------------------------- #
# The detector
# --------------------------------------------------------------------------- #


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DetectorState:
    """Running statistics (arrays) and the watched names (static: part of the tree's structure)."""

    count: jax.Array  # steps folded into the statistics (flagged steps are not)
    mean: jax.Array  # (len(keys),) running mean of each watched metric
    var: jax.Array  # (len(keys),) running variance
    module_mean: jax.Array  # (len(modules),) running mean of each module's norm
    streak: jax.Array  # () int32: consecutive steps over k sigma so far
    keys: tuple[str, ...] = dataclasses.field(metadata={"static": True}, default=())
    modules: tuple[str, ...] = dataclasses.field(metadata={"static": True}, default=())


@dataclasses.dataclass(frozen=True)
class SpikeDetector:
    """Flag a step whose metric jumps over ``k`` sigma, or that holds NaN/Inf, and name the modules behind it.

    Args:
      keys: the global metrics watched for a spike (each must be in the metrics dict).
      modules: the kind whose per-module entries ``<modules>/<name>`` are
        attributed (``grad_norm``: ``norm_metrics(depth=K)``'s per-module norms).
      k: flag a metric more than ``k`` running standard deviations above its running mean.
      decay: weight of the past in the running statistics (exponential; the
        first ``1 / (1 - decay)`` steps are a plain running average).
      warmup: steps folded in before a spike can be flagged (NaN/Inf are
        flagged from the first step).
      top: how many modules the report ranks.
      min_rel_std: the standard deviation is taken as at least this fraction
        of the mean, so a metric that has barely moved is not flagged for a
        tiny wiggle.
      patience: after this many consecutive steps over ``k`` sigma, the new
        level is taken as the metric's own (a shift, not a spike): that step is
        not flagged and is folded into the statistics, so a detector never
        stays stuck flagging every step. NaN/Inf are always flagged.

    >>> SpikeDetector(k=6.0).keys
    ('loss', 'grad_norm')
    """

    keys: tuple[str, ...] = ("loss", "grad_norm")
    modules: str = "grad_norm"
    k: float = 6.0
    decay: float = 0.99
    warmup: int = 20
    top: int = 3
    min_rel_std: float = 0.01
    patience: int = 10

    def __post_init__(self):
        if not self.keys:
            raise ValueError("`keys` must name at least one metric to watch, e.g. ('loss', 'grad_norm').")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"`decay` must be in [0, 1), got {self.decay}.")
        if self.k <= 0 or self.top < 1 or self.warmup < 0:
            raise ValueError(f"`k` must be > 0, `top` >= 1 and `warmup` >= 0; got k={self.k}, top={self.top}, "
                             f"warmup={self.warmup}.")

    def module_names(self, metrics: Mapping[str, Any] | Sequence[str]) -> tuple[str, ...]:
        prefix = self.modules + "/"
        return tuple(n[len(prefix):] for n in _names(metrics) if n.startswith(prefix))

    def init(self, metrics: Mapping[str, Any] | Sequence[str]) -> DetectorState:
        """A fresh state for metric dicts with these keys (values ignored: ``jax.eval_shape`` output will do).

        Raises:
          ValueError: a watched key is not among the metrics (names the ones there are).
        """
        names = _names(metrics)
        missing = [k for k in self.keys if k not in names]
        if missing:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(f"SpikeDetector watches {missing}, which the metrics do not have ({shown}); pass "
                             "`keys=` from those.")
        modules = self.module_names(names)
        zeros = lambda n: jnp.zeros((n,), _F32)  # noqa: E731
        return DetectorState(jnp.zeros((), jnp.int32), zeros(len(self.keys)), zeros(len(self.keys)),
                             zeros(len(modules)), jnp.zeros((), jnp.int32), tuple(self.keys), modules)

    def update(self, state: DetectorState, metrics: Mapping[str, Any]) -> tuple[DetectorState, dict[str, jax.Array]]:
        """Fold this step into the statistics (unless flagged) and report on it. Jittable; no host sync.

        Returns:
          ``(state, report)``; the report holds ``flagged``, ``spike``,
          ``nonfinite`` (bools), ``z`` (each watched metric's distance from
          its mean in standard deviations), ``ratio`` (each module's norm over
          its running mean), ``top`` (indices of the ``top`` largest ratios,
          largest first), ``nonfinite_modules`` (a bool per module: a
          non-finite norm, or ``nonfinite_grads/<module>`` above 0).
        """
        _check_names("SpikeDetector", (*state.keys, *(f"{self.modules}/{m}" for m in state.modules)), metrics)
        x = jnp.stack([jnp.asarray(metrics[k], _F32) for k in state.keys])
        mods = [jnp.asarray(metrics[f"{self.modules}/{m}"], _F32) for m in state.modules]
        mod = jnp.stack(mods) if mods else jnp.zeros((0,), _F32)
        counts = [metrics.get(f"nonfinite_grads/{m}") for m in state.modules]
        bad_mod = ~jnp.isfinite(mod)
        if mods and all(c is not None for c in counts):
            bad_mod = bad_mod | (jnp.stack([jnp.asarray(c) for c in counts]) > 0)
        total = metrics.get("nonfinite_grads")
        nonfinite = ~jnp.all(jnp.isfinite(x)) | jnp.any(bad_mod)
        if total is not None:
            nonfinite = nonfinite | (jnp.asarray(total) > 0)
        std = jnp.maximum(jnp.sqrt(state.var), self.min_rel_std * jnp.abs(state.mean))
        z = jnp.where(std > 0, (x - state.mean) / jnp.where(std > 0, std, 1.0), 0.0)
        over = (state.count >= self.warmup) & jnp.any(jnp.isfinite(x) & (z > self.k))
        spike = over & (state.streak < self.patience)  # past the patience: a new level, not a spike
        flagged = spike | nonfinite
        seen = state.module_mean > 0
        ratio = jnp.where(seen, mod / jnp.where(seen, state.module_mean, 1.0), 1.0)
        ranked = jnp.where(jnp.isfinite(ratio), ratio, jnp.inf)
        top = jnp.argsort(-ranked)[: min(self.top, len(state.modules))] if mods else jnp.zeros((0,), jnp.int32)
        # Exponentially weighted mean and variance; a plain running average while count < 1 / (1 - decay).
        alpha = jnp.maximum(1.0 - self.decay, 1.0 / (state.count + 1).astype(_F32))
        delta = x - state.mean
        mean = state.mean + alpha * delta
        var = (1.0 - alpha) * (state.var + alpha * delta**2)
        module_mean = state.module_mean + alpha * (mod - state.module_mean)
        keep = lambda old, new: jnp.where(flagged, old, new)  # noqa: E731 - a flagged step leaves no trace
        streak = jnp.where(over & ~nonfinite, state.streak + 1, 0).astype(jnp.int32)
        new_state = DetectorState(jnp.where(flagged, state.count, state.count + 1), keep(state.mean, mean),
                                  keep(state.var, var), keep(state.module_mean, module_mean), streak, state.keys,
                                  state.modules)
        report = {"flagged": flagged, "spike": spike, "nonfinite": nonfinite, "z": z, "ratio": ratio,
                  "top": top.astype(jnp.int32), "nonfinite_modules": bad_mod}
        return new_state, report

    def explain(self, state: DetectorState, report: Mapping[str, Any]) -> dict[str, Any]:
        """A report in words (host; one ``device_get``): why the step was flagged and which modules.

        Returns:
          ``{"flagged", "reasons": [...], "attributed": [module names, largest
          jump first], "ratios": {module: norm / running mean},
          "nonfinite_modules": [...], "z": {key: z}}``.
        """
        host = jax.device_get(dict(report))
        z = {k: float(v) for k, v in zip(state.keys, np.atleast_1d(host["z"]))}
        ratios = {state.modules[int(i)]: float(np.asarray(host["ratio"])[int(i)]) for i in np.asarray(host["top"])}
        bad = [m for m, b in zip(state.modules, np.atleast_1d(host["nonfinite_modules"])) if b]
        reasons = []
        if bool(host["spike"]):
            reasons += [f"spike in {k} ({v:.1f} sigma over its running mean)" for k, v in z.items() if v > self.k]
        if bool(host["nonfinite"]):
            reasons.append("NaN/Inf" + (f" in {', '.join(bad)}" if bad else " in a watched metric"))
        return {"flagged": bool(host["flagged"]), "reasons": reasons, "attributed": list(ratios),
                "ratios": ratios, "nonfinite_modules": bad, "z": z}


# --------------------------------------------------------------------------- #
# The recorder: a ring buffer on the device
# --------------------------------------------------------------------------- #


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecorderState:
    """The ring: row ``i % length`` holds the i-th recorded step. Names are static (the tree's structure)."""

    values: jax.Array  # (length, len(names)) float32; 0 where nothing was recorded yet
    steps: jax.Array  # (length,) int32, -1 where nothing was recorded yet (what marks an empty row)
    flagged: jax.Array  # (length,) bool
    written: jax.Array  # () int32: rows recorded so far, ever (continues across a resume)
    names: tuple[str, ...] = dataclasses.field(metadata={"static": True}, default=())


DEFAULT_RECORD = r"^(loss|grad_norm|update_ratio|nonfinite_grads|mu_norm|nu_norm|grad_abs_max)(/|$)"


@dataclasses.dataclass(frozen=True)
class HealthRecorder:
    """The last ``length`` steps of the metrics whose names match ``keys``, kept on the device.

    Args:
      length: how many steps the ring holds.
      keys: a regex (``re.search``) picking metric names; default: loss and
        the health kinds of ``norm_metrics``, global and per module.

    >>> import jax.numpy as jnp
    >>> rec = HealthRecorder(length=3)
    >>> state = rec.init({"loss": 0.0, "grad_norm/a": 0.0})
    >>> for step in range(1, 6):
    ...     state = rec.record(state, step, {"loss": jnp.float32(step), "grad_norm/a": jnp.float32(10 * step)})
    >>> [r["step"] for r in rec.rows(state)], rec.rows(state)[-1]["grad_norm/a"]
    ([3, 4, 5], 50.0)
    """

    length: int = 64
    keys: str = DEFAULT_RECORD

    def __post_init__(self):
        if self.length < 1:
            raise ValueError(f"`length` must be a positive number of steps, got {self.length}.")

    def init(self, metrics: Mapping[str, Any] | Sequence[str]) -> RecorderState:
        """An empty ring for metric dicts with these keys (values ignored).

        Raises:
          ValueError: ``keys`` matches none of the metric names.
        """
        pattern = re.compile(self.keys)
        names = tuple(n for n in _names(metrics) if pattern.search(n))
        if not names:
            raise ValueError(f"HealthRecorder `keys` {self.keys!r} matches none of the metrics "
                             f"({', '.join(_names(metrics)[:8])}); pass a regex that picks some.")
        # An empty row is marked by its step (-1), never by its values: zeros, so a checkpoint holding a ring not yet
        # full has no NaN (`inspect --stats --fail-on-nonfinite` passes a healthy run); `rows` skips them.
        return RecorderState(jnp.zeros((self.length, len(names)), _F32), jnp.full((self.length,), -1, jnp.int32),
                             jnp.zeros((self.length,), bool), jnp.zeros((), jnp.int32), names)

    def record(self, state: RecorderState, step: Any, metrics: Mapping[str, Any], flagged: Any = False,
               where: Any = True) -> RecorderState:
        """Write this step's values into the next row (jittable: a dynamic update, no host sync).

        ``where=False`` (a traced bool) leaves the ring as it was: a step whose
        per-layer work was skipped (``every_n``).
        """
        _check_names("HealthRecorder", state.names, metrics)
        row = jnp.stack([jnp.asarray(metrics[n], _F32) for n in state.names])
        at = state.written % self.length
        where = jnp.asarray(where, bool)
        pick = lambda new, old: jnp.where(where, new, old)  # noqa: E731
        return RecorderState(pick(state.values.at[at].set(row), state.values),
                             pick(state.steps.at[at].set(jnp.asarray(step, jnp.int32)), state.steps),
                             pick(state.flagged.at[at].set(jnp.asarray(flagged, bool)), state.flagged),
                             state.written + where.astype(jnp.int32), state.names)

    @staticmethod
    def rows(state: RecorderState) -> list[dict[str, Any]]:
        """The recorded steps, oldest first, as ``{"step", "flagged", name: value}`` dicts (host; one device_get)."""
        values, steps, flagged = jax.device_get((state.values, state.steps, state.flagged))
        order = sorted((int(s), i) for i, s in enumerate(steps) if s >= 0)
        return [{"step": s, "flagged": bool(flagged[i]), **dict(zip(state.names, map(float, values[i])))}
                for s, i in order]


def every_n(step: Any, n: int, fn: Callable[..., Any], *args: Any) -> tuple[jax.Array, Any]:
    """``(ran, fn(*args))`` on steps divisible by ``n``; on the others ``(False, zeros)`` without running ``fn``.

    One ``lax.cond`` around the per-layer work (XLA runs only the taken
    branch). On CPU that skips the reductions; on GPU a conditional makes
    the step wait for its predicate on the host: there, prefer two jitted
    steps chosen by the host loop. ``benchmarks/test_health_bench.py`` and
    ``benchmarks/gpu_step_overhead.py`` measure both.

    >>> import jax.numpy as jnp
    >>> [(bool(r), float(v)) for r, v in (every_n(s, 2, lambda: jnp.float32(7)) for s in (1, 2))]
    [(False, 0.0), (True, 7.0)]
    """
    if n == 1:
        return jnp.asarray(True), fn(*args)
    shapes = jax.eval_shape(fn, *args)
    ran = jnp.asarray(step) % n == 0
    out = jax.lax.cond(ran, lambda a: fn(*a), lambda a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       args)
    return ran, out


# --------------------------------------------------------------------------- #
# Host side: when to write the ring, and the file
# --------------------------------------------------------------------------- #


def write_health_dump(path: str | os.PathLike, recorder_state: RecorderState, *, reason: str,
                      flagged: Sequence[Mapping[str, Any]] = (), step: int | None = None) -> str:
    """Write the ring to ``path`` as a health dump (JSON; strict: NaN/Inf as null with their kind). Atomic.

    Args:
      path: the file; its folder is created if needed. Written under a
        temporary name and renamed (a link planted at ``path`` is replaced,
        not followed).
      recorder_state: the ring.
      reason: ``"flagged"`` or ``"every"`` (or any word).
      flagged: one ``{"step": s, **SpikeDetector.explain(...)}`` per flagged
        step the dump is about.
      step: the step the dump was written at (default: the last recorded).

    Returns:
      The path written.
    """
    rows = HealthRecorder.rows(recorder_state)
    step = step if step is not None else (rows[-1]["step"] if rows else 0)
    dump = {"schema": DUMP_SCHEMA, "kind": DUMP_KIND, "step": int(step), "reason": reason,
            "names": list(recorder_state.names), "flagged": [_jsonable(f) for f in flagged],
            "records": [encode_record({k: v for k, v in r.items() if k != "flagged"} | {"flagged": int(r["flagged"])})
                        for r in rows]}
    path = os.path.expanduser(os.fspath(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_file(path, (json.dumps(dump, allow_nan=False) + "\n").encode("utf-8"))  # the one safe write
    return path


def _jsonable(value: Any) -> Any:
    """Floats that JSON cannot hold (NaN/Inf) as None, anywhere in an explanation."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class HealthDumper:
    """When to write the recorder's ring: ``after`` steps past a flagged step, and every ``every`` steps.

    Call it once per step with the step's recorder state and detector
    report (device arrays, not read). Every ``check_every`` steps it reads
    the ``flagged`` bits of the steps before the current one since the last
    check (one small ``device_get`` of steps already finished or nearly: the
    current step keeps running meanwhile); for a flagged step
    it reads that step's report once (``SpikeDetector.explain``) and, ``after``
    steps later, writes ``folder/health_<step>.json``. Nothing else is read.

    Args:
      folder: where the dumps go.
      detector: the ``SpikeDetector`` whose reports are passed (to explain them).
      every: also write the ring every ``every`` steps (None: only on flags).
      after: steps to wait past a flagged step, so the dump shows what followed.
      check_every: read the flags every this many steps (1: one step late).
      within: a folder the dumps must stay in (``treetools train``: its WORKDIR): a ``folder`` that is a link
        leading out of it (planted in the run folder, before or during the run) is refused at each dump
        (``PermissionError``, one line), never written through. None: ``folder`` is the caller's to link.

    Returns (a call): a list of events, ``{"event": "flagged", "step", **explanation}``
    and ``{"event": "dump", "step", "path"}``, for the host loop to print.
    """

    def __init__(self, folder: str | os.PathLike, detector: SpikeDetector, *, every: int | None = None,
                 after: int = 4, check_every: int = 1, within: str | os.PathLike | None = None):
        if after < 0 or check_every < 1 or (every is not None and every < 1):
            raise ValueError(f"`after` must be >= 0, `check_every` and `every` >= 1; got after={after}, "
                             f"check_every={check_every}, every={every}.")
        self.folder = os.path.expanduser(os.fspath(folder))
        self.within = os.path.expanduser(os.fspath(within)) if within is not None else None
        self.detector, self.every, self.after, self.check_every = detector, every, after, check_every
        self._recent: list[tuple[int, Any, Any]] = []  # (step, detector state, report), not yet read
        self._pending: list[dict[str, Any]] = []  # explained flagged steps waiting for their dump
        self._state: RecorderState | None = None  # the last step's, and that step
        self._step: int | None = None

    def __call__(self, step: int, recorder_state: RecorderState, detector_state: DetectorState,
                 report: Mapping[str, Any]) -> list[dict[str, Any]]:
        self._state, self._step = recorder_state, int(step)
        self._recent.append((int(step), detector_state, report))
        events: list[dict[str, Any]] = []
        if len(self._recent) > self.check_every:
            # The steps before this one: this step was just dispatched, reading it would wait for it.
            events += self._check(keep_last=True)
        due = [f for f in self._pending if step >= f["step"] + self.after]
        if due:
            events.append(self._dump("flagged", due, recorder_state, int(step)))
        elif self.every is not None and step % self.every == 0:
            events.append(self._dump("every", [], recorder_state, int(step)))
        return events

    def _check(self, keep_last: bool = False) -> list[dict[str, Any]]:
        cut = len(self._recent) - 1 if keep_last else len(self._recent)
        recent, self._recent = self._recent[:cut], self._recent[cut:]
        flags = jax.device_get([r["flagged"] for _, _, r in recent])
        events = []
        for (step, state, report), flag in zip(recent, flags):
            if bool(flag):
                explained = {"step": step, **self.detector.explain(state, report)}
                self._pending.append(explained)
                events.append({"event": "flagged", **explained})
        return events

    def _dump(self, reason: str, flagged: list[dict[str, Any]], state: RecorderState, step: int) -> dict[str, Any]:
        """Write the dump of ``state``, the recorder's at ``step`` (the last step handed over)."""
        self._pending = [f for f in self._pending if f not in flagged]
        path = os.path.join(self.folder, f"health_{step:08d}.json")
        if self.within is not None:
            refuse_link_out(self.folder, self.within)
        write_health_dump(path, state, reason=reason, flagged=flagged, step=step)
        return {"event": "dump", "step": step, "path": path, "reason": reason}

    def close(self) -> list[dict[str, Any]]:
        """At the end of a run: check the last flags and write the dump still owed (fewer steps after it)."""
        if self._state is None or self._step is None:  # set together, by the first step handed over
            return []
        events = self._check() if self._recent else []
        if self._pending:
            events.append(self._dump("flagged", list(self._pending), self._state, self._step))
        return events
