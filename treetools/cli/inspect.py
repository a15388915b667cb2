"""Show what is inside a checkpoint, without the model code, the original
devices, or loading it.

PATH may be any checkpoint of the formats listed at the end (an Orbax
CheckpointManager root, step or item folder of any version; T5X; Flax; a
Hugging Face model folder or file; Levanter, EasyDeL, Equinox, Keras; an
.npz), or any of these as a gs:// or s3:// URL, read in place. Without
--step the latest committed step is shown and every step is listed;
incomplete saves (Orbax tmp folders, a missing commit marker) are listed and
never read. A folder holding several series of steps (checkpoint_<N> and
eval_<N>) shows checkpoint_ and names the others: --prefix NAME reads one. A
path that is not a checkpoint but lies inside one, or holds one, is an error
naming the path to pass.

Metadata mode reads no array data. --stats streams each array in bounded
blocks (--block-size, default 8MiB; a compressed storage chunk is always
decoded whole) and reports the statistics listed under --stats: the
floats over the finite elements (std is the population one), the counts over
all. In JSON a float that is NaN or infinite is written as null.
--stats-columns COLS picks the statistics the table shows, and implies --stats.

The default view fits a screen: the step's saved time and metrics, then one
section per item (params first, then EMA params, optimizer state, the rest),
each titled with the path prefix all its rows share and grouped at the deepest
level (counted below that prefix) that keeps it to about 15 rows, then a
grand total. --depth K chooses the level, --leaves shows every leaf. A JSON
item (such as a data iterator's state) is shown as its values. Tensor names of
flat-key files (safetensors, npz) are shown exactly as stored.

--unstack RE shows a stacked (scanned) leaf of shape (L, ...) that RE
matches as L leaves, layers/attn/q -> layers/0/attn/q ... (with --stats, one
row of statistics per layer). The layer index is a path part for --depth, as
for norm_metrics(depth=K): --depth 2 gives layers/0 ...

Examples:
  treetools inspect runs/demo/checkpoints                 latest step, every item
  treetools inspect runs/demo/checkpoints --item params --depth 1
  treetools inspect runs/demo/checkpoints --step all --format json
  treetools inspect model.safetensors --include 'attn' --sort params --stats
  treetools inspect ckpt_dir --prefix validation_loss_lm_per_token_   another series of steps

An item that cannot be read (a handler treetools does not read, a FIFO or a
damaged file in its folder) is listed under "Not read" with the reason, after
everything that was read, and the exit code is 1, as `du` and `ls` exit for a
tree partly unreadable; --allow-unread keeps it 0.

Exit codes: 0 ok; 1 error (missing path, not a checkpoint, corrupt file, a
pattern that matches nothing) or an item not read (without --allow-unread);
2 usage; 3 non-finite values found under --fail-on-nonfinite. Nothing is
ever written under PATH.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Sequence

from treetools.checkpoint_io.formats import catalog
from treetools.cli import _output
from treetools.cli.options import (
    add_depth,
    add_filters,
    add_allow_unread,
    add_item,
    add_output_format,
    add_prefix,
    add_reading,
    add_sort,
    add_rules,
    add_step,
    options_from,
    read_options,
    reading_given,
    rules_from,
)
from treetools.shared.render import CELL_WIDTH, DEFAULT_STAT_COLUMNS, STAT_COLUMNS, safe_text
from treetools.shared.rows import STATS

FORMATS = ("table", "json", "markdown", "tree")

ROWS_PER_ITEM = 15
"""The default view groups each item at the deepest level that keeps it to this many rows."""

def formats_help(width: int = 79) -> str:
    """The formats PATH may be, one paragraph each, from the format registry
    (``treetools.checkpoint_io.formats.catalog``, read without importing numpy): the end of
    ``treetools inspect --help``."""
    names = catalog()
    pad = max(len(name) for name, _ in names) + 4
    lines = ["formats (asked in this order; the first that claims PATH reads it):"]
    for name, description in names:
        # not at hyphens: an install hint ('jax-treetools[keras]') stays whole, to be pasted
        lines += textwrap.wrap(description, width, initial_indent=f"  {name:<{pad - 2}}", subsequent_indent=" " * pad,
                               break_on_hyphens=False)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # called by the parser (cli._CommandParser) when the help is printed; typeshed's argparse types it str | None
    parser.epilog = formats_help  # type: ignore[assignment]
    parser.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    add_step(parser)
    add_prefix(parser)
    add_item(parser)
    add_reading(parser)
    add_allow_unread(parser)
    group = parser.add_mutually_exclusive_group()
    add_depth(group, help="one row per path prefix of K parts below the item's shared prefix, summed")
    group.add_argument("--leaves", action="store_true",
                       help="one row per leaf (the default view groups each item to fit a screen)")
    add_filters(parser)
    add_sort(parser)
    parser.add_argument("--stats", action="store_true", help=f"stream every array: {' '.join(STATS)}")
    parser.add_argument("--stats-columns", type=stat_columns, default=None, metavar="COLS",
                        help="comma-separated statistics to show (implies --stats; default "
                             f"{','.join(DEFAULT_STAT_COLUMNS)}; any of {','.join(STAT_COLUMNS)} or `all`); "
                             "JSON always has every statistic")
    parser.add_argument("--fail-on-nonfinite", action="store_true",
                        help="exit 3 when any leaf holds NaN or Inf (implies --stats)")
    parser.add_argument("--show", metavar="LEAF[SLICE]", default=None,
                        help="print the values of one leaf, or a slice like 'params/w[0:4, -1]', reading only that "
                             "leaf; LEAF is any path a table or hint prints (below --item, or whole); with --step "
                             "all at every step; with --stats its statistics too")
    add_rules(parser, ("unstack",))
    add_output_format(parser, FORMATS)


def stat_columns(text: str) -> tuple[str, ...]:
    """``mean,std`` -> ``("mean", "std")``; ``all`` -> every statistic; an unknown name is a usage error."""
    if text.strip() == "all":
        return STAT_COLUMNS
    cols = tuple(c.strip() for c in text.split(",") if c.strip())
    bad = [c for c in cols if c not in STAT_COLUMNS]
    if bad or not cols:
        raise argparse.ArgumentTypeError(
            f"unknown statistic(s) {', '.join(bad) or '(none)'}; choose from {', '.join(STAT_COLUMNS)} or all")
    return cols


def _show(args: argparse.Namespace) -> int:
    # Here, not at the top: the reading modules import numpy, which `treetools inspect --help` does not need.
    from treetools.checkpoint_tools.show import show_report
    from treetools.checkpoint_tools.text import render_show

    stats = args.stats or args.fail_on_nonfinite or args.stats_columns is not None
    unused = [flag for flag in reading_given(args, data_only=True) if flag != "--block-size" or not stats]
    if unused:  # taken, as by every command that reads, and said to change nothing: never dropped silently
        _output.note(f"--show reads one slice in one read: {', '.join(unused)} change{'s' * (len(unused) == 1)} "
                     "nothing here")
    # A bad index is the library's UsageError (exit 2).
    report = show_report(args.path, args.show, step=args.step, item=args.item, prefix=args.prefix,
                         rules=rules_from(args), read=read_options(args), stats=stats)
    _output.out(render_show(report, args.format, stat_columns=args.stats_columns or DEFAULT_STAT_COLUMNS))
    if args.fail_on_nonfinite and report.nonfinite:
        return nonfinite_exit(report.nonfinite)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.show is not None:
        return _show(args)
    # Here, not at the top: the reading modules import numpy, which `treetools inspect --help` does not need.
    from treetools.checkpoint_tools.options import InspectOptions
    from treetools.checkpoint_tools.report import inspect_path
    from treetools.checkpoint_tools.text import render_report

    rules = rules_from(args)
    summary = args.format in ("table", "markdown") and args.depth is None and not args.leaves
    # --fail-on-nonfinite and --stats-columns imply --stats
    stats = args.stats or args.fail_on_nonfinite or args.stats_columns is not None
    options = options_from(args, InspectOptions, stats=stats,
                           rows_per_item=ROWS_PER_ITEM if summary else None, rules=rules)
    report = inspect_path(args.path, options)
    for note in report.notes:
        _output.note(note)
    _output.out(render_report(report, args.format, stat_columns=args.stats_columns or DEFAULT_STAT_COLUMNS))
    if args.fail_on_nonfinite and report.nonfinite:
        return nonfinite_exit(report.nonfinite)
    return unread_exit(report.unread, report.complete)


def nonfinite_exit(names: Sequence[str]) -> int:
    """``--fail-on-nonfinite``'s one warning, for the leaf table and ``--show`` alike: how many leaves hold NaN or
    Inf and the first five of them; returns its exit code, 3."""
    shown = ", ".join(safe_text(n, width=CELL_WIDTH) for n in names[:5]) + (" ..." if len(names) > 5 else "")
    _output.warning(f"non-finite values in {len(names)} leaf(s): {shown}")
    return 3


def unread_exit(unread: list[str], complete: bool) -> int:
    """1 with one line naming what could not be read (already listed with the reasons), unless ``complete``."""
    if complete:
        return 0
    shown = ", ".join(f"`{safe_text(n, width=CELL_WIDTH)}`" for n in unread[:5]) + (" ..." if len(unread) > 5 else "")
    _output.error(f"{len(unread)} item{'s' * (len(unread) != 1)} could not be read ({shown}): listed with the "
                  "reason above; --allow-unread exits 0 on a partial read")
    return 1
