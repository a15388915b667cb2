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
parsed whole (held to the memory budget at twice its size, as a Flax msgpack
file is). A single unsharded ``flax_model.msgpack`` is a ``msgpack`` file.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from treetools.errors import CheckpointError
from treetools.inspect.formats.msgpack import read_msgpack
from treetools.inspect.source import FileSource, Format, Leaf, check_name
from treetools.steps import read_json_file

__all__ = ["FORMAT", "find_index", "read_flax_sharded", "read_indexed_shards"]

INDEX_SUFFIX = ".msgpack.index.json"
_PREFERRED = "flax_model" + INDEX_SUFFIX  # transformers' FLAX_WEIGHTS_INDEX_NAME


def find_index(path: str, suffix: str, preferred: str) -> str | None:
    """The index at ``path``: itself when it ends in ``suffix``, else the folder's ``preferred`` or first such file."""
    if os.path.isfile(path) and path.endswith(suffix):
        return path
    if os.path.isdir(path):
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(suffix))
        except OSError:
            return None
        if names:
            return os.path.join(path, preferred if preferred in names else names[0])
    return None


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def read_indexed_shards(index_path: str, *, read_shard: Callable[[str], list[Leaf]], what: str,
                        shard_ext: str) -> list[Leaf]:
    """Every leaf of every shard a Hugging Face index names, the index and the shards checked against each other.

    Works for any ``{"weight_map": {name: shard file}}`` index (sharded
    msgpack, sharded safetensors): a missing shard, a name the index places in
    a shard that does not hold it, a leaf a shard holds that the index does not
    list, or a file of the index's shard family (``<stem>-0000k-of-0000N<shard_ext>``)
    that the index never names is one ``CheckpointError``.

    Args:
      index_path: the index JSON.
      read_shard: one shard file -> its leaves (named as the index names them).
      what: the index's kind, for messages (``Flax msgpack index``).
      shard_ext: the shard files' ending (``.msgpack``).
    """
    index = read_json_file(index_path, what=what)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: not a {what} (no `weight_map` of tensor name -> shard file).")
    folder = os.path.dirname(index_path)
    leaves: list[Leaf] = []
    for shard in dict.fromkeys(sorted(weight_map.values())):  # shard files sort in their -0000k-of- order
        check_name(shard, where=index_path)
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointError(f"{index_path}: shard {shard!r} named by the index is missing from {folder or '.'}.")
        held = read_shard(shard_path)
        listed = {name for name, s in weight_map.items() if s == shard}
        names = {leaf.name for leaf in held}
        unlisted, absent = sorted(names - listed), sorted(listed - names)
        if unlisted:
            raise CheckpointError(f"{shard_path}: holds tensors the index does not list ({_listed(unlisted)}); "
                                  "the index and the shards disagree.")
        if absent:
            raise CheckpointError(f"{index_path}: places {_listed(absent)} in {shard!r}, which does not hold them; "
                                  "the index and the shards disagree.")
        leaves += held
    stem = os.path.basename(index_path).split(".")[0]
    family = re.compile(re.escape(stem) + r"-\d+-of-\d+" + re.escape(shard_ext) + "$")
    try:
        stray = sorted(n for n in os.listdir(folder or ".") if family.match(n) and n not in weight_map.values())
    except OSError:
        stray = []
    if stray:
        raise CheckpointError(f"{index_path}: shard files the index does not name ({_listed(stray)}) sit beside it; "
                              "the index and the shards disagree.")
    return leaves


def read_flax_sharded(index_path: str) -> list[Leaf]:
    """Every leaf of every shard a Flax msgpack index names, checked against the index; paths are the index's names.

    >>> import numpy as np, tempfile, os, json
    >>> from flax.serialization import to_bytes
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "flax_model-00001-of-00002.msgpack"), "wb").write(to_bytes({"a": {"w": np.ones(2)}}))
    >>> _ = open(os.path.join(d, "flax_model-00002-of-00002.msgpack"), "wb").write(to_bytes({"b": {"w": np.ones(3)}}))
    >>> idx = {"metadata": {}, "weight_map": {"a/w": "flax_model-00001-of-00002.msgpack",
    ...                                       "b/w": "flax_model-00002-of-00002.msgpack"}}
    >>> _ = open(os.path.join(d, "flax_model.msgpack.index.json"), "w").write(json.dumps(idx))
    >>> [(l.name, l.row.params) for l in read_flax_sharded(os.path.join(d, "flax_model.msgpack.index.json"))]
    [('a/w', 2), ('b/w', 3)]
    """
    return read_indexed_shards(index_path, read_shard=read_msgpack, what="Flax msgpack index", shard_ext=".msgpack")


def _open(local: str, display: str) -> FileSource:
    index = find_index(local, INDEX_SUFFIX, _PREFERRED)
    if index is None:  # claims() said so; the folder changed since
        raise CheckpointError(f"{display}: no *{INDEX_SUFFIX} index in it.")
    return FileSource(display, "flax-sharded", read_flax_sharded(index))


FORMAT = Format(
    name="flax-sharded",
    priority=45,
    claims=lambda path: find_index(path, INDEX_SUFFIX, _PREFERRED) is not None,
    open=_open,
    description="a Hugging Face Flax folder of flax_model-*-of-*.msgpack shards with flax_model.msgpack.index.json, "
                "or that index",
)
