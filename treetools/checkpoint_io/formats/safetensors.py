"""``.safetensors`` files: leaves from the JSON header; tensor bytes mapped a block at a time on request.

Tensor names are kept exactly as stored (``model.layers.0.self_attn.q_proj.weight``);
``--depth`` and the tree view split them on ``.``.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._hf_index import open_weights, weights_file
from treetools.checkpoint_io.leaves import Leaf, array_row, check_name, stored_path
from treetools.checkpoint_io.readers import (
    JSON_EXPANSION, MAX_ARRAY_BYTES, FileReader, MissingReader, check_budget, check_leaf_count, checked_offsets, checked_shape,
    np_dtype,
)
from treetools.checkpoint_io.source import file_head, Format
from treetools.shared.errors import CheckpointError
from treetools.shared.rows import dtype_name


DTYPE_NAMES = {  # safetensors dtype code -> numpy (ml_dtypes) name; the writer (checkpoint_io/writers) inverts it
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
_ST_MAX_HEADER = 100 * 2**20  # the safetensors spec caps the header at 100 MB


_ENTRY_KEYS = ("data_offsets", "dtype", "shape")


def _pairs(pairs: list[tuple[str, Any]]) -> Any:
    """A JSON object that refuses a key given twice (json.loads would silently keep the last); a tensor's entry
    (``dtype``, ``shape``, ``data_offsets``) kept as a ``(dtype, shape, offsets)`` tuple, a tenth of a dict's
    memory (a header of 144,629 entries held 110 MB as dicts)."""
    if len(pairs) == 3 and tuple(sorted(k for k, _ in pairs)) == _ENTRY_KEYS:
        entry = dict(pairs)
        shape, offsets = entry["shape"], entry["data_offsets"]
        return (entry["dtype"], tuple(shape) if isinstance(shape, list) else shape,
                tuple(offsets) if isinstance(offsets, list) else offsets)
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tensor name {key!r} appears twice")
        out[key] = value
    return out


def _st_header(context: ReadContext, path: str) -> tuple[dict[str, Any], int, int]:
    storage = context.storage
    size = storage.getsize(path)
    with storage.open(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length).")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _ST_MAX_HEADER):
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors header (says {n} bytes, file has {size - 8} after the length)."
            )
        # The header is parsed whole: held to the memory budget by what the parse will hold, before it is read.
        check_budget(JSON_EXPANSION * n, where=path, what=f"the safetensors header ({n:,} bytes), parsed whole,",
                     budget=context.memory_budget)
        raw = f.read(n)
    # Each tensor is one JSON object: counted in the raw bytes (a brace inside a name counts too: more, never
    # fewer), the leaves they become are held to the budget before the parse makes any of them.
    check_leaf_count(raw.count(b"{"), where=path, budget=context.memory_budget)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise CheckpointError(f"{path}: corrupt safetensors header ({reason}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object).")
    return header, 8 + n, size - 8 - n


def read_safetensors(context: ReadContext, path: str) -> list[Leaf]:
    """Leaves of a ``.safetensors`` file from its JSON header; tensor bytes are never read here.

    >>> import numpy as np, safetensors.numpy, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> safetensors.numpy.save_file({"dense.kernel": np.zeros((2, 3), np.float32)}, f)
    >>> [(l.name, l.row.shape, l.row.dtype, l.row.bytes) for l in read_safetensors(ReadContext().confined_to(f), f)]
    [('dense.kernel', (2, 3), 'float32', 24)]
    """
    header, data_start, data_len = _st_header(context, path)
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        check_name(name, where=path)
        try:
            if not isinstance(entry, tuple):  # not the three fields of an entry (_pairs)
                raise TypeError
            code, shape_json, offsets = entry
            dtype = np_dtype(DTYPE_NAMES[code])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{where}: corrupt safetensors header entry {repr(entry)[:200]}.") from None
        shape = checked_shape(shape_json, where=where, itemsize=dtype.itemsize)
        # Each offset bounded by itself, never their product: a 10 GB shard's offsets multiply past 2**60.
        begin, end = checked_offsets(offsets, where=where, count=2, limit=MAX_ARRAY_BYTES, what="data_offsets")
        if not begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{where}: corrupt safetensors header (offsets {begin}..{end} do not hold shape {list(shape)} "
                f"{dtype_name(dtype)}: {math.prod(shape) * dtype.itemsize} bytes)."
            )
        entries.append((name, shape, dtype, begin, end))
    declared = max((end for *_, end in entries), default=0)
    note = _truncation_note(path, entries, declared, data_len) if declared > data_len else ""
    leaves = []
    for name, shape, dtype, begin, end in entries:
        parts, sep = stored_path(name)
        if end <= data_len:
            reader: Any = FileReader(context, path, data_start + begin, shape, dtype)
        else:
            reader = MissingReader(shape, dtype, note=note, reason=(
                f"{path}: tensor {name!r} is not in the file: it is truncated (the header declares {declared:,} "
                f"data bytes, {data_len:,} present; an incomplete download?); fetch the file again."))
        leaves.append(Leaf(array_row(parts, shape, dtype, sep=sep), reader, key=name))
    _check_overlaps(path, [(begin, end, name) for name, _, _, begin, end in entries])
    return leaves


def _truncation_note(path: str, entries: list[tuple[str, Any, Any, int, int]], declared: int, present: int) -> str:
    """One line for a file shorter than its header says: the bytes declared and present, the tensors cut."""
    cut = [name for name, *_, end in entries if end > present]
    shown = ", ".join(cut[:5]) + (f", ... ({len(cut):,} in all)" if len(cut) > 5 else "")
    return (f"{path}: truncated: the header declares {declared:,} data bytes, {present:,} present (an incomplete "
            f"download?); {len(cut):,} of {len(entries):,} tensors are missing or cut short: {shown}.")


def _check_overlaps(path: str, spans: list[tuple[int, int, str]]) -> None:
    """Refuse two tensors whose data ranges (``(begin, end, name)``) overlap (the safetensors library refuses them
    too)."""
    spans.sort()
    for (_, end_a, a), (begin_b, end_b, b) in zip(spans, spans[1:]):
        if begin_b < end_a and begin_b < end_b:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensors {a!r} and {b!r} share data bytes).")


HF_SINGLE = "model.safetensors"
"""The one file of a Hugging Face model folder that fits one shard (``save_pretrained`` writes no index then)."""


def _claims(path: str, context: ReadContext) -> bool:
    storage = context.storage
    if storage.isdir(path):  # a sharded folder's index is asked first (safetensors-sharded, higher priority)
        return weights_file(storage, path, HF_SINGLE) is not None
    head = file_head(storage, path, 9)
    if len(head) == 9 and head[8:9] == b"{":
        try:
            if 2 <= struct.unpack("<Q", head[:8])[0] <= storage.getsize(path) - 8:
                return True
        except OSError:
            return False
    return path.lower().endswith(".safetensors") and storage.isfile(path)  # a broken header: its reader says how


FORMAT = Format(
    name="safetensors",
    priority=40,
    claims=_claims,
    open=lambda location, display, context: open_weights(location, display, context, name=HF_SINGLE,
                                                         format="safetensors", read=read_safetensors),
    description="a .safetensors file, or a Hugging Face model folder holding one model.safetensors (beside "
                "config.json and the tokenizer files)",
)
