"""Health dumps (``tt.HealthDumper`` / ``tt.write_health_dump``): read one, and draw it per layer around the spike.

A dump is one JSON object (strict JSON; NaN/Inf as null with their kind,
``treetools.shared.records``)::

    {"schema": 1, "kind": "treetools.health_dump", "step": 124, "reason": "flagged",
     "names": ["loss", "grad_norm", "grad_norm/layers_0", ...],
     "flagged": [{"step": 120, "reasons": ["spike in grad_norm (35.2 sigma ...)"],
                  "attributed": ["layers_1", "embed"], "ratios": {"layers_1": 41.0, ...},
                  "nonfinite_modules": [], "z": {...}}],
     "records": [{"step": 61, "flagged": 0, "loss": 1.2, "grad_norm/layers_0": 0.3, ...}, ...]}

``health_figure`` draws a modules x steps heatmap per kind (``grad_norm``,
``update_ratio``, ... whichever have per-module entries), with the flagged
steps marked on the top edge and the attributed modules' rows marked in red.
No jax: matplotlib only (``treetools plot DUMP.json``).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from treetools.checkpoint_tools.plot import _import_matplotlib, cell_edges
from treetools.shared.records import decode_record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DUMP_KIND = "treetools.health_dump"  # as treetools.pytree.health writes it
KIND_ORDER = ("grad_norm", "update_ratio", "nonfinite_grads", "grad_abs_max", "mu_norm", "nu_norm", "param_norm",
              "update_norm")
MARK = "red"


MAX_DUMP_BYTES = 256 * 2**20
"""The largest health dump read (a dump of a 32-step ring of a few thousand modules is a few MB)."""


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_health_dump(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a health dump file (its first bytes name the kind); cheap, never raises, never opens
    what is no regular file (a FIFO would block the open)."""
    if not _regular(os.path.expanduser(os.fspath(path))):
        return False
    try:
        with open(os.path.expanduser(os.fspath(path)), "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and DUMP_KIND.encode() in head


def read_health_dump(path: str | os.PathLike) -> dict[str, Any]:
    """The dump at ``path``, its records decoded (NaN/Inf back as floats).

    Raises:
      ValueError: not a health dump (names the file).

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "health_00000003.json")
    >>> _ = open(path, "w").write(json.dumps({"schema": 1, "kind": DUMP_KIND, "step": 3, "reason": "every",
    ...     "names": ["grad_norm/a"], "flagged": [],
    ...     "records": [{"step": 3, "flagged": 0, "grad_norm/a": None, "nonfinite": {"grad_norm/a": "nan"}}]}))
    >>> read_health_dump(path)["records"]
    [{'step': 3, 'flagged': 0, 'grad_norm/a': nan}]
    """
    path = os.path.expanduser(os.fspath(path))
    if not _regular(path) or os.path.getsize(path) > MAX_DUMP_BYTES:
        raise ValueError(f"{path}: not a regular file of at most {MAX_DUMP_BYTES // 2**20} MiB, so not a health dump.")
    with open(path, encoding="utf-8") as f:
        try:
            dump = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else e.reason
            raise ValueError(f"{path}: not JSON ({why}), so not a health "
                             "dump.") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply, so not a health dump.") from None
    if not isinstance(dump, dict) or dump.get("kind") != DUMP_KIND or not isinstance(dump.get("records"), list):
        raise ValueError(f"{path}: not a health dump (a JSON object with \"kind\": \"{DUMP_KIND}\", written by "
                         "tt.HealthDumper or `treetools train --health`).")
    problem = _malformed(dump)
    if problem is not None:
        raise ValueError(f"{path}: a damaged health dump ({problem}).")
    return {**dump, "records": [decode_record(r) for r in dump["records"]]}


def _number(v: Any) -> bool:
    """None, a float, or an int a float holds (``10**400`` would overflow ``float()``)."""
    return v is None or isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= 2**62)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _malformed(dump: Mapping[str, Any]) -> str | None:
    """What makes ``dump`` no health dump ``health_figure`` can draw, as ``tt.write_health_dump`` writes them (a
    record without a step, a value that is no number, a name that is no string), or None when it is one."""
    if not _strings(dump.get("names")):
        return "`names` is not a list of strings"
    for i, r in enumerate(dump["records"]):
        wrong = _malformed_record(i, r)
        if wrong is not None:
            return wrong
    flagged = dump.get("flagged") or []
    if not isinstance(flagged, list):
        return "`flagged` is not a list"
    for i, f in enumerate(flagged):
        if not isinstance(f, dict) or not _step_number(f.get("step")):
            return f"flagged entry {i} has no integer `step`"
        for key in ("reasons", "attributed", "nonfinite_modules"):
            if key in f and not _strings(f[key]):
                return f"flagged entry {i}: `{key}` is not a list of strings"
    if not all(_number(dump.get(k)) or isinstance(dump.get(k), str) for k in ("step", "reason")):
        return "`step` or `reason` is neither a number nor a string"
    return None


