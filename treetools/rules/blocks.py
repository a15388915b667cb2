"""How a target leaf of ``Rules`` is made from its sources, as a small expression, read block by block.

A ``TargetLeaf`` (``treetools.rules.plan``) holds one ``Node``: ``Read`` (a
source leaf, or one layer of a stacked one) at the leaves, and over them
``Window`` (a ``split`` piece or a ``slice``), ``Stack``, ``Concat``,
``Reshape``, ``Permute`` (rotary layouts), ``Transpose``, ``Pad``, ``Tied``,
``Scale`` and ``Cast``. ``node.read(box, reading)`` returns the block ``box`` (one
``(start, stop)`` per axis) of the node's value by reading, through
``reading.fetch(piece, box)``, only the blocks of its sources that the block
needs: a window shifts the box, a stack or a concat reads the children the
box covers, a transpose reads the permuted box, a permute reads the span of
the heads the box touches, a reshape the rows of the source that hold the
box's elements, a pad reads the stored part and makes the new part. Pure
numpy over index ranges: the checkpoint layer's ``RuledReader``
(``treetools.checkpoint_io.mapping``) and a restore engine both read through it.

>>> import numpy as np
>>> class Arrays:
...     cache = {}
...     def __init__(self, arrays): self.arrays = arrays
...     def hold(self, nbytes, what): pass
...     def fetch(self, piece, box): return self.arrays[piece.path][tuple(slice(a, b) for a, b in box)]
>>> w = np.arange(12.0).reshape(6, 2)
>>> node = Reshape((3, 2, 2), w.dtype, Read((6, 2), w.dtype, Piece("w")))
>>> np.array_equal(node.read(((1, 3), (0, 2), (1, 2)), Arrays({"w": w})), w.reshape(3, 2, 2)[1:3, :, 1:2])
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from treetools.rules.dtypes import kind
from treetools.rules.ops import Pad as PadSpec
from treetools.rules.ops import Permute as PermuteSpec
from treetools.rules.ops import Scale as ScaleSpec

Shape = tuple[int, ...]
Box = tuple[tuple[int, int], ...]
"""A block: ``(start, stop)`` along each axis."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One source leaf, or one layer of it, that a target leaf is made of.

    ``layer`` is the index into the source's axis 0 (an unstacked layer), or
    None for the whole leaf.

    >>> str(Piece("layers/attn/q", 3)), str(Piece("w"))
    ('layers/attn/q[3]', 'w')
    """

    path: str
    layer: int | None = None
    axis: int = 0
    """The source's layer axis (``unstack`` of ``(pattern, axis)``)."""

    def __str__(self) -> str:
        return self.path if self.layer is None else f"{self.path}[{':, ' * self.axis}{self.layer}]"


class Reading(Protocol):
    """What a node reads through: the source blocks, a cache for the reader's lifetime, the memory budget."""

    cache: dict[Any, Any]

    def fetch(self, piece: Piece, box: Box) -> np.ndarray:
        """The block ``box`` of one source piece (of the layer, for an unstacked one)."""

    def hold(self, nbytes: int, what: str) -> None:
        """Refuse (raise) to hold ``nbytes`` at once when that is over the memory budget."""


def sizes(box: Box) -> Shape:
    return tuple(b - a for a, b in box)


def _put(box: Box, axis: int, span: tuple[int, int]) -> Box:
    return box[:axis] + (span,) + box[axis + 1:]


def _empty(box: Box, dtype: Any) -> np.ndarray:
    return np.empty(sizes(box), dtype)


