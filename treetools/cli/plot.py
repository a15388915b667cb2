"""Plot metric curves from metrics files (runs overlaid), per-layer heatmaps, or checkpoint statistics across steps.

METRICS is a metrics.jsonl written by `treetools train` or tt.MetricsLogger
(one JSON object per line, each with a `step`), or the folder holding one.
Each run is labelled by its folder name (more of the path where two runs
share a name).

Panels, one per metric: by default loss-like keys, grad/param/update norms,
update_ratio, nonfinite_grads and the learning rate (lr, learning_rate),
whichever are logged (every metric when none of these is). --keys RE picks
metrics by regex (re.search; repeat it to add more); --keys matching no
metric, or more than 12 panels, is an error. Per-module entries such as grad_norm/layers_0
(norm_metrics(depth=K)) get one panel per kind, a line per module (the
largest 8 by their last value). The y axis is linear, and logarithmic when a
panel's values are all positive and span a factor of 3 or more for a ratio
(update_ratio, any metric named *ratio*), of 100 or more for any other (so a
flat update_ratio stays linear). A step whose value is NaN or Inf breaks the
curve there and is marked with a red triangle on the panel's top edge and a
dashed red line; nonfinite_grads marks every step where it is above 0.

--heatmap RE draws a layers x steps heatmap instead: every metric matching RE
(re.search) is a row, named by RE's capture group, e.g. 'grad_norm/layers/(\\d+)$'
for the per-layer norms of a scanned model (norm_metrics with stacked
layers, `treetools train --scan-layers`); numeric rows are ordered by
number. Log colour scale with a colour bar; NaN/Inf cells are red, and their
steps marked on the top edge; cells with no value (or <= 0) are grey.

--stats [STAT] plots a statistic (default l2; also mean, std, min, max,
abs_max, zeros, nan, posinf, neginf) of every leaf (or of every module with
--depth K) of a checkpoint, across its saved steps: one panel per item
(params, opt_state, ...; --item picks one), a line per leaf or module (the
largest 8 by their last value; --keys RE picks paths), the y axis as above.
Integer leaves (an optimizer's step count) are left out unless --keys picks
them. --unstack RE shows a stacked (scanned) leaf that RE matches as one line
per layer. Steps where a shown leaf holds NaN or Inf are marked. CKPT_DIR is a
checkpoint root that `treetools inspect` reads; the arrays are streamed as
`treetools inspect --step all --stats` does, with the same reading flags
(--follow-links, --memory-budget, --block-size, --workers, --progress,
--processes; docs/cli.md), which apply to --stats only.

The figures are the library's (tt.plot_metrics, tt.plot_stats; treetools.checkpoint_tools.plot),
usable from a notebook. A health dump (health_<step>.json, written by
`treetools train --health` or tt.HealthDumper) is drawn as modules x steps
heatmaps around the flagged step, the attributed module marked (default
output: beside it, .png). Needs matplotlib (pip install 'jax-treetools[plot]').
The image format follows the extension of -o (png, svg, pdf, ...). Nothing
is written under CKPT_DIR.

Examples:
  treetools plot runs/demo                        (writes runs/demo/norms.png)
  treetools plot runs/a runs/b -o ab.png          (two runs overlaid)
  treetools plot runs/demo --keys loss --keys '^lr$' -o loss.png
  treetools plot runs/demo --keys '^grad_norm/' -o grads.png
  treetools plot runs/scan --heatmap 'grad_norm/layers/(\\d+)$' -o layers.png
  treetools plot runs/demo/checkpoints --stats --item params -o l2.png
  treetools plot runs/spike/health/health_00000064.json
  treetools plot runs/demo/checkpoints --stats abs_max --depth 1 --keys '^layers' -o absmax.png
"""


from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from treetools.cli import _output
from treetools.cli._args import positive_int
from treetools.cli.options import add_reading, add_rules, read_options, reading_given, rules_from
from treetools.pytree.metrics import METRICS_FILE, read_metrics
from treetools.shared.errors import UsageError
from treetools.shared.files import check_writable, replace_file
from treetools.shared.rows import STATS

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", nargs="+", metavar="RUN_OR_METRICS",
                        help="metrics.jsonl files (or the WORKDIRs holding them; several are overlaid), or with "
                             "--stats one checkpoint root")
    parser.add_argument("--keys", action="append", metavar="RE",
                        help="plot the metrics (with --stats: the leaf or module paths) whose name matches this "
                             "regex (re.search); repeatable (default: loss, norms, update_ratio, nonfinite_grads, "
                             "learning rate)")
    parser.add_argument("--heatmap", metavar="RE",
                        help="a heatmap of the metrics matching RE, one row per value of its capture group, e.g. "
                             "'grad_norm/layers/(\\d+)$' (layers x steps, log colour scale)")
    parser.add_argument("--stats", nargs="?", const="l2", type=_stat_name, metavar="STAT",
                        help="plot a statistic of a checkpoint's leaves across its steps (default l2; mean, std, "
                             "min, max, abs_max, zeros, nan, posinf, neginf)")
    parser.add_argument("--depth", type=positive_int, metavar="K",
                        help="with --stats: one line per module of K path parts (default: one per leaf)")
    parser.add_argument("--item", metavar="NAME", help="with --stats: only this item (e.g. params); reads only it")
    add_rules(parser, ("unstack",))
    add_reading(parser)
    parser.add_argument("-o", "--output", default=None, metavar="IMAGE",
                        help="image to write (default: norms.png, or heatmap.png, beside METRICS; with several, "
                             "and for --stats (stats_STAT.png), in the current folder)")


