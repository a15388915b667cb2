"""EasyDeL checkpoints, written as EasyDeL (through eformer) writes them (neither installs here: eformer needs
ray and an fsspec older than the project's).

Follows erfanzar/EasyDeL at commit 090a03b2e0b3606bd38e0e3fcfdc640cd7e6e246 and erfanzar/eformer at commit
4b17881393601885298725e5aef82592c325f19a:

- ``save_pretrained`` (EasyDeL ``easydel/infra/mixins/bridge.py``, ``_save_model_files``): ``config.json``
  (the model config, ``architectures`` set), then the model's ``nn.Param`` state as a pure dict saved by
  eformer's ``Checkpointer.save_pytree(tree, prefix="model")`` (no step: into the folder itself), then
  ``README.md``.
- eformer ``eformer/serialization/async_manager.py`` ``AsyncCheckpointManager.save_pytree`` and
  ``eformer/serialization/serialization.py`` ``tree_serialize_leaves``: every leaf's name is its jax key path
  joined with ``.`` and prefixed with the prefix (``model.layers.0.q_proj.kernel``); the array is written by
  jax's ``GlobalAsyncCheckpointManager.serialize_with_paths`` at that name split into folders
  (``model/layers/0/q_proj/kernel``: zarr v2, zstd), which this writer calls too; then
  ``tensorstore_index.json`` = ``{"format": "tensorstore", "version", "prefixes": {prefix: [{"path", "shape",
  "dtype"}]}}`` (one file for every prefix of the folder, updated per save), ``<prefix>_structure.json``
  (``"format": "pytree-structure"``, the pickled treedef in base64, ``leaf_keys_full``, ``array_keys``,
  ``array_relpaths``, ...) and ``checkpoint_metadata.json``.
- A trainer save (``easydel/trainers/base_trainer.py`` ``_save_state``, ``easydel/infra/base_state.py``
  ``save_state``) goes to ``<save_directory>/run-<step>/`` (``training_configurations.py``
  ``_get_save_directory_milestone``): ``easydel-training-arguments.json`` and ``README.md``, the optimizer
  state (``save_pytree(opt_state, prefix="tx")``), the model (``save_pretrained`` as above), and last
  ``metadata.json`` = ``{"step", "timestamp", "is_temporary": false, "has_optimizer_state",
  "has_resume_model"}``: a run folder without it did not finish.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.array_serialization.serialization import GlobalAsyncCheckpointManager

from tests._writers._tree import flat_with_names

EFORMER_VERSION = "0.1.0"  # eformer/__init__.py __version__ at the commit above


def save_pytree(directory: Any, tree: Any, prefix: str) -> None:
    """eformer's ``AsyncCheckpointManager.save_pytree(pytree, path, prefix=prefix)`` (TensorStore backend)."""
    root = os.fspath(directory)
    os.makedirs(root, exist_ok=True)
    treedef = jax.tree_util.tree_structure(tree, is_leaf=lambda x: x is None)
    flat = flat_with_names(tree, sep=".")  # the trees written here hold no None leaves: same leaves as treedef's
    names = [f"{prefix}.{name}" if name else prefix for name in flat]
    arrays = [jnp.asarray(x) for x in flat.values()]
    relpaths = [os.path.join(*name.split(".")) for name in names]
    manager = GlobalAsyncCheckpointManager()
    manager.serialize_with_paths(arrays, [os.path.join(root, rel) for rel in relpaths])
    manager.wait_until_finished()

    index_path = os.path.join(root, "tensorstore_index.json")
    index = {"format": "tensorstore", "version": EFORMER_VERSION, "prefixes": {}}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    index["prefixes"][prefix] = [{"path": rel, "shape": list(a.shape), "dtype": str(a.dtype)}
                                 for rel, a in zip(relpaths, arrays)]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    structure = {
        "format": "pytree-structure", "version": EFORMER_VERSION, "backend": "tensorstore", "prefix": prefix,
        "treedef_b64": base64.b64encode(pickle.dumps(treedef)).decode("utf-8"),
        "leaf_keys_full": names, "arr_mask": [True] * len(names), "array_keys": names,
        "array_relpaths": relpaths, "nonarray_payload": {}, "safetensors_file": None, "extras": {},
    }
    with open(os.path.join(root, f"{prefix}_structure.json"), "w") as f:
        json.dump(structure, f, indent=2)
    meta = {"version": EFORMER_VERSION, "timestamp": datetime.datetime.now().isoformat(), "checksum": {},
            "array_metadata": {}, "framework_version": None, "custom_metadata": {}}
    with open(os.path.join(root, "checkpoint_metadata.json"), "w") as f:
        json.dump(meta, f, indent=2)


def save_pretrained(directory: Any, params: dict[str, Any], *, model_type: str = "llama",
                    architecture: str = "LlamaForCausalLM") -> str:
    """``model.save_pretrained(directory)``: config.json, the params under ``model/``, README.md."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": [architecture], "model_type": model_type, "hidden_size": 4}, f, indent=2)
    save_pytree(directory, params, "model")
    readme = os.path.join(directory, "README.md")
    if not os.path.exists(readme):
        with open(readme, "w") as f:
            f.write(f"# {os.path.basename(directory)}\n\nAn EasyDeL model.\n")
    return directory


def save_run(save_directory: Any, step: int, params: dict[str, Any], opt_state: Any = None, *,
             finish: bool = True) -> str:
    """A trainer save of step ``step``: ``<save_directory>/run-<step>/``; returns that folder.

    Args:
      opt_state: saved under the prefix ``tx`` when given (``save_optimizer_state``).
      finish: False stops before ``metadata.json``, as an interrupted save leaves the folder.
    """
    directory = os.path.join(os.fspath(save_directory), f"run-{step}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "easydel-training-arguments.json"), "w") as f:
        json.dump({"model_name": "tiny", "save_steps": 10}, f)
    if opt_state is not None:
        save_pytree(directory, opt_state, "tx")
    save_pretrained(directory, params)
    if finish:
        meta = {"step": int(step), "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "is_temporary": False, "has_optimizer_state": opt_state is not None, "has_resume_model": False}
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            f.write(json.dumps(meta))
    return directory