@dataclasses.dataclass(frozen=True)
class Node:
    """One step of how a target leaf is made; ``shape``/``dtype`` are its value's (None where not known)."""

    shape: Shape | None
    dtype: Any

    @property
    def children(self) -> tuple[Node, ...]:
        child = getattr(self, "child", None)
        return (child,) if child is not None else ()

    def pieces(self) -> Iterator[Piece]:
        """The source pieces read, in order."""
        for c in self.children:
            yield from c.pieces()

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        raise NotImplementedError

    def op(self) -> str | None:
        """What this step does, as ``describe`` shows it (None for a step that says nothing)."""
        return None

    def chunk(self, source_chunk: Any) -> Shape | None:
        """The storage chunk of the value, where the sources' chunk maps onto it (None where it does not)."""
        return None


@dataclasses.dataclass(frozen=True)
class Read(Node):
    piece: Piece = Piece("")

    def pieces(self) -> Iterator[Piece]:
        yield self.piece

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        return np.asarray(reading.fetch(self.piece, box))

    def op(self) -> str | None:
        p = self.piece
        return None if p.layer is None else f"unstack {'axis ' + str(p.axis) + ' ' if p.axis else ''}[{p.layer}]"

    def chunk(self, source_chunk: Any) -> Shape | None:
        chunk = source_chunk(self.piece.path)
        if chunk is None:
            return None
        a = self.piece.axis
        return tuple(chunk[:a]) + tuple(chunk[a + 1:]) if self.piece.layer is not None else tuple(chunk)


@dataclasses.dataclass(frozen=True)
class Window(Node):
    """Entries ``start .. stop - 1`` of the child along ``axis``: a ``split`` piece, or a ``slice``."""

    child: Node = None  # type: ignore[assignment]
    axis: int = 0
    start: int | None = 0
    stop: int | None = None
    what: str = "split"
    count: int = 1
    """For a split piece: how many pieces the leaf is split into."""

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        a, b = box[self.axis]
        return self.child.read(_put(box, self.axis, (a + (self.start or 0), b + (self.start or 0))), reading)

    def op(self) -> str:
        span = "?" if self.start is None or self.stop is None else f"{self.start}:{self.stop}"
        return f"{self.what} axis {self.axis} [{span}]"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


@dataclasses.dataclass(frozen=True)
class Stack(Node):
    """The children stacked along a new axis 0."""

    parts: tuple[Node, ...] = ()

    @property
    def children(self) -> tuple[Node, ...]:
        return self.parts

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        a, b = box[0]
        blocks = [self.parts[i].read(box[1:], reading) for i in range(a, b)]
        return np.stack(blocks) if blocks else _empty(box, self.dtype)

    def op(self) -> str:
        return f"stack {len(self.parts)}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        inner = self.parts[0].chunk(source_chunk) if self.parts else None
        return None if inner is None else (1, *inner)


@dataclasses.dataclass(frozen=True)
class Concat(Node):
    """The children joined along ``axis`` (``numpy.concatenate``)."""

    parts: tuple[Node, ...] = ()
    axis: int = 0

    @property
    def children(self) -> tuple[Node, ...]:
        return self.parts

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        a, b = box[self.axis]
        blocks, offset = [], 0
        for part in self.parts:
            n = part.shape[self.axis]  # type: ignore[index]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                blocks.append(part.read(_put(box, self.axis, (lo - offset, hi - offset)), reading))
            offset += n
        return np.concatenate(blocks, axis=self.axis) if blocks else _empty(box, self.dtype)

    def op(self) -> str:
        return f"concat {len(self.parts)} axis {self.axis}"


def _rect(first: Sequence[int], last: Sequence[int], dims: Sequence[int]) -> list[tuple[int, int]]:
    """The smallest box that is one contiguous run of C order holding ``first`` .. ``last``: the axes before the
    first that differs fixed, that axis from one to the other, the axes after it whole."""
    for k, (f, la) in enumerate(zip(first, last)):
        if f != la:
            return [(x, x + 1) for x in first[:k]] + [(f, la + 1)] + [(0, d) for d in dims[k + 1:]]
    return [(x, x + 1) for x in first]


def _ravel(index: Sequence[int], dims: Sequence[int]) -> int:
    out = 0
    for i, d in zip(index, dims):
        out = out * d + i
    return out


