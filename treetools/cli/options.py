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
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from treetools.cli._args import positive_int, regex, step
from treetools.rules.spec import FIELDS, Rules
from treetools.shared.errors import UsageError
from treetools.shared.rows import human, parse_size, size_forms
from treetools.shared.settings import READ_SETTINGS

if TYPE_CHECKING:  # an annotation only: the parsers are built before the checkpoint layer loads
    from treetools.checkpoint_io.context import ReadOptions

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


def size(flag: str, *, bare: int = 1, minimum: int = 1, unbounded: bool = False) -> Callable[[str], float]:
    """The argparse type of a size flag: ``shared.rows.parse_size`` (``64MiB``, ``500MB``, ``16G``; a bare number
    is ``bare`` bytes, 1 for every flag but the older ``--memory-budget-mb`` and ``--chunk-mb``: MiB), at least
    ``minimum`` bytes; ``unbounded``: ``inf`` too. A bad value is a usage error naming the flag and the forms.

    >>> size("--block-size")("64MiB"), size("--memory-budget-mb", bare=2**20, unbounded=True)("0.5")
    (67108864, 524288)
    >>> try:
    ...     size("--block-size", minimum=1024)("512")
    ... except argparse.ArgumentTypeError as e:
    ...     print(str(e).split(";")[0])
    '512' is below 1KiB (1024 bytes)
    """

    def parse(text: str) -> float:
        try:
            value = parse_size(text, what=flag, bare=bare, unbounded=unbounded)
        except ValueError as e:
            # argparse names the flag first ("argument --block-size: ..."): the message says the rest
            raise argparse.ArgumentTypeError(str(e).replace(f"`{flag}` ", "", 1).rstrip(".")) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {human(minimum, 'B').replace('.00 ', '')}"
                                             f" ({minimum} bytes); {size_forms(bare, unbounded)}")
        return value

    parse.__name__ = "size"  # argparse names the type in its own errors
    return parse


class _NotHere(argparse.Action):
    """A reading flag a command takes no part of: a usage error saying why, never ignored."""

    def __init__(self, option_strings: Sequence[str], dest: str, why: str = "", **kwargs: Any):
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {self.why}")


def add_reading(parser: argparse.ArgumentParser, *, data: bool = True, processes: bool = True) -> None:
    """The reading flags, one per ``tt.ReadOptions`` field, from one table (``shared.settings.READ_SETTINGS``):
    every command that reads a checkpoint calls this, so every one has every flag.

    ``data=False``: the command reads metadata only (``plan``): the flags about reading array data are taken,
    and the command names them in a note (``reading_given``). ``processes=False``: the command runs in one
    process only; ``--processes``/``--distributed`` are a usage error saying so. The older spellings
    (``--memory-budget-mb`` and ``--chunk-mb``, a bare number being MiB) set the same fields, hidden from the help.
    """
    group = parser.add_argument_group("reading (every command that reads a checkpoint; docs/cli.md)")
    for name, setting in READ_SETTINGS.items():
        help = setting.help
        if setting.data and not data:
            help = f"{help}; `{parser.prog}` reads metadata only: no effect"
        if setting.kind == "size":
            group.add_argument(setting.flag, dest=name, default=None, metavar=setting.metavar, help=help,
                               type=size(setting.flag, minimum=setting.minimum, unbounded=setting.unbounded))
            if setting.alias is not None:
                flag, bare = setting.alias
                group.add_argument(flag, dest=name, default=None, help=argparse.SUPPRESS,
                                   type=size(flag, bare=bare, minimum=setting.minimum, unbounded=setting.unbounded))
        elif setting.kind == "count":
            group.add_argument(setting.flag, dest=name, type=positive_int, default=None, metavar=setting.metavar,
                               help=help)
        elif setting.kind == "switch":
            group.add_argument(setting.flag, dest=name, action="store_true", default=False, help=help)
        elif setting.kind == "toggle":
            group.add_argument(setting.flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help)
        elif processes:
            _add_processes(group, setting.help)
        else:
            why = (f"`{parser.prog}` runs in one process (it reads metadata only: nothing to share); "
                   "drop it" if not data else f"`{parser.prog}` runs in one process; drop it")
            group.add_argument(setting.flag, metavar=setting.metavar, nargs=1, action=_NotHere, why=why,
                               help=f"not here: {why}")
            group.add_argument("--distributed", nargs=0, action=_NotHere, why=why, help=argparse.SUPPRESS)


