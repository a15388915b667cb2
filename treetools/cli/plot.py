"""Plot metric curves against the step from metrics files; several runs are overlaid.

METRICS is a metrics.jsonl written by `treetools train` or tt.MetricsLogger
(one JSON object per line, each with a `step`), or the folder holding one.
Each run is labelled by its folder name (more of the path where two runs
share a name).

Panels, one per metric: by default loss-like keys, grad/param/update norms,
update_ratio and the learning rate (lr, learning_rate), whichever are logged
(every metric when none of these is). --keys RE picks metrics by regex
(re.search; repeat it to add more); --keys matching no metric is an error.
Per-module entries such as grad_norm/layers_0 (norm_metrics(depth=K)) get one
panel per kind, a line per module (the largest few). update_ratio, and curves
spanning several decades, use a log axis. Non-finite values are left out.

Needs matplotlib (pip install 'treetools[plot]'). The image format follows
the extension of -o (png, svg, pdf, ...).

Examples:
  treetools plot runs/demo                        (writes runs/demo/norms.png)
  treetools plot runs/a runs/b -o ab.png          (two runs overlaid)
  treetools plot runs/demo --keys loss --keys '^lr$' -o loss.png
  treetools plot runs/demo --keys '^grad_norm/' -o grads.png
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from treetools.metrics import METRICS_FILE, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure


DEFAULT_KEYS = r"loss|(^|/)(grad|param|update)_norm(/|$)|update_ratio|(^|/)(lr|learning_rate)$"
MAX_PANELS = 12
MAX_MODULES = 8
# Panel order: loss first, then the norms, the ratio, the learning rate; other metrics after, as first logged.
_ORDER = (r"loss", r"grad_norm", r"param_norm", r"update_norm", r"update_ratio", r"(^|/)(lr|learning_rate)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", nargs="+", metavar="METRICS",
                        help="metrics.jsonl files (or the WORKDIRs holding them); several are overlaid")
    parser.add_argument("--keys", action="append", metavar="RE",
                        help="plot the metrics whose name matches this regex (re.search); repeatable "
                             "(default: loss, norms, update_ratio, learning rate)")
    parser.add_argument("-o", "--output", default=None, metavar="IMAGE",
                        help="image to write (default: norms.png beside METRICS; with several, in the "
                             "current folder)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_labels(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Legend labels for metrics files: the run's folder name, with more of the path where names clash.

    A file not named ``metrics.jsonl`` is labelled by its own name (without
    the extension).

    >>> run_labels(["runs/a/metrics.jsonl", "runs/b"])
    ['a', 'b']
    >>> run_labels(["x/demo/metrics.jsonl", "y/demo/metrics.jsonl", "y/base.jsonl"])
    ['x/demo', 'y/demo', 'y/base']
    """
    parts = []
    for path in paths:
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        folder, name = os.path.split(path)
        if os.path.isdir(path) or name == METRICS_FILE:
            path = path if os.path.isdir(path) else folder
        else:
            path = os.path.join(folder, os.path.splitext(name)[0])
        parts.append([p for p in path.split(os.sep) if p] or [os.sep])
    unique = list(dict.fromkeys(map(tuple, parts)))
    n = next(n for n in range(1, max(map(len, unique)) + 1) if len({p[-n:] for p in unique}) == len(unique))
    seen: dict[str, int] = {}
    labels = []
    for p in parts:
        label = "/".join(p[-n:])
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label} ({seen[label]})")  # the same file twice
    return labels


def _compile(keys: str | Sequence[str] | None) -> tuple[re.Pattern | None, str]:
    """One pattern matching any of ``keys``, and how to name it in an error (``--keys 'a' --keys 'b'``)."""
    if keys is None:
        return None, ""
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        try:
            re.compile(key)
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