def _unravel(flat: int, dims: Sequence[int]) -> list[int]:
    out = []
    for d in reversed(dims):
        flat, i = divmod(flat, d)
        out.append(i)
    return out[::-1]


def reshape_groups(src: Shape, dst: Shape) -> list[tuple[list[int], list[int]]] | None:
    """The axes of ``src`` and ``dst`` (sizes 1 left out) that hold the same elements: runs whose products agree.

    None when the arrays are empty (no block holds an element).

    >>> reshape_groups((6, 4), (2, 3, 4)), reshape_groups((4, 1, 6), (24,))
    ([([0], [0, 1]), ([1], [2])], [([0, 2], [0])])
    """
    if math.prod(src) == 0:
        return None
    s_axes = [i for i, d in enumerate(src) if d != 1]
    t_axes = [i for i, d in enumerate(dst) if d != 1]
    groups, i, j = [], 0, 0
    while i < len(s_axes):
        gs, gt = [s_axes[i]], [t_axes[j]]
        ps, pt = src[s_axes[i]], dst[t_axes[j]]
        i, j = i + 1, j + 1
        while ps != pt:
            if ps < pt:
                gs.append(s_axes[i])
                ps *= src[s_axes[i]]
                i += 1
            else:
                gt.append(t_axes[j])
                pt *= dst[t_axes[j]]
                j += 1
        groups.append((gs, gt))
    return groups


@dataclasses.dataclass(frozen=True)
class Reshape(Node):
    """The child's elements, in C order, in ``shape`` (axes split or merged)."""

    child: Node = None  # type: ignore[assignment]

    @functools.cached_property
    def _groups(self) -> list[tuple[list[int], list[int]]] | None:
        return reshape_groups(self.child.shape, self.shape)  # type: ignore[arg-type]

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        src, dst = self.child.shape, self.shape
        assert src is not None and dst is not None
        if any(a >= b for a, b in box) or self._groups is None:
            return _empty(box, self.dtype)
        src_box = [(0, 1)] * len(src)
        runs, rect_sizes, inner = [], [], []
        for gs, gt in self._groups:
            tdims, sdims = [dst[k] for k in gt], [src[k] for k in gs]
            rect = _rect([box[k][0] for k in gt], [box[k][1] - 1 for k in gt], tdims)
            lo = _ravel([a for a, _ in rect], tdims)
            hi = _ravel([b - 1 for _, b in rect], tdims) + 1
            srect = _rect(_unravel(lo, sdims), _unravel(hi - 1, sdims), sdims)
            for k, span in zip(gs, srect):
                src_box[k] = span
            slo = _ravel([a for a, _ in srect], sdims)
            runs.append((math.prod(b - a for a, b in srect), lo - slo, hi - lo))
            rect_sizes += [b - a for a, b in rect]
            inner += [(box[k][0] - a, box[k][1] - a) for k, (a, _) in zip(gt, rect)]
        block = self.child.read(tuple(src_box), reading)
        flat = block.reshape([n for n, _, _ in runs])[tuple(slice(o, o + n) for _, o, n in runs)]
        return flat.reshape(rect_sizes)[tuple(slice(a, b) for a, b in inner)].reshape(sizes(box))

    def op(self) -> str:
        return f"reshape {self.shape}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        inner = self.child.chunk(source_chunk)
        src, dst, groups = self.child.shape, self.shape, self._groups
        if inner is None or src is None or dst is None or groups is None or len(inner) != len(src):
            return None
        out = [1] * len(dst)
        for gs, gt in groups:  # a chunk that is one aligned run of a group's elements is such a run after it too
            run = _run([inner[k] for k in gs], [src[k] for k in gs])
            granule = None if run is None else _granule([dst[k] for k in gt], run)
            if granule is None:
                return None
            for k, g in zip(gt, granule):
                out[k] = g
        return tuple(out)