def _step_number(step: Any) -> bool:
    """Whether ``step`` is a step a dump may hold: an int (no bool) of at most 2**62."""
    return isinstance(step, int) and not isinstance(step, bool) and abs(step) <= 2**62


def _malformed_record(i: int, r: Any) -> str | None:
    """``_malformed`` of the dump's record ``i``."""
    if not isinstance(r, dict):
        return f"record {i} is not an object"
    if not _step_number(r.get("step")):
        return f"record {i} has no integer `step`"
    kinds = r.get("nonfinite", {})
    if not isinstance(kinds, dict) or not all(isinstance(v, str) for v in kinds.values()):
        return f"record {i}: `nonfinite` is not an object of strings"
    bad = next((k for k, v in r.items() if k != "nonfinite" and not _number(v)), None)
    if bad is not None:
        return f"record {i}: `{bad[:80]}` is not a number"
    return None


def _natural(label: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", label) if p)


def _kinds(names: list[str]) -> dict[str, list[str]]:
    """``{kind: [module, ...]}`` for the kinds with per-module entries, in ``KIND_ORDER`` then first seen."""
    out: dict[str, list[str]] = {}
    for name in names:
        if "/" in name:
            kind, module = name.split("/", 1)
            out.setdefault(kind, []).append(module)
    rank = {k: i for i, k in enumerate(KIND_ORDER)}
    return {k: sorted(v, key=_natural) for k, v in sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank)))}


