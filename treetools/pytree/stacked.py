"""Stacked (scanned) leaves: which leaves hold L layers on one axis, and where the layer index goes.

A scanned model (flax.linen ``nn.scan``, nnx layers built under ``nnx.vmap``,
MaxText with ``scan_layers``) keeps each parameter of its L layers in one leaf
of shape ``(L, ...)``: ``decoder/layers/attn/q`` holds every layer's ``q``.
``find_stacks`` says, per leaf, whether it is such a stack, on which axis, how
many layers it holds, and where the layer index goes in a per-layer name.

Found how (``stacked=``):

* ``None`` or ``True``: from the boxes. A box whose names hold ``layers`` (flax
  inserts the scan's ``nn.PARTITION_NAME`` there: ``nn.scan(...,
  metadata_params={nn.PARTITION_NAME: "layers"})``, MaxText's ``layers``
  logical axis, ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME:
  "layers"})``) is stacked on that axis. Its scanned module is the outermost
  subtree around it whose every leaf has the same layer axis and count (a box
  naming ``layers`` at that axis, or a leaf without sharding names, e.g.
  linen's unboxed default bias, with L along that axis); every leaf of that
  subtree is stacked, so a scanned block's unboxed biases are split with its
  kernels.
* ``{pattern: axis}``: the leaves whose path ``re.search``-matches a pattern
  (the first matching pattern wins) are stacked on ``axis``; for trees
  without such boxes (an nnx model built with ``nnx.vmap`` and no metadata, a
  dict of stacked arrays). A pattern that matches no leaf is an error naming
  it and nearby paths.
* ``False``: none.

A tree in which no box names a layer axis may still hold stacked layers:
``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` over
modules whose Variables carry no sharding names records the axis nowhere,
nor does linen ``nn.scan`` without ``metadata_params``.
Found from boxes for per-layer norms, such a subtree is reported, not
split: one warning names it and the ``stacked={pattern: 0}`` that splits it. It is the outermost
subtree of two or more unboxed leaves (no sharding names) that all have at
least two axes and the same leading size L >= 2, with L on no other axis of
them, and both a stacked matrix (three or more axes) and a stacked vector
(two axes, a bias or a scale), as a vmapped block has.

Where the index goes (``Stack.at``, the number of path parts before it): with
a pattern, right after the path part in which the match ends (``layers``
in ``decoder/layers/attn/q`` gives ``decoder/layers/3/attn/q``; ``q$`` gives
``decoder/layers/attn/q/3``); found from boxes, after the longest path prefix
that all leaves of the scanned subtree share (the scanned module:
``decoder/layers``), or before the leaf's own name when the subtree is one
leaf. That is where Rules' ``unstack`` puts it too.

How ``depth`` counts (``split_within``): the index is a path part, as in
every path printed. For ``decoder/layers/attn/q`` of shape (L, ...):
``depth=2`` gives ``decoder/layers`` (all layers together), ``depth=3``
``decoder/layers/3``, ``depth=4`` ``decoder/layers/3/attn``: the keys
``inspect --unstack RE --depth K`` shows for the same checkpoint.

>>> import flax.linen as nn, numpy as np
>>> tree = {"layers": {"w": nn.Partitioned(np.ones((4, 2)), names=("layers", None)), "b": np.zeros((4, 2))},
...         "head": nn.Partitioned(np.ones((2, 3)), names=(None, "fsdp"))}
>>> from treetools.pytree.paths import leaves_with_paths
>>> [(path, stack) for (path, _), stack in zip(leaves_with_paths(tree), find_stacks(leaves_with_paths(tree)))]
[('head', None), ('layers/b', Stack(axis=0, length=4, at=1)), ('layers/w', Stack(axis=0, length=4, at=1))]
>>> find_stacks(leaves_with_paths({"w": np.ones((3, 2))}), {"w": 0})
[Stack(axis=0, length=3, at=1)]
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from numbers import Number
from types import FrameType
from typing import Any, TypeGuard

from treetools.shared.aliases import PathStr
from treetools.pytree.partitioning import is_box, is_partitioned, layer_axis, unbox
from treetools.pytree.paths import SEP
from treetools.shared.patterns import compile_patterns, match_patterns

LAYER_AXIS = "layers"
"""The box axis name that marks a stacked leaf's layer axis (flax's ``nn.PARTITION_NAME`` value by convention)."""

Stacked = bool | Mapping[str, int] | None
"""``stacked=`` values: None/True (found from boxes), False (none), ``{pattern: axis}``."""


@dataclasses.dataclass(frozen=True)
class Stack:
    """A stacked leaf: ``length`` layers along array ``axis``; the index goes after ``at`` path parts."""

    axis: int
    length: int
    at: int


def layer_parts(parts: Sequence[str], stack: Stack, layer: int) -> tuple[str, ...]:
    """The path parts of one layer of a stacked leaf: the index inserted after ``stack.at`` parts.

    >>> layer_parts(("decoder", "layers", "attn", "q"), Stack(axis=0, length=4, at=2), 3)
    ('decoder', 'layers', '3', 'attn', 'q')
    """
    return (*parts[: stack.at], str(layer), *parts[stack.at :])


def split_within(stack: Stack | None, depth: int | None) -> TypeGuard[Stack]:
    """Whether a stacked leaf's layers get keys of their own at ``depth``: the depth rule of per-layer results.

    ``depth`` counts the parts of a layer's path, the layer index being one
    of them, as it is in every path treetools prints (``layers/3/attn/q``,
    what ``inspect --unstack`` lists and ``per_param`` keys show) and as it is
    in an unscanned model's path (an nnx list of layers: ``layers/3/attn/q``).
    So ``depth`` K groups by the first K parts of that path: the layers are
    apart from the depth that reaches the index (``stack.at + 1``); below it
    they are one group. ``depth=None`` (per leaf) always splits.

    >>> stack = Stack(axis=0, length=4, at=2)  # decoder/layers/<i>/attn/q
    >>> [split_within(stack, d) for d in (1, 2, 3, None)]
    [False, False, True, True]
    >>> [SEP.join(layer_parts(("decoder", "layers", "attn", "q"), stack, 3)[:d]) for d in (3, 4)]
    ['decoder/layers/3', 'decoder/layers/3/attn']
    """
    return stack is not None and (depth is None or stack.at < depth)


def _shape(x: Any) -> tuple[int, ...] | None:
    value = unbox(x)
    shape = getattr(value, "shape", None)
    if shape is None:
        return () if isinstance(value, Number) else None
    return tuple(int(d) for d in shape)


def _parts(path: PathStr) -> tuple[str, ...]:
    return tuple(path.split(SEP)) if path else ()


def find_stacks(
    pairs: Sequence[tuple[PathStr, Any]],
    stacked: Stacked = None,
    *,
    shape_of: Callable[[Any], tuple[int, ...] | None] = _shape,
    warn_unmarked: bool = False,
) -> list[Stack | None]:
    """Per leaf of ``[(path, leaf), ...]``, its ``Stack`` or None (see the module doc for the rules).

    Args:
      pairs: leaves with their path strings, in tree order (``leaves_with_paths``).
      stacked: None/True (found from boxes), False (none), or ``{pattern: axis}``.
      shape_of: a leaf's (global) shape; inside ``shard_map`` the caller scales
        the local shard's split axes back up.
      warn_unmarked: found from boxes, warn when a subtree looks stacked but no
        box says so (see the module doc); for per-layer results, which lump it.

    Raises:
      PatternError: a pattern is not a regex or matches no leaf (named, with nearby paths).
      ValueError: a matched leaf has no axis ``axis``.
      TypeError: ``stacked`` is none of the above, or an axis is not an int.
    """
    if stacked is False:
        return [None] * len(pairs)
    if stacked is None or stacked is True:
        return _from_boxes(pairs, shape_of, warn_unmarked)
    if isinstance(stacked, Mapping):
        return _from_patterns(pairs, stacked, shape_of)
    raise TypeError(
        f"`stacked` must be None or True (find stacked leaves from `{LAYER_AXIS}` axis names in their boxes), False, "
        f"or a dict {{pattern: axis}}; got {type(stacked).__name__}."
    )


def _from_patterns(pairs: Sequence[tuple[str, Any]], stacked: Mapping[str, int],
                   shape_of: Callable[[Any], Any]) -> list[Stack | None]:
    paths = [p for p, _ in pairs]
    out: list[Stack | None] = [None] * len(pairs)
    for pattern, axis in stacked.items():
        try:
            axis = operator.index(axis)
        except TypeError:
            raise TypeError(f"`stacked` pattern {pattern!r}: the axis must be an int, got {axis!r}.") from None
        [regex] = compile_patterns(pattern, name="stacked")
        hits = match_patterns(paths, [regex], name="stacked")
        for i, hit in enumerate(hits):
            if not hit or out[i] is not None:
                continue
            shape = shape_of(pairs[i][1])
            ndim = len(shape) if shape is not None else 0
            if not -ndim <= axis < ndim:
                what = f"shape {shape}" if shape is not None else type(unbox(pairs[i][1])).__name__
                raise ValueError(
                    f"`stacked` pattern {pattern!r} matches leaf `{paths[i]}` ({what}), which has no axis {axis}; "
                    "narrow the pattern to the stacked leaves or fix the axis."
                )
            found = regex.search(paths[i])  # a match: `hit` says so
            end = found.end() if found is not None else len(paths[i])
            out[i] = Stack(axis % ndim, shape[axis % ndim], _parts_through(paths[i], end))
    return out


def _parts_through(path: str, end: int) -> int:
    """How many path parts the first ``end`` characters reach into (a part cut by the match counts whole)."""
    if end == 0:
        return 0
    if path[end - 1] == SEP:
        end -= 1
    return path[:end].count(SEP) + 1


def _from_boxes(pairs: Sequence[tuple[str, Any]], shape_of: Callable[[Any], Any],
                warn_unmarked: bool = False) -> list[Stack | None]:
    if not warn_unmarked and not any(is_box(x) for _, x in pairs):
        return [None] * len(pairs)  # only a box names a layer axis: no box, no stack (and no path is split)
    parts = [_parts(p) for p, _ in pairs]
    shapes = [shape_of(x) for _, x in pairs]
    says = _box_says(pairs, shapes)
    if not any(isinstance(sig, tuple) for sig in says):
        # No box names a layer axis: nothing is stacked, but say so where the shapes look stacked.
        unmarked = _unmarked_stacks(_subtrees(parts), shapes, says) if warn_unmarked else []
        if unmarked:
            warnings.warn(_unmarked_message(unmarked, parts, shapes), stacklevel=_caller_level())
        return [None] * len(pairs)
    return _marked_stacks(parts, shapes, says)


def _box_says(pairs: Sequence[tuple[str, Any]], shapes: list) -> list[Any]:
    """What each leaf says: (axis, L) for a box naming the layer axis; "other" for a box with other names; None
    for a leaf without sharding names (it joins a stack its shape fits)."""
    says: list[Any] = []
    for (_, x), shape in zip(pairs, shapes):
        axis = layer_axis(x, LAYER_AXIS)
        if axis is not None and shape is not None and axis < len(shape):
            says.append((axis, shape[axis]))
        else:
            says.append("other" if is_partitioned(x) else None)
    return says


def _marked_stacks(parts: list[tuple[str, ...]], shapes: list, says: list[Any]) -> list[Stack | None]:
    """The stacks: each leaf whose box names the layer axis, with every leaf of the largest subtree above it whose
    leaves all fit its ``(axis, L)``."""
    under = _subtrees(parts)

    def fits(j: int, sig: tuple[int, int]) -> bool:
        if says[j] is None:
            shape = shapes[j]
            return shape is not None and len(shape) > sig[0] and shape[sig[0]] == sig[1]
        return says[j] == sig

    uniform: dict[tuple[tuple[str, ...], tuple[int, int]], bool] = {}
    out: list[Stack | None] = [None] * len(parts)
    for i, sig in enumerate(says):
        if not isinstance(sig, tuple) or out[i] is not None:
            continue
        prefix = parts[i]  # the leaf itself fits: the longest prefix always does
        for k in range(len(parts[i]) + 1):
            if (parts[i][:k], sig) not in uniform:
                uniform[parts[i][:k], sig] = all(fits(j, sig) for j in under[parts[i][:k]])
            if uniform[parts[i][:k], sig]:
                prefix = parts[i][:k]
                break
        group = under[prefix]
        if len(group) > 1:
            at = _common_length([parts[j] for j in group])
        else:  # one leaf: the index goes before its own name, unless the leaf is the whole subtree found
            at = max(len(prefix), len(parts[i]) - 1)
        for j in group:
            out[j] = Stack(sig[0], sig[1], at)
    return out


def _subtrees(parts: list[tuple[str, ...]]) -> dict[tuple[str, ...], list[int]]:
    """Every path prefix (a subtree, the root ``()`` included) -> the indices of the leaves under it."""
    under: dict[tuple[str, ...], list[int]] = {}
    for i, ps in enumerate(parts):
        for k in range(len(ps) + 1):
            under.setdefault(ps[:k], []).append(i)
    return under


def _common_length(paths: list[tuple[str, ...]]) -> int:
    n = min(len(p) for p in paths)
    for k in range(n):
        if len({p[k] for p in paths}) > 1:
            return k
    return n


def _unmarked_stacks(under: dict[tuple[str, ...], list[int]], shapes: list,
                     says: list) -> list[tuple[tuple[str, ...], int]]:
    """``(module path, L)`` of the outermost subtrees that look stacked without a box saying so (module doc)."""
    found: list[tuple[tuple[str, ...], int]] = []
    for prefix in sorted(under, key=len):
        members = under[prefix]
        if len(members) < 2 or any(prefix[: len(f)] == f for f, _ in found):
            continue
        member_shapes = [shapes[j] for j in members]
        if any(says[j] is not None or shapes[j] is None or len(shapes[j]) < 2 for j in members):
            continue
        length = member_shapes[0][0]
        if (length >= 2 and all(s[0] == length and length not in s[1:] for s in member_shapes)
                and any(len(s) >= 3 for s in member_shapes) and any(len(s) == 2 for s in member_shapes)):
            found.append((prefix, length))
    return found


def _unmarked_message(unmarked: list[tuple[tuple[str, ...], int]], parts: list[tuple[str, ...]], shapes: list) -> str:
    named = []
    for prefix, length in unmarked:
        leaves = [(SEP.join(ps), shapes[j]) for j, ps in enumerate(parts) if ps[: len(prefix)] == prefix]
        shown = ", ".join(f"`{p}` {s}" for p, s in leaves[:3])
        shown += f", ... ({len(leaves)} leaves)" if len(leaves) > 3 else ""
        named.append(f"`{SEP.join(prefix) or '(the whole tree)'}` ({shown}: L={length})")
    fix = {("^" + re.escape(SEP.join(prefix)) + SEP if prefix else "^"): 0 for prefix, _ in unmarked}
    return (
        f"per-layer results lump the layers of {'; '.join(named)}: these leaves share a leading axis as stacked "
        f"(scanned, vmapped) layers do, but no box names a `{LAYER_AXIS}` axis (flax records it only in sharding "
        "names: nn.scan's metadata_params, nnx.vmap's transform_metadata on Variables that have them). "
        f"Pass stacked={fix!r} to split them per layer, or stacked=False if that axis holds no layers."
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside treetools: the user's call, whichever function it went through."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("treetools."):
        frame, level = frame.f_back, level + 1
    return level