def _run(granule: Sequence[int], dims: Sequence[int]) -> int | None:
    """The length of the C-contiguous run ``granule`` is in ``dims`` (1 on the leading axes, then a divisor of that
    axis (any size on the first), then whole), or None where its boxes are not aligned runs of one length.

    >>> _run((1, 2, 5), (3, 4, 5)), _run((2, 1), (4, 5)), _run((1, 3), (2, 4))
    (10, None, None)
    """
    g = [min(max(1, int(c)), d) for c, d in zip(granule, dims)]
    k = next((i for i, c in enumerate(g) if c != 1), len(g) - 1)
    if not g or any(c != d for c, d in zip(g[k + 1:], dims[k + 1:])) or (k and dims[k] % g[k]):
        return None if g else 1
    return g[k] * math.prod(dims[k + 1:])


def _granule(dims: Sequence[int], run: int) -> tuple[int, ...] | None:
    """The box of ``dims`` that is an aligned C-contiguous run of ``run`` elements (``_run``'s inverse), or None.

    >>> _granule((3, 4, 5), 10), _granule((4, 5), 4)
    ((1, 2, 5), None)
    """
    for k in range(len(dims) - 1, -1, -1):
        after = math.prod(dims[k + 1:])
        if run % after:
            return None
        if run // after <= dims[k]:
            g = run // after
            return (1,) * k + (g,) + tuple(dims[k + 1:]) if not k or dims[k] % g == 0 else None
    return None


def permute_sources(spec: PermuteSpec, positions: np.ndarray) -> np.ndarray:
    """For target positions along the permuted axis, the source positions they come from.

    ``to="interleaved"`` (from ``half``): entry ``2i + a`` of a head's rotated part comes from ``a * R/2 + i``;
    ``to="half"``: the inverse. Entries past ``rotary_dim`` stay where they are.

    >>> permute_sources(PermuteSpec(0, 4, "interleaved"), np.arange(8)).tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
    >>> permute_sources(PermuteSpec(0, 4, "half"), np.arange(8)).tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
    >>> permute_sources(PermuteSpec(0, 6, "half"), np.arange(6)).tolist()
    [0, 2, 4, 1, 3, 5]
    """
    d, r = spec.head_dim, spec.rotated
    half = r // 2
    head, o = np.divmod(positions, d)
    if spec.to == "interleaved":
        moved = (o % 2) * half + o // 2
    else:
        moved = 2 * (o % half) + o // half
    return head * d + np.where(o < r, moved, o)


@dataclasses.dataclass(frozen=True)
class Permute(Node):
    """The child with each head's rotary entries along ``spec.axis`` reordered (``permute_sources``)."""

    child: Node = None  # type: ignore[assignment]
    spec: PermuteSpec = None  # type: ignore[assignment]

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        axis = self.spec.axis
        a, b = box[axis]
        if a >= b:
            return _empty(box, self.dtype)
        idx = permute_sources(self.spec, np.arange(a, b))
        lo, hi = int(idx.min()), int(idx.max()) + 1  # within the heads the block touches
        block = self.child.read(_put(box, axis, (lo, hi)), reading)
        return np.take(block, idx - lo, axis=axis)

    def op(self) -> str:
        s = self.spec
        rotary = f" rotary_dim {s.rotary_dim}" if s.rotary_dim else ""
        return f"permute to {s.to} axis {s.axis} head_dim {s.head_dim}{rotary}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


@dataclasses.dataclass(frozen=True)
class Transpose(Node):
    """``numpy.transpose(child, axes)``: target axis ``j`` is the child's axis ``axes[j]``."""

    child: Node = None  # type: ignore[assignment]
    axes: tuple[int, ...] = ()

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        pre: list[tuple[int, int]] = [(0, 0)] * len(box)
        for j, a in enumerate(self.axes):
            pre[a] = box[j]
        return self.child.read(tuple(pre), reading).transpose(self.axes)

    def op(self) -> str:
        return f"transpose {self.axes}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        chunk = self.child.chunk(source_chunk)
        return None if chunk is None or len(chunk) != len(self.axes) else tuple(chunk[a] for a in self.axes)


