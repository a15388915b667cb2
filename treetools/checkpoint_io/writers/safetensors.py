"""Safetensors output: one ``.safetensors`` file, or a Hugging Face folder of shards and its index, streamed.

A file is written front to back: the 8-byte header length, the JSON header
(every size is known from metadata before any data is read), then each
tensor's bytes in C order, one block at a time. Tensors are laid out by
descending item size, so every tensor starts aligned to its item size (the
header is padded with spaces to a multiple of 8, as the ``safetensors``
library pads it) and the data has no holes, which its reader requires.

A folder is what ``transformers``' ``save_pretrained`` writes
(``huggingface_hub.split_state_dict_into_shards_factory``): tensors go to
shards greedily in order, a new shard starting when the next tensor would
take the current one over ``shard_size``, a tensor larger than
``shard_size`` alone in its own shard; shards are
``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: shard}}``, keys
sorted, two-space indent); a single shard is ``model.safetensors`` and no
index. Every header carries ``__metadata__`` with ``format`` (``pt`` unless
given: ``transformers`` loads only pt/tf/flax/mlx).

Atomic: locally, a file or folder is written under a hidden temporary name
beside the destination (``.NAME.treetools-tmp-...``), fsynced, and renamed
onto it at the end; an existing destination is moved aside first and removed
after. In a bucket, where there is no rename, every object is uploaded to its
final key and appears only when its upload completes (an interrupted upload
leaves no object), and the index, which is what makes a folder of shards a
checkpoint, is uploaded last. Either way an interrupted write leaves nothing
under the destination's name that reads as a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from treetools.checkpoint_io.storage import Storage, backend, join
from treetools.shared.files import fsync_file
from treetools.checkpoint_io.formats.safetensors import DTYPE_NAMES
from treetools.checkpoint_io.readers import (GAP_BYTES, ArrayReader, InMemoryReader, Index, block_extent, np_dtype,
                                             row_axis, row_firsts)
from treetools.checkpoint_io.share import Share, owners, pool
from treetools.checkpoint_io.stream import box_plan, stream_blocks
from treetools.shared import rows
from treetools.shared.errors import CheckpointError

CODES: dict[np.dtype, str] = {np_dtype(name): code for code, name in DTYPE_NAMES.items()}
"""numpy dtype -> safetensors dtype code (``F32``, ``BF16``...): the reader's table, inverted."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_SIZE = "5GB"

OnBlock = Callable[[str, int], None]
"""``on_block(tensor_name, nbytes)``: called after each block is written (a progress bar)."""


