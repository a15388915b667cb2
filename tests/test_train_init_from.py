"""``treetools train --init-from HF_DIR`` (issue 46): fine-tune a Hugging Face model with the reference trainer, and
convert the run back with ``--preset FAMILY:reference:hf``.

The truth is transformers' own model: the trainer's first params give its logits (so the weights were read through
the preset into the right places), and the folder converted back from the trained run loads in
``AutoModelForCausalLM.from_pretrained`` with the logits the reference model computes from the trained params.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

import treetools as tt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Llama (GQA 4:2, untied), every parameter perturbed, saved by transformers in several shards."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = str(tmp_path_factory.mktemp("hf") / "llama")
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(glob.glob(os.path.join(folder, "*.safetensors"))) > 1
    return model, folder


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_the_first_params_are_the_hf_model(hf_llama, tmp_path, scan):
    from treetools.reference.model import ModelConfig, Transformer
    from treetools.reference.train import TrainConfig, build, from_hf_model

    model, folder = hf_llama
    cfg = from_hf_model(TrainConfig(workdir=str(tmp_path), batch_size=8, init_from=folder,
                                    model=ModelConfig(scan_layers=scan)))
    assert (cfg.model.family, cfg.model.n_kv_heads, cfg.model.scan_layers) == ("llama", 2, scan)
    _, _, state, _, _, _ = build(cfg)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 12))
    want = _hf_logits(model, tokens)
    got = np.asarray(Transformer(cfg.model).apply({"params": state["params"]}, tokens))
    assert float(np.max(np.abs(got - want))) <= 2e-4 * float(np.max(np.abs(want)))


def test_fine_tune_from_hf_and_convert_back(hf_llama, tmp_path):
    from treetools.cli import main
    from treetools.reference.model import ModelConfig, Transformer

    model, folder = hf_llama
    work, back = str(tmp_path / "ft"), str(tmp_path / "ft-hf")
    assert main(["train", "--workdir", work, "--init-from", folder, "--steps", "2", "--ckpt-every", "2",
                 "--log-every", "1", "--batch-size", "8", "--quiet"]) == 0
    with open(os.path.join(work, "config.json")) as f:
        written = json.load(f)
    assert written["model_type"] == "llama" and written["num_key_value_heads"] == 2
    trained = tt.load_parameters(os.path.join(work, "checkpoints"))
    assert main(["convert", os.path.join(work, "checkpoints"), back, "--preset", "llama:reference:hf",
                 "--config", os.path.join(work, "config.json")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    tokens = np.random.default_rng(1).integers(0, 64, (2, 12))
    want = np.asarray(Transformer(ModelConfig.from_hf(folder)).apply({"params": trained}, tokens))
    got = _hf_logits(tuned, tokens)
    assert float(np.max(np.abs(got - want))) <= 2e-4 * float(np.max(np.abs(want)))
    # The run trained: its params moved away from the model it started from.
    start = _hf_logits(model, tokens)
    assert float(np.max(np.abs(got - start))) > 1e-3


def test_init_from_a_folder_without_config_is_refused(tmp_path, capsys):
    from treetools.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["train", "--workdir", str(tmp_path / "w"), "--init-from", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "--init-from" in err and "config.json" in err and err.count("\n") == 1


_OTHERS = {  # fused c_attn, Conv1D, learned positions, tied, a vocabulary fsdp=2 does not divide (as GPT-2's 50257);
    # and MQA with (1 + w) norms and scaled embeddings
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"vocab_size": 61, "n_embd": 32, "n_head": 4, "n_layer": 2,
                                               "n_positions": 32, "bos_token_id": 0, "eos_token_id": 1}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                                                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
                                                  "num_hidden_layers": 2, "max_position_embeddings": 64,
                                                  "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}),
}


@pytest.mark.parametrize("family", list(_OTHERS))
def test_fine_tune_other_families_and_convert_back(family, tmp_path):
    """The same round as for Llama, with the family's own preset both ways."""
    from treetools.cli import main
    from treetools.reference.model import ModelConfig, Transformer

    model_cls, config_cls, kwargs = _OTHERS[family]
    torch.manual_seed(5)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder, work, back = str(tmp_path / "hf"), str(tmp_path / "ft"), str(tmp_path / "ft-hf")
    model.save_pretrained(folder, max_shard_size="20KB")
    assert main(["train", "--workdir", work, "--init-from", folder, "--steps", "2", "--ckpt-every", "2",
                 "--log-every", "1", "--batch-size", "8", "--quiet"]) == 0
    trained = tt.load_parameters(os.path.join(work, "checkpoints"))
    assert main(["convert", os.path.join(work, "checkpoints"), back, "--preset", f"{family}:reference:hf",
                 "--config", os.path.join(work, "config.json")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(tuned) is type(model)
    tokens = np.random.default_rng(2).integers(0, kwargs.get("vocab_size"), (2, 12))
    want = np.asarray(Transformer(ModelConfig.from_hf(folder)).apply({"params": trained}, tokens))
    got = _hf_logits(tuned, tokens)
    assert float(np.max(np.abs(got - want))) <= 2e-4 * float(np.max(np.abs(want)))
    assert float(np.max(np.abs(got - _hf_logits(model, tokens)))) > 1e-3  # trained: moved from the start
