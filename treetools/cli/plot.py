"""Plot loss, grad_norm, param_norm and update_ratio against the step, from the
metrics.jsonl that `treetools train` writes (one JSON object per line, each
with a `step`). A curve that was not logged is marked "(not logged)";
non-finite values are left out of the curves.

Needs matplotlib (pip install 'treetools[plot]'). The image format follows
the extension of -o (png, svg, pdf, ...).

Examples:
  treetools plot runs/demo/metrics.jsonl -o norms.png
  treetools plot runs/demo                     (writes runs/demo/norms.png)
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

__all__ = ["add_arguments", "main", "plot", "read_metrics"]

CURVES = ("loss", "grad_norm", "param_norm", "update_ratio")
METRICS_FILE = "metrics.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS",
                        help="a metrics.jsonl written by `treetools train`, or the WORKDIR holding it")
    parser.add_argument("-o", "--output", default=None, metavar="IMAGE",
                        help="image to write (default: norms.png beside METRICS)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics file, in file order; a missing file or a malformed line is a one-line error.

    Args:
      path: a ``metrics.jsonl``, or a folder holding one (a ``treetools train`` WORKDIR).

    Returns:
      One dict per line, each with a numeric ``step``.

    Raises:
      FileNotFoundError, ValueError: the message names the file (and line) and the fix.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> _ = open(f, "w").write('{"step": 1, "loss": 2.5}\\n\\n{"step": 2, "loss": 2.0}\\n')
    >>> [r["loss"] for r in read_metrics(os.path.dirname(f))]
    [2.5, 2.0]
    """
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, METRICS_FILE)):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such metrics file; `treetools train --workdir DIR` writes DIR/{METRICS_FILE}")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or not _is_number(record.get("step")):
                raise ValueError(f"{path}:{lineno}: not a metrics record (a JSON object with a numeric `step`); "
                                 "is it a treetools metrics.jsonl?")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no records; is it a treetools metrics.jsonl?")
    return records


def _check_output(output: str, supported: dict[str, str]) -> None:
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"-o {output}: folder {folder} does not exist; create it or pick another path.")
    ext = os.path.splitext(output)[1].lower().lstrip(".")
    if ext and ext not in supported:
        raise ValueError(f"-o {output}: matplotlib cannot write .{ext} images; use .png, .svg or .pdf.")


def plot(records: list[dict], output: str) -> str:
    """Write a 2x2 figure of the curves present in ``records``; returns its path.

    Raises:
      ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("`treetools plot` needs matplotlib; install it: pip install 'treetools[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    try:
        _check_output(output, fig.canvas.get_supported_filetypes())
        for ax, key in zip(axes.flat, CURVES):
            finite = [(r["step"], r[key]) for r in records if _is_number(r.get(key)) and math.isfinite(r[key])]
            if finite:
                ax.plot(*zip(*finite), marker=".")
            ax.set_title(key if finite else f"{key} (not logged)")
            ax.grid(alpha=0.3)
            if key == "update_ratio" and finite and all(v > 0 for _, v in finite):
                ax.set_yscale("log")
        for ax in axes[-1]:
            ax.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(output, dpi=100)
    finally:
        plt.close(fig)
    return output


def main(args: argparse.Namespace) -> int:
    records = read_metrics(args.metrics)
    folder = args.metrics if os.path.isdir(args.metrics) else os.path.dirname(os.path.abspath(args.metrics))
    print(plot(records, args.output or os.path.join(folder, "norms.png")))
    return 0
