"""``--show``: the values of one leaf, or of a slice of it, reading only the chunks the slice needs.

A leaf is named by any path a command prints: ``item/path`` (``params/Dense_0/kernel``,
``opt_state/0/mu/Dense_0/kernel``), a part of an item holding a whole train state
(``params/...`` of Orbax's ``default``), the path alone when one item has it, and,
with ``item``, the path below it (``--item params --show Dense_0/kernel``) or
pasted whole (``--item params --show params/Dense_0/kernel``). A stored dotted
name (safetensors) may be written with ``/``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np

from treetools.checkpoint_io.mapping import map_items
from treetools.checkpoint_io.context import ReadContext, ReadOptions, context_of
from treetools.checkpoint_io.items import item_argument, part_holder
from treetools.checkpoint_io.leaves import Item, Leaf
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_io.readers import MemoryBudgetError, block_extent, is_numeric
from treetools.checkpoint_io.source import Source
from treetools.checkpoint_tools.stats import array_stats
from treetools.rules.spec import Rules
from treetools.shared.errors import CheckpointNotFoundError, UsageError
from treetools.shared.patterns import nearby
from treetools.shared.render import json_object, jsonable
from treetools.shared.rows import human, nonfinite_count


def parse_leaf_spec(spec: str) -> tuple[str, tuple[Any, ...] | None]:
    """``"params/w[0:2, 3]"`` -> ``("params/w", (slice(0, 2), 3))``; no brackets -> ``(spec, None)``.

    >>> parse_leaf_spec("opt/0/mu/w[::2, -1]")
    ('opt/0/mu/w', (slice(None, None, 2), -1))
    >>> parse_leaf_spec("layers.0.weight")
    ('layers.0.weight', None)
    """
    text = spec.strip()
    if not text.endswith("]") or "[" not in text:
        return text, None
    name, _, inside = text[:-1].rpartition("[")
    index: list[Any] = []
    for part in inside.split(","):
        part = part.strip()
        try:
            if ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3:
                    raise ValueError
                index.append(slice(*bits))
            else:
                index.append(int(part))
        except ValueError:
            raise UsageError(f"`show` index {part!r} in {spec!r} is not an integer or a start:stop:step "
                             "slice.") from None
    return name, tuple(index)


SCHEMA = 1
"""Version of the ``inspect --show --format json`` object (``ShowReport.to_json``)."""


@dataclasses.dataclass(frozen=True)
class Shown:
    """What ``--show`` read: the step, the leaf as ``item/path``, the index asked for, the values, and with
    ``stats`` their statistics (``treetools.checkpoint_tools.stats.array_stats``; None for a non-numeric or empty
    value)."""

    step: int | None
    path: str
    index: tuple[Any, ...] | None
    value: Any
    stats: dict[str, Any] | None = None

    @property
    def is_array(self) -> bool:
        return isinstance(self.value, np.ndarray)

    @property
    def label(self) -> str:
        """``item/path``, with its step where it has one: ``step 200: params/w``."""
        return self.path if self.step is None else f"step {self.step}: {self.path}"

    def to_json(self) -> dict[str, Any]:
        entry = {"step": self.step, "path": self.path, "value": jsonable(self.value)}
        return entry if self.stats is None else {**entry, "stats": jsonable(self.stats)}


@dataclasses.dataclass(frozen=True)
class ShowReport:
    """What ``treetools inspect --show`` prints, as data: one ``Shown`` per step read (every committed step with
    ``all_steps``). Rendered by ``treetools.checkpoint_tools.text.render_show``."""

    shown: list[Shown]
    all_steps: bool = False

    @property
    def nonfinite(self) -> list[str]:
        """The shown values holding NaN or Inf, each as ``Shown.label`` (known only where ``stats`` was asked)."""
        return [s.label for s in self.shown if s.stats is not None and nonfinite_count(s.stats)]

    def to_json(self) -> dict[str, Any]:
        """``{"schema": 1, "step", "path", "value", "stats"}``, or ``{"schema": 1, "steps": [...]}`` for every step;
        non-finite floats as ``null``."""
        entries = [s.to_json() for s in self.shown]
        return json_object(SCHEMA, {"steps": entries} if self.all_steps else entries[0])


def show_report(path: str, spec: str, *, step: int | str | None = None, item: str | None = None,
                memory_budget: float | str | None = None, prefix: str | None = None, rules: Rules | None = None,
                stats: bool = False, read: ReadOptions | ReadContext | None = None) -> ShowReport:
    """``inspect --show``: ``show_values`` of one step or of every one (``step="all"``), each with its statistics
    where ``stats`` asks (numeric, non-empty arrays; the same definitions as ``--stats``, in blocks of the read
    options' block size).

    ``read``: how to read (``tt.ReadOptions`` or a ``ReadContext``: links, memory budget, block size; None: the
    environment's); ``memory_budget`` and ``prefix``, given, go over it.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.array([1.0, np.nan, 3.0]))
    >>> report = show_report(f, "w", stats=True)
    >>> report.nonfinite, report.shown[0].stats["max"], report.to_json()["value"]
    (['default/w'], 3.0, [1.0, None, 3.0])
    """
    context = context_of(read, memory_budget=memory_budget, prefix=prefix)
    shown = show_values(path, spec, step=step, item=item, rules=rules, read=context)
    if stats:  # each with its statistics: new values, as read
        shown = [dataclasses.replace(s, stats=array_stats(s.value, block_bytes=context.block_bytes))
                 if s.is_array and s.value.size and is_numeric(s.value.dtype) else s for s in shown]
    return ShowReport(shown, all_steps=step == "all")


def show_leaf(path: str, spec: str, *, step: int | str | None = None, item: str | None = None,
              memory_budget: float | str | None = None, prefix: str | None = None, rules: Rules | None = None,
              context: ReadContext | None = None, read: ReadOptions | ReadContext | None = None) -> tuple[str, Any]:
    """The values of one leaf, or of a slice of it, reading only that leaf (only the chunks a slice needs).

    Args:
      path: any checkpoint ``inspect_path`` reads.
      spec: the leaf, as any command prints it (``params/Dense_0/kernel``; without the item name
        when ``item`` is given or one item has it), optionally with a numpy-style index of
        integers and slices: ``params/w[0:4, -1]``.
      step: the step of a checkpoint root (default: latest).
      item: the item holding the leaf (an item, a part of a train state, or ``item/path`` of a group).
      memory_budget: the most the read may hold, in bytes (None: ``TREETOOLS_MEMORY_BUDGET_MB``, else 2 GiB).
      prefix: the series of steps in a folder holding several (default ``checkpoint_``).
      rules: read through these rules (``inspect --unstack``): the leaf is a target leaf.
      read: how to read (``tt.ReadOptions`` or a ``ReadContext``; None: from the environment), under
        ``memory_budget`` and ``prefix``.
      context: the older name of ``read``.

    Returns:
      ``(item/path, numpy array or value)``; a stored scalar value is a plain Python value.

    Raises:
      CheckpointNotFoundError: no such leaf (the message names close paths), or a group of leaves.
      UsageError: an index that is not one, has too many entries or is out of range; an index on a value.

    >>> import numpy as np, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "w.npz"); np.savez(f, w=np.arange(12).reshape(3, 4))
    >>> show_leaf(f, "w[1, ::2]")
    ('default/w', array([4, 6]))
    """
    (shown,) = show_values(path, spec, step=step, item=item, memory_budget=memory_budget, prefix=prefix, rules=rules,
                           read=read if read is not None else context)
    return shown.path, shown.value


def show_values(path: str, spec: str, *, step: int | str | None = None, item: str | None = None,
                memory_budget: float | str | None = None, prefix: str | None = None, rules: Rules | None = None,
                context: ReadContext | None = None, read: ReadOptions | ReadContext | None = None) -> list[Shown]:
    """``show_leaf`` of one step, or of every committed step (``step="all"``), each a ``Shown`` naming its step."""
    name, index = parse_leaf_spec(spec)
    source = open_source(path, context_of(read if read is not None else context, memory_budget=memory_budget,
                                          prefix=prefix))
    if step == "all":
        steps = source.steps if source.steps is not None else [source.resolve(None)]
    else:
        steps = [source.resolve(step)]
    out = []
    for s in steps:
        with source.reading(s):  # a step pruned while it is read: StepDeletedError naming it
            item_name, leaf = find_leaf(source, s, name, item, rules)
            out.append(Shown(s, f"{item_name}/{leaf.name}", index, _read(source, spec, item_name, leaf, index)))
    return out


# ---------------------------------------------------------------------------- finding the leaf


def _candidates(source: Source, step: int | None, name: str, item: str | None) -> Iterator[tuple[str, str]]:
    """``(item to read, leaf path in it)`` for every reading of ``name``, the likeliest first."""
    present = source.item_names(step)
    if item is not None:
        holder, under = item_argument(present, item)
        within = f"{under}/" if under else ""
        whole = f"{item}/"
        if name.startswith(whole):  # pasted whole: `--item params --show params/Dense_0/kernel`
            yield holder, within + name[len(whole):]
        if name.startswith(f"{holder}/"):
            yield holder, name[len(holder) + 1:]
        yield holder, within + name
        if within and name.startswith(within):
            yield holder, name
        return
    head, _, rest = name.partition("/")
    if rest and head in present:
        yield head, rest
    for n in present:
        yield n, name
    if rest and part_holder(present, head) is not None:  # `params/...` of an item holding a whole train state
        yield head, rest


def _matches(leaf: Leaf, name: str) -> bool:
    return leaf.name == name or "/".join(leaf.path) == name


def find_leaf(source: Source, step: int | None, name: str, item: str | None = None,
              rules: Rules | None = None) -> tuple[str, Leaf]:
    """The leaf ``name`` names in one step: ``(the item holding it, the leaf)``.

    Raises:
      CheckpointNotFoundError: no such leaf (close paths named), or ``name`` is a group of leaves.
    """
    read: dict[str, Item | None] = {}

    def items_of(item_name: str) -> Item | None:
        if item_name not in read:
            try:
                snap = source.snapshot(step, [item_name])
            except CheckpointNotFoundError:
                read[item_name] = None
                return None
            items = snap.items
            if rules is not None and not rules.empty:
                items = map_items(items, dataclasses.replace(rules, allow_unmatched=True))
            read[item_name] = items[item_name]
        return read[item_name]

    tried = list(dict.fromkeys(_candidates(source, step, name, item)))
    for item_name, leaf_name in tried:
        found = items_of(item_name)
        if found is None:
            continue
        leaf = next((leaf for leaf in found.leaves if _matches(leaf, leaf_name)), None)
        if leaf is not None:
            return item_name, leaf
    for item_name, leaf_name in tried:  # a group: say so, with a few of its leaves
        found = items_of(item_name)
        parts = tuple(leaf_name.split("/"))
        below = [leaf for leaf in found.leaves if leaf.path[:len(parts)] == parts] if found is not None else []
        if below:
            shown = ", ".join(f"{item_name}/{leaf.name}" for leaf in below[:3]) + (", ..." if len(below) > 3 else "")
            raise CheckpointNotFoundError(
                f"{source.path}: `{name}` is a group of {len(below):,} leaves ({shown}); --show takes one leaf: "
                "name one of them (inspect --item GROUP --leaves lists them).")
    every = [f"{n}/{leaf.name}" for n in dict.fromkeys(n for n, _ in tried) if (found := items_of(n)) is not None
             for leaf in found.leaves]
    close = [p for p in nearby(name, every) if p != name] or [p for p in every[:5] if p != name]
    where = f"{source.path}" + (f" (step {step})" if step is not None else "")
    raise CheckpointNotFoundError(f"{where}: no leaf `{name}`; close paths: {', '.join(close) or 'none'}.")


# ---------------------------------------------------------------------------- reading it


def _read(source: Source, spec: str, item_name: str, leaf: Leaf, index: tuple[Any, ...] | None) -> Any:
    if leaf.reader is None:
        if index is not None:
            raise UsageError(f"`{item_name}/{leaf.name}` is a value, not an array; drop the index.")
        value = leaf.value
        return value.item() if isinstance(value, np.generic) else value
    shape = tuple(leaf.reader.shape)
    index = index if index is not None else ()
    if len(index) > len(shape):
        raise UsageError(f"`show` index {spec!r} has {len(index)} entries for an array of shape {shape}.")
    full: list[Any] = []
    for k, (ix, n) in enumerate(zip(index + (slice(None),) * (len(shape) - len(index)), shape)):
        if isinstance(ix, int):
            if not -n <= ix < n:
                raise UsageError(f"`show` index {ix} is out of range for dimension {k} of size {n} in {spec!r}.")
            full.append(slice(ix % n, ix % n + 1))
        else:
            full.append(slice(*ix.indices(n)) if ix.step in (None, 1) else slice(None))
    # What is read: the region the slice spans (a strided slice reads its whole span), or the whole
    # leaf where the storage streams front to back (a compressed npz member). Held to the memory budget.
    region = shape if leaf.reader.sequential else block_extent(tuple(full), shape)[1]
    nbytes = math.prod(region) * leaf.reader.dtype.itemsize
    budget = source.context.memory_budget
    if nbytes > budget:
        reads = "the whole leaf" if tuple(region) == shape else f"a {list(region)} region"
        raise MemoryBudgetError(
            f"{source.path}: `{item_name}/{leaf.name}`: showing {spec!r} reads {reads}, {human(nbytes, 'B')}, over "
            f"the memory budget of {human(budget, 'B')}; show a smaller slice (e.g. `{leaf.name}"
            f"[{', '.join(['0'] * max(0, len(shape) - 1) + [':4'])}]`), or raise the budget with --memory-budget."
        )
    if leaf.reader.sequential:
        block = np.asarray(leaf.reader.read_all())[tuple(full)]
    else:
        block = np.asarray(leaf.reader.read(tuple(full)))
    # Apply integer indices (drop their axes) and strided slices on the block that was read.
    post = tuple(0 if isinstance(ix, int) else (slice(None) if ix.step in (None, 1) else ix)
                 for ix in index + (slice(None),) * (len(shape) - len(index)))
    return block[post]
