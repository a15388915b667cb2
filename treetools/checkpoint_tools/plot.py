"""Figures of a training run and of a checkpoint: metric curves, per-layer heatmaps, statistics across steps.

Library code, usable from a notebook as from ``treetools plot``:

* ``plot_metrics(runs, keys=..., heatmap=...)``: metric curves against the step
  (runs overlaid, one panel per metric, per-module entries a line each), or a
  layers x steps heatmap (``metrics_figure``, ``heatmap_figure``);
* ``plot_stats(report_or_path, stat)``: a statistic of each leaf or module of a
  checkpoint across its saved steps (``stats_figure`` of an inspect ``Report``).

Each returns a matplotlib ``Figure`` (not drawn; ``fig.savefig(path)`` writes
it). matplotlib is imported when a figure is made (``pip install
'jax-treetools[plot]'``); no jax is imported. Metrics files are read with
``tt.read_metrics``; checkpoints with ``tt.inspect_path``.

>>> fig = plot_metrics({"demo": [{"step": s, "loss": 4.0 / s} for s in (1, 2, 3)]})
>>> [ax.get_title() for ax in fig.axes]
['loss']
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import numpy as np

from treetools.checkpoint_io.context import ReadContext, ReadOptions, read_fields
from treetools.checkpoint_tools.options import InspectOptions
from treetools.checkpoint_tools.report import Report, inspect_path
from treetools.shared.errors import UsageError
from treetools.shared.install import install_hint
from treetools.shared.patterns import compile_regex
from treetools.shared.rows import Row, nonfinite_count

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from treetools.rules.spec import Rules

DEFAULT_KEYS = (r"loss|(^|/)(grad|param|update)_norm(/|$)|update_ratio|(^|/)nonfinite_grads$"
                r"|(^|/)(lr|learning_rate)$")
MAX_PANELS = 12
MAX_MODULES = 8
RATIO_LOG_SPAN = 3
"""A ratio's panel (update_ratio) is drawn on a log axis when its positive values span this factor or more."""
LOG_SPAN = 100
"""Any other panel is drawn on a log axis when its positive values span this factor (two decades) or more."""
# Panel order: loss first, then the norms, the ratio, the non-finite count, the learning rate; other metrics after,
# as first logged.
_ORDER = (r"loss", r"grad_norm", r"param_norm", r"update_norm", r"update_ratio", r"nonfinite_grads",
          r"(^|/)(lr|learning_rate)$")
NONFINITE_COLOR = "red"
# Line colours: matplotlib's cycle without its red (C3), which would read as a NaN/Inf mark.
_COLORS = tuple(f"C{i}" for i in (0, 1, 2, 4, 5, 6, 7, 8, 9))
HEATMAP_LABELLED_ROWS = 24  # more rows than this: every k-th row labelled



def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)




def _compile(keys: str | Sequence[str] | None) -> tuple[re.Pattern | None, str]:
    """One pattern matching any of ``keys``, and how to name it in an error (``--keys 'a' --keys 'b'``)."""
    if keys is None:
        return None, ""
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        try:
            compile_regex(key)
        except re.error as e:
            raise ValueError(f"--keys {key!r}: not a valid regex ({e}).") from None
    return re.compile("|".join(f"(?:{k})" for k in keys)), " ".join(f"--keys {k!r}" for k in keys)


