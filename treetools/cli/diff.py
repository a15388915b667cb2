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

Shardings are compared by meaning (P() and P(None,) are both replicated).
--include/--exclude pick leaves by path regex, --depth K groups the listing
by path prefixes, --sort orders it.

--values streams both arrays in the same bounded blocks and reports, per
leaf of equal shape, whether it is bit-identical, how many elements lie
outside |a - b| <= atol + rtol * |b| (numpy's rule; NaN equals NaN and Inf
the same Inf, but a value that becomes NaN or Inf is always outside, and the
non-finite counts of both sides are shown), the max absolute difference over
elements finite on both sides, and the relative L2 difference ||a - b|| / ||a||.
Integers and complex numbers are compared exactly. Defaults atol 1e-8, rtol 1e-5.

The last line is the verdict, with every count named: leaves added, removed,
with changed metadata, with the same metadata and, with --values,
bit-identical, within tolerance and outside tolerance.

Exit codes (as GNU diff): 0 the checkpoints are the same (within tolerance);
1 they differ; 2 trouble (usage, a missing or unreadable checkpoint).
"""

from __future__ import annotations

import argparse
import sys

from treetools.cli._args import nonneg_float, positive_int, regex, step
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
    parser.add_argument("--depth", type=positive_int, default=None, metavar="K",
                        help="group the listing by path prefixes of K parts")
    parser.add_argument("--include", type=regex, action="append", default=[], metavar="RE",
                        help="compare only leaves whose path matches RE; repeatable")
    parser.add_argument("--exclude", type=regex, action="append", default=[], metavar="RE",
                        help="skip leaves whose path matches RE; repeatable")
    parser.add_argument("--sort", choices=("path", "params", "bytes"), default=None, help="order of the listing")
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
        include=args.include,
        exclude=args.exclude,
        depth=args.depth,
        sort=args.sort,
    )
    for note in report.notes:
        print(f"treetools: note: {note}", file=sys.stderr)
    print(render_diff(report, args.format))
    return 0 if report.identical else 1
