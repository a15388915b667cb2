"""diffusers model folders and pipelines (Flax ``save_pretrained``, and the PyTorch safetensors alike).

* A **component folder** (``FlaxModelMixin.save_pretrained``: ``unet/``,
  ``vae/``, ``controlnet/``) holds ``config.json`` and the parameters as
  ``flax.serialization.to_bytes`` in ``diffusion_flax_model.msgpack`` (PyTorch
  models: ``diffusion_pytorch_model.safetensors``): one checkpoint, item
  ``default``, read as that file is.
* A **pipeline** (``FlaxDiffusionPipeline.save_pretrained(dir, params=...)``)
  writes ``model_index.json`` (component name -> its library and class) and
  each component in a folder of its name: diffusers models as above,
  transformers models (``text_encoder/``, ``safety_checker/``) as
  ``flax_model.msgpack`` (or ``model.safetensors``), schedulers, tokenizers
  and feature extractors as configuration only. The pipeline is one
  checkpoint with one item per component that holds weights, in
  ``model_index.json``'s order; the components without weights are named in a
  note. ``load_parameters`` (and ``convert``) read the denoising model
  (``unet``, else ``transformer``, else ``prior``, else the first), with a
  note; ``item=`` (``--item``) picks another component.

Each component folder is also readable alone (PATH ``pipeline/unet``).

A component too large for one file is **sharded** as transformers and
diffusers shard it (``diffusion_pytorch_model-00001-of-00003.safetensors`` with
``diffusion_pytorch_model.safetensors.index.json``; ``model-0000k-of-0000N``
with ``model.safetensors.index.json`` for a transformers component; the Flax
``*.msgpack.index.json`` alike): read through its index, checked against its
shards as ``hf_sharded`` does. A component saved only as a **variant**
(``save_pretrained(..., variant="fp16")``: ``diffusion_pytorch_model.fp16.safetensors``,
``model.fp16.safetensors``) is read from that file, named in a note; the plain
file is preferred where both are present.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Sequence

from treetools.checkpoint_io.context import ReadContext
from treetools.checkpoint_io.formats.hf_flax_sharded import read_flax_sharded
from treetools.checkpoint_io.formats.hf_sharded import read_sharded
from treetools.checkpoint_io.formats.msgpack import read_msgpack
from treetools.checkpoint_io.formats.safetensors import read_safetensors
from treetools.checkpoint_io.leaves import Item, Leaf, Snapshot, Unreadable, check_name
from treetools.checkpoint_io.readers import read_metadata
from treetools.checkpoint_io.source import FileSource, Format, Source
from treetools.checkpoint_io.storage import Storage, normalize
from treetools.shared.errors import CheckpointError

PIPELINE_INDEX = "model_index.json"
MODEL_FILES: tuple[tuple[str, Callable[[ReadContext, str], list[Leaf]]], ...] = (
    ("diffusion_flax_model.msgpack", read_msgpack),
    ("diffusion_pytorch_model.safetensors", read_safetensors),
    ("diffusion_pytorch_model.safetensors.index.json", read_sharded),
    ("diffusion_flax_model.msgpack.index.json", read_flax_sharded),
)
"""A diffusers model folder's weights file (``FLAX_WEIGHTS_NAME``, ``SAFETENSORS_WEIGHTS_NAME``, and the index of
the sharded ones, ``SAFETENSORS_WEIGHTS_INDEX_NAME``...)."""
COMPONENT_FILES = MODEL_FILES + (("flax_model.msgpack", read_msgpack), ("model.safetensors", read_safetensors),
                                 ("model.safetensors.index.json", read_sharded),
                                 ("flax_model.msgpack.index.json", read_flax_sharded))
"""A pipeline component's weights file: a diffusers model's, or a transformers model's."""
_VARIANT = re.compile(r"(diffusion_pytorch_model|model)\.([A-Za-z0-9_]+)\.safetensors")
"""A variant's single weights file (diffusers' ``_add_variant``: ``diffusion_pytorch_model.fp16.safetensors``)."""
MAIN_COMPONENTS = ("unet", "transformer", "prior", "decoder")
"""The component ``load_parameters`` reads from a pipeline (the denoising model), the first present."""