def _metric_names(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Every numeric metric in the runs, in the order first logged."""
    names: dict[str, None] = {}
    for records in runs.values():
        for record in records:
            for key, value in record.items():
                if key != "step" and _is_number(value):
                    names.setdefault(key, None)
    return list(names)


def _rank(key: str) -> int:
    return next((i for i, pattern in enumerate(_ORDER) if re.search(pattern, key)), len(_ORDER))


def _panels(names: list[str], pattern: re.Pattern | None) -> list[tuple[str, list[str], str | None]]:
    """``(title, keys, parent)`` per panel: one per scalar metric (parent None), one per kind of per-module entries."""
    known = set(names)
    groups: dict[str, list[str]] = {}
    scalars = []
    for name in names:
        # `grad_norm/layers_0` is a per-module entry of `grad_norm` when `grad_norm` itself is logged.
        parts = name.split("/")
        parent = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in known), None)
        if parent is None:
            scalars.append(name)
        else:
            groups.setdefault(parent, []).append(name)

    def select(p: re.Pattern | None) -> list[tuple[str, list[str], str | None]]:
        chosen: list[tuple[str, list[str], str | None]] = [
            (name, [name], None) for name in scalars if p is None or p.search(name)]
        for parent, members in groups.items():
            picked = [m for m in members if p is None or p.search(m)]
            if picked:
                chosen.append((f"{parent} per module", picked, parent))
        order = {title: i for i, (title, _, _) in enumerate(chosen)}
        return sorted(chosen, key=lambda panel: (panel[2] is not None, _rank(panel[0]), order[panel[0]]))

    if pattern is not None:
        return select(pattern)
    return select(re.compile(DEFAULT_KEYS)) or select(None)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list, list]:
    """``(steps, values)`` of every record holding a number for ``key``, NaN and Inf included."""
    points = [(r["step"], float(r[key])) for r in records if _is_number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _last_value(runs: Mapping[str, Sequence[Mapping[str, Any]]], key: str) -> float:
    for records in runs.values():
        values = [v for v in _series(records, key)[1] if math.isfinite(v)]
        if values:
            return abs(values[-1])
    return -math.inf


def _log_axis(ax: Any, lo: float, hi: float) -> None:
    """A log y axis with labelled ticks however few decades the data spans."""
    from matplotlib import ticker

    ax.set_yscale("log")
    decades = math.log10(hi / lo)
    if decades > 2.5:
        subs: tuple[float, ...] = (1.0,)
    elif decades > 1:
        subs = (1.0, 2.0, 5.0)
    elif decades > 0.6:
        subs = (1.0, 2.0, 3.0, 5.0, 7.0)
    else:
        subs = tuple(float(i) for i in range(1, 10))
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=12))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs="auto", numticks=12))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def _import_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("plotting (`treetools plot`, tt.plot_*) needs matplotlib; install it: "
                          f"{install_hint('plot')}") from None


def image_formats() -> dict[str, str]:
    """The image formats matplotlib writes, by file extension (``png``, ``svg``, ``pdf``...).

    Raises:
      ImportError: matplotlib is not installed (the message says how to install it).
    """
    _import_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def _curve(ax: Any, steps: Sequence[float], values: Sequence[float], **style: Any) -> tuple[list[float], list]:
    """Draw one curve, broken at its NaN/Inf points; ``(finite values, steps of the non-finite ones)``."""
    ys = [v if math.isfinite(v) else math.nan for v in values]  # matplotlib breaks a line at NaN
    ax.plot(steps, ys, marker="." if len(steps) < 30 else None, **style)
    return [v for v in ys if not math.isnan(v)], [s for s, v in zip(steps, values) if not math.isfinite(v)]


def mark_nonfinite(ax: Any, steps: Sequence[float]) -> None:
    """Mark steps with NaN/Inf values: a red triangle on the panel's top edge and a dashed red line.

    Both are collections (``gid="nonfinite"`` on the triangles), so ``ax.lines``
    stays the curves; the triangles carry the legend label ``NaN/Inf``.
    """
    steps = sorted(set(steps))
    if not steps:
        return
    at_top = ax.get_xaxis_transform()  # x in data, y in axes coordinates: the top edge whatever the y scale
    ax.vlines(steps, 0, 1, transform=at_top, colors=NONFINITE_COLOR, linestyles="--", linewidth=0.8, alpha=0.5,
              zorder=1)
    ax.scatter(steps, [1.0] * len(steps), transform=at_top, marker="v", s=36, color=NONFINITE_COLOR, clip_on=False,
               zorder=5, gid="nonfinite", label="NaN/Inf")


def _finish_panel(ax: Any, title: str, values: list[float], nonfinite: list, *, log_ratio: bool = False) -> None:
    """Title, grid, integer step ticks, a log axis for values spanning ``LOG_SPAN`` (a ratio: ``RATIO_LOG_SPAN``)
    or more, the NaN/Inf marks."""
    from matplotlib import ticker

    # The marks sit on the top edge: the title keeps clear of them.
    ax.set_title(title if values else f"{title} (no finite values)", fontsize=10, pad=12 if nonfinite else None)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    if values:
        lo, hi = min(values), max(values)
        if lo > 0 and hi / lo >= (RATIO_LOG_SPAN if log_ratio else LOG_SPAN):
            _log_axis(ax, lo, hi)
    mark_nonfinite(ax, nonfinite)


def _grid(fig: Figure, n: int, *, ncols: int | None = None, width: float = 5.2) -> tuple[list, int]:
    ncols = ncols or (1 if n == 1 else 2 if n <= 4 else 3)
    nrows = math.ceil(n / ncols)
    fig.set_size_inches(width * ncols, 3.4 * nrows + 0.5)
    axes = list(fig.subplots(nrows, ncols, sharex=True, squeeze=False).flat)
    for ax in axes[n:]:
        fig.delaxes(ax)
    return axes[:n], ncols


def _label_bottom(axes: list, ncols: int) -> None:
    for i, ax in enumerate(axes):
        if i + ncols >= len(axes):  # bottom of its column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)





_STYLES: tuple[Literal["-", "--", ":", "-."], ...] = ("-", "--", ":", "-.")
"""Line styles of the runs in a per-module panel (the colour says the module)."""


def _check_panels(panels: list, runs: Mapping[str, Any], names: list[str], pattern: Any, named: str) -> None:
    """``metrics_figure``: refuse no panel, or more than ``MAX_PANELS``."""
    if not panels:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        if pattern is None:
            raise ValueError(f"{', '.join(runs)}: no numeric metric besides `step` to plot.")
        raise ValueError(f"{named} matches none of the logged metrics ({shown}); pick from those.")
    if len(panels) > MAX_PANELS:
        raise ValueError(f"{len(panels)} metrics to plot ({', '.join(t for t, _, _ in panels[:6])}, ...): more than "
                         f"{MAX_PANELS} panels do not fit one figure; choose some with --keys RE.")


def _largest_modules(panels: list, runs: Mapping[str, Sequence[Mapping[str, Any]]], max_modules: int) -> list:
    """The panels with each per-module panel's keys ordered largest last value first, cut to ``max_modules``
    (its title says so)."""
    shown_panels = []
    for title, panel_keys, parent in panels:
        if parent is not None:
            panel_keys = sorted(panel_keys, key=lambda k: -_last_value(runs, k))
            if len(panel_keys) > max_modules:
                title = f"{title} (largest {max_modules} of {len(panel_keys)})"
                panel_keys = panel_keys[:max_modules]
        shown_panels.append((title, panel_keys, parent))
    return shown_panels


def _draw_curves(ax: Any, runs: Mapping[str, Sequence[Mapping[str, Any]]], panel_keys: Sequence[str],
                 parent: str | None, colors: list[str], module_color: dict[str, str]) -> tuple[list[float], list]:
    """One panel's curves, every run's: ``(finite values, steps to mark non-finite)``."""
    values: list[float] = []
    nonfinite: list = []
    labelled: set[str] = set()
    for r, (label, records) in enumerate(runs.items()):
        for key in panel_keys:
            steps, ys = _series(records, key)
            if not steps:
                continue
            if parent is not None:
                style = dict(color=module_color[key[len(parent) + 1:]], linestyle=_STYLES[r % len(_STYLES)],
                             linewidth=1.2, label=None if key in labelled else key[len(parent) + 1:])
                labelled.add(key)
            else:
                style = dict(color=colors[r], linewidth=1.5, label=label)
            finite, bad = _curve(ax, steps, ys, **style)
            values += finite
            nonfinite += bad
            if key.endswith("nonfinite_grads"):  # a count: its steps above 0 are the NaN/Inf steps
                nonfinite += [s for s, v in zip(steps, ys) if v > 0]
    return values, nonfinite


def metrics_figure(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    keys: str | Sequence[str] | None = None,
    max_modules: int = MAX_MODULES,
) -> Figure:
    """A matplotlib Figure of metric curves against the step, one panel per metric, runs overlaid.

    A NaN or Inf value breaks its curve and its step is marked (``mark_nonfinite``).

    Args:
      runs: run label -> its records (``tt.read_metrics``), in legend order.
      keys: regex (or regexes, any may match) picking metrics by name with
        ``re.search``; None: loss-like keys, grad/param/update norms,
        update_ratio, nonfinite_grads and the learning rate, or every metric
        when none of those is logged.
      max_modules: per-module panels show this many modules, those with the
        largest last value.

    Returns:
      The figure (not yet drawn); ``fig.savefig(path)`` writes it.

    Raises:
      ImportError: matplotlib is not installed (the message says how to install it).
      ValueError: no metric matches ``keys``, ``keys`` is not a regex, or the
        metrics need more than ``MAX_PANELS`` panels.

    >>> fig = metrics_figure({"demo": [{"step": s, "train/loss": 4.0 / s, "lr": 1e-3 * s} for s in range(1, 6)]})
    >>> [(ax.get_title(), len(ax.lines)) for ax in fig.axes]
    [('train/loss', 1), ('lr', 1)]
    """
    _import_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if not runs:
        raise ValueError("no runs to plot; pass at least one metrics file.")
    pattern, named = _compile(keys)
    names = _metric_names(runs)
    panels = _panels(names, pattern)
    _check_panels(panels, runs, names, pattern, named)

    fig = Figure(layout="constrained")
    axes, ncols = _grid(fig, len(panels))
    colors = [_COLORS[i % len(_COLORS)] for i in range(len(runs))]

    shown_panels = _largest_modules(panels, runs, max_modules)
    # One colour per module across every panel (grad_norm's layers_3 and param_norm's layers_3 alike), in the order
    # first shown; more distinct modules than colours: the cycle repeats, a module still keeps its colour.
    modules = dict.fromkeys(key[len(parent) + 1:] for _, panel_keys, parent in shown_panels if parent is not None
                            for key in panel_keys)
    module_color = {module: _COLORS[i % len(_COLORS)] for i, module in enumerate(modules)}

    for ax, (title, panel_keys, parent) in zip(axes, shown_panels):
        values, nonfinite = _draw_curves(ax, runs, panel_keys, parent, colors, module_color)
        _finish_panel(ax, title, values, nonfinite, log_ratio="ratio" in title)
        if parent is not None and values:
            handles, labels = ax.get_legend_handles_labels()
            if len(runs) > 1:
                handles += [Line2D([], [], color="0.3", linestyle=_STYLES[r % len(_STYLES)])
                            for r in range(len(runs))]
                labels += list(runs)
            ax.legend(handles, labels, fontsize=7, ncols=2 if len(labels) > 5 else 1)
        elif nonfinite:
            ax.legend(handles=[c for c in ax.collections if c.get_gid() == "nonfinite"], fontsize=7, loc="best")
    _label_bottom(axes, ncols)

    if len(runs) > 1:
        handles = [Line2D([], [], color=colors[r], linewidth=1.5) for r in range(len(runs))]
        fig.legend(handles, list(runs), loc="outside upper center", ncols=min(len(runs), 4), fontsize=9)
    else:
        fig.suptitle(next(iter(runs)), fontsize=10)
    return fig




# --------------------------------------------------------------------------- #
# Heatmap: one row per layer (a capture group of the metric name), one column per step
# --------------------------------------------------------------------------- #


def _natural(label: str) -> tuple:
    """Sort key: numbers by value (2 before 10), then text."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", label) if p)


