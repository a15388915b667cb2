"""``str(plan)`` of a ``MemoryPlan`` (``treetools.pytree.memory``): the plan as text within ``width()`` columns.

The plan is read by its attributes only (``mesh``, ``by_part``, ``warnings``, ``compiled``, ``host``...), so this
module sits below ``treetools.pytree.memory``, which calls it.
"""

from __future__ import annotations

import re
import textwrap
import dataclasses
from typing import Any, Sequence

from jax.sharding import PartitionSpec

from treetools.shared.render import fit_table, safe_text, width
from treetools.shared.rows import format_shape, human


@dataclasses.dataclass(frozen=True)
class Indivisible:
    """A dimension its mesh axes do not divide (GPT-2's vocabulary, 50257, over ``fsdp=8``): ``asked`` is the
    layout the leaf names, planned with dimension ``dim`` unsplit, as ``jit`` places it."""

    part: str
    path: str
    shape: tuple[int, ...]
    dim: int
    axes: tuple[str, ...]
    size: int
    asked: PartitionSpec

    @property
    def name(self) -> str:
        return f"{self.part}/{self.path}" if self.path else self.part

    def text(self) -> str:
        n, over = self.shape[self.dim], "x".join(self.axes)
        return (f"`{self.name}` {format_shape(self.shape)} is laid out as {self.asked}, but {over} ({self.size}) "
                f"does not divide its dimension {self.dim} ({n}): jax.device_put and jit's in/out_shardings refuse "
                f"that layout (IndivisibleError), and under jit with_sharding_constraint leaves the dimension "
                f"unsplit, so it is planned unsplit; pad it to {-(-n // self.size) * self.size} or split another "
                "dimension")

    def to_json(self) -> dict[str, Any]:
        return {"path": self.name, "shape": list(self.shape), "dim": self.dim, "axes": list(self.axes),
                "axis_size": self.size}



def indivisible_warnings(found: Sequence[Indivisible]) -> list[str]:
    """One line per leaf whose own layout jax cannot place (the params', else each part's first ones); the
    leaves of other parts that mirror them counted."""
    own = [x for x in found if x.part == "params"] or list(found)
    shown = own[:5]
    out = [x.text() for x in shown]
    rest = len(found) - len(shown)
    if rest:
        out.append(f"{rest} more leaf dimension(s) (grads and optimizer moments that mirror these, or others) are "
                   "planned unsplit for the same reason: `plan.indivisible` lists them all")
    return out


# ---------------------------------------------------------------------------- rendering


def _mesh_text(plan: Any) -> str:
    if not plan.mesh:
        return "one device"
    shape = " x ".join(f"{safe_text(a, width=40)}={s}" for a, s in plan.mesh.items())
    return f"mesh {shape} ({plan.devices:,} devices)"


def _b(n: float | None) -> str:
    return "n/a" if n is None else human(n, "B")


def render_summary(plan: Any) -> str:
    """One line per part (the fullest device's bytes of it, and of one whole copy), then the total."""
    width = max([len(p) for p in plan.by_part] + [5])
    total = plan.global_bytes
    lines = [f"memory per device, {_mesh_text(plan)}:"]
    for part, n in plan.by_part.items():
        lines.append(f"  {safe_text(part, width=40):<{width}}  {_b(n):>12}   (whole: {_b(total[part])})")
    lines.append(f"  {'total':<{width}}  {_b(plan.per_device_bytes):>12}")
    return "\n".join(lines)


_FIGURE = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB)\b")


def _wrap(text: str) -> list[str]:
    """A sentence as lines within ``width()`` columns (continuations indented), a figure never cut from its unit."""
    kept = _FIGURE.sub("\\1\u00a0\\2", text)  # textwrap breaks at ASCII whitespace only
    lines = textwrap.wrap(kept, width(), subsequent_indent="    ", break_long_words=True, break_on_hyphens=False)
    return [line.replace("\u00a0", " ") for line in lines]


def _fit_line(plan: Any) -> str | None:
    if plan.device_memory is None:
        return None
    room = plan.headroom_bytes
    verdict = f"fits, {_b(room)} headroom" if plan.fits else f"DOES NOT FIT, {_b(-room)} short"
    return f"device memory {_b(plan.device_memory)}: {verdict} (the state; activations not counted)"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns joined by two spaces, the last aligned right, within ``width()`` by the one rule (``fit_table``):
    the path column (the first) is cut to what the others leave. Every cell is escaped (``safe_text``): a
    newline in a stored leaf name cannot start a line of its own."""
    cells = [[r[0], *(safe_text(c) for c in r[1:])] for r in rows]
    return fit_table(header, cells, style="plain", paths=True, right=[len(header) - 1]).text.splitlines()


def render_plan(plan: Any) -> str:
    """The plan as text within ``width()`` columns: parts, the verdict, the compiled step, host memory, the
    replicated leaves that could be sharded, the largest leaves per device, and the notes."""
    lines = [line for w in plan.warnings for line in _wrap(f"warning: {safe_text(w)}")]
    lines += [render_summary(plan)]
    fit = _fit_line(plan)
    if fit:
        lines += _wrap(fit)
    c = plan.compiled
    if c is not None:
        lines += _wrap(f"compiled step ({c.devices} {c.platform} devices): arguments {_b(c.argument_bytes)}, "
                     f"outputs {_b(c.output_bytes)}, temporaries {_b(c.temp_bytes)}, code "
                     f"{_b(c.generated_code_bytes)}, aliased {_b(c.alias_bytes)}; total {_b(c.total_bytes)}")
    h = plan.host
    if h is not None and h.largest_block is not None:
        lines += _wrap(f"host: largest device block {_b(h.largest_block.bytes)} "
                     f"({safe_text(h.largest_block.name, width=48)}); restore_checkpoint peak "
                     f"{_b(h.restore_peak_bytes)} (one block + one stored chunk)")
        if h.over_budget:
            shown = ", ".join(safe_text(p, width=40) for p in h.over_budget[:3])
            lines += _wrap(f"host: {len(h.over_budget)} stored chunk(s) over the memory budget of "
                         f"{_b(h.memory_budget)} ({shown}{', ...' if len(h.over_budget) > 3 else ''}): a restore "
                         "refuses them; raise --memory-budget")
    for e in getattr(plan, "estimates", []):
        lines += _wrap(f"estimate: {e.name} {_b(e.bytes) if e.bytes >= 0 else '-' + _b(-e.bytes)} = {e.formula}")
    shardable = plan.replicated
    if shardable:
        lines += ["", f"replicated on every device, {_b(plan.replicated_threshold)} or more, and shardable:"]
        rows = [(s.leaf.name, format_shape(s.leaf.shape), s.leaf.dtype, f"dim {s.dim} over {s.axis} ({s.size})",
                 _b(s.leaf.bytes)) for s in shardable[: plan.top]]
        lines += _table(("path", "shape", "dtype", "could split", "bytes"), rows)
        if len(shardable) > plan.top:
            lines.append(f"... and {len(shardable) - plan.top} more")
    if plan.rows:
        lines += ["", "largest leaves per device:"]
        rows = [(r.name, format_shape(r.shape), r.dtype, safe_text(r.sharding, width=32), _b(r.bytes))
                for r in plan.rows]
        lines += _table(("path", "shape", "dtype", "spec", "per device"), rows)
    if plan.notes:
        lines.append("")
        for note in plan.notes:
            lines += _wrap(f"note: {safe_text(note)}")
    return "\n".join(lines)
