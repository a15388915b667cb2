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

from treetools.cli import _output
from treetools.cli.options import add_output_format, add_prefix, add_reading, add_step, options_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="checkpoint folder or file")
    add_step(parser)
    add_prefix(parser)
    add_output_format(parser, ("table", "json"))
    add_reading(parser)


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the reading modules import numpy, which `treetools verify --help` does not need.
    from treetools.inspect.options import VerifyOptions
    from treetools.inspect.text import render_verify
    from treetools.inspect.verify import verify_path, verify_steps

    if args.step == "all":
        reports, notes = verify_steps(args.path, options_from(args, VerifyOptions, step=None))
        for note in notes:
            _output.note(note)  # a step pruned while it was checked: not damage
    else:
        reports = [verify_path(args.path, options_from(args, VerifyOptions))]
    _output.out(render_verify(reports, args.format, many=args.step == "all"))
    return 0 if all(r.ok for r in reports) else 1
