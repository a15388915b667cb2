"""The planner's stages for the layout rules: split, concat, reshape, permute, slice, pad, tie, scale.

Each stage takes the planner (``treetools.rules.plan._Planner``: the rules,
``first_match``, the list of problems) and the target leaves of the stage
before, and returns those of its own, from metadata alone: a rule that does
not fit a leaf (sizes that do not sum, a shape that does not divide, an axis
out of range) is one problem naming the rule, the leaf and what was expected.
What the leaves are made of is a ``treetools.rules.blocks`` node.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterator, Sequence

from treetools.rules import blocks
from treetools.rules.dtypes import dtype_text, kind

Leaf = Any  # a TargetLeaf (treetools.rules.plan imports this module)


def _axis(p: Any, rule: str, leaf: Leaf, axis: int) -> int | None:
    """``axis`` of ``leaf`` as an index >= 0; None (a problem said) when out of range or not an array."""
    if _not_array(p, rule, leaf):
        return None
    if leaf.shape is None:  # a path alone: nothing to check
        return axis
    rank = len(leaf.shape)
    if not -rank <= axis < rank:
        p.problems.append(f"{rule}: axis {axis} is out of range for `{leaf.path}` of shape {leaf.shape} (rank "
                          f"{rank}); give an axis of 0 .. {rank - 1} (or -1 .. -{rank}).")
        return None
    return axis % rank


def _matched(p: Any, field: str, leaves: list[Leaf], where: str, out: list[Leaf]) -> Iterator[tuple[Leaf, int]]:
    """The value stages' one loop: each leaf is appended to ``out`` in turn, and those whose path a ``field`` rule
    matches are yielded with the index of the first such rule (the stage then replaces ``out[-1]`` or adds after
    it). ``where`` names the paths matched, for ``first_match``'s messages."""
    for leaf, k in zip(leaves, p.first_match(field, [t.path for t in leaves], where)):
        out.append(leaf)
        if k is not None:
            yield leaf, k


def _not_array(p: Any, rule: str, leaf: Leaf) -> bool:
    """True (a problem said) when ``rule`` matched a leaf that is not an array."""
    if leaf.is_array:
        return False
    p.problems.append(f"{rule} matches `{leaf.path}`, which is not an array; narrow the pattern.")
    return True


