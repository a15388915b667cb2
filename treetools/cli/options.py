"""Option groups shared by the checkpoint commands, defined once, and the options objects built from them.

Each ``add_*`` function adds one group of flags to a subcommand's parser;
``options_from(args, InspectOptions)`` builds the command's options object
from the parsed flags by field name. Standard library only: parsers are built
before any heavy import (the rules spec, whose field table gives the rules
flags, is standard library only at import too).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence, TypeVar

from treetools.cli._args import chunk_mb, positive_int, regex, step
from treetools.rules.spec import FIELDS, Rules
from treetools.shared.errors import UsageError
from treetools.shared.rows import parse_size

_T = TypeVar("_T")


def add_step(parser: argparse.ArgumentParser, *, allow_all: bool = True, twice: bool = False) -> None:
    """``--step N|latest[|all]``; with ``twice``, once for both sides or twice for A then B.

    ``allow_all=False`` only leaves ``all`` out of the help: the command's library function refuses it with a
    ``UsageError`` (one line, exit 2), the one place that check is written.
    """
    if twice:
        parser.add_argument("--step", type=step, action="append", default=[], metavar="N|latest",
                            help="step of a root (default latest; -1 is the latest too); once for both sides, "
                                 "twice for A then B")
        return
    parser.add_argument("--step", type=step, default=None, metavar="N|latest|all" if allow_all else "N|latest",
                        help="step of a checkpoint root (default latest; -1 is the latest too)"
                             + ("; `all`: every committed step" if allow_all else ""))


def add_item(parser: argparse.ArgumentParser) -> None:
    """``--item NAME``."""
    parser.add_argument("--item", metavar="NAME",
                        help="only this item of a composite checkpoint (e.g. params); in a single-tree file "
                             "(msgpack of a whole state, npz, safetensors) a top-level key")


def add_prefix(parser: argparse.ArgumentParser) -> None:
    """``--prefix NAME``: one series of steps in a folder holding several."""
    parser.add_argument("--prefix", metavar="NAME", default=None,
                        help="in a folder holding several series of steps (flax save_checkpoint(prefix=...): "
                             "checkpoint_6 and eval_6), read the series NAME (default checkpoint_); the others are "
                             "named in a note")


def add_filters(parser: argparse.ArgumentParser, *, verb: str = "keep") -> None:
    """``--include RE`` / ``--exclude RE``, repeatable."""
    parser.add_argument("--include", type=regex, action="append", default=[], metavar="RE",
                        help=f"{verb} leaves whose path matches RE (re.search); repeatable; "
                             "a pattern that matches no leaf is an error")
    parser.add_argument("--exclude", type=regex, action="append", default=[], metavar="RE",
                        help="drop leaves whose path matches RE; repeatable")


def add_sort(parser: argparse.ArgumentParser, *, help: str = "row order (default: stored order; params/bytes: "
             "largest first)", more: Sequence[str] = ()) -> None:
    """``--sort path|params|bytes``, and the command's own keys ``more`` (``diff``'s ``max_abs_diff`` ...)."""
    parser.add_argument("--sort", choices=("path", "params", "bytes", *more), default=None, help=help)


def add_depth(parser: argparse.ArgumentParser | Any, *, help: str) -> None:
    """``--depth K``."""
    parser.add_argument("--depth", type=positive_int, default=None, metavar="K", help=help)


def memory_budget_mb(text: str) -> float:
    """``--memory-budget-mb``: a size (``shared.rows.parse_size``: ``4G``, ``4GiB``, ``500MB``), a bare number
    being MiB (fractions allowed), ``inf`` for none -> bytes.

    >>> memory_budget_mb("0.5"), memory_budget_mb("inf"), memory_budget_mb("4G") == 4096 * 2**20
    (524288, inf, True)
    """
    try:
        return parse_size(text, what="--memory-budget-mb", bare=2**20, unbounded=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("`", "")) from None


def add_reading(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget-mb MB`` (the most stored data decoded at once), ``--follow-links`` (links out of the
    checkpoint followed), and the hidden block size ``--chunk-mb``."""
    parser.add_argument("--memory-budget-mb", type=memory_budget_mb, default=None, dest="memory_budget", metavar="MB",
                        help="most stored data decoded at once by --stats/--show/--values/verify: one storage "
                             "chunk or one --show read: MiB, or a size such as 4G (default 2048; "
                             "TREETOOLS_MEMORY_BUDGET_MB)")
    parser.add_argument("--follow-links", action="store_true", default=False,
                        help="follow symlinks that lead out of the checkpoint (step folders on another volume); "
                             "off by default: only for checkpoints you trust (docs/untrusted.md)")
    # Hidden: the block budget of --stats / --values / verify (tests and benchmarks shrink it).
    parser.add_argument("--chunk-mb", type=chunk_mb, default=None, dest="block_bytes", help=argparse.SUPPRESS)


