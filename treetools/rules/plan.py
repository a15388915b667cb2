"""Plans: what every target leaf of ``Rules`` is and how it is made, from metadata alone.

``plan_rules(rules, leaves)`` (``Rules.plan``) runs the stages in order,
each over the paths of its own stage (``treetools.rules`` tells the order)::

    keep / drop  ->  unstack  ->  split  ->  rename  ->  stack  ->  concat  ->  reshape  ->  permute
                 ->  transpose  ->  slice  ->  pad  ->  tie  ->  scale  ->  cast

and returns a ``RulesPlan`` of ``TargetLeaf``\\ s, or raises one
``RulesError`` with every problem of the first stage that has any. Nothing
here reads array data: ``treetools.checkpoint_io.mapping.RuledReader`` reads a target
leaf's blocks from its source's.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Collection, Iterable, Iterator, Mapping, Sequence

import numpy as np

from treetools.rules import stages
from treetools.rules.blocks import Cast, Node, Piece, Read, Scale, Stack, Transpose, ops, source_text, structure
from treetools.rules.dtypes import dtype_text, kind, resolve_dtype, source_dtype
from treetools.shared.errors import RulesError
from treetools.shared.patterns import nearby
from treetools.shared.render import fit_table

Shape = tuple[int, ...]


# ---------------------------------------------------------------------------------------------- plan data


@dataclasses.dataclass(frozen=True)
class TargetLeaf:
    """One leaf the rules produce, and how to make it.

    ``node`` is how it is made from its sources (``treetools.rules.blocks``:
    source leaves or layers of them, then windows, a stack, a concat, a
    reshape, a permute, a transpose, a pad, a tie, a scale, a cast), read block by block.
    ``shape``/``dtype`` are the result's (None for a non-array value, passed
    through as it is); ``source_shape``/``source_dtype`` are those of the
    source leaf of ``pieces[0]`` as stored. ``known`` is False for an array
    named by its path alone (``Rules.describe(paths)``): its shapes are None,
    as is a dtype not given; it is planned, never read.
    """

    path: str
    shape: Shape | None
    dtype: Any
    node: Node
    source_shape: Shape | None
    source_dtype: Any
    known: bool = True

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The source leaves, or layers of them, read: one, or the stacked (joined) ones in order."""
        return tuple(self.node.pieces())

    @property
    def stacked(self) -> bool:
        """Made by ``stack`` (of layers, below any per-leaf step)."""
        return isinstance(structure(self.node), Stack)

    @property
    def axes(self) -> tuple[int, ...] | None:
        """The axes of the last transpose (``numpy.transpose``'s), or None when the leaf is not transposed last
        (a scale and a cast after it, which change values in place, are looked through)."""
        node = self.node
        while isinstance(node, (Cast, Scale)):
            node = node.children[0]
        return node.axes if isinstance(node, Transpose) else None

    @property
    def cast(self) -> np.dtype | None:
        """The dtype a ``cast``/``dtype`` rule casts to (None for none)."""
        return self.node.dtype if isinstance(self.node, Cast) else None

    @property
    def source(self) -> str:
        """The one source path (for a stack or a concat, that of the first piece)."""
        return self.pieces[0].path

    @property
    def layer(self) -> int | None:
        """The unstacked layer of the one source (None for a whole leaf, a stack or a concat)."""
        node = structure(self.node)
        return node.piece.layer if isinstance(node, Read) else None

    @property
    def is_array(self) -> bool:
        """An array (of a known shape, or named by its path alone), not a value passed through."""
        return self.shape is not None or not self.known

    @property
    def identity(self) -> bool:
        """True when the leaf is a source leaf as stored (at most renamed)."""
        return isinstance(self.node, Read) and self.node.piece.layer is None

    def row(self) -> RuleRow:
        """This leaf as a ``describe`` row."""
        return RuleRow(source_text(self.node), self.path, self.source_shape, self.shape,
                       dtype_text(self.source_dtype), dtype_text(self.dtype), tuple(ops(self.node)))


