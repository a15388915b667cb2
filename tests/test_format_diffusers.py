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