def health_figure(dump: Mapping[str, Any], *, kinds: list[str] | None = None, max_panels: int = 3) -> Figure:
    """Modules x steps heatmaps of a health dump, one panel per kind; flagged steps and attributed modules marked.

    Args:
      dump: ``read_health_dump``'s result.
      kinds: which per-module kinds to draw (default: the first ``max_panels``
        of ``grad_norm``, ``update_ratio``, ``nonfinite_grads`` (only when
        some count is above 0, or NaN), ``grad_abs_max``, ... present).

    Returns:
      The figure. In each panel the values are the mesh with ``gid="values"``
      (log colours, each panel its own scale), NaN/Inf cells the mesh with
      ``gid="nonfinite-cells"``; flagged steps are the red triangles with
      ``gid="flagged"``; for each flagged step, the module it was attributed
      to (its largest jump, ``attributed[0]``) and the modules holding NaN/Inf
      have red row labels and outlined rows (``gid="attributed"``).

    Raises:
      ImportError: matplotlib is not installed.
      ValueError: the dump has no per-module entries, or ``kinds`` names one it lacks.
    """
    _import_matplotlib()
    import matplotlib
    import numpy as np
    from matplotlib import colors
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    available = _kinds(list(dump["names"]))
    if not available:
        raise ValueError("the health dump holds no per-module entries (`grad_norm/<module>`, ...): record "
                         "norm_metrics(depth=K) to draw layers.")
    records = dump["records"]
    if kinds is None:
        # A count that is 0 everywhere says nothing: its panel only when some module holds NaN/Inf.
        counts = [float(r.get(n, 0) or 0) for r in records for n in dump["names"] if n.startswith("nonfinite_grads/")]
        kinds = [k for k in available if k != "nonfinite_grads" or any(c != 0 for c in counts)][:max_panels]
    missing = [k for k in kinds if k not in available]
    if missing:
        raise ValueError(f"the health dump has no per-module {missing}; it has {list(available)}.")
    records = sorted(dump["records"], key=lambda r: r["step"])
    steps = [r["step"] for r in records]
    flagged = dump.get("flagged") or []
    flagged_steps = sorted({f["step"] for f in flagged} | {r["step"] for r in records if r.get("flagged")})
    attributed = list(dict.fromkeys(m for f in flagged for m in f.get("attributed", [])[:1]))
    also = list(dict.fromkeys(m for f in flagged for m in f.get("nonfinite_modules", [])))
    marked = list(dict.fromkeys(attributed + also))

    rows = max(len(available[k]) for k in kinds)
    fig = Figure(figsize=(10, min(max(0.28 * rows, 1.6), 8.0) * len(kinds) + 1.4), layout="constrained")
    axes = list(fig.subplots(len(kinds), 1, sharex=True, squeeze=False).flat)
    edges = cell_edges(steps)
    for ax, kind in zip(axes, kinds):
        modules = available[kind]
        data = np.array([[float(r.get(f"{kind}/{m}", math.nan)) for r in records] for m in modules]).reshape(
            len(modules), len(records))
        bad = ~np.isfinite(data) & np.array([[f"{kind}/{m}" in r for r in records] for m in modules]).reshape(
            data.shape)
        shown = np.where(np.isfinite(data) & (data > 0), data, np.nan)
        positive = shown[np.isfinite(shown)]
        norm = colors.LogNorm(positive.min(), max(positive.max(), positive.min() * 1.01)) if positive.size else None
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
        ys = np.arange(len(modules) + 1) - 0.5
        mesh = ax.pcolormesh(edges, ys, np.ma.masked_invalid(shown), cmap=cmap, norm=norm, shading="flat",
                             gid="values")
        if bad.any():
            ax.pcolormesh(edges, ys, np.ma.masked_where(~bad, np.ones(data.shape)),
                          cmap=colors.ListedColormap([MARK]), shading="flat", gid="nonfinite-cells")
        ax.set_yticks(range(len(modules)), modules, fontsize=8 if len(modules) > 12 else 9)
        for label, module in zip(ax.get_yticklabels(), modules):
            if module in marked:
                label.set_color(MARK)
                label.set_fontweight("bold")
        for i, module in enumerate(modules):
            if module in marked:
                ax.add_patch(Rectangle((edges[0], i - 0.5), edges[-1] - edges[0], 1.0, fill=False, edgecolor=MARK,
                                       linewidth=1.5, gid="attributed"))
        ax.set_ylim(len(modules) - 0.5, -0.5)
        at_top = ax.get_xaxis_transform()
        if flagged_steps:
            ax.vlines(flagged_steps, 0, 1, transform=at_top, colors=MARK, linestyles="--", linewidth=0.9)
            ax.scatter(flagged_steps, [1.0] * len(flagged_steps), transform=at_top, marker="v", s=40, color=MARK,
                       clip_on=False, zorder=5, gid="flagged", label="flagged step")
        ax.set_title(f"{kind} per module", fontsize=10, pad=12 if flagged_steps else None)
        fig.colorbar(mesh, ax=ax, label=kind + (" (log)" if norm is not None else ""), aspect=15)
    axes[-1].set_xlabel("step")
    fig.suptitle(_title(dump, flagged), fontsize=10)
    return fig


def _title(dump: Mapping[str, Any], flagged: list[Mapping[str, Any]]) -> str:
    def cut(text: Any) -> str:  # a title line, not a page: what a dump says is shown at most 120 characters long
        text = str(text)
        return text if len(text) <= 120 else text[:117] + "..."

    head = f"health dump at step {cut(dump.get('step'))} ({cut(dump.get('reason'))})"
    for f in flagged[:2]:
        why = cut("; ".join(f.get("reasons") or []) or "flagged")
        who = cut(", ".join(f.get("attributed", [])[:3]))
        head += f"\nstep {f['step']}: {why}" + (f"; largest jump: {who}" if who else "")
    return head
