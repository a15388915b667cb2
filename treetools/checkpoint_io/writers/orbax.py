"""Orbax output, written by Orbax's own save, block by block: a ``StandardCheckpointer`` checkpoint, or one step
of a manager root.

Orbax saves a tree of arrays held in host memory (and by default copies each
first). Here Orbax's save runs with a type handler of its public API
(``ocp.type_handlers.NumpyHandler``, registered for treetools' own leaf type
in a registry of this save only) whose leaves are readers, not arrays: each
leaf's data is read block by block through the block engine
(``treetools.checkpoint_io.stream``) and written through the TensorStore spec Orbax
builds for it (zarr, OCDBT), a leaf larger than a block alone, one stored chunk per write.
Orbax writes everything else (``_METADATA``, the OCDBT manifests, the
commit), so the checkpoint is what ``StandardCheckpointer().save`` writes
for the same arrays, up to the chunk shape: each array is stored in chunks
of at most the block size (``TREETOOLS_CHUNK_BYTES``) that are C-contiguous
runs (whole rows along the leading axes), or, for a leaf made by moving a
file's axes (``Leaf.stored_chunk``), blocks of whole source rows; so the
output reads back in bounded memory too, and a write never splits a stored
chunk. Memory: the
block engine's read-ahead of one leaf (a few blocks, or one stripe of whole
source chunks, within the memory budget) and one chunk being written,
whatever the item's size.

Two layouts:

* ``step=None``: ``dst`` is what ``ocp.StandardCheckpointer().save(dst, tree)``
  writes, which ``StandardCheckpointer().restore(dst)`` and ``treetools
  inspect dst`` read (the item ``default``). Written under a hidden
  temporary name beside ``dst`` and renamed onto it at the end.
* ``step=N``: ``dst`` is a ``CheckpointManager`` root and step ``N`` holds the
  tree as the item ``item`` (``params``): ``CheckpointManager(dst).restore(N)``,
  ``tt.restore_checkpoint(dst, N, ...)`` and ``treetools inspect dst`` read it.
  A manager of its own saves the step (committed, as Orbax commits it) in a
  hidden folder of the root, and the finished step is renamed into place: an
  old step ``N`` is replaced only then, never deleted first.

Several processes (``share``, on ``jax.distributed``): every process runs
Orbax's save on the whole tree, as Orbax's multi-process save runs, and the
handler writes in each process the leaves that process owns by bytes
(``treetools.checkpoint_io.share.owners``), each into that process's own OCDBT
database (``ocdbt.process_N``), where Orbax's ``NumpyHandler`` writes every
value from process 0. Orbax's primary process merges the databases (TensorStore's
``experimental_copy_range_to``) and writes the metadata; process 0 puts the
result in place. Orbax's public API only (``NumpyHandler``,
``get_json_tspec_write``, ``CommitFutureAwaitingContractedSignals``,
``BasePyTreeCheckpointHandler``).

Importing this module imports neither jax nor Orbax: ``write_orbax`` does.
"""

from __future__ import annotations

import asyncio
import functools
import math
import logging
import os
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

from treetools.checkpoint_io.readers import ArrayReader, Index, block_extent, plan_blocks
from treetools.checkpoint_io.share import Share, owners, pool
from treetools.checkpoint_io.storage import backend
from treetools.checkpoint_io.stream import box_plan, cores
from treetools.checkpoint_io.writers.safetensors import Tensor, tensor_blocks, tensor_boxes
from treetools.shared.files import remove, swap_in, tmp_name
from treetools.shared.errors import CheckpointError