def _heatmap_rows(runs: Mapping[str, Sequence[Mapping[str, Any]]], pattern: re.Pattern) -> tuple[dict[str, str], str]:
    """``({metric name: row label}, colour bar label)``: the metrics ``pattern`` matches, each row named once."""
    rows: dict[str, str] = {}
    owner: dict[str, str] = {}
    bar = ""
    for name in _metric_names(runs):
        m = pattern.search(name)
        if not m:
            continue
        label = "/".join(g for g in m.groups() if g is not None)
        if label in owner:
            raise ValueError(f"--heatmap {pattern.pattern!r} gives row {label!r} to both {owner[label]!r} and "
                             f"{name!r}; anchor it (e.g. end it with `$`) so that one metric names each row.")
        owner[label] = name
        rows[name] = label
        bar = bar or name[: m.start(1)] + "*" + name[m.end(1):]
    return rows, bar


def cell_edges(steps: Sequence[float]) -> list[float]:
    """Cell edges halfway between steps (uneven logging intervals keep their widths)."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [steps[0] - (mids[0] - steps[0]), *mids, steps[-1] + (steps[-1] - mids[-1])]


def _heatmap_grid(records: Sequence[Mapping[str, Any]], rows: Mapping[str, str],
                  index: Mapping[str, int]) -> tuple[list, np.ndarray, np.ndarray]:
    """One run's heatmap: ``(its steps, a rows x steps array of the values (NaN: none), where a value is NaN or
    Inf)``; ``rows`` maps a metric key to its row's label, ``index`` a label to its row."""
    steps = sorted({r["step"] for r in records if any(_is_number(r.get(k)) for k in rows)})
    col = {s: j for j, s in enumerate(steps)}
    data = np.full((len(index), len(steps)), np.nan)
    present = np.zeros(data.shape, bool)
    for r in records:
        for key, row in rows.items():
            if r["step"] in col and _is_number(r.get(key)):
                data[index[row], col[r["step"]]] = r[key]
                present[index[row], col[r["step"]]] = True
    return steps, data, present & ~np.isfinite(data)