@dataclasses.dataclass(frozen=True)
class RuleRow:
    """One line of ``describe``: a source (``path``, ``path[3]`` for a layer, ``a .. b (N)`` for a stack) and its
    target.

    ``target`` is None for a dropped leaf; ``ops`` names what happens
    (``unstack [3]``, ``rename``, ``stack 12``, ``transpose (1, 0)``, ``cast bfloat16``).
    """

    source: str
    target: str | None
    source_shape: Shape | None
    shape: Shape | None
    source_dtype: str | None
    dtype: str | None
    ops: tuple[str, ...] = ()


def format_rows(rows: Sequence[RuleRow]) -> str:
    """``describe``'s rows as plain text: ``source -> target  shape  dtype  rules``, a change shown as ``a -> b``,
    and what the rules do to the leaf (``rules``: a permute or a square transpose changes no shape).

    Names are printed as they are; a terminal renderer escapes control characters.

    >>> from treetools.rules import Rules
    >>> print(format_rows(Rules(dtype="bfloat16").describe([("w", (2,), "float32")])))
    source -> target  shape  dtype               rules
    w      -> w       (2,)   float32 -> bfloat16  cast bfloat16
    """

    def change(a: Any, b: Any) -> str:
        a, b = ("?" if a is None and b is not None else "" if a is None else str(a)), ("" if b is None else str(b))
        return a if a == b or not b else f"{a} -> {b}"

    table = [("source", "-> target", "shape", "dtype", "rules")]
    for r in rows:
        target = "-> " + r.target if r.target is not None else "(dropped)"
        shape = "" if r.target is None else change(r.source_shape and tuple(r.source_shape), r.shape)
        dtype = "" if r.target is None else change(r.source_dtype, r.dtype)
        table.append((r.source, target, shape, dtype, "" if r.target is None else ", ".join(r.ops)))
    return fit_table(table[0], table[1:], style="plain", fit=False).text


@dataclasses.dataclass(frozen=True)
class RulesPlan:
    """The result of ``Rules.plan``: the target leaves, in order, and the dropped source paths.

    Iterating gives the ``TargetLeaf``\\ s; ``plan[path]`` looks one up by target path.
    """

    leaves: tuple[TargetLeaf, ...]
    dropped: tuple[str, ...] = ()
    unmatched: tuple[tuple[tuple[str, str], str], ...] = ()
    """``((field, pattern), message)`` of every pattern that matched nothing (with ``allow_unmatched``, which let
    it)."""

    def __iter__(self) -> Iterator[TargetLeaf]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, path: str) -> TargetLeaf:
        return self._by_path[path]

    def __contains__(self, path: object) -> bool:
        return path in self._by_path

    @functools.cached_property
    def _by_path(self) -> dict[str, TargetLeaf]:
        return {t.path: t for t in self.leaves}

    @property
    def sources(self) -> set[str]:
        """Every source path some target leaf reads."""
        return {p.path for t in self.leaves for p in t.pieces}

    def rows(self) -> list[RuleRow]:
        """One ``RuleRow`` per target leaf, then one per dropped source leaf."""
        dropped = [RuleRow(p, None, None, None, None, None, ("drop",)) for p in self.dropped]
        return [t.row() for t in self.leaves] + dropped

    def __str__(self) -> str:
        return format_rows(self.rows())


# ---------------------------------------------------------------------------------------------- planner


def plan_rules(
    rules: Any,
    leaves: Mapping[str, Any] | Iterable[Any],
    *,
    num_layers: int | None = None,
    targets: Collection[str] | None = None,
) -> RulesPlan:
    """``rules.plan(leaves, ...)``: see ``Rules.plan`` (``treetools.rules.spec``) for the arguments.

    ``rules`` is a ``Rules``; this module reads its fields and compiled
    patterns and does not import the spec (the spec calls this).

    >>> from treetools.rules import Rules
    >>> [t.path for t in plan_rules(Rules(unstack=["layers"]), [("layers/w", (2, 3), "float32")])]
    ['layers/0/w', 'layers/1/w']
    """
    return _Planner(rules, num_layers, targets).run(_as_leaves(leaves))


