"""Hugging Face Flax sharded checkpoints: ``flax_model-0000k-of-0000N.msgpack`` plus ``flax_model.msgpack.index.json``.

This is what transformers' ``FlaxPreTrainedModel.save_pretrained(dir,
max_shard_size=...)`` writes when the params do not fit one shard: the params
are flattened with ``/`` (``flatten_dict(params, sep="/")``), cut into shards
in key order, and each shard is saved as ``to_bytes(unflatten_dict(shard,
sep="/"))``, a nested Flax msgpack; the index's ``weight_map`` maps each
``/``-joined name to its shard file. PATH may be the folder or the index file.

All shards form one item (``default``) whose leaf paths are the index's names.
The index and the shards are checked against each other, like sharded
safetensors (``hf_sharded.py``): a missing shard, a name the index places in a
shard that does not hold it, or a tensor a shard holds that the index does not
list, is one clear error. msgpack has no index of its own, so each shard is
walked once for its structure (as a Flax msgpack file is) and its arrays are
read from their offsets. A single unsharded ``flax_model.msgpack`` is a
``msgpack`` file.
"""

from __future__ import annotations

from treetools.checkpoint_io.formats._hf_index import indexed_format, read_indexed_shards
from treetools.checkpoint_io.formats.msgpack import read_msgpack
from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.leaves import Leaf


INDEX_SUFFIX = ".msgpack.index.json"
_PREFERRED = "flax_model" + INDEX_SUFFIX  # transformers' FLAX_WEIGHTS_INDEX_NAME


def read_flax_sharded(context: ReadContext, index_path: str) -> list[Leaf]:
    """Every leaf of every shard a Flax msgpack index names, checked against the index; paths are the index's names.

    >>> import numpy as np, tempfile, os, json
    >>> from flax.serialization import to_bytes
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "flax_model-00001-of-00002.msgpack"), "wb").write(to_bytes({"a": {"w": np.ones(2)}}))
    >>> _ = open(os.path.join(d, "flax_model-00002-of-00002.msgpack"), "wb").write(to_bytes({"b": {"w": np.ones(3)}}))
    >>> idx = {"metadata": {}, "weight_map": {"a/w": "flax_model-00001-of-00002.msgpack",
    ...                                       "b/w": "flax_model-00002-of-00002.msgpack"}}
    >>> _ = open(os.path.join(d, "flax_model.msgpack.index.json"), "w").write(json.dumps(idx))
    >>> [(l.name, l.row.params) for l in read_flax_sharded(ReadContext().confined_to(d),
    ...                                                           os.path.join(d, "flax_model.msgpack.index.json"))]
    [('a/w', 2), ('b/w', 3)]
    """
    return read_indexed_shards(context, index_path, read_shard=read_msgpack, what="Flax msgpack index", shard_ext=".msgpack")


FORMAT = indexed_format(
    "flax-sharded",
    priority=45,  # before safetensors (40) and msgpack (10), which claim a model folder's one weights file
    index_suffix=INDEX_SUFFIX,
    preferred=_PREFERRED,
    read=read_flax_sharded,
    description="a Hugging Face Flax folder of flax_model-*-of-*.msgpack shards with flax_model.msgpack.index.json, "
                "or that index",
)