def heatmap_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], pattern: str) -> Figure:
    """A rows x steps heatmap of the metrics whose name matches ``pattern``, one panel per run.

    Each matching metric is a row, labelled by the pattern's capture group(s)
    (``grad_norm/layers/(\\d+)$`` gives rows ``0``, ``1``, ...), numeric labels
    in numeric order, the first row at the top. Colours are on a log scale
    shared by all panels, with a colour bar. A NaN/Inf value is a red cell
    and its step is marked on the panel's top edge (``mark_nonfinite``); a
    step where a row has no value, or a value <= 0, is grey. The figure's
    height follows the number of rows; with more than 24 rows, every k-th is
    labelled.

    Args:
      runs: run label -> its records (``tt.read_metrics``).
      pattern: a regex with at least one capture group, ``re.search``-ed on metric names.

    Returns:
      The figure; in each panel the values are the mesh with ``gid="values"``,
      the NaN/Inf cells the one with ``gid="nonfinite-cells"``.

    Raises:
      ImportError: matplotlib is not installed.
      ValueError: the pattern is not a regex, has no capture group, matches
        no metric, or gives two metrics the same row.

    >>> records = [{"step": s, **{f"grad_norm/layers/{i}": (i + 1) / s for i in range(3)}} for s in range(1, 5)]
    >>> fig = heatmap_figure({"run": records}, r"grad_norm/layers/(\\d+)$")
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
    ['0', '1', '2']
    """
    _import_matplotlib()
    import matplotlib
    from matplotlib import colors, ticker
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    try:
        regex_ = compile_regex(pattern)
    except re.error as e:
        raise ValueError(f"--heatmap {pattern!r}: not a valid regex ({e}).") from None
    if regex_.groups < 1:
        raise ValueError(f"--heatmap {pattern!r} has no capture group to name the rows; put the layer index in one, "
                         r"e.g. 'grad_norm/layers/(\d+)$'.")
    if not runs:
        raise ValueError("no runs to plot; pass at least one metrics file.")
    rows, bar_label = _heatmap_rows(runs, regex_)
    if not rows:
        names = _metric_names(runs)
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ValueError(f"--heatmap {pattern!r} matches none of the logged metrics ({shown}); per-layer norms are "
                         "logged by norm_metrics(depth=K) on stacked layers (`treetools train --scan-layers`).")
    order = sorted(set(rows.values()), key=_natural)
    index = {label: i for i, label in enumerate(order)}

    grids = {label: _heatmap_grid(records, rows, index) for label, records in runs.items()}
    positive = np.concatenate([d[np.isfinite(d) & (d > 0)] for _, d, _ in grids.values()])
    if positive.size:
        lo, hi = float(positive.min()), float(positive.max())
        norm: colors.Normalize = colors.LogNorm(lo / 1.05, hi * 1.05) if hi / lo < 1.1 else colors.LogNorm(lo, hi)
    else:
        norm = colors.Normalize(0, 1)  # nothing positive and finite: every cell grey or red
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")  # no value (or <= 0): grey

    panel_height = min(max(0.2 * len(order), 1.4), 9.0)
    fig = Figure(figsize=(10, panel_height * len(grids) + 1.3), layout="constrained")
    axes = list(fig.subplots(len(grids), 1, sharex=True, squeeze=False).flat)
    stride = math.ceil(len(order) / HEATMAP_LABELLED_ROWS)
    ylabel = next(iter(regex_.groupindex), "layer")
    meshes = []
    for ax, (label, (steps, data, bad)) in zip(axes, grids.items()):
        xs, ys = cell_edges(steps), np.arange(len(order) + 1) - 0.5
        cells = np.where(np.isfinite(data) & (data > 0), data, np.nan)
        meshes.append(ax.pcolormesh(xs, ys, np.ma.masked_invalid(cells), cmap=cmap, norm=norm, shading="flat",
                                    gid="values"))
        if bad.any():
            ax.pcolormesh(xs, ys, np.ma.masked_where(~bad, np.ones(data.shape)), cmap=colors.ListedColormap(
                [NONFINITE_COLOR]), shading="flat", gid="nonfinite-cells")
            mark_nonfinite(ax, [s for j, s in enumerate(steps) if bad[:, j].any()])
        ax.set_yticks(range(0, len(order), stride), [order[i] for i in range(0, len(order), stride)],
                      fontsize=8 if len(order) > 12 else 9)
        ax.set_ylim(len(order) - 0.5, -0.5)  # the first row on top, as in a table
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.set_title(label if len(grids) > 1 else f"{label}: {bar_label}", fontsize=10, pad=12 if bad.any() else None)
    axes[-1].set_xlabel("step")
    scale = " (log scale)" if isinstance(norm, colors.LogNorm) else ""
    bar = fig.colorbar(meshes[-1], ax=axes, label=bar_label + scale,
                       aspect=max(10.0, 4 * fig.get_figheight()))  # about a quarter inch wide at any height
    bar.ax.tick_params(labelsize=8)
    handles = [Patch(color=NONFINITE_COLOR, label="NaN/Inf"), Patch(color="0.85", label="no value / <= 0")]
    fig.legend(handles=handles, loc="outside lower right", ncols=2, fontsize=8, frameon=False)
    return fig




