"""The options of each checkpoint command, one dataclass per command.

A command is data in, a report out: ``inspect_path(path, InspectOptions(...))``,
``diff_paths(a, b, DiffOptions(...))``, ``verify_path(path, VerifyOptions(...))``.
Keyword arguments are a shorthand for the same fields
(``inspect_path(path, depth=1)``). The CLI builds these objects from its
option groups (``treetools.cli.options``) by field name, so a new option is
one field here, its use in the command, and its flag.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

from treetools.checkpoint_io.context import ReadOptions

if TYPE_CHECKING:  # an annotation only: the rules engine loads with the first rules (inspect/diff/convert)
    from treetools.rules.spec import Rules

_O = TypeVar("_O", bound="ReadOptions")

DEFAULT_ATOL, DEFAULT_RTOL = 0.0, 1e-5
"""``diff``'s default tolerance ``|a - b| <= atol + rtol * |b|``: relative only, so that a tensor of small values
(Adam's ``nu`` around 1e-9) is not "within tolerance" of anything else small."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class InspectOptions(ReadOptions):
    """What ``inspect_path`` shows.

    Attributes:
      step: a step number, ``"latest"`` (default) or ``"all"``; roots only.
      prefix: the series of steps to read in a folder holding several (``checkpoint_``, the default).
      item: show only this item (e.g. ``params``); only its metadata is read. Any path the view prints works:
        a part of an item holding a whole train state (``params``), or ``item/path`` for a group or leaf.
      depth: one row per path prefix of ``depth`` parts below the item's shared prefix, summed; 0: one row
        per item.
      leaves: one row per leaf (no grouping).
      include: regexes (``re.search`` on path strings); keep leaves matching any.
      exclude: regexes; drop leaves matching any. A pattern that matches no leaf is an error.
      sort: ``path``, ``params`` or ``bytes``; default stored order.
      stats: stream every array and attach the statistics of ``treetools.checkpoint_tools.stats.STATS``.
      rows_per_item: without ``depth`` or ``leaves``, group an item's rows at the deepest level that keeps
        it to this many rows (the CLI's one-screen summary); None shows every leaf.
      rules: ``tt.Rules`` applied to every item first (``--unstack``: a scanned block shown per layer).
      allow_unread: a partial read is complete enough (``--allow-unread``): ``Report.complete`` stays True
        when an item could not be read (it is still listed).
    """

    step: int | str | None = None
    prefix: str | None = None
    item: str | None = None
    depth: int | None = None
    leaves: bool = False
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    sort: str | None = None
    stats: bool = False
    rows_per_item: int | None = None
    rules: Rules | None = None
    allow_unread: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"`depth` must be 0 (one row per item) or a positive integer, got {self.depth}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffOptions(ReadOptions):
    """What ``diff_paths`` compares.

    Attributes:
      step: the step of each side that is a checkpoint root (None: latest).
      step_a, step_b: the step of A / of B, overriding ``step``.
      prefix: the series of steps each side that is such a folder reads (``checkpoint_``, the default).
      item: compare only this item (a side with a single item uses that one).
      values: also compare values, streamed in blocks.
      atol, rtol: the tolerance ``|a - b| <= atol + rtol * |b|`` (numpy's rule); default ``atol=0``,
        ``rtol=1e-5``: relative, so a tensor of tiny values (Adam's ``nu``) is held to its own size.
      include, exclude: path regexes selecting the leaves compared.
      depth: group the results by path prefixes of ``depth`` parts.
      sort: ``path``, ``params`` or ``bytes`` order of the listed leaves; with ``values``, also
        ``max_abs_diff``, ``rel_l2`` or ``outside`` (elements outside the tolerance): most changed first.
      rules: ``tt.Rules`` applied to A's leaves first (compare a renamed export with its source).
      allow_unread: an item either side could not read (still listed) does not make them differ
        (``--allow-unread``); by default it does: nothing is called the same that was not read.
    """

    step: int | str | None = None
    step_a: int | str | None = None
    step_b: int | str | None = None
    prefix: str | None = None
    item: str | None = None
    values: bool = False
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    depth: int | None = None
    sort: str | None = None
    rules: Rules | None = None
    allow_unread: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOptions(ReadOptions):
    """What ``verify_path`` checks: one step of a checkpoint root (None: the latest committed one; with
    ``verify_checkpoint``, ``"all"``: every committed one), of the series ``prefix`` in a folder holding several.
    ``allow_unread``: an item that could not be read is listed (``VerifyReport.unread``), not a problem
    (``--allow-unread``); by default it is one."""

    step: int | str | None = None
    prefix: str | None = None
    allow_unread: bool = False


def resolve(cls: type[_O], options: _O | None, fields: dict[str, Any]) -> _O:
    """``options`` (or the defaults of ``cls``) with ``fields`` given as keywords on top.

    >>> resolve(InspectOptions, None, {"depth": 2}).depth
    2
    """
    if options is None:
        return cls(**fields)
    if not isinstance(options, cls):
        raise TypeError(f"`options` must be a {cls.__name__}, got {type(options).__name__}.")
    return dataclasses.replace(options, **fields) if fields else options


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertOptions(ReadOptions):
    """What ``convert`` writes, and how.

    Attributes:
      step: the source step (None, -1 or ``"latest"``: the latest committed one).
      prefix: the series of steps to read in a folder holding several (``checkpoint_``, the default).
      item: the source item (None: the one ``load_parameters`` reads, the params).
      rules: a ``tt.Rules`` applied to the item's leaves (rename, drop, cast, transpose, unstack...).
      preset: a preset's name, ``FAMILY:SOURCE:TARGET`` (``tt.presets()``; docs/presets.md), options after a
        comma (``llama:hf:maxtext,scale_query=false``): its rules, then ``rules`` after them.
      config: the model's Hugging Face ``config.json`` (a path, its folder, or its dict): the sizes a preset
        needs, and the ``config.json`` a conversion to ``hf`` writes; None: the one beside the source, if any.
      to: ``"safetensors"`` (default) or ``"orbax"``.
      shard_size: the most bytes per shard of a safetensors folder (``5GB``, ``500MB``, ``2GiB`` or an int).
      metadata: extra ``__metadata__`` of every safetensors header (``format`` defaults to ``pt``).
      verify: re-read the destination and compare it with the source after the rules, bit for bit.
      overwrite: replace an existing destination.
      dry_run: plan only: the mapping and the files, nothing read or written.
      dst_step: with ``to="orbax"``, write this step of a CheckpointManager root at the destination.
      fsync: flush written files to disk before renaming them into place.
    """

    step: int | str | None = None
    prefix: str | None = None
    item: str | None = None
    rules: Any = None
    preset: str | None = None
    config: Any = None
    to: str | None = None
    shard_size: int | str = "5GB"
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    verify: bool = False
    overwrite: bool = False
    dry_run: bool = False
    dst_step: int | None = None
    fsync: bool = True