def nest(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """A nested dict from ``(path parts, value)`` pairs; a path that is both a leaf and a folder is an error.

    >>> nest([(("a", "w"), 1), (("b",), 2)])
    {'a': {'w': 1}, 'b': 2}
    """
    tree: dict[str, Any] = {}
    for parts, value in leaves:
        node = tree
        for i, key in enumerate(parts[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CheckpointError(f"`{'/'.join(parts[:i + 1])}` is a leaf and also holds `{'/'.join(parts)}`; "
                                      "rename one of them.")
            node = child
        if parts[-1] in node:
            raise CheckpointError(f"`{'/'.join(parts)}` is given twice, or is also a folder of other leaves; "
                                  "rename one of them.")
        node[parts[-1]] = value
    return tree


MAX_DEPTH = 256
"""The deepest tree ``--to orbax`` writes (Orbax recurses once a level and failed with a ``SystemError`` near 1,000)."""


def check_orbax(leaves: Sequence[tuple[tuple[str, ...], Any]]) -> None:
    """What Orbax refuses to save, found before anything is read: zero-size arrays, empty path parts, trees nested
    deeper than ``MAX_DEPTH``.

    Raises:
      CheckpointError: one line naming the leaf and the fix.
    """
    for parts, reader in leaves:
        name = "/".join(parts)
        if len(parts) > MAX_DEPTH:
            raise CheckpointError(f"`{name[:80]}...` is nested {len(parts):,} levels deep: Orbax (and jax's tree "
                                  f"functions under it) recurse once a level, and at most {MAX_DEPTH} are written; "
                                  "rename it (--rename) or write safetensors, whose names are flat.")
        if not all(parts):
            raise CheckpointError(f"`{name}` has an empty path component, which Orbax cannot save; rename it.")
        if 0 in tuple(reader.shape):
            raise CheckpointError(f"`{name}` has shape {tuple(reader.shape)}: Orbax cannot save zero-size arrays; "
                                  f"drop it (--drop '^{name}$') or write safetensors.")


OnBlock = Callable[[str, int], None]
"""``on_block(leaf name, nbytes)``: called after each stored chunk is written (a progress bar)."""


PIECE_BYTES = 2**20
"""About how large the stored chunks of a box-plan block whole along its first axis are: the block cut along that
axis (``Leaf.stored_chunk``)."""


def c_order_chunk(shape: Sequence[int], itemsize: int, block_bytes: int) -> tuple[int, ...]:
    """The chunk shape a leaf is stored in: the first block of a C-order plan of ``block_bytes`` (whole rows along
    the leading axes, a run of the flat data), so a C-ordered write fills whole chunks and a chunk reads back
    within a block.

    >>> c_order_chunk((1000, 512), 4, 2**20), c_order_chunk((4, 2**20), 2, 2**20), c_order_chunk((), 4, 8)
    ((512, 512), (1, 524288), ())
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return ()
    return block_extent(next(plan_blocks(shape, max(1, block_bytes // max(1, itemsize)))), shape)[1]


def boxes(pieces: Iterator[np.ndarray], shape: tuple[int, ...], dtype: np.dtype, block_bytes: int
          ) -> Generator[tuple[Index, np.ndarray], None, None]:
    """A leaf's C-ordered blocks (``pieces``, any sizes) regrouped as its stored chunks (``c_order_chunk``), in C
    order: ``(index, data)``. A piece that is one chunk passes through as it is; otherwise chunks are filled
    from the pieces' flat data (one chunk held at a time).

    >>> [(ix, d.tolist()) for ix, d in boxes(iter([np.arange(3), np.arange(3, 5)]), (5,), np.dtype(int), 16)]
    [((slice(0, 2, None),), [0, 1]), ((slice(2, 4, None),), [2, 3]), ((slice(4, 5, None),), [4])]
    """
    src = np.empty(0, dtype)
    pos = 0
    for index in plan_blocks(shape, max(1, block_bytes // dtype.itemsize)):
        sizes = block_extent(index, shape)[1]
        n = math.prod(sizes)
        if pos == src.size:
            src, pos = np.ravel(next(pieces, np.empty(0, dtype))), 0
        if pos == 0 and src.size == n:
            yield index, src.reshape(sizes)
            pos = n
            continue
        out = np.empty(n, dtype)
        filled = 0
        while filled < n:
            if pos == src.size:
                src, pos = np.ravel(next(pieces, np.empty(0, dtype))), 0
                if not src.size:
                    raise CheckpointError(f"a leaf of shape {list(shape)} read as {filled:,} of its {n:,} elements.")
            take = min(n - filled, src.size - pos)
            out[filled:filled + take] = src[pos:pos + take]
            filled, pos = filled + take, pos + take
        yield index, out.reshape(sizes)


class Leaf:
    """One leaf to save, as Orbax's ``NumpyHandler`` sees a value (``shape``, ``dtype``, ``size``), holding its
    reader instead of its data."""

    def __init__(self, name: str, reader: Any, mine: bool = True):
        self.name, self.reader, self.mine = name, reader, mine  # mine: this process writes it (a run of several)
        self.dtype = Tensor(name, reader).dtype
        self.shape = tuple(int(d) for d in reader.shape)
        self.size = math.prod(self.shape)
        self.ndim = len(self.shape)

    def stored_chunk(self, block_bytes: int) -> tuple[int, ...]:
        """The chunk shape the leaf is stored in: C-order runs of a block (``c_order_chunk``), or, for a leaf
        whose C-order blocks would cross its sources' cheapest boxes (``stream.box_plan``: rules transposing or
        stacking a file's rows, MaxText's ``[embed, layers, heads, head_dim]`` from per-layer ``[heads * head_dim,
        embed]`` projections), a block of whole such boxes (cut along the first axis where it is whole): each
        block written then reads whole source rows, each source byte once, where C-order chunks would read a
        piece of every layer's projection for each chunk."""
        plan = self._box_plan(block_bytes)
        if plan is None:
            return c_order_chunk(self.shape, self.dtype.itemsize, block_bytes)
        chunk = list(block_extent(plan[0], self.shape)[1])
        if chunk and chunk[0] == self.shape[0]:
            # A block whole along the first axis is stored as pieces of it of about PIECE_BYTES (each write is
            # still one block, whole chunks): a restore sharded along that axis (MaxText's FSDP shards `embed`)
            # decodes its own rows, not every row of every chunk it touches.
            pieces = min(self.shape[0], max(1, math.prod(chunk) * self.dtype.itemsize // PIECE_BYTES))
            chunk[0] = -(-self.shape[0] // pieces)
        return tuple(chunk)

    def _box_plan(self, block_bytes: int) -> list[Index] | None:
        return box_plan(self.reader, block_bytes) if isinstance(self.reader, ArrayReader) else None

    def chunks(self, block_bytes: int) -> Generator[tuple[Index, np.ndarray], None, None]:
        """The leaf's data as ``(index, block)`` writes of whole stored chunks (``stored_chunk``), read block by
        block (each source chunk decoded once): each chunk in C order, or (a box plan) each block of the plan,
        one read each, whole chunks of the grid."""
        tensor = Tensor(self.name, self.reader)
        plan = self._box_plan(block_bytes)
        if plan is not None:
            return ((index, block) for _, index, block in tensor_boxes([tensor], block_bytes, plans=[plan]))
        pieces = (block for _, block in tensor_blocks([tensor], block_bytes))
        return boxes(pieces, self.shape, self.dtype, block_bytes)


def _with_chunks(spec: dict[str, Any], chunk: tuple[int, ...]) -> bool:
    """Set the chunk shape in the zarr (v2: ``chunks``; v3: ``chunk_grid``) metadata of an Orbax write spec, under a
    ``cast`` driver too; False when the spec holds neither (Orbax's own chunks, of at most the block, are kept)."""
    if spec.get("driver") == "cast" and isinstance(spec.get("base"), dict):
        return _with_chunks(spec["base"], chunk)
    meta = spec.get("metadata")
    if not isinstance(meta, dict) or len(meta.get("shape", ())) != len(chunk):
        return False
    grid = meta.get("chunk_grid")
    if isinstance(grid, dict) and isinstance(grid.get("configuration"), dict):
        grid["configuration"]["chunk_shape"] = list(chunk)
        return True
    if "chunks" in meta:
        meta["chunks"] = list(chunk)
        return True
    return False


async def _write_owned(handler: Any, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None
                       ) -> None:
    """``LeafHandler``'s writes: the leaves this process owns (``Leaf.mine``), each into this process's own OCDBT
    database (``ocdbt.process_N``, which Orbax's primary process merges at the end), where Orbax's
    ``NumpyHandler`` writes every value from process 0. The write specs are Orbax's own (its public
    ``get_json_tspec_write``)."""
    import orbax.checkpoint as ocp

    args = list(args or [ocp.SaveArgs()] * len(values))
    ocp.type_handlers.check_input_arguments(values, infos, args)
    writes = []
    for value, info, arg in zip(values, infos, args):
        await info.await_path_creation()
        ocdbt = bool(info.is_ocdbt_checkpoint)
        tspec = ocp.type_handlers.get_json_tspec_write(
            info, use_ocdbt=ocdbt, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
            process_index=ocp.multihost.process_index() if ocdbt else None, arg=arg)
        if value.mine if isinstance(value, Leaf) else ocp.multihost.process_index() == 0:
            writes.append(handler._open_and_write(value, tspec, info.ts_context))
    await asyncio.gather(*writes)


@functools.cache
def _leaf_handler_class() -> type:
    """The type handler of a block-by-block save (made on first use: it subclasses Orbax's, and importing Orbax
    imports jax)."""
    import orbax.checkpoint as ocp

    if not callable(getattr(ocp.type_handlers.NumpyHandler, "_open_and_write", None)):  # the one hook overridden
        raise CheckpointError("--to orbax: this orbax-checkpoint's NumpyHandler has no _open_and_write (written "
                              "against 0.12.8); install the version constraints.txt names, or convert to safetensors.")

    class LeafHandler(ocp.type_handlers.NumpyHandler):
        """``NumpyHandler`` whose values are ``Leaf``s, each written chunk by chunk.

        Orbax starts every leaf's write at once. A leaf larger than a block
        is written alone (the block engine reads it ahead, on every core);
        smaller leaves go together, as many as ``window`` bytes of them, so
        their writes share OCDBT commits as Orbax's own do.
        """

        def __init__(self, block_bytes: int, on_block: OnBlock | None):
            super().__init__(deepcopy_host_arrays=False)
            self.block_bytes, self.on_block = block_bytes, on_block
            self.window = 2 * cores() * block_bytes
            self.error: BaseException | None = None
            self._gate = asyncio.Condition()
            self._held = 0
            self._context: Any = None

        async def _open_and_write(self, value: Any, tspec: dict[str, Any], ts_context: Any) -> None:
            if not isinstance(value, Leaf):
                return await super()._open_and_write(value, tspec, ts_context)
            nbytes = value.size * value.dtype.itemsize
            cost = self.window if nbytes > self.block_bytes else max(1, nbytes)
            async with self._gate:
                await self._gate.wait_for(lambda: self.error is not None or self._held == 0
                                          or self._held + cost <= self.window)
                if self.error is not None:
                    return
                self._held += cost
            try:
                await self._write(value, tspec, ts_context)
            except Exception as e:
                # Kept, not raised: Orbax would close its event loop with other leaves' writes in flight. The
                # leaves not started skip, Orbax finishes its (temporary) checkpoint, and write_orbax raises this.
                self.error = self.error or e
            finally:
                async with self._gate:
                    self._held -= cost
                    self._gate.notify_all()

        async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None
                            ) -> list[Any]:
            """Orbax's ``NumpyHandler.serialize``, but every process writes the leaves it owns (``Leaf.mine``):
            ``_write_owned``."""
            write = _write_owned(self, values, infos, args)
            return [ocp.future.CommitFutureAwaitingContractedSignals(write, name="np_type_handler")]

        def _own_context(self, ts_context: Any) -> Any:
            """Orbax's TensorStore context with its caches emptied, one for every leaf of the save: Orbax's keeps
            up to 100 MB of OCDBT cache, and the peak grew with the bytes written through it (by 290 MB over
            8 GiB), where this one's stays flat."""
            if self._context is None:
                self._context = _uncached_context(ts_context)
            return self._context

        async def _write(self, leaf: Leaf, tspec: dict[str, Any], ts_context: Any) -> None:
            await _write_leaf(self, leaf, tspec, self._own_context(ts_context))

    return LeafHandler


def _uncached_context(ts_context: Any) -> Any:
    """A TensorStore context like Orbax's ``ts_context`` (its spec), with every cache pool emptied."""
    import tensorstore as ts

    spec = ts_context.spec.to_json() if ts_context is not None else {}
    for key, value in spec.items():
        if key.split("#")[0] == "cache_pool" and isinstance(value, dict):
            value["total_bytes_limit"] = 0
    return ts.Context(spec)


async def _write_leaf(handler: Any, leaf: Leaf, tspec: dict[str, Any], context: Any) -> None:
    """One leaf into its TensorStore array, chunk by chunk: the next chunk is read (in a thread) while the last
    one is written; ``handler.on_block`` hears of each."""
    import tensorstore as ts

    _with_chunks(tspec, leaf.stored_chunk(handler.block_bytes))
    store = await ts.open(ts.Spec(tspec), create=True, open=True, context=context)
    chunks = leaf.chunks(handler.block_bytes)
    pending = None
    try:
        while True:
            item = await asyncio.to_thread(next, chunks, None)
            if pending is not None:
                done, pending = pending, None
                await done
            if item is None:
                break
            index, data = item
            pending = store[index].write(data, can_reference_source_data_indefinitely=True)
            if handler.on_block is not None:
                handler.on_block(leaf.name, data.nbytes)
    finally:
        chunks.close()
        if pending is not None:  # a read failed: let the write in flight finish before the loop ends
            await asyncio.gather(pending, return_exceptions=True)


def write_orbax(
    dst: str,
    leaves: Sequence[tuple[tuple[str, ...], Any]],
    *,
    step: int | None = None,
    item: str = "params",
    overwrite: bool = False,
    block_bytes: int = 8 * 2**20,
    on_block: OnBlock | None = None,
    share: Share | None = None,
) -> None:
    """Save ``leaves`` with Orbax's own writer, block by block (see the module docstring); atomic.

    Either way the checkpoint (or step) is written whole under a hidden
    temporary name first and only then put at its place: ``overwrite``
    replaces what is there once the new one is complete (``swap_in``), and
    without it the final rename refuses anything that appeared there meanwhile.
    A failure or an interrupt leaves the old checkpoint (or step) whole, and
    no temporary behind.

    Args:
      dst: a local folder: the checkpoint (``step`` None), or a manager root.
      leaves: ``(path parts, reader)`` per leaf; the tree nests on the parts.
      step: write step ``step`` of a manager root ``dst`` instead.
      item: the manager item's name (with ``step``).
      overwrite: replace an existing ``dst`` (or step).
      block_bytes: the most source data read at once per block, and the largest stored chunk written.
      on_block: called with (leaf name, bytes) after each chunk is written.
      share: this process's share of a run of several (``treetools.checkpoint_io.share``, on ``jax.distributed``;
        every process calls this with the same arguments, ``dst`` on a file system they all see): each process
        writes the leaves it owns by bytes (``owners``) into its own OCDBT database, Orbax's multi-process save
        (its primary process, process 0, merges the databases and writes the metadata), and process 0 puts the
        checkpoint at its place. Orbax's restore reads the same tree and values as one process writes.

    Raises:
      CheckpointError: ``dst`` (or the step) exists without ``overwrite``, or appeared while it was written; no
        array to write; a bucket ``dst``; the errors of reading the leaves (in a run of several: any process's,
        raised by every process).
    """
    if backend(dst).remote:
        raise CheckpointError(f"{dst}: --to orbax writes local folders; write it locally and upload the folder, "
                              "or convert to safetensors, which streams to buckets.")
    check_orbax(leaves)
    dst = os.path.abspath(dst)
    final = dst if step is None else os.path.join(dst, str(step))
    if step is not None and os.path.lexists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"{dst} is not a folder; a manager root (--dst-step) is a folder of step folders.")
    if os.path.lexists(final) and not overwrite:  # a dangling symlink is something there too
        if step is None:
            raise CheckpointError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
        raise CheckpointError(f"{dst} already has step {step}; pass --overwrite (overwrite=True) to replace it, or "
                              "choose another step.")
    if not leaves:  # Orbax refuses an empty item ("Found empty item") after making its folders
        raise CheckpointError(f"{dst}: no array to write (the item holds none, or the rules dropped them all); "
                              "nothing was written.")
    index, count = (share.index, share.count) if share is not None else (0, 1)
    objects = [Leaf("/".join(parts), reader) for parts, reader in leaves]
    for leaf, owner in zip(objects, owners([leaf.size * leaf.dtype.itemsize for leaf in objects], count)):
        leaf.mine = owner == index  # by bytes, the same list in every process
    tree = nest([(parts, leaf) for (parts, _), leaf in zip(leaves, objects)])
    save = _OrbaxSave(tree, [p for p, _ in leaves], step, item, block_bytes, on_block, several=count > 1)
    if share is not None and count > 1:
        _write_shared(share, save, dst, final, overwrite)
        return
    made_root = step is not None and not os.path.lexists(dst)
    if made_root:
        os.makedirs(dst)
    tmp = tmp_name(final, "tmp")
    try:
        _put(save.run(tmp), final, overwrite)
    except BaseException:
        if made_root:
            remove(dst)
        raise
    finally:
        _remove_tmp(tmp)


def _put(written: str, final: str, overwrite: bool) -> None:
    """The finished checkpoint (or step) ``written`` put at ``final``."""
    try:
        swap_in(written, final, overwrite=overwrite)
    except FileExistsError:
        raise CheckpointError(f"{final} appeared while it was being written and was left as it is; pass "
                              "--overwrite (overwrite=True) to replace it.") from None


def _remove_tmp(tmp: str) -> None:
    """Our temporary, and Orbax's own temporary beside it (``StandardCheckpointer``), removed."""
    remove(tmp)
    folder = os.path.dirname(tmp)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith(os.path.basename(tmp)):
                remove(os.path.join(folder, name))


class _OrbaxSave:
    """Orbax's own save of a tree of ``Leaf``s through ``LeafHandler`` (a registry of this save only)."""

    def __init__(self, tree: dict[str, Any], paths: Sequence[tuple[str, ...]], step: int | None, item: str,
                 block_bytes: int, on_block: OnBlock | None, several: bool):
        self.tree, self.paths, self.step, self.item, self.block_bytes = tree, paths, step, item, block_bytes
        self.several = several  # one of several processes
        # Orbax (and jax under it) only here: everything else treetools converts stays jax-free.
        self.handler = _leaf_handler_class()(block_bytes, on_block)

    def run(self, tmp: str) -> str:
        """Save at ``tmp`` (the checkpoint, or a manager root holding the step); the finished checkpoint's (or
        step's) folder. A leaf whose read failed: its error, once Orbax has finished."""
        import orbax.checkpoint as ocp

        registry = ocp.type_handlers.create_type_handler_registry((Leaf, self.handler))
        # A registry without jax.Array makes Orbax warn that it keeps no array metadata: true, and no jax.Array is
        # saved here; not a line for the user of every convert.
        _quiet_absl("No jax.Array in TypeHandlerRegistry")

        def save_handler() -> Any:  # StandardCheckpointHandler is this handler with Orbax's global type registry
            if not self.several:
                return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
            # Several processes: Orbax's check of the merged databases would fail process 0 alone (inside Orbax,
            # the others waiting at its next barrier) when another process's read failed; every process's outcome
            # is pooled after the save instead (``_write_shared``), and a failed save is never put in place.
            impl = ocp.BasePyTreeCheckpointHandler(type_handler_registry=registry, enable_post_merge_validation=False)
            return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, handler_impl=impl)

        # (Orbax refuses a chunk_byte_size under 4 bytes, before it reads one: the chunks of a block of 1 byte are
        # one element each, whatever that is.)
        save_args = ocp.args.PyTreeSave(self.tree, save_args=nest([(p, ocp.SaveArgs(
            chunk_byte_size=max(16, self.block_bytes))) for p in self.paths]))
        try:
            if self.step is None:
                with ocp.Checkpointer(save_handler()) as checkpointer:
                    checkpointer.save(tmp, args=save_args)
                written = tmp
            else:  # a manager of its own in a hidden folder of the root: the step is moved out once committed
                options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
                with ocp.CheckpointManager(tmp, options=options,
                                           item_handlers={self.item: save_handler()}) as manager:
                    manager.save(self.step, args=ocp.args.Composite(**{self.item: save_args}))
                    manager.wait_until_finished()
                written = os.path.join(tmp, str(self.step))
        except BaseException:
            if self.handler.error is not None:
                raise self.handler.error from None  # a leaf's read failed: that, not what it made Orbax raise
            raise
        if self.handler.error is not None:  # a leaf's read failed; Orbax finished the temporary, which is removed
            raise self.handler.error
        return written


def _write_shared(share: Share, save: _OrbaxSave, dst: str, final: str, overwrite: bool) -> None:
    """``write_orbax`` as one of ``share.count`` processes (see its ``share``).

    Three meetings, held by every process whatever fails (a process that skipped one would leave the others
    waiting): the temporary's name (process 0 makes the manager root first, with ``step``), each process's
    outcome of Orbax's save (Orbax meets inside it too: every process saves, a failed read of a leaf is raised
    only after), the outcome of process 0's rename. An error anywhere is raised everywhere, after the third.
    """
    met: list[list[Any]] = []

    def meet(value: Any) -> list[Any]:
        met.append(pool(share, value))
        return met[-1]

    def first_error() -> BaseException | None:
        return next((v for round_ in met for v in round_ if isinstance(v, BaseException)), None)

    made_root, done = False, False
    tmp: Any = None
    try:
        if share.index == 0:
            named: Any
            try:
                made_root = save.step is not None and not os.path.lexists(dst)
                if made_root:
                    os.makedirs(dst)
                tmp = named = tmp_name(final, "tmp")
            except Exception as e:
                named = e
            meet(named)
        else:
            tmp = meet(None)[0]
        written: Any = "skipped"
        if first_error() is None:
            try:
                written = save.run(tmp)
            except Exception as e:
                written = e
        meet(written)
        outcome: Any = "ok"
        if share.index == 0 and first_error() is None:
            try:
                _put(written, final, overwrite)
                done = True
            except Exception as e:
                outcome = e
        meet(outcome)
    finally:  # process 0, on any error or an interrupt too: no temporary left, nor a manager root it made
        if isinstance(tmp, str) and share.index == 0:
            _remove_tmp(tmp)
        if made_root and not done:
            remove(dst)
    error = first_error()
    if error is not None:
        raise error


class _Without(logging.Filter):
    """Drops the log records whose message holds ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _quiet_absl(text: str) -> None:
    """Drop absl log records holding ``text`` from now on (once per text, whatever the number of saves)."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _Without) and f.text == text for f in logger.filters):
        logger.addFilter(_Without(text))
