"""``treetools`` command line: inspect, diff, verify, convert, train, plan, plot.

A thin argparse layer over the library. Only the chosen subcommand's module
is imported, and only when it runs, so ``treetools --help`` imports neither
jax nor numpy. Each subcommand module provides ``add_arguments(parser)`` and
``main(args) -> int``.

Exit codes: 0 ok; 1 a known error (one ``treetools: error: ...`` line on
stderr, no traceback); 2 usage; 3 non-finite values under
``--fail-on-nonfinite``. ``diff`` follows GNU diff: 0 same, 1 different, 2
trouble. Known errors are mapped by type (``treetools.shared.errors``, missing files,
a missing optional dependency); any other exception is a bug and keeps its
traceback. A reader that closes stdout early (``| head``) changes no exit code:
the command runs to its end, its later output dropped.

The program is ``run()`` (the ``treetools`` script and ``python -m
treetools``); ``main()`` is the same command line for Python callers.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
import threading
import traceback
from typing import NoReturn, Sequence

import treetools
from treetools.cli import _args, _output
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, PatternError


PROG = "treetools"

COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("treetools.cli.inspect", "show what is inside a checkpoint, without loading it"),
    "diff": ("treetools.cli.diff", "compare two checkpoints (or two steps of one run)"),
    "verify": ("treetools.cli.verify", "check that a checkpoint is whole: markers, metadata, every chunk readable"),
    "convert": ("treetools.cli.convert", "convert any checkpoint to safetensors (Hugging Face) or Orbax, streamed"),
    "train": ("treetools.cli.train", "run the reference trainer"),
    "plan": ("treetools.cli.plan", "will it fit? per-device memory to restore a checkpoint onto a mesh and train it"),
    "plot": ("treetools.cli.plot", "plot metric curves (runs overlaid), per-layer heatmaps, or a checkpoint's "
                                   "statistics across its steps"),
}


READ_ONLY = frozenset({"inspect", "diff", "verify"})
"""The commands that write nothing: they end without Python's teardown of the modules they loaded (``run``)."""


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), if any."""
    for word in argv:
        if word in COMMANDS:
            return word
        if not word.startswith("-"):
            return None
    return None


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser, whose epilog may be a function: called when the help is printed, not on every run
    (``inspect``'s list of formats reads each format module's source)."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``treetools`` parser; only ``command``'s options are filled in (its module is imported).

    Each subcommand's description is its module's docstring.

    >>> build_parser("plot").parse_args(["plot", "m.jsonl"]).metrics
    ['m.jsonl']
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="PyTree toolkit for JAX/Flax/Optax/Orbax trainers.",
        epilog="Run `treetools COMMAND --help` for a command's options (`treetools` alone prints this help, exit "
               "2). Exit codes: 0 ok, 1 error (missing/corrupt/not a checkpoint), 2 usage, 3 non-finite values "
               "(--fail-on-nonfinite).",
    )
    # treetools.__version__, not importlib.metadata (which costs every command 5-8 ms of imports).
    parser.add_argument("--version", action="version", version=f"%(prog)s {treetools.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.description = module.__doc__
            sp.set_defaults(_main=module.main, _parser=sp)
    return parser


KNOWN_ERRORS: tuple[type, ...] = (CheckpointError, CheckpointNotFoundError, PatternError, FileNotFoundError,
                                   PermissionError, IsADirectoryError, NotADirectoryError, ImportError,
                                   UnicodeDecodeError)
"""Exception types that are the user's input, not a bug: reported as one line. Anything else keeps its traceback."""


def _error(message: str) -> int:
    _output.error(message)
    return 1


def _parse(parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the fix in its usage errors: a mistyped command or option is named with
    the one it is close to ("did you mean --item?"), by the subcommand whose option it is (its usage line).

    Raises:
      SystemExit: 2 on a usage error (argparse's own exit), 0 after ``--help``.
    """
    word = next((w for w in argv if not w.startswith("-")), None)
    if command is None and word is not None:
        close = _args.closest(word, COMMANDS)
        parser.error(f"argument COMMAND: invalid choice: {word!r} (choose from {', '.join(COMMANDS)})"
                     + (f"; did you mean {close}?" if close else ""))
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = getattr(args, "_parser", parser)
        sub.error(_args.unrecognized(sub, extras))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``treetools`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Never raises ``SystemExit``: ``--help`` returns 0, a usage error 2. ``treetools`` alone prints the help (on
    stderr: no command is a usage error, exit 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        parser = build_parser(command)
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        args = _parse(parser, argv, command)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        with _output.readers_may_leave():  # `| head`: the command still ends with its own exit code
            code = args._main(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except _output.OutputError as e:  # stdout cannot be written: said on stderr if it can be
        with contextlib.suppress(OSError):
            _error(str(e))
            sys.stderr.flush()
        return 2 if command == "diff" else 1
    except KNOWN_ERRORS + ((ValueError,) if command in ("plot", "train") else ()) as e:
        # Known problems with what the user gave: one line, exit 1 (diff: 2, GNU diff's "trouble").
        if os.environ.get("TREETOOLS_DEBUG"):
            raise
        _error(error_text(e))
        return 2 if command == "diff" else 1
    return int(code or 0)


def error_text(e: BaseException) -> str:
    """A known error as its one line: ``PATH: reason.`` for an OS error, else its message."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}."
    return str(e) or type(e).__name__


def run() -> NoReturn:
    """The ``treetools`` program: ``main()`` on ``sys.argv``, then the process ends with its exit code.

    A command that writes nothing (``READ_ONLY``) ends without Python's
    teardown of every module it loaded, which takes longer than reading a
    small checkpoint's metadata: 20-30 ms once numpy and TensorStore are
    loaded. Only when treetools is the whole program (``_alone``); what
    Python's exit does that anyone can see is done as it does it
    (``_end_now``). Every other command, and ``main()`` called from Python,
    ends the ordinary way.
    """
    argv = sys.argv[1:]
    code = main(argv)
    if _command_of(argv) in READ_ONLY and _alone():
        _end_now(code)
    raise SystemExit(code)


def _alone() -> bool:
    """Whether the treetools program is this process's main program with nothing watching it: the ``__main__``
    module is the script (or ``treetools/__main__.py``) that called ``run``, and there is no ``python -i``, no
    debugger, profiler or tracer (``python -m cProfile|pdb -m treetools ...``), and no ``runpy`` call from another
    program, each of which expects the process to go on after the command."""
    return (getattr(sys.modules.get("__main__"), "run", None) is run and not sys.flags.interactive
            and sys.gettrace() is None and sys.getprofile() is None and "bdb" not in sys.modules)


def _end_now(code: int) -> None:
    """End the process as Python's exit would, less tearing the modules down: the atexit handlers run, stdout and
    stderr are flushed, and a flush that fails is reported and makes the exit code 120, all as ``Py_FinalizeEx``
    does. Returns (and the caller exits the ordinary way) while a thread Python's exit would wait for is alive."""
    main_thread = threading.main_thread()
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None or any(t is not main_thread and not t.daemon for t in threading.enumerate()):
        return
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # closed when the process started
            continue
        try:
            stream.flush()
        except Exception as e:  # noqa: BLE001 -- reported in Python's own words, and the exit code is its 120
            if stream is sys.stdout and sys.stderr is not None:
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"Exception ignored in: {stream!r}\n{traceback.format_exception_only(e)[-1]}")
                    sys.stderr.flush()
            code = 120
    os._exit(code)
