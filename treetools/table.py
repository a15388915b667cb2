"""Rows as data; ``tabulate_params`` and the CLI render them.

One ``Row`` type serves the parameter table, the checkpoint inspector and
every output format: the terminal table (via ``tabulate``), markdown, JSON
and an indented tree are four renderers of the same rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

from treetools._typing import PyTree
from treetools.paths import leaves_with_paths, path_prefix  # importing paths does not import jax

__all__ = [
    "Row",
    "Totals",
    "aggregate_rows",
    "render_rows",
    "rows_from_tree",
    "sort_rows",
    "tabulate_params",
    "totals",
]

MIXED = "mixed"


@dataclasses.dataclass
class Row:
    """One leaf (or, after ``aggregate_rows``, one module prefix).

    ``sharding`` is a ``treetools.partitioning.LeafSharding`` or None;
    ``shape`` is None for non-array leaves and for aggregated rows;
    ``weight_decay`` is None where it was not asked for or is mixed;
    ``stats`` holds per-leaf statistics when they were computed.
    """

    path: str
    shape: tuple[int, ...] | None
    dtype: str | None
    params: int
    bytes: int
    sharding: Any = None
    weight_decay: bool | None = None
    stats: dict[str, float] | None = None
    leaves: int = 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "params": self.params,
            "bytes": self.bytes,
            "sharding": self.sharding.to_json() if self.sharding is not None else None,
        }
        if self.weight_decay is not None:
            out["weight_decay"] = self.weight_decay
        if self.stats is not None:
            out["stats"] = self.stats
        if self.leaves != 1:
            out["num_leaves"] = self.leaves  # an aggregated (--depth) row: how many leaves it sums
        return out


@dataclasses.dataclass
class Totals:
    params: int
    bytes: int
    by_dtype: dict[str, dict[str, int]]

    def to_json(self) -> dict[str, Any]:
        return {"total_params": self.params, "total_bytes": self.bytes, "by_dtype": self.by_dtype}


def rows_from_tree(tree: PyTree, *, weight_decay: PyTree | None = None, mesh: Any = None) -> list[Row]:
    """One ``Row`` per leaf of ``tree``, in tree order.

    Args:
      tree: any pytree; boxes are leaves and report their sharding.
      weight_decay: optional bool tree of the same structure (e.g. the output
        of ``get_param_mask_fn``); flags are joined by path, never by position.
      mesh: passed to ``leaf_sharding`` for boxes without a mesh.

    >>> import numpy as np
    >>> [(r.path, r.shape, r.params) for r in rows_from_tree({"w": np.ones((2, 3)), "step": 7})]
    [('step', None, 0), ('w', (2, 3), 6)]
    """
    from treetools.counting import is_array_like, leaf_nbytes, leaf_size
    from treetools.partitioning import leaf_sharding, unbox

    flags: dict[str, Any] = {}
    if weight_decay is not None:
        flags = {p: bool(unbox(f)) for p, f in leaves_with_paths(weight_decay)}
    rows = []
    for path, leaf in leaves_with_paths(tree):
        arr = is_array_like(leaf)
        value = unbox(leaf)
        if weight_decay is not None and path not in flags:
            raise ValueError(f"weight-decay mask has no entry for `{path}`; build it from the same params.")
        rows.append(
            Row(
                path=path,
                shape=tuple(int(d) for d in value.shape) if arr else None,
                dtype=dtype_name(value.dtype) if arr else None,
                params=leaf_size(leaf),
                bytes=leaf_nbytes(leaf),
                sharding=leaf_sharding(leaf, mesh=mesh) if arr else None,
                weight_decay=flags.get(path) if weight_decay is not None else None,
            )
        )
    return rows


@functools.cache
def dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``...: the name a user types, not ``<f4`` (once per dtype).

    ``jax.dtypes.float0`` (the gradient dtype of integer inputs under
    ``jax.grad(..., allow_int=True)``) is a numpy structured void dtype with
    itemsize 0, which numpy would print as ``[('float0', 'V')]``; it is
    recognised by its structure, so this never imports jax.

    >>> import numpy as np
    >>> dtype_name(np.float32), dtype_name(np.dtype([("float0", "V")]))
    ('float32', 'float0')
    """
    import numpy as np

    dtype = np.dtype(dtype)
    return "float0" if dtype.names == ("float0",) and dtype.itemsize == 0 else str(dtype)


def _merge(values: Iterable[Any]) -> Any:
    vals = set(values)
    return vals.pop() if len(vals) == 1 else None