def _stat_name(text: str) -> str:
    if text not in STATS:
        raise argparse.ArgumentTypeError(f"unknown statistic {text!r}; one of {', '.join(STATS)}")
    return text


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


def _read_runs(paths: Sequence[str | os.PathLike]) -> dict[str, list[dict]]:
    return {label: read_metrics(path) for label, path in zip(run_labels(paths), paths)}


def plot_files(paths: Sequence[str | os.PathLike], *, keys: str | Sequence[str] | None = None) -> Figure:
    """``metrics_figure`` of metrics files (or folders holding ``metrics.jsonl``), labelled by ``run_labels``.

    Raises:
      FileNotFoundError, ValueError: a file is missing or not a metrics file
        (``tt.read_metrics``), or as ``metrics_figure``.
    """
    # Here, not at the top: matplotlib and the reading modules, which `treetools plot --help` does not need (numpy).
    from treetools.checkpoint_tools.plot import plot_metrics

    return plot_metrics(_read_runs(paths), keys=keys)


def _check_output(output: str, supported: Mapping[str, str], reads: str | None = None) -> None:
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"-o {output}: folder {folder} does not exist; create it or pick another path.")
    ext = os.path.splitext(output)[1].lower().lstrip(".")
    if ext and ext not in supported:
        raise ValueError(f"-o {output}: matplotlib cannot write .{ext} images; use .png, .svg or .pdf.")
    if reads is not None and "://" not in reads:
        root = os.path.realpath(os.path.expanduser(reads))
        if os.path.realpath(output) == root or os.path.realpath(output).startswith(root.rstrip(os.sep) + os.sep):
            raise ValueError(f"-o {output} is inside the checkpoint {reads}, and nothing is written under a path "
                             "that is read; pick a path outside it.")
    check_writable(output)  # a read-only folder fails now, before anything is read or drawn


def _default_output(paths: Sequence[str], name: str = "norms.png") -> str:
    if len(paths) > 1:
        return name
    path = os.path.expanduser(paths[0])
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)), name)


def _plot_health_dump(path: str, output: str | None) -> int:
    # Here, not at the top: the figures' modules import numpy, which `treetools plot --help` does not need.
    from treetools.checkpoint_tools import healthplot
    from treetools.checkpoint_tools.plot import image_formats

    output = os.path.expanduser(output) if output else os.path.splitext(os.path.expanduser(path))[0] + ".png"
    _check_output(output, image_formats())
    _save(healthplot.health_figure(healthplot.read_health_dump(path)), output)
    _output.out(output)
    return 0


def _save(fig: "Figure", output: str) -> None:
    """Write ``fig`` to ``output``: whole, then renamed over it (a link planted there is replaced, never written
    through: ``shared.files.replace_file``); matplotlib's warnings (a glyph missing for an ESC in a name) as one
    escaped note each, never raw on stderr."""
    fmt = os.path.splitext(output)[1].lower().lstrip(".") or "png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replace_file(output, lambda f: fig.savefig(f, format=fmt, dpi=100))
    for message in dict.fromkeys(str(w.message) for w in caught):
        _output.note(f"matplotlib: {message}")


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the figures' modules import numpy, which `treetools plot --help` does not need.
    from treetools.checkpoint_tools import healthplot

    paths = args.metrics
    if len(paths) == 1 and args.stats is None and args.heatmap is None and healthplot.is_health_dump(paths[0]):
        return _plot_health_dump(paths[0], args.output)
    if args.stats is None:
        reading = reading_given(args)
        if args.depth is not None or args.item is not None or args.unstack or reading:
            given = [f for f, v in (("--depth", args.depth is not None), ("--item", args.item is not None),
                                    ("--unstack", bool(args.unstack))) if v] + reading
            raise UsageError(f"{', '.join(given)}: these flags apply to --stats (a checkpoint's statistics); "
                             "metrics files are read whole")
    elif args.heatmap is not None:
        raise UsageError("--heatmap draws metrics files, --stats a checkpoint; give one of them")
    elif len(paths) != 1:
        raise UsageError(f"--stats reads one checkpoint root, got {len(paths)} paths")
    if args.output:
        output = os.path.expanduser(args.output)
    elif args.stats is not None:
        output = f"stats_{args.stats}.png"
    else:
        output = _default_output(paths, "heatmap.png" if args.heatmap is not None else "norms.png")
    # Here, not at the top: matplotlib and the reading modules, which `treetools plot --help` does not need (numpy).
    from treetools.checkpoint_tools.plot import image_formats, plot_metrics, plot_stats

    # Checked before anything is read: --stats streams a whole checkpoint.
    _check_output(output, image_formats(), reads=paths[0] if args.stats is not None else None)
    if args.stats is not None:
        fig = plot_stats(paths[0], args.stats, keys=args.keys, depth=args.depth, item=args.item,
                         rules=rules_from(args), read=read_options(args))
    else:
        fig = plot_metrics(_read_runs(paths), keys=args.keys, heatmap=args.heatmap)
    share = getattr(args, "share", None)
    if share is not None and share.index != 0:
        return 0  # --processes: each process read its share; process 0 writes the one image
    _save(fig, output)
    _output.out(output)
    return 0
