"""Check that a checkpoint is whole: commit evidence, metadata that parses, every
leaf's stored data present and decodable (read chunk by chunk, bounded
memory), metadata and stored arrays that agree (no leaf without data, no
stored array the metadata does not list), and consistent offsets in
safetensors and npz files. Nothing is written.

Examples:
  treetools verify runs/demo/checkpoints               the latest committed step
  treetools verify runs/demo/checkpoints --step all    every committed step
  treetools verify model.safetensors

Exit codes: 0 every check passed (one verdict line); 1 problems found (one
line each, then the verdict) or a known error (missing path, not a
checkpoint); 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from treetools.cli._args import step
from treetools.cli.inspect import add_memory_argument

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    parser.add_argument("--step", type=step, default=None, metavar="N|latest|all",
                        help="step of a checkpoint root (default latest); `all` checks every committed step")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    add_memory_argument(parser)


def main(args: argparse.Namespace) -> int:
    from treetools.inspect.arrays import chunk_bytes_from_env
    from treetools.inspect.source import open_source
    from treetools.inspect.verify import verify_path
    from treetools.render import safe_text

    steps = [args.step]
    if args.step == "all":
        source = open_source(args.path)
        steps = source.steps if source.steps is not None else [None]
    reports = [verify_path(args.path, step=s, chunk_bytes=chunk_bytes_from_env()) for s in steps]
    if args.format == "json":
        print(json.dumps([r.to_json() for r in reports] if args.step == "all" else reports[0].to_json(), indent=2))
    else:
        for r in reports:
            for problem in r.problems:
                print(f"problem: {safe_text(problem)}")
            print(safe_text(r.verdict()))
    return 0 if all(r.ok for r in reports) else 1
