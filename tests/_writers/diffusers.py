"""diffusers' Flax model folders and pipelines, written as diffusers writes them (diffusers' Flax classes are
deprecated and need transformers' Flax models, which transformers 5 removed: neither installs here).

Follows huggingface/diffusers at commit 38749fc44a4ea7232558bfa1fe928d1910282104
(``src/diffusers/models/modeling_flax_utils.py`` ``FlaxModelMixin.save_pretrained``: ``save_config`` writes
``config.json`` (``_class_name``, ``_diffusers_version`` and the model's arguments), then
``flax.serialization.to_bytes(params)`` into ``diffusion_flax_model.msgpack``) and at commit
0397776dff71b8ddcfdba313e68a5936244020e9 (``src/diffusers/pipelines/pipeline_flax_utils.py``
``FlaxDiffusionPipeline.save_pretrained(save_directory, params)``: ``save_config`` writes ``model_index.json``
(``_class_name``, ``_diffusers_version``, and ``component: [library, class]``), then each component is saved in
the folder of its name, ``params[component]`` passed to those whose save method takes params: diffusers models
as above, transformers Flax models (``FlaxPreTrainedModel.save_pretrained``: ``config.json`` and
``flax_model.msgpack``, one shard), schedulers as ``scheduler_config.json`` only).
"""

from __future__ import annotations

import json
import os
from typing import Any

from flax.serialization import to_bytes

DIFFUSERS_VERSION = "0.30.0"


def save_model(directory: Any, params: Any, class_name: str) -> str:
    """``FlaxModelMixin.save_pretrained(directory, params)``."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, "sample_size": 8}, f, indent=2)
    with open(os.path.join(directory, "diffusion_flax_model.msgpack"), "wb") as f:
        f.write(to_bytes(params))
    return directory


def save_transformers_model(directory: Any, params: Any, architecture: str) -> str:
    """``FlaxPreTrainedModel.save_pretrained(directory, params=params)`` of a model that fits one shard."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": [architecture], "model_type": "clip_text_model"}, f, indent=2)
    with open(os.path.join(directory, "flax_model.msgpack"), "wb") as f:
        f.write(to_bytes(params))
    return directory


def save_pipeline(directory: Any, params: dict[str, Any]) -> str:
    """``FlaxStableDiffusionPipeline.save_pretrained(directory, params)`` with a UNet, a VAE, a CLIP text encoder
    (transformers) and a scheduler (no weights)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    components = {"scheduler": ["diffusers", "FlaxPNDMScheduler"], "text_encoder": ["transformers", "FlaxCLIPTextModel"],
                  "unet": ["diffusers", "FlaxUNet2DConditionModel"], "vae": ["diffusers", "FlaxAutoencoderKL"]}
    with open(os.path.join(directory, "model_index.json"), "w") as f:
        json.dump({"_class_name": "FlaxStableDiffusionPipeline", "_diffusers_version": DIFFUSERS_VERSION,
                   **components}, f, indent=2)
    for name, (library, class_name) in components.items():
        folder = os.path.join(directory, name)
        if name == "scheduler":
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "scheduler_config.json"), "w") as f:
                json.dump({"_class_name": class_name, "num_train_timesteps": 1000}, f, indent=2)
        elif library == "transformers":
            save_transformers_model(folder, params[name], class_name[len("Flax"):])
        else:
            save_model(folder, params[name], class_name)
    return directory