def weights_of(storage: Storage, folder: str, files: Sequence[tuple[str, Any]] = COMPONENT_FILES
               ) -> tuple[str, Callable[[ReadContext, str], list[Leaf]]] | None:
    """The weights file of a model folder and its reader, the first of ``files`` present."""
    for name, read in files:
        path = os.path.join(folder, name)
        if storage.isfile(path):
            return path, read
    model_only = files is MODEL_FILES
    try:
        names = sorted(storage.listdir(folder))
    except OSError:
        return None
    for name in names:  # no plain file: a variant's (fp16, ema, ...), the first in name order
        match = _VARIANT.fullmatch(name)
        if match and not (model_only and match.group(1) == "model") and storage.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name), read_safetensors
    return None


def _components(context: ReadContext, root: str) -> tuple[dict[str, str], list[str]]:
    """``{component: folder}`` of a pipeline's components holding weights, in ``model_index.json``'s order, and
    the names of those holding none (a scheduler, a tokenizer)."""
    storage = context.storage
    index_path = os.path.join(root, PIPELINE_INDEX)
    index = read_metadata(context, index_path, what=f"diffusers {PIPELINE_INDEX}")
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_path}: not a diffusers pipeline index (not an object).")
    names = [k for k in index if isinstance(k, str) and not k.startswith("_")]
    listed = set(names)
    try:  # a component folder the index does not list still holds weights: never left out
        names += [d for d in sorted(storage.listdir(root)) if d not in listed and storage.isdir(os.path.join(root, d))]
    except OSError:
        pass
    found, without = {}, []
    for name in names:
        check_name(name, where=index_path)
        folder = os.path.join(root, name)
        if storage.isdir(folder) and weights_of(storage, folder) is not None:
            found[name] = folder
        elif name in listed:
            without.append(name)
    return found, without


class PipelineSource(Source):
    """A diffusers pipeline folder: one item per component that holds weights."""

    format = "diffusers"

    def __init__(self, location: str, display: str, context: ReadContext):
        self.location = location
        self._components, without = _components(context, location)
        super().__init__(display, context)
        if not self._components:
            raise CheckpointError(f"{display}: a diffusers pipeline ({PIPELINE_INDEX}) whose component folders hold "
                                  "no weights file (diffusion_flax_model.msgpack, flax_model.msgpack, *.safetensors).")
        if without:
            self.notes.append(f"{display}: components without weights (configuration only), not shown: "
                              f"{', '.join(without)}.")
        for name, folder in self._components.items():
            file, _ = weights_of(context.storage, folder)
            if _VARIANT.fullmatch(os.path.basename(file)):
                self.notes.append(f"{display}: component `{name}` has only a variant's weights; read "
                                  f"{os.path.basename(file)}.")

    def item_names(self, step: int | None) -> list[str]:
        return list(self._components)

    def default_item(self, step: int | None) -> str | None:
        return next((n for n in MAIN_COMPONENTS if n in self._components), next(iter(self._components)))

    def read_items(self, step: int | None, names: Sequence[str]) -> Snapshot:
        items, unreadable = {}, []
        for name in names:
            file, read = weights_of(self.storage, self._components[name])
            try:
                items[name] = Item(name, "pytree", list(read(self.context, file)))
            except CheckpointError as e:  # a broken component (a shard missing) is listed; the others are read
                unreadable.append(Unreadable(name, os.path.basename(file), str(e)))
        return Snapshot(None, items, unreadable=unreadable)


def _is_pipeline(storage: Storage, location: str) -> bool:
    return storage.isdir(location) and storage.isfile(os.path.join(location, PIPELINE_INDEX))


def _claims(location: str, context: ReadContext) -> bool:
    storage = context.storage
    if _is_pipeline(storage, location):
        return True
    return storage.isdir(location) and weights_of(storage, location, MODEL_FILES) is not None


def _open(location: str, display: str, context: ReadContext) -> Source:
    storage = context.storage
    if _is_pipeline(storage, location):
        return PipelineSource(location, display, context)
    file, read = weights_of(storage, location, MODEL_FILES)
    note = [f"{display}: a diffusers model folder; read {os.path.basename(file)}."]
    parent = os.path.dirname(normalize(location))
    if parent != normalize(location) and _is_pipeline(storage, parent):
        note.append(f"{display} is the component `{os.path.basename(normalize(location))}` of the diffusers pipeline "
                    f"{os.path.dirname(display.rstrip('/')) or '.'}, which reads every component.")
    return FileSource(display, context, "diffusers", read(context, file), notes=note)


FORMAT = Format(
    name="diffusers",
    priority=46,  # before safetensors (40) and msgpack (10): a pipeline root, or a model folder of diffusers' names
    claims=_claims,
    open=_open,
    description="diffusers folders",
)