def _finite(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if _is_number(r.get(key)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def _last_value(runs: Mapping[str, Sequence[Mapping[str, Any]]], key: str) -> float:
    for records in runs.values():
        _, values = _finite(records, key)
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


def metrics_figure(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    keys: str | Sequence[str] | None = None,
    max_modules: int = MAX_MODULES,
) -> Figure:
    """A matplotlib Figure of metric curves against the step, one panel per metric, runs overlaid.

    Args:
      runs: run label -> its records (``tt.read_metrics``), in legend order.
      keys: regex (or regexes, any may match) picking metrics by name with
        ``re.search``; None: loss-like keys, grad/param/update norms,
        update_ratio and the learning rate, or every metric when none of
        those is logged.
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
    try:
        from matplotlib import ticker
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise ImportError("`treetools plot` needs matplotlib; install it: pip install 'treetools[plot]'") from None

    if not runs:
        raise ValueError("no runs to plot; pass at least one metrics file.")
    pattern, named = _compile(keys)
    names = _metric_names(runs)
    panels = _panels(names, pattern)
    if not panels:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        if pattern is None:
            raise ValueError(f"{', '.join(runs)}: no numeric metric besides `step` to plot.")
        raise ValueError(f"{named} matches none of the logged metrics ({shown}); pick from those.")
    if len(panels) > MAX_PANELS:
        raise ValueError(f"{len(panels)} metrics to plot ({', '.join(t for t, _, _ in panels[:6])}, ...): more than "
                         f"{MAX_PANELS} panels do not fit one figure; choose some with --keys RE.")

    ncols = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows + 0.5), layout="constrained")
    grid = fig.subplots(nrows, ncols, sharex=True, squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    colors = [f"C{i % 10}" for i in range(max(len(runs), max_modules))]
    styles = ["-", "--", ":", "-."]

    for i, (ax, (title, panel_keys, parent)) in enumerate(zip(axes, panels)):
        per_module = parent is not None
        if per_module:
            panel_keys = sorted(panel_keys, key=lambda k: -_last_value(runs, k))
            if len(panel_keys) > max_modules:
                title = f"{title} (largest {max_modules} of {len(panel_keys)})"
                panel_keys = panel_keys[:max_modules]
        values: list[float] = []
        labelled: set[str] = set()
        for r, (label, records) in enumerate(runs.items()):
            for m, key in enumerate(panel_keys):
                steps, ys = _finite(records, key)
                if not steps:
                    continue
                values += ys
                if per_module:
                    ax.plot(steps, ys, color=colors[m], linestyle=styles[r % len(styles)], linewidth=1.2,
                            marker="." if len(steps) < 30 else None,
                            label=None if key in labelled else key[len(parent) + 1:])
                    labelled.add(key)
                else:
                    ax.plot(steps, ys, color=colors[r], linewidth=1.5,
                            marker="." if len(steps) < 30 else None, label=label)
        ax.set_title(title if values else f"{title} (no finite values)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        if values:
            lo, hi = min(values), max(values)
            wants_log = "ratio" in title or (hi / lo >= 100 if lo > 0 else False)
            if lo > 0 and hi / lo >= 3 and wants_log:
                _log_axis(ax, lo, hi)
        if per_module and values:
            handles, labels = ax.get_legend_handles_labels()
            if len(runs) > 1:
                handles += [Line2D([], [], color="0.3", linestyle=styles[r % len(styles)]) for r in range(len(runs))]
                labels += list(runs)
            ax.legend(handles, labels, fontsize=7, ncols=2 if len(labels) > 5 else 1)
        below = i + ncols
        if below >= len(panels):  # bottom of its column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)

    if len(runs) > 1:
        handles = [Line2D([], [], color=colors[r], linewidth=1.5) for r in range(len(runs))]
        fig.legend(handles, list(runs), loc="outside upper center", ncols=min(len(runs), 4), fontsize=9)
    else:
        fig.suptitle(next(iter(runs)), fontsize=10)
    return fig


def plot_files(paths: Sequence[str | os.PathLike], *, keys: str | Sequence[str] | None = None) -> Figure:
    """``metrics_figure`` of metrics files (or folders holding ``metrics.jsonl``), labelled by ``run_labels``.

    Raises:
      FileNotFoundError, ValueError: a file is missing or not a metrics file
        (``tt.read_metrics``), or as ``metrics_figure``.
    """
    runs = {label: read_metrics(path) for label, path in zip(run_labels(paths), paths)}
    return metrics_figure(runs, keys=keys)


def _check_output(output: str, supported: Mapping[str, str]) -> None:
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"-o {output}: folder {folder} does not exist; create it or pick another path.")
    ext = os.path.splitext(output)[1].lower().lstrip(".")
    if ext and ext not in supported:
        raise ValueError(f"-o {output}: matplotlib cannot write .{ext} images; use .png, .svg or .pdf.")


def _default_output(paths: Sequence[str]) -> str:
    if len(paths) > 1:
        return "norms.png"
    path = os.path.expanduser(paths[0])
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)), "norms.png")


def main(args: argparse.Namespace) -> int:
    fig = plot_files(args.metrics, keys=args.keys)
    output = os.path.expanduser(args.output) if args.output else _default_output(args.metrics)
    _check_output(output, fig.canvas.get_supported_filetypes())
    fig.savefig(output, dpi=100)
    print(output)
    return 0
