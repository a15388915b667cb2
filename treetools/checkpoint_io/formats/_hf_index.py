"""Hugging Face model folders: the sharded-checkpoint index, and the one weights file of an unsharded folder.

Not a format (its name starts with ``_``): ``hf_sharded.py`` and
``hf_flax_sharded.py`` are each ``indexed_format`` with their shard reader,
so both find, open and check an index against its shards the same way; the
``safetensors`` and ``msgpack`` formats read a folder holding one
``model.safetensors`` / ``flax_model.msgpack`` (what ``save_pretrained``
writes when the model fits one shard, beside ``config.json``,
``generation_config.json`` and the tokenizer files) through
``weights_file``, and say which file they read where the folder holds
several (``weights_note``).
"""

from __future__ import annotations

import os
import re
from typing import Callable

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.leaves import Leaf, check_name
from treetools.checkpoint_io.readers import read_metadata
from treetools.checkpoint_io.source import FileSource, Format
from treetools.checkpoint_io.storage import Storage
from treetools.shared.errors import CheckpointError

Reader = Callable[[ReadContext, str], list[Leaf]]
"""A file (or index) -> its leaves, read through the context."""


def find_index(storage: Storage, path: str, suffix: str, preferred: str) -> str | None:
    """The index at ``path``: itself when it ends in ``suffix``, else the folder's ``preferred`` or first such file."""
    if storage.isfile(path) and path.endswith(suffix):
        return path
    if storage.isdir(path):
        try:
            names = sorted(n for n in storage.listdir(path) if n.endswith(suffix))
        except OSError:
            return None
        if names:
            return os.path.join(path, preferred if preferred in names else names[0])
    return None


WEIGHTS_FILES = ("model.safetensors", "flax_model.msgpack", "pytorch_model.bin", "tf_model.h5")
"""The one weights file ``save_pretrained`` writes into an unsharded model folder (PyTorch with safetensors, Flax,
PyTorch pickle, TensorFlow), in the order treetools prefers them: safetensors first (what transformers'
PyTorch ``from_pretrained`` loads first too); the last two are never read (a pickle, a Keras 2 file)."""


def weights_file(storage: Storage, path: str, name: str) -> str | None:
    """The file ``name`` (one of ``WEIGHTS_FILES``) of the model folder ``path``; None when ``path`` is no folder
    holding it. A format's ``claims`` and ``open`` of a model folder.

    >>> import tempfile, os
    >>> from treetools.checkpoint_io.storage import LOCAL
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "flax_model.msgpack"), "wb").write(b"\\x80")
    >>> weights_file(LOCAL, d, "flax_model.msgpack") == os.path.join(d, "flax_model.msgpack")
    True
    >>> weights_file(LOCAL, d, "model.safetensors") is None
    True
    """
    if not storage.isdir(path):
        return None
    file = os.path.join(path, name)
    return file if storage.isfile(file) else None


def weights_note(storage: Storage, folder: str, display: str, read: str) -> list[str]:
    """A note when the model folder ``folder`` holds weights files besides ``read`` (the one opened): which one
    is read, and how to read another that treetools reads."""
    others = [n for n in WEIGHTS_FILES if n != read and storage.isfile(os.path.join(folder, n))]
    if not others:
        return []
    readable = [n for n in others if n in WEIGHTS_FILES[:2]]
    hint = "".join(f"; pass {display.rstrip('/')}/{n} to read that one" for n in readable)
    return [f"{display} holds several weights files ({', '.join([read, *others])}); reading {read} (safetensors "
            f"first, then Flax msgpack; never a PyTorch pickle or a TensorFlow .h5){hint}."]


def open_weights(location: str, display: str, context: ReadContext, *, name: str, format: str,
                 read: Reader) -> FileSource:
    """A weights file, or the file ``name`` of the model folder ``location`` (with ``weights_note``)."""
    storage = context.storage
    file = weights_file(storage, location, name)
    notes = weights_note(storage, location, display, name) if file is not None else []
    return FileSource(display, context, format, read(context, file or location), notes=notes)


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def read_indexed_shards(context: ReadContext, index_path: str, *, read_shard: Reader, what: str,
                        shard_ext: str) -> list[Leaf]:
    """Every leaf of every shard a Hugging Face index names, in the index's order, checked against the shards.

    Works for any ``{"weight_map": {name: shard file}}`` index (sharded
    msgpack, sharded safetensors): a missing shard, a name the index places in
    a shard that does not hold it, a leaf a shard holds that the index does not
    list, or a file of the index's shard family (``<stem>-0000k-of-0000N<shard_ext>``)
    that the index never names is one ``CheckpointError``.

    Args:
      context: how to read them (through ``context.storage``).
      index_path: the index JSON.
      read_shard: ``(context, shard file)`` -> its leaves (named as the index names them).
      what: the index's kind, for messages (``Flax msgpack index``).
      shard_ext: the shard files' ending (``.msgpack``).
    """
    storage = context.storage
    index = read_metadata(context, index_path, what=what)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: not a {what} (no `weight_map` of tensor name -> shard file).")
    folder = os.path.dirname(index_path)
    by_shard: dict[str, set[str]] = {}  # one pass over the index: the check is linear in its size
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    leaves: list[Leaf] = []
    for shard in sorted(by_shard):  # shard files sort in their -0000k-of- order
        check_name(shard, where=index_path)
        shard_path = os.path.join(folder, shard)
        if not storage.isfile(shard_path):
            raise CheckpointError(f"{index_path}: shard {shard!r} named by the index is missing from {folder or '.'}.")
        held = read_shard(context, shard_path)
        listed = by_shard[shard]
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
        stray = sorted(n for n in storage.listdir(folder or ".") if family.match(n) and n not in by_shard)
    except OSError:
        stray = []
    if stray:
        raise CheckpointError(f"{index_path}: shard files the index does not name ({_listed(stray)}) sit beside it; "
                              "the index and the shards disagree.")
    order = {name: i for i, name in enumerate(weight_map)}  # the index's order (the model's), not the shards'
    return sorted(leaves, key=lambda leaf: order.get(leaf.name, len(order)))


def indexed_format(name: str, *, priority: int, index_suffix: str, preferred: str,
                   read: Reader, description: str) -> Format:
    """The ``Format`` of a folder of shards with its index (or the index itself): every shard one item.

    Args:
      name: the format's name.
      priority: as ``Format.priority``.
      index_suffix: how an index file's name ends (``.safetensors.index.json``).
      preferred: the index chosen when a folder holds several (``model.safetensors.index.json``).
      read: ``(context, index file)`` -> every leaf (``read_indexed_shards`` with the shard reader).
      description: for the "not a checkpoint" error.
    """
    def _open(location: str, display: str, context: ReadContext) -> FileSource:
        index = find_index(context.storage, location, index_suffix, preferred)
        if index is None:  # claims() said so; the folder changed since
            raise CheckpointError(f"{display}: no *{index_suffix} index in it.")
        return FileSource(display, context, name, read(context, index))

    def _claims(location: str, context: ReadContext) -> bool:
        return find_index(context.storage, location, index_suffix, preferred) is not None

    return Format(name=name, priority=priority, claims=_claims, open=_open, description=description)