def _add_processes(group: Any, help: str) -> None:
    """``--processes N`` (N local processes, each reading a share of the leaves) and ``--distributed`` (this
    process is one of a ``jax.distributed`` run started elsewhere): ``treetools.cli._distributed``."""
    group.add_argument("--processes", type=positive_int, default=None, metavar="N", help=help)
    group.add_argument("--distributed", action="store_true", default=False,
                       help="be one process of a jax.distributed run (SLURM, Open MPI, Kubernetes, or "
                            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID on each host): each "
                            "reads a share of the leaves; process 0 prints the report")


def reading_given(args: argparse.Namespace, *, data_only: bool = False) -> list[str]:
    """The reading flags given on the command line (``--block-size``, ...); ``data_only``: only those about
    reading array data (what a command that reads metadata only names in its note).

    >>> reading_given(argparse.Namespace(block_bytes=4096, workers=None, memory_budget=None, progress=None,
    ...                                  follow_links=True, processes=None, distributed=False))
    ['--follow-links', '--block-size']
    """
    given = []
    for name, setting in READ_SETTINGS.items():
        if data_only and not setting.data:
            continue
        if setting.kind == "processes":
            given += [flag for flag, value in (("--processes", getattr(args, "processes", None)),
                                               ("--distributed", getattr(args, "distributed", False))) if value]
        elif setting.kind == "toggle" and getattr(args, name, None) is False:
            given.append(f"--no-{setting.flag[2:]}")
        elif getattr(args, name, None) not in (None, False):
            given.append(setting.flag)
    return given


def read_options(args: argparse.Namespace) -> ReadOptions:
    """The ``tt.ReadOptions`` the reading flags say (``share``: set by ``--processes``/``--distributed``, in
    ``cli._distributed``); for the library functions that take ``read=`` (``show_report``, ``plan_checkpoint``,
    ``plot_stats``)."""
    from treetools.checkpoint_io.context import ReadOptions  # here: keeps startup (the parsers) off the I/O layer

    return options_from(args, ReadOptions)


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
        hows: dict[str, dict[str, Any]] = {
            "switch": {"action": "store_true"}, "one": {"default": None, "metavar": field.metavar},
            "repeat": {"action": "append", "default": [], "metavar": field.metavar}}
        group.add_argument(field.flag(name), dest=name, help=field.help, **hows[field.kind.flag])


def add_preset(parser: argparse.ArgumentParser) -> None:
    """``--preset FAMILY:SOURCE:TARGET`` and ``--config FILE`` (docs/presets.md): a preset's rules, the rules
    flags after them, and the model's Hugging Face ``config.json`` that gives its sizes."""
    group = parser.add_argument_group("presets (a model family's layout moves, shipped as rules; docs/presets.md)")
    group.add_argument("--preset", metavar="FAMILY:SOURCE:TARGET[,OPTION=false]", default=None,
                       help="apply a preset's rules (the rules flags come after them), e.g. llama:hf:reference, "
                            "mistral:maxtext:hf; an unknown name lists them; options after a comma: "
                            "llama:hf:maxtext,scale_query=false")
    group.add_argument("--config", metavar="FILE", default=None,
                       help="the model's Hugging Face config.json (or its folder): the sizes a preset needs, and "
                            "the config.json a conversion to hf writes (default: the one beside SRC)")


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
