"""``treetools`` command line: inspect, diff, verify, convert, train, plan, plot.

A thin argparse layer over the library. Only the chosen subcommand's module
is imported, and only when it runs, so ``treetools --help`` imports neither
jax nor numpy. Each subcommand module provides ``add_arguments(parser)`` and
``main(args) -> int``.

Exit codes: 0 ok; 1 a known error (one ``treetools: error: ...`` line on
stderr, no traceback); 2 usage; 3 non-finite values under
``--fail-on-nonfinite``. ``diff`` follows GNU diff: 0 same, 1 different, 2
trouble. Known errors are mapped by type (``treetools.shared.errors``,
missing files, a missing optional dependency): a ``UsageError``, raised by a
command or by the library where it takes the same argument, is a usage error
(exit 2, also for ``diff``); any other exception is a bug and keeps its
traceback. An error with several problems is one line per problem (the
first 20 and a count), and a command asked for ``--format json`` also prints
it as one JSON object on stdout (``error_object``). A reader that closes
stdout early (``| head``) changes no exit code: the command runs to its end, its later output dropped; the process's
streams are never replaced or redirected while a command runs.

The program is ``run()`` (the ``treetools`` script and ``python -m
treetools``), which ends the process with ``sys.exit``; ``main()`` is the
same command line for Python callers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from typing import Any, NoReturn, Sequence

import treetools
from treetools.cli import _args, _distributed, _output, _process
from treetools.shared.files import WRITE_ERRNOS, user_path
from treetools.shared.render import json_object, set_width, terminal_columns
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError, PatternError, UsageError


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


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), if any."""
    for word in argv:
        if word in COMMANDS:
            return word
        if not word.startswith("-"):
            return None
    return None