# --------------------------------------------------------------------------- #
# A checkpoint's statistics across its steps
# --------------------------------------------------------------------------- #


def _shared_folder(paths: Sequence[str]) -> str:
    """The leading path parts two or more paths share (a path's own last part never counts).

    >>> _shared_folder(["opt/0/mu/w", "opt/0/nu/w"]), _shared_folder(["a/w"])
    ('opt/0', '')
    """
    if len(paths) < 2:
        return ""
    split = [p.split("/")[:-1] for p in paths]
    shared = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        shared.append(parts[0])
    return "/".join(shared)


def stats_report(path: str | os.PathLike, *, depth: int | None = None, item: str | None = None,
                 rules: Rules | None = None, read: ReadOptions | ReadContext | None = None) -> Report:
    """The ``treetools inspect --step all --stats`` report of a checkpoint root, as ``plot_stats`` draws it.

    Every leaf (or every module of ``depth`` path parts) of every committed
    step, with its statistics; arrays are streamed within the memory budget,
    with a progress bar on a terminal. ``rules`` (``tt.Rules(unstack=[...])``)
    map the leaves first: a stacked leaf is one line per layer. ``read``: how to read (``tt.ReadOptions`` or a
    ``ReadContext``: links, memory budget, block size, threads, progress bar, processes; None: the
    environment's).

    Raises:
      CheckpointNotFoundError, CheckpointError: as ``treetools inspect``.
    """
    options = InspectOptions(step="all", stats=True, item=item, depth=depth, leaves=depth is None, rules=rules,
                             **read_fields(read))
    return inspect_path(os.fspath(path), options)


