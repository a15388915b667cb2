"""msgpack that is not one map: record streams and arrays of ``[key, value]`` pairs (a structural reader).

* **Record streams**: EasyLM's ``StreamingCheckpointer.save_checkpoint`` (as
  OpenLLaMA and EasyLM users have them: ``streaming_params``,
  ``streaming_train_state[_<step>]``, no extension) writes the flattened
  state dict one leaf at a time, each record ``msgpack.pack((key_path,
  flax.serialization.to_bytes(value)))``: a ``[key path, bytes]`` pair whose
  bytes are themselves a Flax msgpack value (an ndarray ext, or a scalar).
  The records are walked front to back once; each array is left in the file
  and read from its offset on request (bfloat16 as bfloat16).
* **Arrays of pairs**: one msgpack array of ``[key, value]`` pairs.

A key is a list of path parts (``["params", "transformer", "wte",
"embedding"]``) or a string (split on ``/``). The checkpoint is one item,
``default``; ``load_parameters`` finds the parameters inside it. A note says
that this reader read it. Maps (``flax.serialization.to_bytes``) are the
``msgpack`` format's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._msgpack import MsgpackError, walk, walk_records
from treetools.checkpoint_io.leaves import Leaf, check_name, tree_leaves
from treetools.checkpoint_io.source import FileSource, Format, file_head
from treetools.shared.errors import CheckpointError

_ARRAYS = set(range(0x90, 0xA0)) | {0xDC, 0xDD}
_STRINGS = set(range(0xA0, 0xC0)) | {0xD9, 0xDA, 0xDB}


def _parts(key: Any, where: str) -> tuple[str, ...]:
    if isinstance(key, str):
        parts = tuple(key.split("/"))
    elif isinstance(key, (list, tuple)) and key and all(isinstance(k, (str, int)) for k in key):
        parts = tuple(str(k) for k in key)
    else:
        raise CheckpointError(f"{where}: a record key {str(key)[:80]!r} is neither a key path nor a string.")
    for part in parts:
        check_name(part, where=where)
    return parts


def _leaves(pairs: list[tuple[Any, Any]], where: str) -> list[Leaf]:
    out: list[Leaf] = []
    seen: set[tuple[str, ...]] = set()
    for key, value in pairs:
        parts = _parts(key, where)
        for leaf in tree_leaves(value, where=where):
            path = parts + leaf.path
            if path in seen:
                raise CheckpointError(f"{where}: the key `{'/'.join(path)}` is stored twice.")
            seen.add(path)
            out.append(dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=path)))
    return out


def _is_pair(x: Any) -> bool:
    return isinstance(x, list) and len(x) == 2 and (
        isinstance(x[0], str) or (isinstance(x[0], list) and bool(x[0]) and all(isinstance(k, str) for k in x[0])))


def read_stream(context: ReadContext, path: str) -> tuple[list[Leaf], str]:
    """The leaves of a record stream or an array of pairs, and the note naming which it was."""
    try:
        whole = walk(context, path)
    except MsgpackError as e:
        if "extra data after the object" not in e.reason:
            raise
        records = walk_records(context, path)
        return _leaves(records, path), (f"{path}: read as a msgpack record stream ({len(records):,} [key, value] "
                                        "records, as EasyLM's StreamingCheckpointer writes them).")
    if isinstance(whole, list) and whole and all(_is_pair(x) for x in whole):
        if all(isinstance(x[1], bytes) for x in whole):  # pairs whose values are msgpack bytes: one record, nested
            records = walk_records(context, path)
            return _leaves(records, path), f"{path}: read as a msgpack record stream (1 [key, value] record)."
        return _leaves([(x[0], x[1]) for x in whole], path), (
            f"{path}: read as a msgpack array of {len(whole):,} [key, value] pairs.")
    if isinstance(whole, list):
        return tree_leaves(whole, where=path), f"{path}: read as a msgpack array (leaves named by position)."
    raise CheckpointError(f"{path}: msgpack whose top level is a {type(whole).__name__}: not a checkpoint.")


def _claims(location: str, context: ReadContext) -> bool:
    head = file_head(context.storage, location, 4)
    if len(head) < 3 or head[0] not in _ARRAYS:
        return False
    if head[0] == 0x92 and head[1] in _ARRAYS | _STRINGS:  # a record: [key path, ...] or ["key", ...]
        return head[1] in _STRINGS or head[2] in _STRINGS or head[1] == 0x90
    return head[1] == 0x92 and (head[2] in _STRINGS or (head[2] in _ARRAYS and len(head) > 3 and head[3] in _STRINGS))


def _open(location: str, display: str, context: ReadContext) -> FileSource:
    leaves, note = read_stream(context, location)
    return FileSource(display, context, "msgpack-stream", leaves, notes=[note.replace(location, display, 1)])


FORMAT = Format(
    name="msgpack-stream",
    priority=5,  # structural: after every format that knows its files
    claims=_claims,
    open=_open,
    structural=True,
    description="msgpack record streams",
)
