"""The plan of a restore, as data: ``plan_restore`` returns a ``RestorePlan``.

For every item its target leaves (``LeafPlan``: where each value comes from
and what happens on the way), the checkpoint leaves no target uses or the
rules drop, and every problem. ``str(plan)`` is the summary a person reads;
``plan.describe()`` lists every leaf. Built by
``treetools.checkpoint_jax.restore``; nothing here reads a checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from treetools.shared.errors import Mismatch
from treetools.shared.render import fit_table, safe_text
from treetools.shared.rows import format_shape


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Where one target leaf's value comes from.

    ``origin`` is ``"checkpoint"`` (``source`` names the checkpoint leaf, or
    ``path[3]`` for one layer of a stacked leaf, after the rules),
    ``"fill_missing"``, ``"missing"``, or ``"unresolved"`` (the item's rules
    do not fit the checkpoint, a problem of the plan: no source is known);
    ``ops`` says what happens on the way (``unstack [3]``, ``transpose (1, 0)``,
    ``cast bfloat16``, ``renamed``). ``shape``/``dtype`` are the source's, or
    the target's for a missing or unresolved leaf.
    """

    path: str
    origin: str
    source: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    ops: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ItemPlan:
    """The plan of one item: its target leaves, and the checkpoint leaves no target leaf uses or the rules drop."""

    name: str
    kind: str
    leaves: list[LeafPlan] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What ``restore_checkpoint`` would do, from metadata alone (``plan_restore``).

    ``str(plan)`` is the summary a person reads (the count from the
    checkpoint, the leaves from ``fill_missing``, the checkpoint leaves left
    unused, every problem); ``plan.describe()`` lists every leaf.
    """

    path: str
    format: str
    step: int | None
    items: dict[str, ItemPlan]
    problems: list[Mismatch]

    @property
    def ok(self) -> bool:
        """No problem: ``restore_checkpoint`` with the same arguments reads."""
        return not self.problems

    def _leaves(self, origin: str) -> list[str]:
        return [f"{i.name}/{leaf.path}" for i in self.items.values() for leaf in i.leaves if leaf.origin == origin]

    def __str__(self) -> str:
        total = sum(len(i.leaves) for i in self.items.values())
        from_ckpt, filled = self._leaves("checkpoint"), self._leaves("fill_missing")
        unused = [f"{i.name}/{p}" for i in self.items.values() for p in i.unused]
        dropped = sum(len(i.dropped) for i in self.items.values())
        parts = [f"{len(from_ckpt)}/{total} target leaves from the checkpoint"]
        parts.append(f"{len(filled)} from fill_missing{_few(filled)}")
        parts.append(f"{len(unused)} checkpoint leaves unused{_few(unused)}")
        if dropped:
            parts.append(f"{dropped} dropped by the rules")
        n = len(self.problems)
        parts.append(f"{n} problem{'s' * (n != 1)}")
        where = f"{safe_text(self.path)}" + (f" (step {self.step})" if self.step is not None else "")
        lines = [f"{where}: " + ", ".join(parts)]
        lines += [f"  {safe_text(p)}" for p in self.problems]
        return "\n".join(lines)

    def describe(self) -> str:
        """Every target leaf: ``item/path <- source  shape  dtype  what happens``, then the unused leaves."""
        rows = [("target", "<- source", "shape", "dtype", "")]
        for item in self.items.values():
            for leaf in item.leaves:
                source = {"checkpoint": leaf.source, "fill_missing": "fill_missing", "missing": "MISSING",
                          "unresolved": "? (the rules do not fit)"}[leaf.origin]
                rows.append((f"{item.name}/{leaf.path}", f"<- {source}", format_shape(leaf.shape), leaf.dtype or "",
                             ", ".join(leaf.ops)))
            rows += [(f"({item.name}/{p} unused)", "", "", "", "") for p in item.unused]
            rows += [(f"({item.name}/{p} dropped by the rules)", "", "", "", "") for p in item.dropped]
        safe = [tuple(safe_text(c) for c in row) for row in rows]
        return fit_table(safe[0], safe[1:], style="plain", fit=False).text


def _few(names: Sequence[str], n: int = 3) -> str:
    if not names:
        return ""
    return " (" + ", ".join(safe_text(x) for x in names[:n]) + (", ..." if len(names) > n else "") + ")"