@dataclasses.dataclass(frozen=True)
class Pad(Node):
    """The child grown along ``spec.axis`` to ``spec.size`` entries; the new ones from ``spec.init``."""

    child: Node = None  # type: ignore[assignment]
    spec: PadSpec = None  # type: ignore[assignment]

    def new_values(self, reading: Reading) -> np.ndarray:
        """The whole new region, drawn once per reader: ``default_rng(seed).normal(mean, stddev, region)`` or
        ``.uniform(low, high, region)``, in the leaf's dtype."""
        s, shape = self.spec, list(self.child.shape)  # type: ignore[arg-type]
        shape[s.axis] = s.size - shape[s.axis]
        key = ("pad", id(self))
        if key not in reading.cache:
            reading.hold(math.prod(shape) * 8, f"the {shape} new entries `pad` draws ({s.init})")
            rng = np.random.default_rng(s.seed)
            if s.init == "normal":
                drawn = rng.normal(s.mean, float(s.stddev or 0.0), size=shape)
            else:
                drawn = rng.uniform(float(s.low or 0.0), float(s.high or 0.0), size=shape)
            reading.cache[key] = drawn.astype(self.dtype)
        return reading.cache[key]

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        axis, n = self.spec.axis, self.child.shape[self.spec.axis]  # type: ignore[index]
        a, b = box[axis]
        blocks = []
        if a < min(b, n):
            blocks.append(self.child.read(_put(box, axis, (a, min(b, n))), reading))
        if max(a, n) < b:
            new = _put(box, axis, (max(a, n) - n, b - n))
            if self.spec.init == "zeros":
                blocks.append(np.zeros(sizes(new), self.dtype))
            else:
                blocks.append(self.new_values(reading)[tuple(slice(x, y) for x, y in new)])
        return np.concatenate(blocks, axis=axis) if blocks else _empty(box, self.dtype)

    def op(self) -> str:
        s = self.spec
        if s.init == "normal":
            how = f"normal{f' mean {s.mean:g}' if s.mean else ''} stddev {s.stddev:g} seed {s.seed}"
        else:
            how = "zeros" if s.init == "zeros" else f"uniform {s.low:g}..{s.high:g} seed {s.seed}"
        return f"pad axis {s.axis} to {s.size} ({how})"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


@dataclasses.dataclass(frozen=True)
class Tied(Node):
    """Another target leaf's value (``tie``): ``of`` names it."""

    child: Node = None  # type: ignore[assignment]
    of: str = ""

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        return self.child.read(box, reading)

    def op(self) -> str:
        return f"tie of {self.of}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


