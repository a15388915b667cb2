"""Show what is inside a checkpoint, without the model code, the original devices, or loading it.

PATH may be an Orbax CheckpointManager root (step folders N or prefix_N, any
zero padding), one step folder, one item folder, a Flax msgpack file
(flax.serialization.to_bytes), a .safetensors file or an .npz. Without --step
the latest committed step is shown and every step is listed; incomplete saves
(Orbax tmp folders, a missing commit marker) are listed and never read.

Metadata mode reads no array data. --stats streams each array in bounded
blocks (TREETOOLS_CHUNK_BYTES, default 8 MiB; a compressed storage chunk is
always decoded whole) and reports mean, std (population), min, max, l2 and
abs_max over the finite elements, plus the counts zeros, nan, posinf, neginf.
In JSON a float that is NaN or infinite is written as null. Dotted tensor
names (model.layers.0.weight) are shown as path strings (model/layers/0/weight).

Exit codes: 0 ok; 1 error (missing path, not a checkpoint, corrupt file, a
pattern that matches nothing); 2 usage; 3 non-finite values found under
--fail-on-nonfinite. Nothing is ever written under PATH.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "main"]

FORMATS = ("table", "json", "markdown", "tree")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _step(text: str) -> int | str:
    if text in ("latest", "all"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number, `latest` or `all`; got {text!r}") from None


def _chunk_mb(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB, got {text!r}")
    return max(1024, int(value * 2**20))


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``inspect`` and ``diff``."""
    parser.add_argument("--item", metavar="NAME", help="only this item of a composite checkpoint (e.g. params)")
    # Hidden: the block budget of --stats / --values (tests and benchmarks shrink it).
    parser.add_argument("--chunk-mb", type=_chunk_mb, default=None, dest="chunk_bytes", help=argparse.SUPPRESS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    parser.add_argument("--step", type=_step, default=None, metavar="N|latest|all",
                        help="step of a CheckpointManager root (default latest); `all` shows every committed step")
    add_common_arguments(parser)
    parser.add_argument("--depth", type=_positive_int, default=None, metavar="K",
                        help="one row per path prefix of K parts, summed")
    parser.add_argument("--include", action="append", default=[], metavar="RE",
                        help="keep leaves whose path matches RE (re.search); repeatable")
    parser.add_argument("--exclude", action="append", default=[], metavar="RE",
                        help="drop leaves whose path matches RE; repeatable")
    parser.add_argument("--sort", choices=("path", "params", "bytes"), default=None,
                        help="row order (default: stored order; params/bytes: largest first)")
    parser.add_argument("--stats", action="store_true",
                        help="stream every array: mean std min max l2 abs_max zeros nan posinf neginf")
    parser.add_argument("--fail-on-nonfinite", action="store_true",
                        help="exit 3 when any leaf holds NaN or Inf (implies --stats)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")


def check_patterns(parser_error, include, exclude) -> None:
    """Invalid regexes are usage errors (exit 2)."""
    import re

    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        for pat in patterns:
            try:
                re.compile(pat)
            except re.error as e:
                parser_error(f"{flag} {pat!r} is not a valid regex ({e})")


def chunk_bytes(args: argparse.Namespace) -> int:
    from treetools.inspect._base import chunk_bytes_from_env

    return args.chunk_bytes if args.chunk_bytes is not None else chunk_bytes_from_env()


def main(args: argparse.Namespace) -> int:
    from treetools.inspect import inspect_path, render_report

    def usage(message: str) -> None:
        print(f"treetools inspect: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    check_patterns(usage, args.include, args.exclude)
    stats = args.stats or args.fail_on_nonfinite
    report = inspect_path(
        args.path,
        step=args.step,
        item=args.item,
        depth=args.depth,
        include=args.include,
        exclude=args.exclude,
        sort=args.sort,
        stats=stats,
        chunk_bytes=chunk_bytes(args),
    )
    for note in report.notes:
        print(f"treetools: note: {note}", file=sys.stderr)
    print(render_report(report, args.format))
    if args.fail_on_nonfinite and report.nonfinite:
        shown = ", ".join(report.nonfinite[:5]) + (" ..." if len(report.nonfinite) > 5 else "")
        print(f"treetools: non-finite values in {len(report.nonfinite)} leaves: {shown}", file=sys.stderr)
        return 3
    return 0