_UNKNOWN = object()
"""A shape not given: the leaf is an array (its shape and dtype unknown) named by its path alone."""


def _as_leaves(leaves: Any) -> list[tuple[str, Shape | None, Any, bool]]:
    """``(path, shape, dtype, known)`` of every source leaf: ``known`` is False for a path given alone."""
    if isinstance(leaves, Mapping):
        given = []
        for path, leaf in leaves.items():
            array = hasattr(leaf, "shape") and hasattr(leaf, "dtype")
            given.append((path, leaf.shape if array else None, leaf.dtype if array else None))
    else:
        given = [(t, _UNKNOWN, None) if isinstance(t, str) else (*t, *(_UNKNOWN, None)[len(t) - 1:]) for t in leaves]
    out, seen = [], set()
    for path, shape, dtype in given:
        if not isinstance(path, str):
            raise TypeError(f"leaf paths must be path strings such as 'params/w', got {path!r}.")
        if path in seen:
            raise ValueError(f"two source leaves share the path {path!r}.")
        seen.add(path)
        known = shape is not _UNKNOWN
        shape = None if shape is None or not known else tuple(int(d) for d in shape)
        out.append((path, shape, source_dtype(dtype), known))
    return out


def _sep(path: str) -> str:
    """The component separator: ``/`` for a tree path, ``.`` for a flat name without ``/``."""
    return "/" if "/" in path or "." not in path else "."


def _component_end(path: str, end: int, sep: str) -> int:
    """Where the component holding the match's last character ends; -1 for an empty match at 0.

    A separator ending the match belongs to the component before it.
    """
    if end == 0:
        return -1
    if path[end - 1] == sep:
        return end - 1
    j = path.find(sep, end)
    return len(path) if j < 0 else j


def insert_index(path: str, match: re.Match, index: int) -> str:
    """``path`` with ``index`` as a new component right after the one in which ``match`` ends.

    >>> insert_index("params/layers/attn/q", re.search("lay", "params/layers/attn/q"), 3)
    'params/layers/3/attn/q'
    """
    sep = _sep(path)
    c = _component_end(path, match.end(), sep)
    return f"{index}{sep}{path}" if c < 0 else f"{path[:c]}{sep}{index}{path[c:]}"


def take_index(path: str, match: re.Match) -> tuple[str, str] | None:
    """``(path without the component after the match, that component)``; None when none follows.

    >>> take_index("params/layers/3/attn/q", re.search("layers", "params/layers/3/attn/q"))
    ('params/layers/attn/q', '3')
    """
    sep = _sep(path)
    c = _component_end(path, match.end(), sep)
    start = c + 1
    if start >= len(path):
        return None
    j = path.find(sep, start)
    stop = len(path) if j < 0 else j
    rest = path[:c] + path[stop:] if c >= 0 else path[stop + 1 :]
    return rest, path[start:stop]


