"""Hugging Face Flax sharded msgpack checkpoints, written as transformers' FlaxPreTrainedModel.save_pretrained does.

transformers is not a dependency: ``write_hf_flax`` follows ``flax_shard_checkpoint`` and ``save_pretrained``
(flatten_dict(params, sep="/"), greedy cut by bytes in key order, each shard saved as
to_bytes(unflatten_dict(shard, sep="/")), index JSON with sort_keys=True) using flax's own functions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax.serialization import to_bytes
from flax.traverse_util import flatten_dict, unflatten_dict

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_tools.report import inspect_path

INDEX = "flax_model.msgpack.index.json"


def write_hf_flax(folder, params, max_shard_size):
    """Save ``params`` like ``save_pretrained(folder, max_shard_size=...)``; returns the flat truth."""
    weights = flatten_dict(params, sep="/")
    blocks, block, size = [], {}, 0
    for name, w in weights.items():
        if size + w.nbytes > max_shard_size and block:
            blocks.append(block)
            block, size = {}, 0
        block[name] = w
        size += w.nbytes
    blocks.append(block)
    assert len(blocks) > 1, "params fit one shard: save_pretrained would write flax_model.msgpack"
    weight_map = {}
    for i, shard in enumerate(blocks, 1):
        name = f"flax_model-{i:05d}-of-{len(blocks):05d}.msgpack"
        (folder / name).write_bytes(to_bytes(unflatten_dict(shard, sep="/")))
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return weights


def _params():
    rng = np.random.default_rng(0)
    return {"bert": {"embeddings": {"word_embeddings": {"embedding": rng.standard_normal((16, 8)).astype(np.float32)}},
                     "encoder": {"layer": {str(i): {"attention": {"query": {
                         "kernel": rng.standard_normal((8, 8)).astype(np.float32),
                         "bias": np.full((8,), i, np.float32)}}} for i in range(3)}}},
            "cls": {"predictions": {"bias": np.arange(16, dtype=np.float32)}}}


@pytest.fixture
def sharded(tmp_path):
    truth = write_hf_flax(tmp_path, _params(), max_shard_size=600)
    return tmp_path, truth


def test_folder_and_index_read_every_shard_as_one_item(sharded):
    folder, truth = sharded
    assert len(list(folder.glob("flax_model-*-of-*.msgpack"))) >= 3
    for path in (folder, folder / INDEX):
        rep = inspect_path(str(path), stats=True).to_json()
        assert rep["format"] == "flax-sharded" and rep["steps"] is None
        leaves = {leaf["path"]: leaf for leaf in rep["checkpoints"][0]["items"]["default"]["leaves"]}
        assert sorted(leaves) == sorted(truth)
        for name, w in truth.items():
            assert leaves[name]["shape"] == list(w.shape)
            assert leaves[name]["stats"]["max"] == pytest.approx(float(w.max()))
            assert leaves[name]["stats"]["mean"] == pytest.approx(float(w.astype(np.float64).mean()), abs=1e-6)


def test_load_parameters_show_diff_and_verify(sharded, tmp_path_factory, capsys):
    folder, truth = sharded
    loaded = tt.flatten(tt.load_parameters(folder))
    assert sorted(loaded) == sorted(truth)
    for name, w in truth.items():
        np.testing.assert_array_equal(loaded[name], w, err_msg=name)
    assert main(["inspect", str(folder), "--show", "bert/encoder/layer/2/attention/query/bias"]) == 0
    assert "[2. 2. 2. 2. 2. 2. 2. 2.]" in capsys.readouterr().out
    single = tmp_path_factory.mktemp("single") / "flax_model.msgpack"  # the unsharded save of the same params
    single.write_bytes(to_bytes(_params()))
    assert main(["diff", str(folder), str(single), "--values"]) == 0
    assert main(["verify", str(folder)]) == 0


def test_missing_shard_is_one_clear_error(sharded, capsys):
    folder, _ = sharded
    (folder / "flax_model-00002-of-00003.msgpack").unlink()
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'flax_model-00002-of-00003.msgpack'" in err and "missing" in err


def test_tensor_not_in_index_is_an_error(sharded):
    folder, truth = sharded
    index = json.loads((folder / INDEX).read_text())
    dropped = sorted(truth)[0]
    del index["weight_map"][dropped]
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(tt.CheckpointError, match="shard files the index does not name \\(flax_model-00001-of-"):
        tt.load_parameters(folder)  # the first shard held only that tensor: now a shard the index never names
    other = "cls/predictions/bias"  # shares the last shard with layer 2
    del index["weight_map"][other]
    index["weight_map"][dropped] = "flax_model-00001-of-00003.msgpack"
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(tt.CheckpointError, match=f"does not list \\({other}\\)"):
        tt.load_parameters(folder)


def test_index_places_tensor_in_wrong_shard_is_an_error(sharded):
    folder, truth = sharded
    index = json.loads((folder / INDEX).read_text())
    name = "cls/predictions/bias"
    index["weight_map"]["bert/extra"] = index["weight_map"][name]  # a name no shard holds
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(tt.CheckpointError, match="places bert/extra in"):
        inspect_path(str(folder))


def test_index_naming_a_file_outside_the_folder_is_refused(sharded):
    folder, _ = sharded
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["cls/predictions/bias"] = "../flax_model-00001-of-00003.msgpack"
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(tt.CheckpointError, match="tries to escape the checkpoint folder"):
        tt.load_parameters(folder)


def test_corrupt_index_and_corrupt_shard_are_clear_errors(sharded, capsys):
    folder, _ = sharded
    (folder / "flax_model-00003-of-00003.msgpack").write_bytes(b"\x83\xa1a")
    assert main(["inspect", str(folder)]) == 1
    assert "flax_model-00003-of-00003.msgpack: corrupt or truncated Flax msgpack" in capsys.readouterr().err
    (folder / INDEX).write_text('{"weight_map": ')
    assert main(["inspect", str(folder)]) == 1
    assert "corrupt or truncated Flax msgpack index" in capsys.readouterr().err
