"""Flax msgpack files (``flax.serialization.to_bytes`` of a state dict).

msgpack has no index: the file is walked once (``_msgpack.walk``),
decoding its structure and keeping each array's offset, so arrays are read in
blocks from the file on request, like safetensors tensors; nothing is parsed
whole. Paths follow the state dict's keys.
"""

from __future__ import annotations

import os

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats._hf_index import open_weights, weights_file
from treetools.checkpoint_io.formats._msgpack import walk
from treetools.checkpoint_io.leaves import Leaf, tree_leaves
from treetools.checkpoint_io.source import file_head, Format
from treetools.checkpoint_io.storage import Storage
from treetools.shared.errors import CheckpointError


_GDA_PLACEHOLDER = "//GDAPlaceholder:"  # flax.training.checkpoints.MP_ARRAY_PH


def read_msgpack(context: ReadContext, path: str) -> list[Leaf]:
    """Leaves of a ``flax.serialization.to_bytes`` file; arrays are read from their offsets on request.

    >>> import numpy as np, tempfile
    >>> from flax.serialization import to_bytes
    >>> f = os.path.join(tempfile.mkdtemp(), "state.msgpack")
    >>> _ = open(f, "wb").write(to_bytes({"params": {"w": np.ones((2, 3), np.float32)}, "step": 3}))
    >>> [(leaf.name, leaf.row.shape, leaf.value) for leaf in read_msgpack(ReadContext().confined_to(f), f)]
    [('params/w', (2, 3), NO_VALUE), ('step', None, 3)]
    """
    tree = walk(context, path)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: not a Flax msgpack checkpoint (top level is {type(tree).__name__}, not a dict).")
    leaves = tree_leaves(tree, where=path)
    held = [leaf.name for leaf in leaves if isinstance(leaf.value, str) and leaf.value.startswith(_GDA_PLACEHOLDER)]
    if held:  # flax's save_checkpoint_multiprocess: the arrays are in `<file>_gda/`, the file keeps placeholders
        raise CheckpointError(
            f"{path}: a Flax multi-process checkpoint whose arrays ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}) are stored in {os.path.basename(path)}_gda/, which treetools does "
            "not read; restore it with flax.training.checkpoints.restore_checkpoint(..., gda_manager=...)."
        )
    return leaves


def is_msgpack_map(storage: Storage, path: str) -> bool:
    """A file that opens a msgpack map keyed by strings: what ``flax.serialization.to_bytes`` writes for a state
    dict (whose keys are always strings), or the one byte of an empty map.

    The key's type is checked too, so files that merely start with a map's byte are not claimed: a PNG
    (``\\x89PNG``: a map whose first key would be the integer 80) or a pickle (``\\x80\\x02``: an empty map
    followed by more bytes), such as PyTorch's ``pytorch_model.bin``.
    """
    head = file_head(storage, path, 6)
    if not head:
        return False
    if 0x80 <= head[0] <= 0x8F:
        key = 1 if head[0] > 0x80 else None
        if key is None:
            return len(head) == 1  # an empty map is the whole file
    elif head[0] in (0xDE, 0xDF):
        key = 3 if head[0] == 0xDE else 5
    else:
        return False
    return len(head) > key and (0xA0 <= head[key] <= 0xBF or head[key] in (0xD9, 0xDA, 0xDB))


HF_FLAX_SINGLE = "flax_model.msgpack"
"""The one file of a Hugging Face Flax model folder that fits one shard (``FlaxPreTrainedModel.save_pretrained``)."""


def _claims(path: str, context: ReadContext) -> bool:
    if context.storage.isdir(path):  # a folder also holding model.safetensors is the safetensors format's (asked first)
        return weights_file(context.storage, path, HF_FLAX_SINGLE) is not None
    head = file_head(context.storage, path, 1)
    is_array = bool(head) and (0x90 <= head[0] <= 0x9F or head[0] in (0xDC, 0xDD))  # msgpack-stream's, not a map
    return is_msgpack_map(context.storage, path) or (bool(head) and not is_array
                                                      and os.path.splitext(path)[1].lower() in (".msgpack", ".flax", ".mpk"))


FORMAT = Format(
    name="msgpack",
    priority=10,
    claims=_claims,
    open=lambda location, display, context: open_weights(location, display, context, name=HF_FLAX_SINGLE,
                                                         format="msgpack", read=read_msgpack),
    description="a Flax msgpack file from flax.serialization.to_bytes, or a Hugging Face Flax model folder holding "
                "one flax_model.msgpack",
)
