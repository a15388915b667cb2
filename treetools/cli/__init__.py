"""``treetools`` command line: inspect, diff, train, plot.

A thin argparse layer over the library. Only the chosen subcommand's module
is imported, and only when it runs, so ``treetools --help`` imports neither
jax nor numpy. Each subcommand module provides ``add_arguments(parser)`` and
``main(args) -> int``.

Exit codes: 0 ok; 1 a known error (one ``treetools: error: ...`` line on
stderr, no traceback); 2 usage; 3 non-finite values under
``--fail-on-nonfinite``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

__all__ = ["build_parser", "main"]

PROG = "treetools"

COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("treetools.cli.inspect", "show what is inside a checkpoint, without loading it"),
    "diff": ("treetools.cli.diff", "compare two checkpoints (or two steps of one run)"),
    "train": ("treetools.cli.train", "run the reference trainer"),
    "plot": ("treetools.cli.plot", "plot norm curves from a metrics .jsonl"),
}


def _default_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``treetools train`` when its module does not declare them itself."""
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="training steps")
    parser.add_argument("--workdir", default=None, metavar="DIR", help="checkpoints and metrics go here")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="resume from the latest checkpoint in --workdir")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--ckpt-every", type=int, default=None)
    parser.add_argument("--freeze-embeddings", action="store_true")
    parser.add_argument("--ema-decay", type=float, default=None)


def _default_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS", help="metrics .jsonl written by treetools train")
    parser.add_argument("-o", "--output", default=None, help="image file to write")


_FALLBACK_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "train": _default_train_arguments,
    "plot": _default_plot_arguments,
}


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), if any."""
    for word in argv:
        if word in COMMANDS:
            return word
        if not word.startswith("-"):
            return None
    return None


def _load_command(name: str):
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[name][0]:
            raise
        return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``treetools`` parser; only ``command``'s options are filled in (its module is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("treetools")
    except PackageNotFoundError:
        ver = "unknown"
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="PyTree toolkit for JAX/Flax/Optax/Orbax trainers.",
        epilog="Run `treetools COMMAND --help` for a command's options. Exit codes: 0 ok, 1 error "
               "(missing/corrupt/not a checkpoint), 2 usage, 3 non-finite values (--fail-on-nonfinite).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {ver}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text[:1].upper() + help_text[1:] + ".",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name != command:
            continue
        module = _load_command(name)
        add = getattr(module, "add_arguments", None) or _FALLBACK_ARGUMENTS.get(name)
        if add is not None:
            add(sp)
        if module is not None and getattr(module, "__doc__", None) and name in ("inspect", "diff"):
            sp.description = module.__doc__
        sp.set_defaults(_module=module)
    return parser


def _error(message: str) -> int:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``treetools`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Never raises ``SystemExit``: ``--help`` returns 0, a usage error 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    module = getattr(args, "_module", None)
    if module is None or not hasattr(module, "main"):
        return _error(f"the `{args.command}` command is not available in this installation.")
    try:
        code = module.main(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): quietly stop, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (ValueError, OSError) as e:
        # CheckpointError is a ValueError; so are bad patterns and TensorStore failures.
        if os.environ.get("TREETOOLS_DEBUG"):
            raise
        return _error(str(e) or type(e).__name__)
    except Exception as e:  # a bug, but still one line; TREETOOLS_DEBUG=1 shows the traceback
        if os.environ.get("TREETOOLS_DEBUG"):
            raise
        return _error(f"internal error: {type(e).__name__}: {e} (set TREETOOLS_DEBUG=1 for the traceback)")
    return int(code or 0)