class _Planner:
    def __init__(self, rules: Any, num_layers: int | None, targets: Collection[str] | None):
        self.rules = rules
        self.num_layers = num_layers
        self.targets = None if targets is None else set(targets)
        self.problems: list[str] = []
        self.unmatched: dict[tuple[str, str], str] = {}  # recorded even when allow_unmatched lets them pass

    def check(self) -> None:
        if self.problems:
            raise RulesError(self.problems)

    def first_match(self, field: str, paths: Sequence[str], where: str) -> list[int | None]:
        """For each path the index of the first ``field`` pattern that matches it; unmatched patterns are problems."""
        patterns = self.rules.compiled(field)
        matched = [False] * len(patterns)
        firsts: list[int | None] = []
        for path in paths:
            first = None
            for k, pat in enumerate(patterns):
                if (first is None or not matched[k]) and pat.search(path):
                    matched[k] = True
                    first = k if first is None else first
            firsts.append(first)
        for pat, ok in zip(patterns, matched):
            if not ok:
                message = (f"`{field}` pattern {pat.pattern!r} matches no leaf ({where}); nearby paths: "
                           f"{nearby(pat.pattern, list(paths))}. Fix the pattern, drop it, or pass "
                           "allow_unmatched=True.")
                self.unmatched[(field, pat.pattern)] = message
                if not self.rules.allow_unmatched:
                    self.problems.append(message)
        return firsts

    def run(self, leaves: list[tuple[str, Shape | None, Any, bool]]) -> RulesPlan:
        nodes = [TargetLeaf(p, s, d, Read(s, d, Piece(p)), s, d, known=known) for p, s, d, known in leaves]
        nodes, dropped = self.keep_drop(nodes)
        self.check()
        nodes = self.unstack(nodes)
        self.check()
        nodes = stages.split(self, nodes)
        self.check()
        nodes = self.rename(nodes)
        self.check()
        nodes = self.stack(nodes)
        self.check()
        nodes = stages.concat(self, nodes)
        self.check()
        for stage in (stages.reshape, stages.permute, stages.transpose, stages.slice_, stages.pad, stages.tie,
                      stages.scale):
            nodes = stage(self, nodes)
            self.check()
        nodes = self.cast(nodes)
        self.check()
        return RulesPlan(tuple(nodes), tuple(dropped), tuple(self.unmatched.items()))

    def keep_drop(self, nodes: list[TargetLeaf]) -> tuple[list[TargetLeaf], list[str]]:
        paths = [n.path for n in nodes]
        keep = self.first_match("keep", paths, "checkpoint paths") if self.rules.keep else [0] * len(paths)
        drop = self.first_match("drop", paths, "checkpoint paths")
        kept = [n for n, k, d in zip(nodes, keep, drop) if k is not None and d is None]
        return kept, [n.path for n, k, d in zip(nodes, keep, drop) if not (k is not None and d is None)]

    def unstack(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("unstack", [n.path for n in nodes], "checkpoint paths after keep/drop")
        out = []
        for node, k in zip(nodes, firsts):
            if k is None:
                out.append(node)
                continue
            pat = self.rules.compiled("unstack")[k]
            entry = self.rules.unstack[k]
            axis = entry[1] if isinstance(entry, tuple) else 0
            shape = node.shape
            fix = "narrow the pattern so that it matches only stacked (scanned) leaves"
            where = "leading axis" if axis == 0 else f"axis {axis}"
            if not node.known:  # a path alone: the layer count is num_layers, or unknown
                if self.num_layers is None:
                    self.problems.append(
                        f"`unstack` pattern {pat.pattern!r} matches `{node.path}`, whose shape is not given; pass "
                        "its shape (a (path, shape, dtype) triple) or num_layers=."
                    )
                    continue
            elif shape is None or len(shape) <= axis or shape[axis] == 0:
                missing = "leading layer axis" if axis == 0 else f"layer axis {axis}"
                what = "is not an array" if shape is None else f"has shape {shape}, no {missing}"
                self.problems.append(f"`unstack` pattern {pat.pattern!r} matches `{node.path}`, which {what}; {fix}.")
                continue
            elif self.num_layers is not None and shape[axis] != self.num_layers:
                self.problems.append(
                    f"`unstack` pattern {pat.pattern!r}: `{node.path}` has shape {shape}, whose {where} is "
                    f"not the {self.num_layers} layers expected; {fix}, or fix num_layers."
                )
                continue
            match = pat.search(node.path)
            if shape is not None:
                self.check_target_layers(node, match, shape[axis])
            inner = None if shape is None else shape[:axis] + shape[axis + 1:]
            layers = self.num_layers if shape is None else shape[axis]
            assert layers is not None  # no shape: the `not node.known` branch above went on only with num_layers
            for i in range(layers):
                out.append(dataclasses.replace(
                    node, path=insert_index(node.path, match, i),
                    node=Read(inner, node.dtype, Piece(node.path, i, axis)), shape=inner,
                ))
        return out

    def check_target_layers(self, node: TargetLeaf, match: re.Match, layers: int) -> None:
        """With ``targets``: the layers of an unstacked leaf that the target names must be 0 .. L-1."""
        if self.targets is None:
            return
        named = 0
        try:
            while named <= len(self.targets) and self.renamed(insert_index(node.path, match, named)) in self.targets:
                named += 1
        except (re.error, IndexError):
            return  # a bad replacement: the rename stage names it
        if named and named != layers:
            first, last = (self.renamed(insert_index(node.path, match, i)) for i in (0, named - 1))
            self.problems.append(
                f"`unstack`: `{node.path}` has shape {node.shape}, {layers} layers, but the target has {named} "
                f"(`{first}` .. `{last}`); restore a checkpoint with as many layers or fix the target's layer count."
            )

    def renamed(self, path: str) -> str:
        for pat, (_, repl) in zip(self.rules.compiled("rename"), self.rules.rename):
            if pat.search(path):
                return pat.sub(repl, path)
        return path

    def rename(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        where = "paths after keep/drop and unstack" if self.rules.unstack else "checkpoint paths after keep/drop"
        firsts = self.first_match("rename", [n.path for n in nodes], where)
        failed: set[int] = set()  # a bad replacement is said once, on the first path it fails on
        out = []
        for node, k in zip(nodes, firsts):
            out.append(node)
            if k is None or k in failed:
                continue
            pattern, repl = self.rules.rename[k]
            try:
                out[-1] = dataclasses.replace(node, path=self.rules.compiled("rename")[k].sub(repl, node.path))
            except (re.error, IndexError) as e:
                failed.add(k)
                self.problems.append(
                    f"`rename` rule ({pattern!r}, {repl!r}) fails on `{node.path}`: {e}; fix the replacement "
                    r"(groups are \1 or \g<name>)."
                )
        self.check_collisions(out, "rename")
        return out

    def check_collisions(self, nodes: Sequence[TargetLeaf], stage: str) -> None:
        by_path: dict[str, list[TargetLeaf]] = {}
        for node in nodes:
            by_path.setdefault(node.path, []).append(node)
        for path, group in by_path.items():
            if len(group) > 1:
                names = [f"`{source_text(n.node)}`" for n in group]
                both = "both" if len(names) == 2 else "all"
                self.problems.append(
                    f"{', '.join(names[:-1])} and {names[-1]} {both} become `{path}` after {stage}; fix the "
                    f"`{stage}` rules so that each leaf gets its own path, or drop all but one of them."
                )

    def stack(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("stack", [n.path for n in nodes], "paths after rename")
        groups: dict[str, list[tuple[int, TargetLeaf]]] = {}
        slots: list[TargetLeaf | str] = []  # leaves no stack takes, and each stack's path where its first layer was
        for node, k in zip(nodes, firsts):
            if k is None:
                slots.append(node)
                continue
            pat = self.rules.compiled("stack")[k]
            taken = take_index(node.path, pat.search(node.path))
            if taken is None or not (taken[1].isascii() and taken[1].isdecimal()) or not taken[0]:
                after = "nothing" if taken is None else f"`{taken[1]}`"
                self.problems.append(
                    f"`stack` pattern {pat.pattern!r} matches `{node.path}`, but {after} follows the match "
                    "where a layer index belongs; end the pattern just before the layer index (e.g. 'layers/')."
                )
                continue
            if not node.is_array:
                self.problems.append(f"`stack` pattern {pat.pattern!r} matches `{node.path}`, which is not an array.")
                continue
            if taken[0] not in groups:
                groups[taken[0]] = []
                slots.append(taken[0])
            groups[taken[0]].append((int(taken[1]), node))
        out = []
        for slot in slots:
            out.append(self.stack_group(slot, groups[slot]) if isinstance(slot, str) else slot)
        self.check_collisions(out, "stack")
        return out

    def stack_group(self, path: str, members: list[tuple[int, TargetLeaf]]) -> TargetLeaf:
        members.sort(key=lambda m: m[0])
        indices = [i for i, _ in members]
        first = members[0][1]
        names = ", ".join(f"`{n.path}`" for _, n in members[:3]) + (" ..." if len(members) > 3 else "")
        if indices != list(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - set(indices))
            twice = sorted({i for i in indices if indices.count(i) > 1})
            what = "; ".join([f"missing {missing}"] * bool(missing) + [f"given twice {twice}"] * bool(twice))
            self.problems.append(
                f"`stack` into `{path}`: layers {indices} from {names} are not 0 .. {len(indices) - 1} ({what}); "
                "every layer from 0 up must be present once."
            )
        like = (first.shape, str(first.dtype), first.known)
        odd = [n for _, n in members if (n.shape, str(n.dtype), n.known) != like]
        if odd:
            each = "; ".join(f"`{n.path}` {n.shape} {dtype_text(n.dtype)}" for n in [first, *odd])
            self.problems.append(
                f"`stack` into `{path}`: the layers differ in shape or dtype ({each}); only like layers stack."
            )
        if self.num_layers is not None and len(members) != self.num_layers:
            self.problems.append(
                f"`stack` into `{path}`: {len(members)} layers ({names}), not the {self.num_layers} expected."
            )
        shape = None if first.shape is None else (len(members), *first.shape)
        node = Stack(shape, first.dtype, tuple(n.node for _, n in members))
        return TargetLeaf(path, shape, first.dtype, node, first.source_shape, first.source_dtype, known=first.known)

    def cast(self, nodes: list[TargetLeaf]) -> list[TargetLeaf]:
        firsts = self.first_match("cast", [n.path for n in nodes], "target paths, after rename and stack")
        # The kinds each cast rule applies to: a kind change is only for a rule written for that kind.
        kinds_of: dict[int, dict[str | None, str]] = {}
        for node, k in zip(nodes, firsts):
            if k is not None and node.is_array and node.dtype is not None:
                kinds_of.setdefault(k, {}).setdefault(_node_kind(node), node.path)
        out = []
        for node, k in zip(nodes, firsts):
            target = None if not node.is_array else self.cast_to(node, k, kinds_of.get(k, {}) if k is not None else {})
            out.append(node if target is None or target == node.dtype else
                       dataclasses.replace(node, dtype=target, node=Cast(node.shape, target, node.node)))
        return out

    def cast_to(self, node: TargetLeaf, k: int | None, kinds: dict[str | None, str]) -> np.dtype | None:
        """The dtype cast rule ``k`` (or ``dtype=``, for None) gives an array leaf; None for none.

        An array whose dtype is not given (``describe(paths)``) shows the cast it would get: ``dtype=``'s
        (which casts it only if it is floating) or its rule's.
        """
        node_kind = _node_kind(node)
        if k is None:
            wanted = self.rules.dtype and (node_kind == "floating" or node.dtype is None)
            return resolve_dtype(self.rules.dtype) if wanted else None
        pattern, target = self.rules.cast[k][0], resolve_dtype(self.rules.cast[k][1])
        if node.dtype is None:
            return target
        if node_kind is None:
            self.problems.append(
                f"`cast` rule {pattern!r} -> {target.name} matches `{node.path}` of dtype "
                f"{dtype_text(node.dtype)}, which does not cast; narrow the pattern."
            )
            return None
        others = [(kd, p) for kd, p in kinds.items() if kd != node_kind]
        if kind(target) != node_kind and others:
            self.problems.append(
                f"`cast` rule {pattern!r} -> {target.name} would turn {node_kind} `{node.path}` "
                f"({dtype_text(node.dtype)}) into {kind(target)}, but the rule also applies to {others[0][0]} "
                f"`{others[0][1]}`; a kind change needs a rule for leaves of that kind only: narrow the pattern or "
                "put a rule for this leaf first (`dtype=` casts floating leaves only)."
            )
            return None
        return target


def _node_kind(node: TargetLeaf) -> str | None:
    return kind(node.dtype) if isinstance(node.dtype, np.dtype) else None


