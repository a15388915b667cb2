"""Check that a checkpoint is whole: commit evidence, metadata that parses, every
leaf's stored data present and decodable (read chunk by chunk, bounded
memory), metadata and stored arrays that agree (no leaf without data, no
stored array the metadata does not list), and consistent offsets in
safetensors and npz files. Nothing is written.

Several PATHs are checked one after the other, each in its own section of
the output (a blank line between them, then one line summing them up); a
PATH that cannot be read at all (missing, not a checkpoint) is one error
line on stderr and the others are still checked.

Unfinished saves of a root (an Orbax tmp folder, a step folder without its
commit marker: what `inspect` lists as incomplete) are named on an
`incomplete:` line; they are not checkpoints yet, so they are never read and
are not damage: they do not change the exit code.

Examples:
  treetools verify runs/demo/checkpoints               the latest committed step
  treetools verify runs/demo/checkpoints --step all    every committed step
  treetools verify runs/a/checkpoints runs/b/checkpoints model.safetensors

--format json prints one object, "schema": 1, for any number of PATHs and
steps: {"ok": ..., "paths": [{"path", "format", "steps", "incomplete", "ok",
"checkpoints": [one entry per step checked]}]} (docs/json-schema.md).

An item that cannot be read (a handler treetools does not read, a FIFO in
its folder) is a problem: nothing is called whole that was not read.
--allow-unread lists it on a `not read:` line instead, and the exit code
follows what was read.

Exit codes: 0 every check of every PATH passed (one verdict line per step);
1 problems found (one line each, then the verdict), an item not read
(without --allow-unread) or a known error (missing path, not a checkpoint)
at any PATH; 2 usage.
"""

from __future__ import annotations

import argparse
import os

from treetools.cli import KNOWN_ERRORS, _output, error_text
from treetools.cli.options import (
    add_allow_unread, add_output_format, add_prefix, add_reading, add_step, options_from,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", metavar="PATH", nargs="+", help="checkpoint folders or files (one or more)")
    add_step(parser)
    add_prefix(parser)
    add_output_format(parser, ("table", "json"))
    add_reading(parser)
    add_allow_unread(parser)


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the reading modules import numpy, which `treetools verify --help` does not need.
    from treetools.checkpoint_tools.options import VerifyOptions
    from treetools.checkpoint_tools.text import render_verify
    from treetools.checkpoint_tools.verify import VerifyResult, VerifyRun, verify_checkpoint

    options = options_from(args, VerifyOptions)
    results = []
    for path in args.paths:
        try:
            result = verify_checkpoint(path, options)
        except KNOWN_ERRORS as e:
            if len(args.paths) == 1 or os.environ.get("TREETOOLS_DEBUG"):
                raise  # one PATH: the one error line of every command
            result = VerifyResult(path, "?", error=error_text(e))
            _output.error(result.error)  # the others are still checked
        for note in result.notes:
            _output.note(note)  # a step pruned while it was checked: not damage
        results.append(result)
    run = VerifyRun(results)
    _output.out(render_verify(run, args.format))
    return 0 if run.ok else 1
