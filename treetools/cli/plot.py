"""``treetools plot METRICS.jsonl``: loss and norm curves from the trainer's log."""

from __future__ import annotations

import argparse
import json
import math
import os

CURVES = ("loss", "grad_norm", "param_norm", "update_ratio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.jsonl", help="a metrics.jsonl written by `treetools train`")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: norms.png beside METRICS)")


def read_metrics(path: str) -> list[dict]:
    """One dict per JSON line; a missing file or a malformed line is a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such metrics file; `treetools train --workdir DIR` writes DIR/metrics.jsonl")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
    if not any("step" in r for r in records):
        raise ValueError(f"{path}: no records with a `step`; is it a treetools metrics.jsonl?")
    return [r for r in records if "step" in r]


def plot(records: list[dict], output: str) -> str:
    """Write a 2x2 PNG of the curves present in ``records``; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("`treetools plot` needs matplotlib; install it: pip install 'treetools[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, key in zip(axes.flat, CURVES):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        finite = [(s, v) for s, v in points if math.isfinite(v)]
        if finite:
            ax.plot(*zip(*finite), marker=".")
        ax.set_title(key if finite else f"{key} (not logged)")
        ax.grid(alpha=0.3)
        if key in ("update_ratio",) and finite and all(v > 0 for _, v in finite):
            ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def main(args: argparse.Namespace) -> int:
    records = read_metrics(args.metrics)
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "norms.png")
    print(plot(records, output))
    return 0
