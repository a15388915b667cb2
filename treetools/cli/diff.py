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
uses its own. Without --item, a side holding only params (an export:
model.safetensors, an .npz) compares with the params of a side holding more
(a run's step), picked as convert picks them, and a note says so:
  treetools diff RUN/checkpoints model.safetensors --values

Shardings are compared by meaning (P() and P(None,) are both replicated).
--include/--exclude pick leaves by path regex, --depth K groups the listing
by path prefixes, --sort orders it.

Rules (--rules FILE, --rename, --drop, --keep, --dtype, --cast, --transpose,
--unstack, --stack; docs/rules.md) map A's leaves first, so a checkpoint
compares with an export made from it under other names and layouts:
  treetools diff RUN/checkpoints model.safetensors --rules to_hf.json --values

--values streams both arrays in the same bounded blocks and reports, per
leaf of equal shape, whether it is bit-identical, how many elements lie
outside |a - b| <= atol + rtol * |b| (numpy's rule; NaN equals NaN and Inf
the same Inf, but a value that becomes NaN or Inf is always outside, and the
non-finite counts of both sides are shown), the max absolute difference over
elements finite on both sides, and the relative L2 difference ||a - b|| / ||a||
(both inf when a finite value became NaN or Inf: the most changed).
Integers and complex numbers are compared exactly. Defaults atol 0, rtol 1e-5:
a relative tolerance, so a tensor of tiny values (Adam's nu, around 1e-9) that
changed by 60% is outside it; an element that is 0 on one side and not on the
other is outside unless --atol allows it. The table lists the leaves that are
not bit-identical ("outside tol" as a count and a share of the leaf's
elements); --sort max_abs_diff|rel_l2|outside puts the most changed first.
The table fits 100 columns: long paths are cut (JSON keeps them whole) and,
where needed, the allclose column is left out, with a note.

--depth K groups leaves by path prefixes of K parts (a dotted stored name
splits on "."): the section titles count leaves and say how many groups
they form; the verdict counts leaves.

The last two lines are the verdict, with every count named: leaves added,
removed, with changed metadata, with the same metadata; then, with --values,
bit-identical, within tolerance and outside tolerance, or "values: not
compared".

--format json prints one object, "schema": 1 (docs/json-schema.md).

An item either side cannot read (a handler treetools does not read, a FIFO
or a damaged file in its folder) is listed under "not read" with the reason,
and the checkpoints are not called the same: exit 1. --allow-unread compares
what was read and lets the exit code follow it.

Exit codes (as GNU diff): 0 the checkpoints are the same (with --values:
every value within tolerance; without, values are not compared and 0 says
only that the leaves and their metadata match); 1 they differ, or an item
was not read (without --allow-unread); 2 trouble (usage, a missing or
unreadable checkpoint).
"""

from __future__ import annotations

import argparse

from treetools.cli import _output
from treetools.cli._args import nonneg_float
from treetools.cli.options import (
    add_allow_unread,
    add_depth,
    add_filters,
    add_item,
    add_output_format,
    add_prefix,
    add_reading,
    add_sort,
    add_rules,
    add_step,
    options_from,
    rules_from,
)
from treetools.shared.errors import UsageError
from treetools.shared.rows import VALUE_SORTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="first checkpoint (the reference)")
    parser.add_argument("b", metavar="B", nargs="?", default=None, help="second checkpoint (default: A)")
    add_step(parser, twice=True)
    add_prefix(parser)
    add_item(parser)
    add_reading(parser)
    add_allow_unread(parser)
    parser.add_argument("--values", action="store_true", help="also compare values, streamed in blocks")
    parser.add_argument("--atol", type=nonneg_float, default=0.0,
                        help="absolute tolerance of |a - b| <= atol + rtol * |b| (default 0: relative only, so "
                             "tensors of tiny values are compared to their own size)")
    parser.add_argument("--rtol", type=nonneg_float, default=1e-5, help="relative tolerance (default 1e-5)")
    add_depth(parser, help="group the listing by path prefixes of K parts (titles count leaves and groups)")
    add_filters(parser, verb="compare only")
    add_sort(parser, help="order of the listing: path; params/bytes largest first; with --values, "
                          f"{'/'.join(VALUE_SORTS)} most changed first", more=VALUE_SORTS)
    add_rules(parser)
    add_output_format(parser, ("table", "json", "markdown"))


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the reading modules import numpy, which `treetools diff --help` does not need.
    from treetools.checkpoint_tools.diff import diff_paths
    from treetools.checkpoint_tools.options import DiffOptions
    from treetools.checkpoint_tools.text import render_diff

    steps = list(args.step)
    if len(steps) > 2:
        raise UsageError("--step may be given at most twice (A's step, then B's)")
    if args.b is None and len(steps) != 2:
        raise UsageError("with one checkpoint, give two steps: treetools diff RUN --step 100 --step 200")
    # --step all, a value sort without --values: the library's UsageError (exit 2), before anything is read.
    options = options_from(args, DiffOptions, step=steps[0] if len(steps) == 1 else None,
                           step_a=steps[0] if len(steps) == 2 else None, step_b=steps[1] if len(steps) == 2 else None,
                           rules=rules_from(args))
    report = diff_paths(args.a, args.b if args.b is not None else args.a, options)
    for note in report.notes:
        _output.note(note)
    _output.out(render_diff(report, args.format))
    return 0 if report.identical else 1