def aggregate_rows(rows: Sequence[Row], depth: int | None) -> list[Row]:
    """Sum rows per path prefix of ``depth`` parts, in first-seen order.

    A group of one leaf keeps that leaf's row whole (shape, sharding, stats).

    >>> import numpy as np
    >>> rows = rows_from_tree({"enc": {"w": np.ones(4), "b": np.ones(2)}, "head": np.ones(3)})
    >>> [(r.path, r.params, r.leaves) for r in aggregate_rows(rows, 1)]
    [('enc', 6, 2), ('head', 3, 1)]
    """
    if depth is None:
        return list(rows)
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(path_prefix(row.path, depth), []).append(row)
    out = []
    for prefix, members in groups.items():
        if len(members) == 1 and members[0].path == prefix:
            out.append(members[0])
            continue
        dtypes = {m.dtype for m in members if m.dtype is not None}
        out.append(
            Row(
                path=prefix,
                shape=None,
                dtype=dtypes.pop() if len(dtypes) == 1 else (MIXED if dtypes else None),
                params=sum(m.params for m in members),
                bytes=sum(m.bytes for m in members),
                sharding=None,
                weight_decay=_merge(m.weight_decay for m in members),
                leaves=sum(m.leaves for m in members),
            )
        )
    return out


def totals(rows: Iterable[Row]) -> Totals:
    """Global params and bytes with a per-dtype breakdown (leaf rows only).

    >>> import numpy as np
    >>> totals(rows_from_tree({"a": np.ones(2, np.float32), "b": np.ones(3, np.int8)})).to_json()
    {'total_params': 5, 'total_bytes': 11, 'by_dtype': {'float32': {'params': 2, 'bytes': 8}, 'int8': {'params': 3, 'bytes': 3}}}
    """
    params = nbytes = 0
    by_dtype: dict[str, dict[str, int]] = {}
    for row in rows:
        params += row.params
        nbytes += row.bytes
        if row.dtype is not None and row.dtype != MIXED:
            d = by_dtype.setdefault(row.dtype, {"params": 0, "bytes": 0})
            d["params"] += row.params
            d["bytes"] += row.bytes
    return Totals(params, nbytes, dict(sorted(by_dtype.items())))


_SORT_KEYS: dict[str, Callable[[Row], Any]] = {
    "path": lambda r: r.path,
    "params": lambda r: (-r.params, r.path),
    "bytes": lambda r: (-r.bytes, r.path),
}


