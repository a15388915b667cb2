"""Hugging Face sharded safetensors: ``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``.

PATH may be the folder or the index file itself. Every shard's tensors form
one item (``default``), names kept exactly as stored. The index and the
shards are checked against each other: a shard the index names that is
missing, a tensor the index places in a shard that does not hold it, or a
tensor a shard holds that the index does not list, is one clear error.
Each shard is read like a single ``.safetensors`` file (header only; tensor
bytes read a block at a time on request).
"""

from __future__ import annotations

import os

from treetools.errors import CheckpointError
from treetools.inspect.formats.safetensors import read_safetensors
from treetools.inspect.source import FileSource, Format, Leaf, check_name
from treetools.steps import read_json_file

__all__ = ["FORMAT", "read_sharded"]

INDEX_SUFFIX = ".safetensors.index.json"


def _index_file(path: str) -> str | None:
    if os.path.isfile(path) and path.endswith(INDEX_SUFFIX):
        return path
    if os.path.isdir(path):
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        except OSError:
            return None
        if names:
            preferred = [n for n in names if n == "model" + INDEX_SUFFIX]
            return os.path.join(path, (preferred or names)[0])
    return None


def read_sharded(index_path: str) -> list[Leaf]:
    """Every tensor of every shard an index names, checked against the index.

    >>> import numpy as np, safetensors.numpy, tempfile, os, json
    >>> d = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"a.w": np.ones(2, np.float32)}, os.path.join(d, "model-00001-of-00002.safetensors"))
    >>> safetensors.numpy.save_file({"b.w": np.ones(3, np.float32)}, os.path.join(d, "model-00002-of-00002.safetensors"))
    >>> idx = {"metadata": {}, "weight_map": {"a.w": "model-00001-of-00002.safetensors", "b.w": "model-00002-of-00002.safetensors"}}
    >>> _ = open(os.path.join(d, "model.safetensors.index.json"), "w").write(json.dumps(idx))
    >>> [(l.name, l.row.params) for l in read_sharded(os.path.join(d, "model.safetensors.index.json"))]
    [('a.w', 2), ('b.w', 3)]
    """
    index = read_json_file(index_path, what="safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: not a safetensors index (no `weight_map` of tensor name -> shard file).")
    folder = os.path.dirname(index_path)
    shards = list(dict.fromkeys(weight_map.values()))
    leaves: list[Leaf] = []
    for shard in shards:
        check_name(shard, where=index_path)
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(f"{index_path}: shard {shard!r} named by the index is missing from {folder or '.'}.")
        held = read_safetensors(shard_path)
        listed = {name for name, s in weight_map.items() if s == shard}
        names = {leaf.name for leaf in held}
        unlisted = sorted(names - listed)
        if unlisted:
            raise CheckpointError(
                f"{shard_path}: holds tensors the index does not list ({', '.join(unlisted[:5])}"
                f"{', ...' if len(unlisted) > 5 else ''}); the index and the shards disagree."
            )
        absent = sorted(listed - names)
        if absent:
            raise CheckpointError(
                f"{index_path}: places {', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''} in {shard!r}, "
                "which does not hold them; the index and the shards disagree."
            )
        leaves += held
    order = {name: i for i, name in enumerate(weight_map)}
    return sorted(leaves, key=lambda leaf: order.get(leaf.name, len(order)))


def _open(local: str, display: str) -> FileSource:
    index = _index_file(local)
    assert index is not None  # claims() said so
    return FileSource(display, "safetensors-sharded", read_sharded(index))


FORMAT = Format(
    name="safetensors-sharded",
    priority=45,
    claims=lambda path: _index_file(path) is not None,
    open=_open,
    description="a Hugging Face folder of sharded safetensors with its *.safetensors.index.json, or that index",
)