def round_once(values: np.ndarray, dtype: Any) -> np.ndarray:
    """float64 ``values`` rounded once to the floating ``dtype`` (to nearest, ties to even).

    numpy rounds float64 to float32 and float16 directly; ml_dtypes converts a float64 to ``bfloat16`` and the
    ``float8_*`` through float32, which rounds twice. For those, the float32 step rounds to odd (toward zero,
    then the last bit set when inexact), which a second rounding to a format at least 2 bits narrower turns into
    the one correct rounding.

    >>> import ml_dtypes
    >>> x = np.array([1 + 2**-8 + 2**-40])  # just above the bfloat16 midpoint between 1 and 1 + 2**-7
    >>> float(x.astype(ml_dtypes.bfloat16)[0]), float(round_once(x, ml_dtypes.bfloat16)[0])
    (1.0, 1.0078125)
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or kind(dtype) != "floating":  # numpy's floats, and any other kind: astype as a cast does
        return values.astype(dtype)
    f32 = values.astype(np.float32)
    wide = f32.astype(np.float64)
    inexact = np.isfinite(values) & (wide != values)
    away = inexact & (np.abs(wide) > np.abs(values))
    f32 = np.where(away, np.nextafter(f32, np.float32(0)), f32)
    bits = f32.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Scale(Node):
    """The child times ``spec``'s factor (``treetools.rules.ops.Scale``), in float64, rounded once to ``dtype``
    (a ``Cast`` over it reads the float64 values, so a scale then a cast round once too)."""

    child: Node = None  # type: ignore[assignment]
    spec: ScaleSpec = None  # type: ignore[assignment]

    def exact(self, box: Box, reading: Reading) -> np.ndarray:
        """The scaled block in float64, before any rounding (one float64 copy of the block, scaled in place)."""
        block = np.array(self.child.read(box, reading), dtype=np.float64)
        s = self.spec
        if s.root is None:
            block *= np.float64(s.number)
        elif s.inverse:
            block /= np.sqrt(np.float64(s.root))
        else:
            block *= np.sqrt(np.float64(s.root))
        return block

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        return round_once(self.exact(box, reading), self.dtype)

    def op(self) -> str:
        return f"scale {self.spec}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


@dataclasses.dataclass(frozen=True)
class Cast(Node):
    """``astype(dtype)``; a complex value cast to a real dtype keeps its real part."""

    child: Node = None  # type: ignore[assignment]

    def read(self, box: Box, reading: Reading) -> np.ndarray:
        if isinstance(self.child, Scale):  # scaled and cast: rounded once
            return round_once(self.child.exact(box, reading), self.dtype)
        block = self.child.read(box, reading)
        if block.dtype.kind == "c" and np.dtype(self.dtype).kind != "c":
            block = block.real
        return block.astype(self.dtype)

    def op(self) -> str:
        return f"cast {np.dtype(self.dtype).name}"

    def chunk(self, source_chunk: Any) -> Shape | None:
        return self.child.chunk(source_chunk)


def ops(node: Node) -> list[str]:
    """What the steps of ``node`` do, innermost first (``describe``'s ops): a stack or a concat lists the steps of
    its first part, then itself; an unstacked layer inside a stack is the stack's."""
    out = []
    if isinstance(node, (Stack, Concat)) and node.parts:
        out = [o for o in ops(node.parts[0]) if not (isinstance(node, Stack) and o.startswith("unstack"))]
    elif node.children:
        out = ops(node.children[0])
    here = node.op()
    return out + [here] if here else out


def source_text(node: Node) -> str:
    """The sources of ``node`` as ``describe`` shows them: ``path``, ``path[3]`` (a layer), ``path[0..11]`` (a
    stack of one leaf's layers), ``a .. b (N)`` (another stack), ``a + b + c`` (a concat)."""
    if isinstance(node, Read):
        return str(node.piece)
    if isinstance(node, Stack):
        reads = [p for p in node.parts if isinstance(p, Read)]
        if len(reads) == len(node.parts) and len({(r.piece.path, r.piece.axis) for r in reads}) == 1:
            layers = [r.piece.layer for r in reads]
            start = layers[0] or 0
            if layers == list(range(start, start + len(layers))):
                return f"{reads[0].piece.path}[{':, ' * reads[0].piece.axis}{start}..{layers[-1]}]"
        return f"{source_text(node.parts[0])} .. {source_text(node.parts[-1])} ({len(node.parts)})"
    if isinstance(node, Concat):
        return " + ".join(source_text(p) for p in node.parts)
    return source_text(node.children[0])


def structure(node: Node) -> Node:
    """The step under the ones that only change values in place (cast, scale, transpose, permute, pad, reshape,
    window, tie): a ``Read``, a ``Stack`` or a ``Concat``."""
    while not isinstance(node, (Read, Stack, Concat)):
        node = node.children[0]
    return node