def _is_integer(dtype: str | None) -> bool:
    """An integer or bool dtype (a step counter, a mask): its statistics are counts, not a weight's scale.

    >>> [_is_integer(d) for d in ("int32", "uint8", "bool", "float32", "bfloat16", "mixed", None)]
    [True, True, True, False, False, False, False]
    """
    return dtype is not None and (dtype == "bool" or re.fullmatch(r"u?int\d*", dtype) is not None)


def _stat_series(report: Report, stat: str) -> dict[str, dict[str, tuple[Row, list]]]:
    """``{item: {path: (its last row, [(step, value, nonfinite elements), ...])}}`` in the report's order."""
    out: dict[str, dict[str, tuple[Row, list]]] = {}
    for checkpoint in report.by_step:
        if checkpoint.step is None:
            continue
        for item, data in checkpoint.items.items():
            for row in data.rows:
                if row.stats is None:
                    continue
                value = row.stats.get(stat)
                value = float(value) if _is_number(value) else math.nan  # None: no finite element
                points = out.setdefault(item, {}).get(row.name, (row, []))[1]
                points.append((checkpoint.step, value, nonfinite_count(row.stats)))
                out[item][row.name] = (row, points)
    return out


def stats_figure(
    report: Report,
    stat: str = "l2",
    *,
    keys: str | Sequence[str] | None = None,
    max_lines: int = MAX_MODULES,
) -> Figure:
    """A statistic of each leaf (or module) of a checkpoint against the step: one panel per item.

    Integer leaves (an optimizer's step ``count``, masks) are left out unless
    ``keys`` picks them (their statistics are counts: they would take the
    largest slots and force a log axis), and each panel's title says how many.

    Args:
      report: an inspect ``Report`` of every step with statistics (``stats_report``, or
        ``tt.inspect_path(path, step="all", stats=True)``).
      stat: one statistic of each leaf's ``stats`` (``l2``, ``abs_max``, ``nan``, ...).
      keys: regex (or regexes) picking leaf or module paths with ``re.search``.
      max_lines: each panel shows this many paths, those with the largest last value.

    Returns:
      The figure, titled per leaf or, for a report grouped with ``depth``, per
      module. Steps where a shown path holds NaN/Inf elements (its
      ``nan``/``posinf``/``neginf`` counts), or whose statistic is not finite,
      are marked (``mark_nonfinite``).

    Raises:
      ImportError: matplotlib is not installed.
      ValueError: the report holds no statistics or no saved steps, or ``keys`` matches no path.
    """
    _import_matplotlib()
    from matplotlib.figure import Figure

    found = _stat_series(report, stat)
    if not found:
        raise ValueError(f"{report.path}: no saved step with statistics to plot (a checkpoint root with committed "
                         "steps, read with stats).")
    pattern, named = _compile(keys)
    left_out: dict[str, int] = {}
    if pattern is not None:
        series = {item: {p: v for p, v in paths.items() if pattern.search(p)} for item, paths in found.items()}
        if not any(series.values()):
            names = list(dict.fromkeys(p for paths in found.values() for p in paths))
            raise ValueError(f"{named} matches none of the checkpoint's paths ({', '.join(names[:8])}"
                             f"{', ...' if len(names) > 8 else ''}); pick from those.")
    else:
        series = {item: {p: v for p, v in paths.items() if not _is_integer(v[0].dtype)}
                  for item, paths in found.items()}
        left_out = {item: len(found[item]) - len(paths) for item, paths in series.items()}
        if not any(series.values()):  # integers only: nothing else to show
            series, left_out = found, {}
    series = {item: paths for item, paths in series.items() if paths}

    fig = Figure(layout="constrained")
    axes, ncols = _grid(fig, len(series), ncols=1, width=9.0)  # one panel a row: the legend at its right
    for ax, (item, paths) in zip(axes, series.items()):
        ranked = sorted(paths, key=lambda p: -next((abs(v) for _, v, _ in reversed(paths[p][1]) if math.isfinite(v)),
                                                   -math.inf))
        shown = ranked[:max_lines]
        shared = _shared_folder(shown)  # said once in the title, not in every label
        title = f"{item}: {stat}"
        if len(ranked) > max_lines:
            title += f" (largest {max_lines} of {len(ranked)})"
        if shared:
            title += f", under {shared}/"
        if left_out.get(item):
            n = left_out[item]
            title += f"; {n} integer lea{'f' if n == 1 else 'ves'} left out (--keys picks them)"
        values: list[float] = []
        nonfinite: list = []
        for m, path in enumerate(shown):
            points = paths[path][1]
            finite, bad = _curve(ax, [s for s, _, _ in points], [v for _, v, _ in points],
                                 color=_COLORS[m % len(_COLORS)], linewidth=1.2, label=path[len(shared):].lstrip("/"))
            values += finite
            nonfinite += bad + [s for s, _, n in points if n]
        _finish_panel(ax, title, values, nonfinite)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _label_bottom(axes, ncols)
    fig.suptitle(f"{report.path}: {stat} per {'leaf' if report.depth is None else 'module'}", fontsize=10)
    return fig