# ---------------------------------------------------------------------------------------------- sizes


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (decimal, as ``huggingface_hub`` reads ``max_shard_size``), ``500MiB`` (binary) or an int:
    ``treetools.shared.rows.parse_size`` naming ``shard_size`` in its error.

    >>> parse_size("5GB"), parse_size("1.5MiB"), parse_size(1024)
    (5000000000, 1572864, 1024)
    """
    return rows.parse_size(size, what="shard_size")


# ---------------------------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name in the file and a reader (``shape``, ``dtype``, ``read(index)``)."""

    name: str
    reader: Any

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.reader.dtype).newbyteorder("<") if np.dtype(self.reader.dtype).byteorder == ">" \
            else np.dtype(self.reader.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.reader.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ShardFile:
    """One file of the output: its name (relative to a folder destination) and its tensors, in header order."""

    name: str
    tensors: tuple[Tensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every tensor goes: the files (one, or the shards) and whether an index is written.

    ``folder`` is False for a single ``.safetensors`` destination (the one file is the destination itself).
    """

    dst: str
    files: tuple[ShardFile, ...]
    folder: bool
    index: bool

    @property
    def total_size(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def file_of(self) -> dict[str, str]:
        """tensor name -> the file holding it (the index's ``weight_map``)."""
        return {t.name: f.name for f in self.files for t in f.tensors}


def dtype_code(dtype: Any, *, name: str) -> str:
    """The safetensors code of a dtype; a ``CheckpointError`` naming the tensor when safetensors has none."""
    d = np.dtype(dtype)
    code = CODES.get(d.newbyteorder("<") if d.byteorder == ">" else d)
    if code is None:
        known = ", ".join(sorted(DTYPE_NAMES.values()))
        raise CheckpointError(f"`{name}` has dtype {d.name}, which safetensors cannot hold ({known}); "
                              f"cast it (--cast '{re.escape(name)}$=float32') or drop it.")
    return code


def shard_groups(tensors: Sequence[Tensor], shard_size: int) -> list[list[Tensor]]:
    """Tensors in shards, greedily in order, as ``huggingface_hub.split_state_dict_into_shards_factory`` does:
    a tensor over ``shard_size`` becomes a shard of its own at once, while the current shard goes on filling.

    >>> sizes = [Tensor(str(n), np.zeros(n, np.uint8)) for n in (4, 4, 9, 3)]
    >>> [[t.name for t in g] for g in shard_groups(sizes, 8)]
    [['9'], ['4', '4'], ['3']]
    """
    groups: list[list[Tensor]] = []
    current: list[Tensor] = []
    current_size = 0
    for t in tensors:
        if t.nbytes > shard_size:  # larger than a shard: alone in its own
            groups.append([t])
            continue
        if current and current_size + t.nbytes > shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(t)
        current_size += t.nbytes
    if current:
        groups.append(current)
    return groups


def _data_order(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    # Largest item size first: each tensor then starts aligned to its item size, with no padding between tensors.
    return tuple(sorted(tensors, key=lambda t: -t.dtype.itemsize))


def plan_layout(dst: str, tensors: Sequence[Tensor], *, shard_size: int | str = DEFAULT_SHARD_SIZE) -> Layout:
    """The files a write of ``tensors`` to ``dst`` makes; reads no data (``--dry-run`` shows it).

    ``dst`` ending in ``.safetensors`` is one file; anything else a folder of
    shards of at most ``shard_size`` bytes each (a larger tensor alone in its
    own), ``model.safetensors`` when one shard holds everything.

    Raises:
      CheckpointError: two tensors share a name, or a dtype safetensors cannot hold.
    """
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise CheckpointError(f"two tensors are both named `{t.name}`; rename one of them.")
        seen.add(t.name)
        dtype_code(t.dtype, name=t.name)
    if dst.lower().endswith(".safetensors"):
        return Layout(dst, (ShardFile(os.path.basename(dst), _data_order(tensors)),), folder=False, index=False)
    groups = shard_groups(tensors, parse_size(shard_size)) or [[]]
    if len(groups) == 1:
        return Layout(dst, (ShardFile(SINGLE_NAME, _data_order(groups[0])),), folder=True, index=False)
    n = len(groups)
    files = tuple(ShardFile(f"model-{k + 1:05d}-of-{n:05d}.safetensors", _data_order(g)) for k, g in enumerate(groups))
    return Layout(dst, files, folder=True, index=True)


def header(tensors: Sequence[Tensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header of a file holding ``tensors`` in this order, padded to 8 bytes.

    >>> h = header([Tensor("w", np.zeros((2, 3), np.float32))], {"format": "pt"})
    >>> struct.unpack("<Q", h[:8])[0] % 8, json.loads(h[8:])["w"]
    (0, {'dtype': 'F32', 'shape': [2, 3], 'data_offsets': [0, 24]})
    """
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        entries[t.name] = {"dtype": dtype_code(t.dtype, name=t.name), "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def index_json(layout: Layout) -> bytes:
    """``model.safetensors.index.json`` as ``transformers`` writes it: sorted keys, two-space indent."""
    index = {"metadata": {"total_size": layout.total_size}, "weight_map": layout.file_of()}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------- reading blocks


def tensor_boxes(tensors: Sequence[Tensor], block_bytes: int, plans: Sequence[Sequence[Index] | None] | None = None
                 ) -> Iterator[tuple[Tensor, Index, np.ndarray]]:
    """``tensor_blocks`` with each block's index; a tensor that ``plans`` gives a plan comes in the blocks of that
    plan instead (a writer of boxes: ``stream.box_plan``).

    The one read path of every writer: the block engine (``treetools.checkpoint_io.stream.stream_blocks``) reads
    ahead on every core, a bounded window of blocks, while the caller writes.
    """
    readers = [t.reader if isinstance(t.reader, ArrayReader) else InMemoryReader(np.asarray(t.reader))
               for t in tensors]
    for i, index, block in stream_blocks(readers, block_bytes=max(1, block_bytes), contiguous=True, plans=plans):
        tensor = tensors[i]
        block = np.asarray(block)
        want = tuple(len(range(n)[s]) for n, s in zip(tensor.shape, index))
        if block.shape != want:
            raise CheckpointError(f"`{tensor.name}`: a block read as shape {block.shape}, expected {want}.")
        if block.dtype != tensor.dtype:
            if block.dtype.newbyteorder("=") != tensor.dtype.newbyteorder("="):
                raise CheckpointError(f"`{tensor.name}`: a block read as {block.dtype.name}, expected "
                                      f"{tensor.dtype.name}.")
            block = block.astype(tensor.dtype)  # byte order only: exact
        yield tensor, index, np.ascontiguousarray(block)


def tensor_blocks(tensors: Sequence[Tensor], block_bytes: int) -> Iterator[tuple[Tensor, np.ndarray]]:
    """Every tensor's blocks, tensors in order and each in C order (whole rows along the leading axes), each
    at most ``block_bytes``, as contiguous little-endian arrays of its dtype (``tensor_boxes``)."""
    for tensor, _, block in tensor_boxes(tensors, block_bytes):
        yield tensor, block


CALL_BYTES = 40_000
"""What one read or write call costs, in bytes copied from the page cache: a ``pwrite`` of a row and its Python
take 7 us, and 1.1 TB copied took 178 s, 0.16 ns a byte (benchmarks/preset_scale.py, BENCHMARKS.md). How a
local file takes a transposed leaf is the cheaper of the two by it (``_positional_plan``)."""


def _positional_plan(tensor: Tensor, block_bytes: int) -> list[Index] | None:
    """The blocks a local file takes ``tensor`` in at their places (``box_plan``), or None for C order.

    Always for stored chunks that are not C-ordered runs (C order would read stripes of them, up to the memory
    budget). For a file's rows moved by rules (a transpose), whichever costs less: in C order each block reads a
    piece of every source row, and where those pieces lie closer than ``GAP_BYTES`` the file is read in slabs, so
    each block copies the whole leaf again (a 128k-vocabulary ``lm_head``: 256 times); else one read call per
    source row and block. At their places, each source byte is read once and each row of a block is one write
    call (a ``[d, vocab]`` kernel to ``[vocab, d]``: rows of 32 entries, millions of calls). A call counts as
    ``CALL_BYTES`` copied.
    """
    reader = tensor.reader
    if not isinstance(reader, ArrayReader):
        return None
    if reader.chunk_shape is not None:
        return box_plan(reader, block_bytes, whole_chunks=True)
    plan = box_plan(reader, block_bytes)
    if plan is None or reader.layout is None:
        return None
    n = tensor.nbytes
    sizes = block_extent(plan[0], tensor.shape)[1]
    written = math.prod(sizes[row_axis(sizes, tensor.shape):]) * tensor.dtype.itemsize
    row = math.prod(reader.layout) * tensor.dtype.itemsize  # one source row, as the rules moved it
    blocks = -(-n // block_bytes)
    piece = block_bytes * row // max(1, n)  # what each source row gives one C-order block
    c_order = blocks * n if row - piece < GAP_BYTES else blocks * (n // max(1, row)) * CALL_BYTES
    at_place = (n // max(1, written)) * CALL_BYTES + n
    return plan if at_place < c_order else None


def box_runs(data: np.ndarray, index: Index, shape: Sequence[int], itemsize: int, start: int
             ) -> Iterator[tuple[memoryview, int]]:
    """The block ``index`` of an array of ``shape`` stored in C order from byte ``start``, its bytes ``data``
    (C order), as ``(bytes, file position)`` runs: one per row of the block, a row ending at its last partial axis.

    >>> [(bytes(v), p) for v, p in box_runs(np.arange(4, dtype=np.uint8), (slice(1, 3), slice(0, 2)), (4, 3), 1, 10)]
    [(b'\\x00\\x01', 13), (b'\\x02\\x03', 16)]
    """
    starts, sizes = block_extent(index, shape)
    j = row_axis(sizes, shape)
    run = math.prod(sizes[j:]) * itemsize
    view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    for r, first in enumerate((start + row_firsts(starts, sizes, shape, j) * itemsize).tolist()):
        yield view[r * run:(r + 1) * run], first


def blocks(tensor: Tensor, block_bytes: int) -> Iterator[np.ndarray]:
    """One tensor's blocks (``tensor_blocks`` of it alone)."""
    for _, block in tensor_blocks([tensor], block_bytes):
        yield block


# ---------------------------------------------------------------------------------------------- writing


def _write_file(storage: Storage, path: str, file: ShardFile, metadata: dict[str, str], block_bytes: int,
                on_block: OnBlock | None) -> None:
    head = header(file.tensors, metadata)

    with storage.create(path, size=len(head) + file.data_bytes, fsync=False) as out:
        out.write(head)
        # A local file is written with random access where a tensor's C-order blocks would cross its sources'
        # cheapest boxes (stored chunks that are not C-ordered runs; a transposed leaf of a file where that costs
        # less): blocks of whole such boxes, each at its place (`_positional_plan`).
        positional = getattr(out, "write_runs", None)
        plans = [_positional_plan(t, block_bytes) if positional is not None else None for t in file.tensors]
        ends = itertools.accumulate((t.nbytes for t in file.tensors), initial=len(head))
        placed = {id(t): at for t, plan, at in zip(file.tensors, plans, ends) if plan is not None}  # where it starts
        stream = tensor_boxes(file.tensors, block_bytes, plans) if placed else \
            ((t, None, b) for t, b in tensor_blocks(file.tensors, block_bytes))
        for tensor, index, block in stream:
            data = block.reshape(-1).view(np.uint8)
            if positional is not None and index is not None and id(tensor) in placed:
                positional(box_runs(data, index, tensor.shape, tensor.dtype.itemsize, placed[id(tensor)]))
            else:
                out.write(data)
            if on_block is not None:
                on_block(tensor.name, data.nbytes)
        want = len(head) + file.data_bytes
        if out.written != want:  # the blocks did not cover the tensors: never commit such a file
            raise CheckpointError(f"{path}: wrote {out.written:,} bytes, the header promises {want:,}.")


def write_safetensors(
    layout: Layout,
    *,
    metadata: dict[str, str] | None = None,
    block_bytes: int = 16 * 2**20,
    overwrite: bool = False,
    on_block: OnBlock | None = None,
    fsync: bool = True,
    share: Share | None = None,
) -> None:
    """Write ``layout`` (``plan_layout``'s) to its destination, streamed and atomic (see the module docstring).

    Args:
      layout: the files and their tensors.
      metadata: the header's ``__metadata__`` (string -> string); ``format`` defaults to ``pt``.
      block_bytes: the most source data read at once per block.
      overwrite: replace an existing destination (else it is an error).
      on_block: called with (tensor name, bytes) after each block is written.
      fsync: flush local files to disk before the rename (durable across a crash).
      share: this process's share of a run of several (``treetools.checkpoint_io.share``; every process calls this with
        the same layout): each writes the shard files ``owners`` gives it, by bytes, into the one temporary
        folder process 0 made; process 0 writes the index and renames the folder onto ``dst``. The files are
        the ones one process writes, byte for byte. One file (no folder) is written by process 0 alone.

    Raises:
      CheckpointError: the destination exists (without ``overwrite``), or a read fails.
    """
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    dst = layout.dst
    storage = backend(dst)
    if storage.lexists(dst) and not overwrite:  # a dangling symlink is something there too
        raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
    if share is not None and share.count > 1:
        _write_shared(share, storage, layout, meta, block_bytes, overwrite, on_block, fsync)
        return

    def write(path: str) -> list[str]:
        if not layout.folder:
            _write_file(storage, path, layout.files[0], meta, block_bytes, on_block)
            return [path]
        written = [join(path, f.name) for f in layout.files]  # create makes the folder
        for file_path, f in zip(written, layout.files):
            _write_file(storage, file_path, f, meta, block_bytes, on_block)
        if layout.index:  # last: a folder of shards is a checkpoint only with its index
            written.append(join(path, INDEX_NAME))
            with storage.create(written[-1], fsync=False) as out:
                out.write(index_json(layout))
        return written

    try:
        storage.write_atomically(dst, write, folder=layout.folder, fsync=fsync, overwrite=overwrite)
    except FileExistsError:
        raise CheckpointError(f"{dst} appeared while it was being written and was left as it is; pass --overwrite "
                              "(overwrite=True) to replace it.") from None


def _write_own(storage: Storage, path: str | None, layout: Layout, mine: list[int], meta: dict[str, str],
               block_bytes: int, on_block: OnBlock | None, fsync: bool) -> Any:
    """This process's files of a shared write (``mine``: their indices) into the folder ``path``: "ok", "skipped"
    (no folder to write into: another process failed first), or the exception that stopped it."""
    try:
        if path is None:
            return "skipped"
        written = []
        for i in mine:
            target = join(path, layout.files[i].name) if layout.folder else path
            _write_file(storage, target, layout.files[i], meta, block_bytes, on_block)
            written.append(target)
        if fsync and not storage.remote:
            for target in written:
                fsync_file(target)
        return "ok"
    except Exception as e:
        return e


def _with_index(storage: Storage, path: str, layout: Layout) -> list[str]:
    """The files of a shared write, every process's, with the index written last (a folder of shards is a
    checkpoint only with its index)."""
    written = [join(path, f.name) for f in layout.files] if layout.folder else [path]
    if layout.index:
        written.append(join(path, INDEX_NAME))
        with storage.create(written[-1], fsync=False) as out:
            out.write(index_json(layout))
    return written


def _write_shared(share: Share, storage: Storage, layout: Layout, meta: dict[str, str], block_bytes: int,
                  overwrite: bool, on_block: OnBlock | None, fsync: bool) -> None:
    """``write_safetensors`` as one of ``share.count`` processes (see its ``share``).

    Three meetings, held by every process whatever fails (a process that skipped one would leave the others
    waiting): the temporary folder's name (from process 0), each process's files written (or why not), the
    outcome of process 0's index and rename. An error anywhere is raised everywhere, after the third.
    """
    sizes = [f.data_bytes for f in layout.files] if layout.folder else [1]
    mine = [i for i, p in enumerate(owners(sizes, share.count)) if p == share.index]
    met: list[list[Any]] = []

    def meet(value: Any) -> list[Any]:
        met.append(pool(share, value))
        return met[-1]

    def write_mine(path: str | None) -> Any:
        return _write_own(storage, path, layout, mine, meta, block_bytes, on_block, fsync)

    def first_error() -> Exception | None:
        return next((v for round_ in met for v in round_ if isinstance(v, Exception)), None)

    if share.index == 0:
        def write(path: str) -> list[str]:
            meet(path)  # the folder is made by the first file created in it
            meet(write_mine(path))
            error = first_error()
            if error is not None:
                raise error
            return _with_index(storage, path, layout)

        outcome: Any = "ok"
        try:
            storage.write_atomically(layout.dst, write, folder=layout.folder, fsync=fsync, overwrite=overwrite)
        except FileExistsError:
            outcome = CheckpointError(f"{layout.dst} appeared while it was being written and was left as it is; "
                                      "pass --overwrite (overwrite=True) to replace it.")
        except Exception as e:
            outcome = e
        while len(met) < 2:  # write() never ran, or stopped early: the others still wait for these
            meet(outcome if isinstance(outcome, Exception) else CheckpointError("process 0 did not write"))
        meet(outcome)
    else:
        path = next((v for v in meet(None) if isinstance(v, str)), None)
        meet(write_mine(path) if first_error() is None else "skipped")
        meet(None)
    error = first_error()
    if error is not None:
        raise error
