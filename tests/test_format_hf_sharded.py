"""Hugging Face sharded safetensors, written with the safetensors library and a Hugging Face-style index."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_tools.diff import diff_paths
from treetools.checkpoint_tools.report import inspect_path


def _write(folder, tensors_per_shard):
    n = len(tensors_per_shard)
    weight_map = {}
    for i, tensors in enumerate(tensors_per_shard, 1):
        shard = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(folder / shard))
        weight_map.update({name: shard for name in tensors})
    total = sum(t.nbytes for tensors in tensors_per_shard for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return {name: t for tensors in tensors_per_shard for name, t in tensors.items()}


@pytest.fixture
def sharded(tmp_path):
    rng = np.random.default_rng(0)
    shards = [{"model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32),
               "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float32)},
              {"model.layers.1.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float32)},
              {"lm_head.weight": rng.standard_normal((8, 4)).astype(np.float32)}]
    return tmp_path, _write(tmp_path, shards)


def test_folder_and_index_file_read_every_shard_with_names_as_stored(sharded, capsys):
    folder, truth = sharded
    for path in (folder, folder / "model.safetensors.index.json"):
        rep = inspect_path(str(path), stats=True).to_json()
        assert rep["format"] == "safetensors-sharded"
        leaves = {leaf["path"]: leaf for leaf in rep["checkpoints"][0]["items"]["default"]["leaves"]}
        assert sorted(leaves) == sorted(truth)
        for name, t in truth.items():
            assert leaves[name]["shape"] == list(t.shape)
            assert leaves[name]["stats"]["max"] == pytest.approx(float(t.max()))
    loaded = tt.load_parameters(folder)
    assert sorted(loaded) == sorted(truth)  # a flat dict of the stored names
    for name, t in truth.items():
        np.testing.assert_array_equal(loaded[name], t)
    assert main(["inspect", str(folder), "--depth", "2"]) == 0
    assert "model.layers" in capsys.readouterr().out


def test_diff_against_one_safetensors_file_of_the_same_tensors(sharded, tmp_path):
    folder, truth = sharded
    save_file(truth, str(tmp_path / "single.safetensors"))
    report = diff_paths(str(folder), str(tmp_path / "single.safetensors"), values=True)
    assert report.identical and report.counts()["bit_identical"] == len(truth)


def test_missing_shard_and_disagreeing_index_are_one_line(sharded, capsys):
    folder, truth = sharded
    (folder / "model-00002-of-00003.safetensors").unlink()
    assert main(["inspect", str(folder)]) == 1
    assert "shard 'model-00002-of-00003.safetensors' named by the index is missing" in capsys.readouterr().err
    save_file({"model.layers.1.self_attn.q_proj.weight": np.ones((4, 4), np.float32), "extra.bias": np.ones(2, np.float32)},
              str(folder / "model-00002-of-00003.safetensors"))
    assert main(["inspect", str(folder)]) == 1
    assert "holds tensors the index does not list (extra.bias)" in capsys.readouterr().err


def test_a_shard_file_the_index_never_names_is_an_error(tmp_path, capsys):
    # A leftover shard of an earlier save (another -of- count) beside the index: the two disagree.
    _write(tmp_path, [{"a.w": np.ones(2, np.float32)}, {"b.w": np.ones(3, np.float32)}])
    save_file({"c.w": np.ones(1, np.float32)}, str(tmp_path / "model-00003-of-00003.safetensors"))
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "model-00003-of-00003.safetensors" in err and "does not name" in err