# --------------------------------------------------------------------------- #
# The entries for a notebook (tt.plot_metrics, tt.plot_stats)
# --------------------------------------------------------------------------- #


def plot_metrics(
    runs: Mapping[str, Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
    *,
    keys: str | Sequence[str] | None = None,
    heatmap: str | None = None,
    max_modules: int = MAX_MODULES,
) -> Figure:
    """Metric curves of one or more runs (``metrics_figure``), or with ``heatmap`` a layers x steps heatmap
    (``heatmap_figure``): what ``treetools plot RUN...`` draws.

    Args:
      runs: run label -> its records (``tt.read_metrics(path)``), in legend order; or one run's records.
      keys: regex (or regexes) picking metrics by name; default: loss, norms, update_ratio, nonfinite_grads, lr.
      heatmap: a regex with a capture group naming each row (``r"grad_norm/layers/(\\d+)$"``).
      max_modules: per-module panels show this many modules, the largest by their last value.

    Returns:
      A matplotlib ``Figure``; ``fig.savefig("norms.png")`` writes it.

    Raises:
      ImportError: matplotlib is not installed.
      UsageError: both ``keys`` and ``heatmap``.
      ValueError: as ``metrics_figure`` / ``heatmap_figure`` (nothing matches, too many panels...).

    >>> records = [{"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "grad_norm/layers/0": 0.5, "grad_norm/layers/1": 0.8}
    ...            for s in (10, 20, 30)]
    >>> [ax.get_title() for ax in plot_metrics(records).axes]
    ['loss', 'grad_norm', 'grad_norm per module']
    >>> plot_metrics({"run": records}, heatmap=r"grad_norm/layers/(\\d+)$").axes[0].get_ylabel()
    'layer'
    """
    if keys is not None and heatmap is not None:
        raise UsageError("--keys and --heatmap (`keys`, `heatmap`) pick metrics each their own way; give one of them")
    if not isinstance(runs, Mapping):
        runs = {"run": list(runs)}
    if heatmap is not None:
        return heatmap_figure(runs, heatmap)
    return metrics_figure(runs, keys=keys, max_modules=max_modules)


def plot_stats(
    report: Report | str | os.PathLike,
    stat: str = "l2",
    *,
    keys: str | Sequence[str] | None = None,
    depth: int | None = None,
    item: str | None = None,
    rules: Rules | None = None,
    max_lines: int = MAX_MODULES,
    read: ReadOptions | ReadContext | None = None,
) -> Figure:
    """A statistic of each leaf (or module) of a checkpoint across its saved steps: what
    ``treetools plot CKPT --stats STAT`` draws.

    Args:
      report: an inspect ``Report`` of every step with statistics (``tt.inspect_path(path, step="all",
        stats=True)``), or a checkpoint root, read here (``stats_report``) with ``depth``, ``item`` and ``rules``.
      stat: ``l2`` (default), ``mean``, ``std``, ``min``, ``max``, ``abs_max``, ``zeros``, ``nan``, ``posinf``,
        ``neginf``.
      keys: regex (or regexes) picking leaf or module paths; integer leaves are shown only when ``keys`` picks them.
      depth: with a path, one line per module of ``depth`` path parts (default: one per leaf).
      item: with a path, only this item (``params``); only it is read.
      rules: with a path, ``tt.Rules`` mapping the leaves first (``unstack``: a stacked leaf is a line per layer).
      max_lines: each panel shows this many paths, the largest by their last value.
      read: with a path, how to read it (``tt.ReadOptions`` or a ``ReadContext``: ``follow_links``,
        ``memory_budget``, ``block_bytes``, ``workers``, ``progress``; None: the environment's).

    Returns:
      A matplotlib ``Figure``, one panel per item.

    Raises:
      ImportError: matplotlib is not installed.
      UsageError: ``depth``, ``item``, ``rules`` or ``read`` with a report (they say how to read a path).
      ValueError, CheckpointError: as ``stats_figure`` and ``tt.inspect_path``.

    >>> import numpy as np, tempfile, treetools as tt
    >>> root = tempfile.mkdtemp()
    >>> manager = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    >>> for step in (1, 2):
    ...     _ = tt.save_checkpoint(manager, step, {"params": {"w": np.full(4, step, np.float32)}}, wait=True)
    >>> manager.close()
    >>> fig = plot_stats(root, "max")
    >>> [(ax.get_title(), ax.lines[0].get_ydata().tolist()) for ax in fig.axes]
    [('params: max', [1.0, 2.0])]
    """
    if isinstance(report, Report):
        if depth is not None or item is not None or rules is not None or read is not None:
            raise UsageError("`depth`, `item`, `rules` and `read` say how to read a checkpoint; pass them with its "
                             "path, or to tt.inspect_path for a report")
    else:
        report = stats_report(report, depth=depth, item=item, rules=rules, read=read)
    return stats_figure(report, stat, keys=keys, max_lines=max_lines)