def permutation(axes: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """``axes`` as indices >= 0 when they permute ``rank`` axes (each in ``-rank .. rank - 1``, every axis once);
    None when they do not."""
    if len(axes) != rank or not all(-rank <= a < rank for a in axes) or len({a % rank for a in axes}) != rank:
        return None
    return tuple(a % rank for a in axes)


def _sub(p: Any, rule: str, pat: re.Pattern, name: str, path: str) -> str | None:
    try:
        return pat.sub(name, path)
    except (re.error, IndexError) as e:
        p.problems.append(rf"{rule}: name {name!r} fails on `{path}`: {e}; fix it (groups are \1 or \g<name>).")
        return None


def _wrap(leaf: Leaf, node: blocks.Node, **changes: Any) -> Leaf:
    return dataclasses.replace(leaf, node=node, shape=node.shape, **changes)


def split(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``split``: each matched leaf (paths after unstack) becomes its pieces, named by ``re.sub``."""
    firsts = p.first_match("split", [t.path for t in leaves], "paths after unstack")
    out = []
    for leaf, k in zip(leaves, firsts):
        if k is None:
            out.append(leaf)
            continue
        pattern, spec = p.rules.split[k]
        rule = f"`split` rule {pattern!r}"
        axis = _axis(p, rule, leaf, spec.axis)
        names = [_sub(p, rule, p.rules.compiled("split")[k], name, leaf.path) for name in spec.names]
        if axis is None or None in names:
            continue
        spans: list[tuple[int | None, int | None]] = [(None, None)] * len(names)
        if leaf.shape is not None:
            n = leaf.shape[axis]
            sizes = list(spec.sizes) if spec.sizes is not None else [n // len(names)] * len(names)
            if -1 in sizes:
                sizes[sizes.index(-1)] = n - (sum(sizes) + 1)
            if spec.sizes is None and n % len(names):
                p.problems.append(f"{rule}: axis {axis} of `{leaf.path}` {leaf.shape} has {n} entries, which do not "
                                  f"split into {len(names)} equal pieces; give sizes=[...].")
                continue
            if min(sizes) < 0 or sum(sizes) != n:
                p.problems.append(f"{rule}: sizes {list(spec.sizes or ())} do not sum to {n}, the length of axis "
                                  f"{axis} of `{leaf.path}` {leaf.shape}; give sizes that sum to {n}.")
                continue
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            spans = [(a, a + s) for a, s in zip(starts, sizes)]
        for name, (a, b) in zip(names, spans):
            shape = None if leaf.shape is None else leaf.shape[:axis] + (b - a,) + leaf.shape[axis + 1:]  # type: ignore
            node = blocks.Window(shape, leaf.dtype, leaf.node, axis, a, b, "split", len(names))
            out.append(_wrap(leaf, node, path=name))
    p.check_collisions(out, "split")
    return out


def concat(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``concat``: matched leaves (paths after stack) grouped by their new name, joined in the order of ``parts``."""
    firsts = p.first_match("concat", [t.path for t in leaves], "paths after rename and stack")
    groups: dict[tuple[int, str], dict[str, Leaf]] = {}
    slots: list[Any] = []
    for leaf, k in zip(leaves, firsts):
        if k is None:
            slots.append(leaf)
            continue
        pattern, spec = p.rules.concat[k]
        pat = p.rules.compiled("concat")[k]
        rule = f"`concat` rule {pattern!r}"
        part = pat.search(leaf.path).group("part")
        name = _sub(p, rule, pat, spec.name, leaf.path)
        if name is None:
            continue
        if part not in spec.parts:
            p.problems.append(f"{rule}: `{leaf.path}` is part {part!r}, not one of the parts {list(spec.parts)}; "
                              "list it in parts, or narrow the pattern.")
            continue
        if (k, name) not in groups:
            groups[(k, name)] = {}
            slots.append((k, name))
        if part in groups[(k, name)]:
            p.problems.append(f"{rule}: `{groups[(k, name)][part].path}` and `{leaf.path}` are both part {part!r} "
                              f"of `{name}`; each part once.")
            continue
        groups[(k, name)][part] = leaf
    out = [slot if not isinstance(slot, tuple) else _concat_group(p, slot, groups[slot]) for slot in slots]
    out = [leaf for leaf in out if leaf is not None]
    p.check_collisions(out, "concat")
    return out


def _concat_group(p: Any, key: tuple[int, str], members: dict[str, Leaf]) -> Leaf | None:
    pattern, spec = p.rules.concat[key[0]]
    rule, name = f"`concat` rule {pattern!r}", key[1]
    missing = [part for part in spec.parts if part not in members]
    if missing:
        have = ", ".join(f"`{t.path}`" for t in members.values())
        p.problems.append(f"{rule}: `{name}` lacks part(s) {missing} (it has {have}); every part of "
                          f"{list(spec.parts)} must be there.")
        return None
    parts = [members[part] for part in spec.parts]
    first = parts[0]
    axis = _axis(p, rule, first, spec.axis)
    if axis is None:
        return None
    if any(not t.is_array for t in parts):
        p.problems.append(f"{rule}: a part of `{name}` is not an array; narrow the pattern.")
        return None
    shape = None
    if all(t.shape is not None for t in parts):
        rest = {(t.shape[:axis] + t.shape[axis + 1:], len(t.shape), str(t.dtype)) for t in parts}
        if len(rest) > 1:
            each = "; ".join(f"`{t.path}` {t.shape} {dtype_text(t.dtype)}" for t in parts)
            p.problems.append(f"{rule}: the parts of `{name}` do not join along axis {axis} ({each}); they must "
                              "agree in rank, dtype and every other axis.")
            return None
        shape = first.shape[:axis] + (sum(t.shape[axis] for t in parts),) + first.shape[axis + 1:]
    node = blocks.Concat(shape, first.dtype, tuple(t.node for t in parts), axis)
    return type(first)(name, shape, first.dtype, node, first.source_shape, first.source_dtype, known=first.known)


def reshape(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``reshape``: an axis split ``into`` several, axes merged, or a whole new shape."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "reshape", leaves, "target paths, after concat", out):
        pattern, spec = p.rules.reshape[k]
        rule = f"`reshape` rule ({pattern!r}, {spec})"
        if _not_array(p, rule, leaf):
            continue
        if leaf.shape is None:
            out[-1] = _wrap(leaf, blocks.Reshape(None, leaf.dtype, leaf.node))
            continue
        shape = resolve_shape(leaf.shape, spec)
        if isinstance(shape, str):
            p.problems.append(f"{rule} does not fit `{leaf.path}` of shape {leaf.shape} "
                              f"({math.prod(leaf.shape)} elements): {shape}.")
            continue
        if shape != leaf.shape:
            out[-1] = _wrap(leaf, blocks.Reshape(shape, leaf.dtype, leaf.node))
    return out


def resolve_shape(shape: tuple[int, ...], spec: Any) -> tuple[int, ...] | str:
    """The new shape a ``reshape`` spec (``treetools.rules.ops.Reshape``) gives ``shape``; a string saying why it
    does not fit.

    >>> from treetools.rules.ops import Reshape
    >>> resolve_shape((12, 5), Reshape(axis=0, into=(-1, 4))), resolve_shape((3, 4, 5), Reshape(merge=(1, 2)))
    ((3, 4, 5), (3, 20))
    >>> resolve_shape((12, 5), Reshape(shape=(-1, 4, 0)))
    'a 0 (the size at that position) at axis 2, past the rank 2'
    """
    rank = len(shape)
    if spec.merge is not None:
        a, b = spec.merge
        if not (-rank <= a < rank and -rank <= b < rank) or a % rank >= b % rank:
            return f"merge {list(spec.merge)} is not two axes of 0 .. {rank - 1}, the first before the second"
        a, b = a % rank, b % rank
        return shape[:a] + (math.prod(shape[a:b + 1]),) + shape[b + 1:]
    if spec.into is not None:
        if not -rank <= spec.axis < rank:
            return f"axis {spec.axis} is out of range (rank {rank})"
        a = spec.axis % rank
        into = _sized(shape[a], list(spec.into), f"axis {a}")
        return into if isinstance(into, str) else shape[:a] + into + shape[a + 1:]
    want = list(spec.shape)
    if any(d == 0 and i >= rank for i, d in enumerate(want)):
        return f"a 0 (the size at that position) at axis {want.index(0, rank)}, past the rank {rank}"
    return _sized(math.prod(shape), [shape[i] if d == 0 else d for i, d in enumerate(want)], "the leaf")


def _sized(total: int, sizes: list[int], what: str) -> tuple[int, ...] | str:
    """``sizes`` with its -1 resolved so that they hold ``total`` elements, or why they cannot."""
    known = math.prod(d for d in sizes if d != -1)
    if -1 in sizes:
        if known == 0 or total % known:
            return f"{what} holds {total} elements, which the sizes {sizes} (-1: the rest) do not divide"
        sizes[sizes.index(-1)] = total // known
    elif known != total:
        return f"{what} holds {total} elements, the sizes {sizes} {known}"
    return tuple(sizes)


def permute(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``permute``: the rotary layout along an axis whose length is whole heads."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "permute", leaves, "target paths, after reshape", out):
        pattern, spec = p.rules.permute[k]
        rule = f"`permute` rule {pattern!r}"
        axis = _axis(p, rule, leaf, spec.axis)
        if axis is None:
            continue
        if leaf.shape is not None and leaf.shape[axis] % spec.head_dim:
            p.problems.append(f"{rule}: axis {axis} of `{leaf.path}` {leaf.shape} has {leaf.shape[axis]} entries, "
                              f"not a multiple of head_dim {spec.head_dim}; give the axis that holds the heads "
                              "and the model's head_dim.")
            continue
        out[-1] = _wrap(leaf, blocks.Permute(leaf.shape, leaf.dtype, leaf.node, dataclasses.replace(spec, axis=axis)))
    return out


def transpose(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``transpose``: a leaf's axes permuted (``numpy.transpose``)."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "transpose", leaves, "target paths, after rename and stack", out):
        pattern, axes = p.rules.transpose[k]
        # a path alone: its rank is not known, so the axes are checked against themselves
        rank = len(leaf.shape) if leaf.shape is not None else len(axes) if leaf.is_array else None
        perm = None if rank is None else permutation(axes, rank)
        if perm is None:
            what = ("not an array" if rank is None else "shape not given" if leaf.shape is None else
                    f"shape {leaf.shape}, rank {rank}")
            p.problems.append(f"`transpose` rule ({pattern!r}, {axes}) does not fit `{leaf.path}` ({what}); give a "
                              "permutation of 0 .. rank-1, or narrow the pattern.")
            continue
        if perm != tuple(range(len(perm))):
            shape = None if leaf.shape is None else tuple(leaf.shape[a] for a in perm)
            out[-1] = _wrap(leaf, blocks.Transpose(shape, leaf.dtype, leaf.node, perm))
    return out


def slice_(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``slice``: entries ``start .. stop - 1`` of an axis."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "slice", leaves, "target paths, after transpose", out):
        pattern, spec = p.rules.slice[k]
        rule = f"`slice` rule {pattern!r}"
        axis = _axis(p, rule, leaf, spec.axis)
        if axis is None:
            continue
        shape = None
        if leaf.shape is not None:
            n = leaf.shape[axis]
            if spec.stop > n:
                p.problems.append(f"{rule}: stop {spec.stop} is past the {n} entries of axis {axis} of `{leaf.path}` "
                                  f"{leaf.shape}; give stop <= {n} (`pad` grows an axis).")
                continue
            if (spec.start, spec.stop) == (0, n):
                continue
            shape = leaf.shape[:axis] + (spec.stop - spec.start,) + leaf.shape[axis + 1:]
        out[-1] = _wrap(leaf, blocks.Window(shape, leaf.dtype, leaf.node, axis, spec.start, spec.stop, "slice"))
    return out


def pad(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``pad``: an axis grown at its end, the new entries zeros or drawn from a seeded initializer."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "pad", leaves, "target paths, after transpose and slice", out):
        pattern, spec = p.rules.pad[k]
        rule = f"`pad` rule {pattern!r}"
        axis = _axis(p, rule, leaf, spec.axis)
        if axis is None:
            continue
        if spec.init != "zeros" and leaf.dtype is not None and kind(leaf.dtype) != "floating":
            p.problems.append(f"{rule}: init {spec.init!r} draws floating values, but `{leaf.path}` is "
                              f"{dtype_text(leaf.dtype)}; use init zeros for it (a rule of its own).")
            continue
        shape = None
        if leaf.shape is not None:
            n = leaf.shape[axis]
            if spec.size < n:
                p.problems.append(f"{rule}: size {spec.size} is below the {n} entries of axis {axis} of "
                                  f"`{leaf.path}` {leaf.shape}; give size >= {n} (`slice` shrinks an axis).")
                continue
            if spec.size == n:
                continue
            shape = leaf.shape[:axis] + (spec.size,) + leaf.shape[axis + 1:]
        out[-1] = _wrap(leaf, blocks.Pad(shape, leaf.dtype, leaf.node, dataclasses.replace(spec, axis=axis)))
    return out


def tie(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``tie``: after each matched leaf, one more leaf holding its values (transposed by ``axes``)."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "tie", leaves, "target paths, after pad", out):
        pattern, spec = p.rules.tie[k]
        rule = f"`tie` rule {pattern!r}"
        if _not_array(p, rule, leaf):
            continue
        name = _sub(p, rule, p.rules.compiled("tie")[k], spec.name, leaf.path)
        if name is None:
            continue
        node: blocks.Node = blocks.Tied(leaf.shape, leaf.dtype, leaf.node, leaf.path)
        if spec.axes is not None:
            rank = len(leaf.shape) if leaf.shape is not None else len(spec.axes)
            axes = permutation(spec.axes, rank)
            if axes is None:
                p.problems.append(f"{rule}: axes {list(spec.axes)} are not a permutation of the {rank} axes of "
                                  f"`{leaf.path}` {leaf.shape}; give a permutation of 0 .. {rank - 1}.")
                continue
            shape = None if leaf.shape is None else tuple(leaf.shape[a] for a in axes)
            node = blocks.Transpose(shape, leaf.dtype, node, axes)
        out.append(_wrap(leaf, node, path=name))
    p.check_collisions(out, "tie")
    return out


def scale(p: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``scale``: a floating leaf times a constant (in float64, rounded once to its dtype)."""
    out: list[Leaf] = []
    for leaf, k in _matched(p, "scale", leaves, "target paths, after tie", out):
        pattern, spec = p.rules.scale[k]
        rule = f"`scale` rule ({pattern!r}, {spec})"
        if _not_array(p, rule, leaf):
            continue
        if leaf.dtype is not None and kind(leaf.dtype) != "floating":
            p.problems.append(f"{rule} matches `{leaf.path}` of dtype {dtype_text(leaf.dtype)}, which is not "
                              "floating; scale multiplies floating leaves only: narrow the pattern.")
            continue
        out[-1] = _wrap(leaf, blocks.Scale(leaf.shape, leaf.dtype, leaf.node, spec))
    return out
