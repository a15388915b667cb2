"""Hugging Face sharded safetensors: ``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``.

PATH may be the folder or the index file itself. Every shard's tensors form
one item (``default``), names kept exactly as stored. The index and the
shards are checked against each other: a shard the index names that is
missing, a tensor the index places in a shard that does not hold it, a
tensor a shard holds that the index does not list, or a shard file the index
never names, is one clear error (``_hf_index.read_indexed_shards``, shared
with the Flax sharded format).
Each shard is read like a single ``.safetensors`` file (header only; tensor
bytes read a block at a time on request).
"""

from __future__ import annotations

from treetools.checkpoint_io.formats._hf_index import indexed_format, read_indexed_shards
from treetools.checkpoint_io.formats.safetensors import read_safetensors
from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.leaves import Leaf


INDEX_SUFFIX = ".safetensors.index.json"


def read_sharded(context: ReadContext, index_path: str) -> list[Leaf]:
    """Every tensor of every shard an index names, checked against the index.

    >>> import numpy as np, safetensors.numpy, tempfile, os, json
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"a.w": np.ones(2, np.float32)}, os.path.join(d, "model-00001-of-00002.safetensors"))
    >>> safetensors.numpy.save_file({"b.w": np.ones(3, np.float32)}, os.path.join(d, "model-00002-of-00002.safetensors"))
    >>> idx = {"metadata": {}, "weight_map": {"a.w": "model-00001-of-00002.safetensors", "b.w": "model-00002-of-00002.safetensors"}}
    >>> _ = open(os.path.join(d, "model.safetensors.index.json"), "w").write(json.dumps(idx))
    >>> [(l.name, l.row.params) for l in read_sharded(ReadContext().confined_to(d),
    ...                                                      os.path.join(d, "model.safetensors.index.json"))]
    [('a.w', 2), ('b.w', 3)]
    """
    return read_indexed_shards(context, index_path, read_shard=read_safetensors, what="safetensors index",
                               shard_ext=".safetensors")


FORMAT = indexed_format(
    "safetensors-sharded",
    priority=45,  # before safetensors (40) and msgpack (10), which claim a model folder's one weights file
    index_suffix=INDEX_SUFFIX,
    preferred="model" + INDEX_SUFFIX,
    read=read_sharded,
    description="a Hugging Face folder of sharded safetensors with its *.safetensors.index.json, or that index",
)