class _UsageExit(SystemExit):
    """argparse's usage error (exit 2), with its message kept for the ``--format json`` error object."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


_NARGS: dict[int | str | None, str] = {None: "{0}", "?": "[{0}]", "*": "[{0} ...]", "+": "{0} [{0} ...]",
                                       argparse.PARSER: "{0} ..."}
"""How a positional argument's ``nargs`` reads in a usage line (argparse's own notation)."""


def short_usage(parser: argparse.ArgumentParser) -> str:
    """One line: the command, ``[OPTIONS]`` and its positional arguments; ``--help`` lists the options.

    >>> p = argparse.ArgumentParser(prog="treetools diff")
    >>> _ = p.add_argument("a", metavar="A"); _ = p.add_argument("b", metavar="B", nargs="?")
    >>> short_usage(p)
    'usage: treetools diff [OPTIONS] A [B]  (treetools diff --help lists the options)'
    """
    words = [parser.prog, "[OPTIONS]"]
    words += [_NARGS.get(a.nargs, "{0} ...").format(a.metavar or a.dest.upper())
              for a in parser._actions if not a.option_strings]  # argparse keeps its arguments there, in order
    return f"usage: {' '.join(words)}  ({parser.prog} --help lists the options)"


class _Parser(argparse.ArgumentParser):
    """argparse, its help and usage written through the CLI's output (``_output.message``): a write that fails
    is reported, not swallowed (argparse's own ``_print_message`` drops an ``OSError``). A usage error is one
    short usage line (``short_usage``), then ``PROG: error: MESSAGE``, exit 2, the message kept (``_UsageExit``);
    ``--help`` has the whole usage."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if not message:
            return
        file = file or sys.stderr
        if file is sys.stdout or file is sys.stderr:
            _output.message(message, stream="stdout" if file is sys.stdout else "stderr")
        else:
            file.write(message)

    def error(self, message: str) -> NoReturn:
        self._print_message(f"{short_usage(self)}\n{self.prog}: error: {message}\n", sys.stderr)
        raise _UsageExit(message)


class _CommandParser(_Parser):
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
    parser = _Parser(
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


KNOWN_ERRORS: tuple[type[Exception], ...] = (CheckpointError, CheckpointNotFoundError, PatternError, FileNotFoundError,
                                              PermissionError, IsADirectoryError, NotADirectoryError, ImportError,
                                              UnicodeDecodeError)
"""Exception types that are the user's input, not a bug: reported as one line. Anything else keeps its traceback."""


ERROR_SCHEMA = 1
"""Version of the ``--format json`` error object (``error_object``, docs/json-schema.md)."""


def error_object(e: BaseException | str, exit_code: int, *, usage: bool) -> dict:
    """What a command asked for ``--format json`` prints on stdout when it fails with a known or usage error: one
    object, ``"error"`` the message of the ``treetools: error:`` line (for an error with several problems, its
    header, with every problem in ``"problems"`` and the common fix in ``"hint"``), the exit code, and whether it is
    a usage error.

    >>> error_object(UsageError("--step all is for `inspect`"), 2, usage=True)
    {'schema': 1, 'error': '--step all is for `inspect`', 'exit_code': 2, 'usage': True}
    """
    problems = getattr(e, "problems", None)
    header = getattr(e, "header", None)
    if isinstance(problems, list) and len(problems) > 1 and isinstance(header, str):
        fields = {"error": header, "problems": [str(p) for p in problems]}
        if getattr(e, "hint", None) is not None:
            fields["hint"] = str(e.hint)  # type: ignore[union-attr]
    else:
        fields = {"error": e if isinstance(e, str) else " ".join(error_text(e).split())}
    return json_object(ERROR_SCHEMA, {**fields, "exit_code": exit_code, "usage": usage})


def _takes_format(parser: argparse.ArgumentParser, command: str) -> bool:
    """Whether ``command``'s parser has a ``--format`` option (argparse keeps its parsers in private fields)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(command)
            return sub is not None and "--format" in sub._option_string_actions
    return False


def _asks_json(argv: Sequence[str], args: argparse.Namespace | None = None) -> bool:
    """Whether the command line asks for ``--format json`` (read from ``argv`` where parsing failed)."""
    if args is not None:
        return getattr(args, "format", None) == "json"
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if len(name) >= 4 and "--format".startswith(name) and name.startswith("--fo"):  # argparse takes "--form"
            if (value if eq else (argv[i + 1] if i + 1 < len(argv) else None)) == "json":
                return True
    return False


def _error(message: str) -> int:
    _output.error(message)
    return 1


def report_error(e: BaseException, *, prog: str = PROG) -> None:
    """A known error on stderr: its one line, or for an error with several problems (``problems``, ``header``,
    ``hint``: ``RulesError``, ``CheckpointMismatchError``) its header, one line per problem (the first
    ``_output.MOST_PROBLEMS`` and a count) and the fix."""
    problems = getattr(e, "problems", None)
    header = getattr(e, "header", None)
    if isinstance(problems, list) and len(problems) > 1 and isinstance(header, str):
        _output.error(header, prog=prog, problems=[str(p) for p in problems], hint=getattr(e, "hint", None))
    else:
        _output.error(error_text(e), prog=prog)


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
    stderr: no command is a usage error, exit 2). A reader that closes stdout early changes no exit code
    (``_output``); the process's streams are left as they are.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        with _output.session():  # `| head`: the command still ends with its own exit code
            return _main(argv, command)
    except _output.OutputError as e:  # stdout cannot be written: said on stderr if it can be
        _error(str(e))
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        return 2 if command == "diff" else 1
    finally:
        set_width(None)  # a library caller after a command renders at the default width again


def _main(argv: list[str], command: str | None) -> int:
    """Parse, run the command, map its known errors to exit codes: on stderr always, and on stdout too as one
    JSON object (``error_object``) when the command was asked for ``--format json``."""
    try:
        parser = build_parser(command)
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        args = _parse(parser, argv, command)
    except _UsageExit as e:
        if command is not None and _takes_format(parser, command) and _asks_json(argv):
            _output.out(json.dumps(error_object(e.message, 2, usage=True)))
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    set_width(terminal_columns(sys.stdout))  # tables fit the terminal stdout is, 100 columns for a file or a pipe
    run = _distributed.Run()
    # plot and train take the user's values straight (a bad metrics file, a bad setting): one line too
    known = KNOWN_ERRORS + ((ValueError,) if command in ("plot", "train") else ())
    try:
        run.join(args, argv)  # --processes N / --distributed: this process's share of the reads
        code = run.finish(int(args._main(args) or 0))
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except UsageError as e:  # arguments that cannot work together, found by the command or the library: exit 2
        if os.environ.get("TREETOOLS_DEBUG"):
            raise
        _output.error(e, prog=f"{PROG} {command}")
        return _json_error(args, e, 2, usage=True)
    except known as e:
        # Known problems with what the user gave: one line, exit 1 (diff: 2, GNU diff's "trouble").
        if os.environ.get("TREETOOLS_DEBUG"):
            raise
        report_error(e)
        return _json_error(args, e, 2 if command == "diff" else 1, usage=False)
    except OSError as e:  # a write the place refuses (read-only, full, over quota): one line; other OS errors are bugs
        if e.errno not in WRITE_ERRNOS or os.environ.get("TREETOOLS_DEBUG"):
            raise
        report_error(e)
        return _json_error(args, e, 2 if command == "diff" else 1, usage=False)
    finally:
        run.close()  # after an error too: the run left, the local copies waited for
    return int(code or 0)


def _json_error(args: argparse.Namespace, e: BaseException, code: int, *, usage: bool) -> int:
    """``code``, after the error object on stdout where ``--format json`` was asked (stdout then never stays empty)."""
    if _asks_json((), args):
        _output.out(json.dumps(error_object(e, code, usage=usage)))
    return code


def error_text(e: BaseException) -> str:
    """A known error as its one line: ``PATH: reason.`` for an OS error, else its message."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{user_path(os.fspath(e.filename))}: {e.strerror}."  # the destination, not its temporary name
    return str(e) or type(e).__name__


def run() -> NoReturn:
    """The ``treetools`` program: ``main()`` on ``sys.argv``, then the process ends with its exit code
    (``sys.exit``, Python's ordinary exit).

    A stream whose reader left during the command (``| head``) is let go of
    first (``_output.let_go``), so what Python still holds for it goes nowhere
    and the exit code stays the command's. Before the command, the program sets what its own process runs
    best with (OpenBLAS's threads, malloc's thresholds: ``_process.tune``), where the environment does not.
    """
    _process.tune()
    code = main(sys.argv[1:])
    for name in sorted(_output.current.left):
        _output.let_go(name)
    sys.exit(code)
