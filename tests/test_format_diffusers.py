"""diffusers Flax model folders and pipelines (issue 37), written as diffusers writes them
(tests/_writers/diffusers.py names the files and commits): a pipeline is one checkpoint with one item per
component holding weights; each component folder reads alone. The truth is the params the writer saved.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_inspect,
                                  check_load_parameters, check_restore, check_show, check_stats, check_verify,
                                  inspect_json, run, flat_arrays)
from tests._writers.diffusers import save_model, save_pipeline


def _params(delta: float = 0.0) -> dict:
    rng = np.random.default_rng(0)
    return {
        "unet": {"conv_in": {"kernel": rng.standard_normal((3, 3, 4, 8)).astype(np.float32) + delta,
                             "bias": np.zeros(8, np.float32)},
                 "time_embedding": {"linear_1": {"kernel": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)}}},
        "vae": {"encoder": {"conv_in": {"kernel": rng.standard_normal((3, 3, 3, 4)).astype(np.float32)}}},
        "text_encoder": {"text_model": {"embeddings": {"token_embedding": {
            "embedding": rng.standard_normal((10, 4)).astype(np.float32)}}}},
    }


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusers") / "sd-tiny"
    params = _params()
    save_pipeline(root, params)
    return root, params


def test_pipeline_one_item_per_component(pipeline):
    root, params = pipeline
    report = inspect_json(root)
    assert report["format"] == "diffusers" and report["steps"] is None
    assert list(report["checkpoints"][0]["items"]) == ["text_encoder", "unet", "vae"]  # model_index.json's order
    rc, _, err = run("inspect", root)
    assert rc == 0 and "scheduler" in err  # configuration-only components named in a note
    for name in ("unet", "vae", "text_encoder"):
        check_inspect(root, flat_arrays(params[name]), item=name)
        check_show(root, flat_arrays(params[name]), item=name)
        check_stats(root, flat_arrays(params[name]), item=name)
        check_load_parameters(root, flat_arrays(params[name]), item=name)
        check_restore(root, flat_arrays(params[name]), item=name)
    check_verify(root)
    rules = tt.Rules(rename=[(r"^conv_in/", "stem/")])
    unet = flat_arrays(params["unet"])
    check_restore(root, unet, item="unet", rules=rules,
                  expect={k.replace("conv_in/", "stem/", 1): v for k, v in unet.items()})


def test_load_parameters_and_convert_take_the_unet(pipeline, tmp_path):
    root, params = pipeline
    check_load_parameters(root, flat_arrays(params["unet"]))
    check_convert(root, flat_arrays(params["vae"]), tmp_path / "vae", item="vae")
    check_convert(root, flat_arrays(params["unet"]), tmp_path)


def test_each_component_reads_alone(pipeline):
    root, params = pipeline
    unet = check_inspect(root / "unet", flat_arrays(params["unet"]))
    assert unet["format"] == "diffusers"
    rc, _, err = run("inspect", root / "unet")
    assert rc == 0 and "component `unet`" in err
    check_inspect(root / "text_encoder", flat_arrays(params["text_encoder"]))  # transformers' flax_model.msgpack
    check_load_parameters(root / "vae", flat_arrays(params["vae"]))
    check_verify(root / "unet")


def test_a_model_folder_and_diff(tmp_path):
    a = save_model(tmp_path / "a", _params()["unet"], "FlaxUNet2DConditionModel")
    b = save_model(tmp_path / "b", _params(delta=0.5)["unet"], "FlaxUNet2DConditionModel")
    check_diff_names_the_changed_leaf(a, b, "conv_in/kernel", 0.5)
    rc, out, err = run("diff", tmp_path / "a", tmp_path / "a")
    assert rc == 0, out + err


def _save_sharded(folder, tensors: dict, stem: str, shards: int = 2) -> None:
    """A component saved as diffusers/transformers shard one too large for a file (``huggingface_hub``'s
    ``split_state_dict_into_shards``: ``{stem}-0000k-of-0000N.safetensors`` and ``{stem}.safetensors.index.json``
    with ``metadata.total_size`` and ``weight_map``)."""
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.nbytes for t in tensors.values())
    (folder / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def test_a_pipeline_with_sharded_and_variant_components(tmp_path):
    # Issue 49: a PyTorch pipeline (SDXL-like) whose transformer and second text encoder are sharded, and whose VAE
    # was saved only as the fp16 variant: every component is an item, read from its shards or its variant file.
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    transformer = {f"blocks.{i}.attn.to_q.weight": rng.standard_normal((4, 4)).astype(np.float32) for i in range(3)}
    encoder = {"text_model.embeddings.token_embedding.weight": rng.standard_normal((10, 4)).astype(np.float32),
               "text_model.final_layer_norm.weight": rng.standard_normal(4).astype(np.float32)}
    vae = {"encoder.conv_in.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float16)}
    root = tmp_path / "pipe"
    _save_sharded(root / "transformer", transformer, "diffusion_pytorch_model", shards=2)
    _save_sharded(root / "text_encoder_2", encoder, "model", shards=2)
    (root / "vae").mkdir(parents=True)
    save_file(vae, str(root / "vae" / "diffusion_pytorch_model.fp16.safetensors"))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "_diffusers_version": "0.30.0", "scheduler": ["diffusers", "X"],
        "text_encoder_2": ["transformers", "T5EncoderModel"], "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"]}))
    report = inspect_json(root)
    assert report["format"] == "diffusers"
    assert list(report["checkpoints"][0]["items"]) == ["text_encoder_2", "transformer", "vae"]
    rc, _, err = run("inspect", root)
    assert rc == 0 and "diffusion_pytorch_model.fp16.safetensors" in err  # the variant read is named
    for name, tensors in (("transformer", transformer), ("text_encoder_2", encoder), ("vae", vae)):
        check_inspect(root, tensors, item=name)
        check_show(root, tensors, item=name)
        check_load_parameters(root, tensors, item=name)
    check_load_parameters(root, transformer)  # the denoising model by default
    check_verify(root)
    check_inspect(root / "transformer", transformer)  # the sharded component alone
    # A shard the index names, missing: that component is listed unread with the reason, the others are read,
    # and the exit code says the read was partial (1; --allow-unread: 0).
    (root / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    rc, out, err = run("inspect", root, "--format", "json")
    assert rc == 1, err
    report = json.loads(out)
    (unread,) = report["checkpoints"][0]["unreadable"]
    assert unread["item"] == "transformer" and "diffusion_pytorch_model-00002-of-00002.safetensors" in unread["reason"]
    assert list(report["checkpoints"][0]["items"]) == ["text_encoder_2", "vae"]
    assert run("inspect", root, "--allow-unread")[0] == 0
