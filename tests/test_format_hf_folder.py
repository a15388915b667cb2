"""Hugging Face model folders that fit one shard: one `model.safetensors` or `flax_model.msgpack` beside
`config.json`, `generation_config.json` and the tokenizer files, as `save_pretrained` writes them.

transformers is not a dependency: the weights are written with safetensors' and flax's own functions, as
`save_pretrained` does (`safe_serialization=True`: `safetensors.numpy.save_file(..., metadata={"format": "pt"})`;
Flax: `to_bytes(params)`), and the side files with the keys transformers writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from flax.serialization import to_bytes
from safetensors.numpy import save_file

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_tools.report import inspect_path
from treetools.pytree.paths import flatten

SIDE_FILES = {
    "config.json": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_layer": 2},
    "generation_config.json": {"bos_token_id": 0, "eos_token_id": 0, "transformers_version": "4.46.0"},
    "tokenizer.json": {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}},
    "tokenizer_config.json": {"model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"},
    "special_tokens_map.json": {"bos_token": "<|endoftext|>"},
}


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"transformer": {"wte": {"embedding": rng.standard_normal((16, 8)).astype(np.float32)},
                            "h": {str(i): {"attn": {"c_attn": {"kernel": rng.standard_normal((8, 24)).astype(np.float32),
                                                               "bias": np.full(24, i, np.float32)}}}
                                  for i in range(2)}}}


def write_model_folder(folder: Path, *, flax: bool) -> dict[str, np.ndarray]:
    """A model folder as `save_pretrained` writes one that fits one shard; returns its leaves as treetools names them
    (PyTorch safetensors: the dotted names stored; Flax: the params' `/` paths)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in SIDE_FILES.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    params = _params()
    flat = {path: np.asarray(x) for path, x in flatten(params).items()}
    if flax:
        (folder / "flax_model.msgpack").write_bytes(to_bytes(params))
        return flat
    tensors = {path.replace("/", "."): x for path, x in flat.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _leaves(path) -> dict:
    report = inspect_path(str(path)).to_json()
    (item,) = report["checkpoints"][0]["items"].values()
    return report["format"], {leaf["path"]: leaf for leaf in item["leaves"]}


def test_a_safetensors_model_folder_reads_its_model_safetensors(tmp_path, capsys):
    truth = write_model_folder(tmp_path / "gpt2", flax=False)
    fmt, leaves = _leaves(tmp_path / "gpt2")
    assert fmt == "safetensors" and sorted(leaves) == sorted(truth)
    for name, want in truth.items():
        assert leaves[name]["shape"] == list(want.shape) and leaves[name]["dtype"] == "float32"
    loaded = tt.load_parameters(tmp_path / "gpt2")
    assert sorted(loaded) == sorted(truth) and all(np.array_equal(loaded[k], truth[k]) for k in truth)
    assert main(["verify", str(tmp_path / "gpt2")]) == 0
    assert main(["diff", str(tmp_path / "gpt2"), str(tmp_path / "gpt2" / "model.safetensors"), "--values"]) == 0
    assert capsys.readouterr().err == ""  # one weights file: no note


def test_a_flax_model_folder_reads_its_flax_model_msgpack(tmp_path, capsys):
    # Issue 24.6: a folder of one flax_model.msgpack and config.json was refused ("not a checkpoint").
    truth = write_model_folder(tmp_path / "gpt2-flax", flax=True)
    fmt, leaves = _leaves(tmp_path / "gpt2-flax")
    assert fmt == "msgpack" and sorted(leaves) == sorted(truth)
    loaded = tt.flatten(tt.load_parameters(tmp_path / "gpt2-flax"))
    assert sorted(loaded) == sorted(truth) and all(np.array_equal(loaded[k], truth[k]) for k in truth)
    assert main(["inspect", str(tmp_path / "gpt2-flax"), "--stats", "--format", "json"]) == 0
    stats = {leaf["path"]: leaf["stats"] for leaf in
             json.loads(capsys.readouterr().out)["checkpoints"][0]["items"]["default"]["leaves"]}
    for path, want in truth.items():
        assert stats[path]["max"] == float(want.max())
        assert abs(stats[path]["l2"] - np.linalg.norm(want.astype(np.float64))) <= 1e-5 * stats[path]["l2"]
    assert main(["verify", str(tmp_path / "gpt2-flax")]) == 0
    capsys.readouterr()


def test_a_folder_with_several_weights_files_reads_safetensors_and_says_so(tmp_path, capsys):
    # Decided: model.safetensors first (then flax_model.msgpack; never the pickle), with a note naming the other.
    folder = tmp_path / "both"
    truth = write_model_folder(folder, flax=False)
    flax_truth = write_model_folder(tmp_path / "flax", flax=True)
    (folder / "flax_model.msgpack").write_bytes((tmp_path / "flax" / "flax_model.msgpack").read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch pickle")
    assert main(["inspect", str(folder), "--format", "json"]) == 0
    cap = capsys.readouterr()
    report = json.loads(cap.out)
    leaves = report["checkpoints"][0]["items"]["default"]["leaves"]
    assert report["format"] == "safetensors" and sorted(leaf["path"] for leaf in leaves) == sorted(truth)
    assert cap.err == (f"treetools: note: {folder} holds several weights files (model.safetensors, "
                       "flax_model.msgpack, pytorch_model.bin); reading model.safetensors (safetensors first, then "
                       "Flax msgpack; never a PyTorch pickle or a TensorFlow .h5); pass "
                       f"{folder}/flax_model.msgpack to read that one.\n")
    other = tt.flatten(tt.load_parameters(folder / "flax_model.msgpack"))  # the path the note names works
    assert sorted(other) == sorted(flax_truth)
    # Without model.safetensors the Flax weights are read, and the pickle is said not to be.
    (folder / "model.safetensors").unlink()
    assert main(["inspect", str(folder), "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["format"] == "msgpack"
    assert "reading flax_model.msgpack" in cap.err and "pytorch_model.bin" in cap.err


def test_a_hub_cache_snapshot_reads_through_its_links(tmp_path):
    # huggingface_hub's cache: snapshots/<rev>/ holds links into the repo's blobs/.
    repo = tmp_path / "hub" / "models--org--gpt2"
    source = tmp_path / "written"
    truth = write_model_folder(source, flax=False)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(source))):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    loaded = tt.load_parameters(snapshot)
    assert sorted(loaded) == sorted(truth) and all(np.array_equal(loaded[k], truth[k]) for k in truth)