def add_processes(parser: argparse.ArgumentParser) -> None:
    """``--processes N`` (N local processes, each reading a share of the leaves) and ``--distributed`` (this
    process is one of a ``jax.distributed`` run started elsewhere): ``treetools.cli._distributed``."""
    parser.add_argument("--processes", type=positive_int, default=None, metavar="N",
                        help="read with N processes on this machine (jax.distributed on 127.0.0.1), each a share "
                             "of the leaves by bytes; one report, the same as one process's")
    parser.add_argument("--distributed", action="store_true", default=False,
                        help="be one process of a jax.distributed run (SLURM, Open MPI, Kubernetes, or "
                             "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID on each host): each "
                             "reads a share of the leaves; process 0 prints the report")


def add_allow_unread(parser: argparse.ArgumentParser) -> None:
    """``--allow-unread``: an item, leaf or file that could not be read is listed, and the exit code stays 0."""
    parser.add_argument("--allow-unread", action="store_true", default=False,
                        help="exit 0 although an item could not be read (it is still listed, with the reason); "
                             "by default a partial read exits 1 after printing all that was read")


def add_output_format(parser: argparse.ArgumentParser, choices: Sequence[str]) -> None:
    """``--format`` with the renderings a command has."""
    parser.add_argument("--format", choices=tuple(choices), default="table", help="output format (default table)")


def add_rules(parser: argparse.ArgumentParser, fields: Sequence[str] | None = None) -> None:
    """The rules flags (``tt.Rules``: docs/rules.md), building one ``Rules`` with ``rules_from(args)``.

    ``--rules FILE`` and one flag per field of the rules' field table (``treetools.rules.spec.FIELDS``:
    its metavar and help); ``fields`` names the few that make sense for a command (``inspect``: unstack;
    ``rules`` for ``--rules``).
    """
    group = parser.add_argument_group("rules (map the checkpoint's leaves first; docs/rules.md)")
    if fields is None or "rules" in fields:
        group.add_argument("--rules", metavar="FILE", dest="rules_file", default=None,
                           help="a JSON or TOML rules file; the flags below come after its rules")
    for name, field in FIELDS.items():
        if fields is not None and name not in fields:
            continue
        kinds: dict[str, dict[str, Any]] = {
            "switch": {"action": "store_true"}, "one": {"default": None, "metavar": field.metavar},
            "repeat": {"action": "append", "default": [], "metavar": field.metavar}}
        how = kinds[field.kind.flag]
        group.add_argument(field.flag(name), dest=name, help=field.help, **how)


def rules_from(args: argparse.Namespace) -> Rules | None:
    """The ``tt.Rules`` the rules flags say (None when none is given).

    Raises:
      UsageError: a malformed flag, or a rules file that cannot be read or parsed (the message names it).
    """
    given = {name: getattr(args, name) for name in ("rules_file", *FIELDS) if getattr(args, name, None)}
    if not given:
        return None
    try:
        return Rules.from_cli(**given)
    except (ValueError, TypeError, OSError) as e:
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(what) from None


def options_from(args: argparse.Namespace, cls: type[_T], **fields: Any) -> _T:
    """An options object of type ``cls`` from the parsed flags of the same names, with ``fields`` on top.

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Opts:
    ...     depth: int | None = None
    ...     sort: str | None = None
    >>> options_from(argparse.Namespace(depth=2, sort=None, format="json"), Opts, sort="path")
    Opts(depth=2, sort='path')
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {k: v for k, v in vars(args).items() if k in names and k not in fields}
    return cls(**given, **fields)
