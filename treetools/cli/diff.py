"""Compare two checkpoints: leaves added, removed and changed; optionally
their values.

A and B are anything `treetools inspect` reads, in any mix of formats (an
Orbax step against an .npz of the same tree works). Leaves are joined by path
string; when each side has one item (or --item picks one) the items are
paired whatever their names. Shape and dtype changes are always reported;
sharding changes when both sides are Orbax (other formats store none).

Two steps of one run:
  treetools diff RUN --step 100 --step 200      (B defaults to A)
  treetools diff RUN/ckpt_100 RUN/ckpt_200
--step given once applies to each side that is a CheckpointManager root;
given twice, the first is A's step and the second B's. --item NAME picks that
item on each side; in a single-tree file (a Flax msgpack of a whole train
state) it is a top-level key, and a side with one item (an .npz of params)
uses its own.

--values streams both arrays in the same bounded blocks and reports, per
leaf of equal shape, the max absolute difference, the relative L2 difference
||a - b|| / ||a||, and allclose under |a - b| <= atol + rtol * |b| (numpy's
rule, NaN equal to NaN; defaults atol 1e-8, rtol 1e-5).

Exit codes: 0 when the comparison ran, whether or not the checkpoints differ
(the verdict is the last line, and "identical" in JSON); 1 error; 2 usage.
"""

from __future__ import annotations

import argparse
import sys

from treetools.cli._args import nonneg_float, step
from treetools.cli.inspect import add_common_arguments, chunk_bytes

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="first checkpoint (the reference)")
    parser.add_argument("b", metavar="B", nargs="?", default=None, help="second checkpoint (default: A)")
    parser.add_argument("--step", type=step, action="append", default=[], metavar="N|latest",
                        help="step of a root; once for both sides, twice for A then B")
    add_common_arguments(parser)
    parser.add_argument("--values", action="store_true", help="also compare values, streamed in blocks")
    parser.add_argument("--atol", type=nonneg_float, default=1e-8, help="absolute tolerance (default 1e-8)")
    parser.add_argument("--rtol", type=nonneg_float, default=1e-5, help="relative tolerance (default 1e-5)")
    parser.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                        help="output format (default table)")


def main(args: argparse.Namespace) -> int:
    from treetools.inspect import diff_paths, render_diff

    def usage(message: str) -> int:
        print(f"treetools diff: error: {message}", file=sys.stderr)
        return 2

    steps = list(args.step)
    if len(steps) > 2:
        return usage("--step may be given at most twice (A's step, then B's)")
    if "all" in steps:
        return usage("--step all is for `inspect`; diff compares one step with another")
    if args.b is None and len(steps) != 2:
        return usage("with one checkpoint, give two steps: treetools diff RUN --step 100 --step 200")
    report = diff_paths(
        args.a,
        args.b if args.b is not None else args.a,
        step=steps[0] if len(steps) == 1 else None,
        step_a=steps[0] if len(steps) == 2 else None,
        step_b=steps[1] if len(steps) == 2 else None,
        item=args.item,
        values=args.values,
        atol=args.atol,
        rtol=args.rtol,
        chunk_bytes=chunk_bytes(args),
    )
    for note in report.notes:
        print(f"treetools: note: {note}", file=sys.stderr)
    print(render_diff(report, args.format))
    return 0
