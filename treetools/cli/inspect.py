"""Show what is inside a checkpoint, without the model code, the original
devices, or loading it.

PATH may be an Orbax CheckpointManager root (step folders N or prefix_N, any
zero padding), one step folder, one item folder, a Flax msgpack file
(flax.serialization.to_bytes), a .safetensors file or an .npz. Without --step
the latest committed step is shown and every step is listed; incomplete saves
(Orbax tmp folders, a missing commit marker) are listed and never read.

Metadata mode reads no array data. --stats streams each array in bounded
blocks (TREETOOLS_CHUNK_BYTES, default 8 MiB; a compressed storage chunk is
always decoded whole) and reports mean, std (population), min, max, l2 and
abs_max over the finite elements, plus the counts zeros, nan, posinf, neginf.
In JSON a float that is NaN or infinite is written as null.

The default view fits a screen: the step's saved time and metrics, then one
section per item (params first, then EMA params, optimizer state, the rest),
each titled with the path prefix all its rows share and grouped at the deepest
level (counted below that prefix) that keeps it to about 15 rows, then a
grand total. --depth K chooses the level, --leaves shows every leaf. A JSON
item (such as a data iterator's state) is shown as its values. Tensor names of
flat-key files (safetensors, npz) are shown exactly as stored.

Examples:
  treetools inspect runs/demo/checkpoints                 latest step, every item
  treetools inspect runs/demo/checkpoints --item params --depth 1
  treetools inspect runs/demo/checkpoints --step all --format json
  treetools inspect model.safetensors --include 'attn' --sort params --stats

Exit codes: 0 ok; 1 error (missing path, not a checkpoint, corrupt file, a
pattern that matches nothing); 2 usage; 3 non-finite values found under
--fail-on-nonfinite. Nothing is ever written under PATH.
"""

from __future__ import annotations

import argparse
import sys

from treetools.cli._args import chunk_mb, positive_float, positive_int, regex, step

__all__ = ["add_arguments", "main"]

FORMATS = ("table", "json", "markdown", "tree")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``inspect`` and ``diff``."""
    parser.add_argument("--item", metavar="NAME",
                        help="only this item of a composite checkpoint (e.g. params); in a single-tree file "
                             "(msgpack of a whole state, npz, safetensors) a top-level key")
    add_memory_argument(parser)
    # Hidden: the block budget of --stats / --values (tests and benchmarks shrink it).
    parser.add_argument("--chunk-mb", type=chunk_mb, default=None, dest="chunk_bytes", help=argparse.SUPPRESS)


def add_memory_argument(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget-mb``: the most stored data decoded at once (``inspect``, ``diff``, ``verify``)."""
    parser.add_argument("--memory-budget-mb", type=positive_float, default=None, metavar="MB",
                        help="most stored data decoded at once by --stats/--show/--values/verify: one storage "
                             "chunk or one --show read (default 2048; TREETOOLS_MEMORY_BUDGET_MB)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    parser.add_argument("--step", type=step, default=None, metavar="N|latest|all",
                        help="step of a CheckpointManager root (default latest); `all` shows every committed step")
    add_common_arguments(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--depth", type=positive_int, default=None, metavar="K",
                       help="one row per path prefix of K parts below the item's shared prefix, summed")
    group.add_argument("--leaves", action="store_true",
                       help="one row per leaf (the default view groups each item to fit a screen)")
    parser.add_argument("--include", type=regex, action="append", default=[], metavar="RE",
                        help="keep leaves whose path matches RE (re.search); repeatable; "
                             "a pattern that matches no leaf is an error")
    parser.add_argument("--exclude", type=regex, action="append", default=[], metavar="RE",
                        help="drop leaves whose path matches RE; repeatable")
    parser.add_argument("--sort", choices=("path", "params", "bytes"), default=None,
                        help="row order (default: stored order; params/bytes: largest first)")
    parser.add_argument("--stats", action="store_true",
                        help="stream every array: mean std min max l2 abs_max zeros nan posinf neginf")
    parser.add_argument("--stats-columns", type=stat_columns, default=None, metavar="COLS",
                        help="comma-separated statistics to show with --stats (default mean,std,min,max,nonfinite; "
                             "any of mean,std,min,max,l2,abs_max,zeros,nan,posinf,neginf,nonfinite or `all`); "
                             "JSON always has every statistic")
    parser.add_argument("--fail-on-nonfinite", action="store_true",
                        help="exit 3 when any leaf holds NaN or Inf (implies --stats)")
    parser.add_argument("--show", metavar="LEAF[SLICE]", default=None,
                        help="print the values of one leaf, or a slice like 'params/w[0:4, -1]', reading only that leaf")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")