def sort_rows(rows: Sequence[Row], by: str | None) -> list[Row]:
    """Rows sorted by ``path`` (ascending) or ``params``/``bytes`` (largest first).

    >>> import numpy as np
    >>> [r.path for r in sort_rows(rows_from_tree({"a": np.ones(1), "b": np.ones(5)}), "params")]
    ['b', 'a']
    """
    if by is None:
        return list(rows)
    if by not in _SORT_KEYS:
        raise ValueError(f"`sort` must be one of {sorted(_SORT_KEYS)}, got {by!r}.")
    return sorted(rows, key=_SORT_KEYS[by])


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (params) or, with unit='B', '1.18 MiB'.

    >>> human(1234567), human(1234567, "B")
    ('1.23M', '1.18 MiB')
    """
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or suffix == "TiB":
                return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.2f} {suffix}"
            n /= 1024
    for suffix in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.0f}" if suffix == "" else f"{n:.2f}{suffix}"
        n /= 1000
    return str(n)


def _fmt_stat(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


STAT_COLUMNS = ("mean", "std", "min", "max", "l2", "abs_max", "zeros", "nan", "posinf", "neginf")


def _table_data(rows: Sequence[Row], show_weight_decay: bool) -> tuple[list[str], list[list[Any]]]:
    show_stats = any(r.stats is not None for r in rows)
    show_leaves = any(r.leaves != 1 for r in rows)
    headers = ["path", "shape", "dtype", "params", "bytes", "sharding"]
    if show_leaves:
        headers.insert(1, "leaves")
    if show_weight_decay:
        headers.append("weight_decay")
    if show_stats:
        headers += list(STAT_COLUMNS)
    data = []
    for r in rows:
        line: list[Any] = [
            r.path,
            "" if r.shape is None else "(" + ", ".join(map(str, r.shape)) + ("," if len(r.shape) == 1 else "") + ")",
            r.dtype or "",
            f"{r.params:,}",
            human(r.bytes, "B"),
            "" if r.sharding is None else str(r.sharding.spec),
        ]
        if show_leaves:
            line.insert(1, r.leaves)
        if show_weight_decay:
            line.append(MIXED if r.weight_decay is None else str(r.weight_decay))
        if show_stats:
            line += ["" if r.stats is None else _fmt_stat(r.stats.get(k)) for k in STAT_COLUMNS]
        data.append(line)
    return headers, data


def _footer(t: Totals, *, markdown: bool = False) -> str:
    # In markdown the per-dtype lines are a list, so they do not run together into one paragraph.
    indent = "- " if markdown else "  "
    lines = [f"Total: {t.params:,} params ({human(t.params)}), {t.bytes:,} bytes ({human(t.bytes, 'B')})"]
    for dtype, d in t.by_dtype.items():
        lines.append(f"{indent}{dtype}: {d['params']:,} params, {d['bytes']:,} bytes ({human(d['bytes'], 'B')})")
    if markdown and t.by_dtype:
        lines.insert(1, "")
    return "\n".join(lines)


def _render_tree(rows: Sequence[Row]) -> str:
    lines: list[str] = []
    opened: list[str] = []
    for r in rows:
        parts = r.path.split("/")
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            lines.append("  " * depth + parts[depth] + "/")
            opened.append(parts[depth])
        shape = "" if r.shape is None else f" {list(r.shape)}"
        dtype = f" {r.dtype}" if r.dtype else ""
        spec = f" {r.sharding.spec}" if r.sharding is not None else ""
        lines.append("  " * (len(parts) - 1) + f"{parts[-1]}{shape}{dtype}  {r.params:,} params{spec}")
    return "\n".join(lines)


def render_rows(
    rows: Sequence[Row],
    *,
    fmt: str = "table",
    tablefmt: str = "simple",
    show_weight_decay: bool = False,
    total: Totals | None = None,
) -> str:
    """Render rows as ``table`` (tabulate's ``tablefmt``), ``markdown``, ``tree`` or ``json``.

    ``total`` defaults to the totals of ``rows``; pass the leaf totals when the
    rows are aggregated or filtered and the footer should say so.

    >>> import numpy as np
    >>> print(render_rows(rows_from_tree({"enc": {"w": np.ones(4, np.float32)}}), fmt="tree"))
    enc/
      w [4] float32  4 params
    Total: 4 params (4), 16 bytes (16 B)
      float32: 4 params, 16 bytes (16 B)
    """
    total = total if total is not None else totals(rows)
    if fmt == "json":
        return json.dumps({**total.to_json(), "leaves": [r.to_json() for r in rows]}, indent=2)
    if fmt == "tree":
        return _render_tree(rows) + "\n" + _footer(total)
    if fmt not in ("table", "markdown"):
        raise ValueError(f"`fmt` must be one of table, markdown, tree, json; got {fmt!r}.")
    from tabulate import tabulate

    headers, data = _table_data(rows, show_weight_decay)
    body = tabulate(data, headers=headers, tablefmt="github" if fmt == "markdown" else tablefmt, disable_numparse=True)
    return body + "\n\n" + _footer(total, markdown=fmt == "markdown")


def _params_of(state: Any) -> PyTree:
    """A TrainState's ``params``; an nnx Module's state; any other tree as is."""
    if hasattr(state, "params") and not isinstance(state, Mapping):
        return state.params
    if hasattr(state, "__class__") and any(c.__module__.startswith("flax.nnx") and c.__name__ == "Module"
                                           for c in type(state).__mro__):
        from flax import nnx

        return nnx.state(state, nnx.Param)
    return state


def tabulate_params(
    state: Any,
    show_weight_decay: bool = False,
    weight_decay_exclude: Sequence[str] | None = None,
    weight_decay_include: Sequence[str] | None = None,
    *,
    depth: int | None = None,
    tablefmt: str = "simple",
    sort: str | None = None,
    mesh: Any = None,
) -> str:
    """A table of parameters: path, shape, dtype, params, bytes, sharding.

    The weight-decay column comes from ``get_param_mask_fn`` itself, the same
    function the optimizer uses, joined by path, so rows and flags cannot be
    misaligned. Totals (params, bytes, per dtype) are at the bottom.

    Args:
      state: a ``TrainState`` (its ``params``), an nnx Module or State, or a plain tree.
      show_weight_decay: add the weight-decay column.
      weight_decay_exclude: patterns of leaves *not* decayed (``get_param_mask_fn``).
      weight_decay_include: patterns of the only leaves decayed.
      depth: one row per module prefix of ``depth`` path parts, summed.
      tablefmt: any ``tabulate`` format (``simple``, ``github``, ``simple_grid``...).
      sort: ``path``, ``params`` or ``bytes``; default tree order.
      mesh: sizes for boxes that name mesh axes but carry no mesh.

    Returns:
      The rendered table as a string.

    >>> import jax.numpy as jnp
    >>> print(tabulate_params({"w": jnp.zeros((2, 3))}).splitlines()[2])
    w       (2, 3)   float32  6         24 B
    """
    params = _params_of(state)
    mask = None
    if show_weight_decay:
        from treetools.masks import get_param_mask_fn

        mask = get_param_mask_fn(weight_decay_exclude or [], weight_decay_include)(params)
    leaf_rows = rows_from_tree(params, weight_decay=mask, mesh=mesh)
    rows = sort_rows(aggregate_rows(leaf_rows, depth), sort)
    return render_rows(rows, tablefmt=tablefmt, show_weight_decay=show_weight_decay, total=totals(leaf_rows))