_STATS = ("mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf", "nonfinite")


def stat_columns(text: str) -> tuple[str, ...]:
    """``mean,std`` -> ``("mean", "std")``; ``all`` -> every statistic; an unknown name is a usage error."""
    if text.strip() == "all":
        return _STATS
    cols = tuple(c.strip() for c in text.split(",") if c.strip())
    bad = [c for c in cols if c not in _STATS]
    if bad or not cols:
        raise argparse.ArgumentTypeError(f"unknown statistic(s) {', '.join(bad) or '(none)'}; choose from {', '.join(_STATS)} or all")
    return cols


def chunk_bytes(args: argparse.Namespace) -> int:
    from treetools.inspect.arrays import chunk_bytes_from_env

    return args.chunk_bytes if args.chunk_bytes is not None else chunk_bytes_from_env()


ROWS_PER_ITEM = 15

SHOW_THRESHOLD = 200
"""``--show`` prints at most about this many elements (numpy's summarization with ``...`` beyond)."""


def _show(args: argparse.Namespace) -> int:
    import json

    import numpy as np

    from treetools.errors import CheckpointError
    from treetools.inspect.report import show_leaf
    from treetools.inspect.source import jsonable
    from treetools.render import safe_text

    try:
        name, value = show_leaf(args.path, args.show, step=args.step if args.step != "all" else None, item=args.item)
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        print(f"treetools inspect: error: --show: {e}", file=sys.stderr)  # a bad index: usage
        return 2
    if args.format == "json":
        print(json.dumps({"path": name, "value": jsonable(value)}, default=str))
        return 0
    if isinstance(value, np.ndarray):
        print(f"{safe_text(name)}: shape {tuple(value.shape)}, {value.dtype}")
        with np.printoptions(threshold=SHOW_THRESHOLD, edgeitems=3, linewidth=100):
            print(np.array2string(value))
    else:
        print(f"{safe_text(name)}: {safe_text(repr(value))}")
    return 0
"""The default view groups each item at the deepest level that keeps it to this many rows."""


def main(args: argparse.Namespace) -> int:
    from treetools.inspect import inspect_path, render_report

    if args.show is not None:
        return _show(args)
    stats = args.stats or args.fail_on_nonfinite
    summary = args.format != "json" and args.depth is None and not args.leaves
    report = inspect_path(
        args.path,
        step=args.step,
        item=args.item,
        depth=args.depth,
        leaves=args.leaves,
        rows_per_item=ROWS_PER_ITEM if summary else None,
        include=args.include,
        exclude=args.exclude,
        sort=args.sort,
        stats=stats,
        chunk_bytes=chunk_bytes(args),
    )
    for note in report.notes:
        print(f"treetools: note: {note}", file=sys.stderr)
    from treetools.render import DEFAULT_STAT_COLUMNS

    print(render_report(report, args.format, stat_columns=args.stats_columns or DEFAULT_STAT_COLUMNS))
    if args.fail_on_nonfinite and report.nonfinite:
        shown = ", ".join(report.nonfinite[:5]) + (" ..." if len(report.nonfinite) > 5 else "")
        print(f"treetools: non-finite values in {len(report.nonfinite)} leaf(s): {shown}", file=sys.stderr)
        return 3
    return 0
