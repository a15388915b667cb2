"""Presets (issue 46): tiny random models built by transformers itself, converted with every preset.

Each case is a transformers model (PyTorch on the CPU) whose every parameter is perturbed, saved sharded with
``save_pretrained(..., max_shard_size=...)``. Checked per family:

* ``hf -> reference -> hf`` and ``hf -> maxtext -> hf`` with ``scale_query=false`` give back every tensor of
  transformers' own ``state_dict`` bit for bit (and no other tensor); ``hf -> maxtext -> hf`` with MaxText's
  query scale (the default) gives every other tensor bit for bit and the query kernels within one float32 ulp,
  bit for bit when head_dim is a power of 4 (sqrt(head_dim) a power of 2);
* the intermediate layouts hold what an independent numpy computation says: the reference model's table
  (``nn.Linear`` weights transposed, GPT-2's ``Conv1D`` copied), and MaxText's layout as its conversion script
  (``llama_or_mistral_ckpt.py``, the commit the preset files name) builds it, the query kernel divided by
  sqrt(head_dim) in float64 and rounded to float32;
* ``AutoModelForCausalLM.from_pretrained(DST)`` of the converted-back folder, with no other step, gives logits
  identical to the original model's (within 2e-4 of their scale where a query kernel moved by an ulp);
* errors: an unknown preset, a checkpoint that does not fit (nothing written), a conversion to ``hf`` with no
  ``config.json``.

Skipped without torch and transformers (the ``test-hf`` extra); tests/test_presets_data.py checks the files,
docs/presets.md's table (each row names a test here) and the package data without them.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

import treetools as tt
from treetools.shared.errors import RulesError, UsageError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
           "pad_token_id": None}
CASES = {
    # GQA 6:2, untied, a large rotary base
    "llama": ("llama", "LlamaForCausalLM", "LlamaConfig",
              {**_COMMON, "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 6,
               "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": False}),
    # tied, attention and MLP biases
    "llama-tied-bias": ("llama", "LlamaForCausalLM", "LlamaConfig",
                        {**_COMMON, "vocab_size": 89, "hidden_size": 32, "intermediate_size": 72,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                         "attention_bias": True, "mlp_bias": True}),
    # MQA, head_dim 12 apart from 40 / 5, tied: to MaxText too (no logits_dense)
    "llama-tied-mqa": ("llama", "LlamaForCausalLM", "LlamaConfig",
                       {**_COMMON, "vocab_size": 61, "hidden_size": 40, "intermediate_size": 56,
                        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12,
                        "tie_word_embeddings": True}),
    # GQA 4:2, untied, head_dim 16 != 32 / 4 (a power of 4: MaxText's query scale, 1/4, goes there and back exactly)
    "mistral": ("mistral", "MistralForCausalLM", "MistralConfig",
                {**_COMMON, "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5, "tie_word_embeddings": False}),
    # q/k/v biases, tied
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config",
              {**_COMMON, "vocab_size": 103, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    # MQA, head_dim 16 != 32 / 4, tied, (1 + w) norms
    "gemma": ("gemma", "GemmaForCausalLM", "GemmaConfig",
              {**_COMMON, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 16}),
    "gpt2": ("gpt2", "GPT2LMHeadModel", "GPT2Config",
             {"vocab_size": 101, "n_embd": 48, "n_head": 4, "n_layer": 2, "n_positions": 32, "bos_token_id": 0,
              "eos_token_id": 1}),
    "gpt2-untied": ("gpt2", "GPT2LMHeadModel", "GPT2Config",
                    {"vocab_size": 53, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 24, "n_inner": 40,
                     "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}),
}
MAXTEXT = [case for case, (family, *_rest) in CASES.items() if family in ("llama", "mistral")
           and not CASES[case][3].get("attention_bias")]  # MaxText's Llama/Mistral layout has no biases


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (model, its folder as save_pretrained wrote it, its state_dict as numpy, tokens, logits)."""
    torch.manual_seed(0)
    out = {}
    for i, (case, (_family, model_cls, config_cls, kwargs)) in enumerate(CASES.items()):
        config = getattr(transformers, config_cls)(**kwargs)
        model = getattr(transformers, model_cls)(config).float().eval()
        with torch.no_grad():
            for p in model.parameters():  # tied parameters are listed once
                p.add_(torch.randn_like(p) * 0.1)
        folder = str(tmp_path_factory.mktemp(case) / "hf")
        model.save_pretrained(folder, max_shard_size="20KB")  # several shards and their index
        assert len(glob.glob(os.path.join(folder, "*.safetensors"))) > 1
        tokens = np.random.default_rng(i).integers(0, kwargs["vocab_size"], (2, 12))
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens)).logits.numpy()
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        out[case] = (model, folder, state, tokens, logits)
    return out


def _saved(folder):
    """Every tensor of a safetensors folder, read by safetensors' own reader."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(path))
    return out


def _config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _ulps(a, b):
    """How many float32 steps apart ``a`` and ``b`` are, entry by entry (same signs)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def _check_back(case, models, back, *, scaled=False):
    """``back`` holds every tensor the original folder holds, bit for bit equal to transformers' state_dict, and
    ``from_pretrained(back)`` computes the original logits exactly.

    ``scaled``: the query kernels went through MaxText's query scale, x / sqrt(head_dim) then * sqrt(head_dim),
    each rounded to float32: bit for bit when head_dim is a power of 4 (the scale a power of 2), else within one
    ulp (x -> x / s is many-to-one in float32: nothing can undo it), some of them one ulp off, and the logits
    within 2e-4 of their scale."""
    model, folder, state, tokens, logits = models[case]
    got, stored = _saved(back), _saved(folder)
    assert sorted(got) == sorted(stored)
    exact = not scaled or _head_dim(model.config) in (1, 4, 16, 64, 256)
    moved = 0
    for name, value in got.items():
        assert value.dtype == state[name].dtype and value.shape == state[name].shape, name
        if not exact and name.endswith(".self_attn.q_proj.weight"):
            ulps = _ulps(value, state[name])
            assert ulps.max() <= 1, f"{case}: {name} is {ulps.max()} ulps off"
            moved += int(ulps.sum())
        else:
            assert value.tobytes() == state[name].tobytes(), f"{case}: {name} differs"
    assert exact or moved, f"{case}: no query entry moved, though sqrt({_head_dim(model.config)}) is irrational"
    assert _config(back) == _config(folder)
    again = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(again) is type(model)
    with torch.no_grad():
        out = again(torch.as_tensor(tokens)).logits.numpy()
    if exact:
        np.testing.assert_array_equal(out, logits)
    else:
        scale, diff = float(np.max(np.abs(logits))), float(np.max(np.abs(out - logits)))
        print(f"{case}: hf -> maxtext -> hf logits max |diff| {diff:.2e} of max |logits| {scale:.3f}")  # -s shows it
        assert diff <= 2e-4 * scale


# --- hf -> reference -> hf ---------------------------------------------------------------------------------------


def _reference_by_hand(family, state, layers):
    """The reference model's params from a state_dict (flat paths), by the reference model's table."""
    t = {k: v for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    out = {}
    if family == "gpt2":
        out.update({"embed/embedding": t["transformer.wte.weight"], "pos_embed": t["transformer.wpe.weight"],
                    "ln_f/scale": t["transformer.ln_f.weight"], "ln_f/bias": t["transformer.ln_f.bias"]})
        names = {"ln_1.weight": "ln_attn/scale", "ln_1.bias": "ln_attn/bias", "ln_2.weight": "ln_mlp/scale",
                 "ln_2.bias": "ln_mlp/bias", "attn.c_attn.weight": "qkv/kernel", "attn.c_attn.bias": "qkv/bias",
                 "attn.c_proj.weight": "proj/kernel", "attn.c_proj.bias": "proj/bias", "mlp.c_fc.weight": "up/kernel",
                 "mlp.c_fc.bias": "up/bias", "mlp.c_proj.weight": "down/kernel", "mlp.c_proj.bias": "down/bias"}
        for i in range(layers):
            out.update({f"layers_{i}/{v}": t[f"transformer.h.{i}.{k}"] for k, v in names.items()})
    else:
        out.update({"embed/embedding": t["model.embed_tokens.weight"], "ln_f/scale": t["model.norm.weight"]})
        for i in range(layers):
            p = f"model.layers.{i}."
            out[f"layers_{i}/ln_attn/scale"] = t[p + "input_layernorm.weight"]
            out[f"layers_{i}/ln_mlp/scale"] = t[p + "post_attention_layernorm.weight"]
            for hf, ref in (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                            ("self_attn.o_proj", "proj"), ("mlp.gate_proj", "gate"), ("mlp.up_proj", "up"),
                            ("mlp.down_proj", "down")):
                out[f"layers_{i}/{ref}/kernel"] = t[p + hf + ".weight"].T  # nn.Linear [out, in] -> [in, out]
                if p + hf + ".bias" in t:
                    out[f"layers_{i}/{ref}/bias"] = t[p + hf + ".bias"]
    if "lm_head.weight" in t and not _tied(t):
        out["lm_head/kernel"] = t["lm_head.weight"].T
    return out


def _tied(state):
    embed = state.get("model.embed_tokens.weight", state.get("transformer.wte.weight"))
    return "lm_head.weight" in state and np.shares_memory(embed, state["lm_head.weight"]) or (
        "lm_head.weight" in state and np.array_equal(embed, state["lm_head.weight"]))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_reference_hf_round_trip(models, case, tmp_path):
    family = CASES[case][0]
    model, folder, state, _, _ = models[case]
    ref = str(tmp_path / "ref")
    report = tt.convert(folder, ref, preset=f"{family}:hf:reference", to="orbax", verify=True)
    assert report.ok and "config.json" in report.files
    params = tt.flatten(tt.load_parameters(ref))
    want = _reference_by_hand(family, state, model.config.num_hidden_layers)
    assert sorted(params) == sorted(want)
    for path, value in want.items():
        assert np.asarray(params[path]).tobytes() == np.ascontiguousarray(value).tobytes(), path
    back = str(tmp_path / "back")
    tt.convert(ref, back, preset=f"{family}:reference:hf", shard_size="30KB")  # config.json: the one carried over
    assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    _check_back(case, models, back)


# --- hf -> maxtext -> hf -----------------------------------------------------------------------------------------


def _half_to_interleaved(x):
    """MaxText's max_utils.permute_to_match_maxtext_rope, on the last axis (each head's rotary pairs)."""
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    out[..., ::2], out[..., 1::2] = x[..., :half], x[..., half:]
    return out


def _maxtext_by_hand(family, state, cfg, *, scale_query=True):
    """MaxText's layout, as llama_or_mistral_ckpt.py's _convert_huggingface_to_jax_weights builds it, in float32
    (the script casts to bfloat16 besides): with ``scale_query``, the query kernel divided by sqrt(head_dim), here
    in float64 and rounded once to float32 (see docs/presets.md)."""
    L, H, K = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    D = _head_dim(cfg)
    d = cfg.hidden_size

    def stack(name, fn):
        return np.stack([fn(state[f"model.layers.{i}.{name}"]) for i in range(L)])

    q = stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, H, D))
    k = stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, K, D))
    if family == "llama":  # the script's llama3.1 path: rotate-half -> interleaved
        q, k = _half_to_interleaved(q), _half_to_interleaved(k)
    if scale_query:  # the script: query kernel / sqrt(head_dim)
        q = (q.astype(np.float64) / np.sqrt(np.float64(D))).astype(np.float32)
    out = {
        "token_embedder.embedding": state["model.embed_tokens.weight"],
        "decoder.decoder_norm.scale": state["model.norm.weight"],
        "decoder.layers.self_attention.query.kernel": q.transpose(1, 0, 2, 3),
        "decoder.layers.self_attention.key.kernel": k.transpose(1, 0, 2, 3),
        "decoder.layers.self_attention.value.kernel":
            stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, K, D)).transpose(1, 0, 2, 3),
        "decoder.layers.self_attention.out.kernel":
            stack("self_attn.o_proj.weight", lambda w: w.reshape(d, H, D)).transpose(2, 0, 3, 1),
        "decoder.layers.pre_self_attention_layer_norm.scale": stack("input_layernorm.weight", lambda w: w).T,
        "decoder.layers.post_self_attention_layer_norm.scale": stack("post_attention_layernorm.weight", lambda w: w).T,
        "decoder.layers.mlp.wi_0.kernel": stack("mlp.gate_proj.weight", lambda w: w.T).transpose(1, 0, 2),
        "decoder.layers.mlp.wi_1.kernel": stack("mlp.up_proj.weight", lambda w: w.T).transpose(1, 0, 2),
        "decoder.layers.mlp.wo.kernel": stack("mlp.down_proj.weight", lambda w: w.T).transpose(1, 0, 2),
    }
    if not cfg.tie_word_embeddings:
        out["decoder.logits_dense.kernel"] = state["lm_head.weight"].T
    return out


@pytest.mark.parametrize("case", MAXTEXT)
def test_hf_maxtext_hf_round_trip(models, case, tmp_path):
    """MaxText's layout with its query scale (the default), and back: the scale undone."""
    family = CASES[case][0]
    model, folder, state, _, _ = models[case]
    mt = str(tmp_path / "maxtext")
    report = tt.convert(folder, mt, preset=f"{family}:hf:maxtext", to="safetensors", verify=True)
    assert report.ok
    got, want = _saved(mt), _maxtext_by_hand(family, state, model.config)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].tobytes() == np.ascontiguousarray(value).tobytes(), name
    back = str(tmp_path / "back")
    tt.convert(mt, back, preset=f"{family}:maxtext:hf")
    _check_back(case, models, back, scaled=True)


def test_a_preset_to_orbax_keeps_the_config_in_the_save_and_verify_counts_it_the_model_s(models, tmp_path):
    # The model's config.json rides in the Orbax save (the way back finds it there), and `verify` takes it for the
    # model's, not for something written into the save; a file of another name still is a stranger.
    case = MAXTEXT[0]
    family = CASES[case][0]
    _, folder, _, _, _ = models[case]
    mt = tmp_path / "maxtext"
    tt.convert(folder, str(mt), preset=f"{family}:hf:maxtext", to="orbax")
    assert json.loads((mt / "config.json").read_text()) == _config(folder)
    proc = _cli("verify", str(mt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (mt / "notes.txt").write_text("x")
    proc = _cli("verify", str(mt))
    assert proc.returncode == 1 and "holds `notes.txt`, which is no item of this save" in proc.stdout, proc.stdout
    (mt / "notes.txt").unlink()
    back = str(tmp_path / "back")
    tt.convert(str(mt), back, preset=f"{family}:maxtext:hf")  # no --config: the save's own
    _check_back(case, models, back, scaled=True)


@pytest.mark.parametrize("case", MAXTEXT)
def test_hf_maxtext_hf_round_trip_layout_only(models, case, tmp_path):
    """scale_query=false, there (as --preset writes it) and back (as tt.preset's keyword): layout only, every
    tensor bit for bit, the logits identical."""
    family = CASES[case][0]
    model, folder, state, _, _ = models[case]
    mt = str(tmp_path / "maxtext")
    tt.convert(folder, mt, preset=f"{family}:hf:maxtext,scale_query=false", to="safetensors")
    got, want = _saved(mt), _maxtext_by_hand(family, state, model.config, scale_query=False)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == np.ascontiguousarray(value).tobytes(), name
    back = str(tmp_path / "back")
    tt.convert(mt, back, rules=tt.preset(f"{family}:maxtext:hf", scale_query=False))  # sizes: mt's config.json
    _check_back(case, models, back)


def test_maxtext_to_hf_reads_head_dim_off_the_shapes(models, tmp_path):
    """Without any config.json, maxtext -> hf takes head_dim from the query kernel (the rules' permute and the
    query scale need it), and the output is the same tensors; the config for from_pretrained is then given with
    --config."""
    folder = models["llama"][1]
    mt = str(tmp_path / "mt")
    tt.convert(folder, mt, preset="llama:hf:maxtext", to="safetensors")
    os.remove(os.path.join(mt, "config.json"))
    rules = tt.preset("llama:maxtext:hf")  # no config: sizes come from the shapes
    assert not rules.sizes
    plan = rules.plan([(k, v.shape, v.dtype) for k, v in _saved(mt).items()])
    query = next(t for t in plan if t.path.endswith("q_proj.weight"))
    assert "permute" in " ".join(query.row().ops) and query.row().ops[-1] == "scale sqrt(8)"
    with pytest.raises(UsageError, match="needs its config.json"):
        tt.convert(mt, str(tmp_path / "back"), preset="llama:maxtext:hf")
    assert not os.path.exists(tmp_path / "back")
    tt.convert(mt, str(tmp_path / "back"), preset="llama:maxtext:hf", config=os.path.join(folder, "config.json"))
    _check_back("llama", models, str(tmp_path / "back"), scaled=True)


def test_a_preset_conversion_reads_from_and_writes_to_a_bucket(models, s3_store, tmp_path):
    """The Hugging Face folder in a bucket: its config.json is found there, the MaxText layout written to a
    bucket, and the way back (config.json carried over, in the bucket) loads in transformers once copied."""
    _, folder, _, _, _ = models["mistral"]
    src = s3_store.upload(folder, "hf")
    mt = s3_store.url("maxtext")
    tt.convert(src, mt, preset="mistral:hf:maxtext")
    back = s3_store.url("back")
    report = tt.convert(mt, back, preset="mistral:maxtext:hf", verify=True)
    assert report.ok and {"config.json", "generation_config.json"} <= set(report.files)
    local = tmp_path / "back"
    s3_store.fs().get(back, str(local), recursive=True)
    _check_back("mistral", models, str(local))


# --- restore and load with a preset ------------------------------------------------------------------------------


def test_load_parameters_and_restore_with_a_preset(models):
    jax = pytest.importorskip("jax")
    model, folder, state, _, _ = models["qwen2"]
    rules = tt.preset("qwen2:hf:reference", config=folder)
    loaded = tt.flatten(tt.load_parameters(folder, rules=rules))
    want = _reference_by_hand("qwen2", state, model.config.num_hidden_layers)
    assert sorted(loaded) == sorted(want)
    assert all(np.array_equal(loaded[k], v) for k, v in want.items())
    target: dict = {}
    for path, value in want.items():
        *parents, leaf = path.split("/")
        node = target
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    restored = tt.flatten(tt.restore_checkpoint(folder, -1, {"default": target}, rules=rules)["default"])
    assert all(np.array_equal(np.asarray(restored[k]), v) for k, v in want.items())


# --- errors ------------------------------------------------------------------------------------------------------


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "treetools", *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_unknown_preset_is_a_usage_error_listing_them(models, tmp_path):
    with pytest.raises(UsageError) as e:
        tt.preset("llama:hf:flax")
    assert all(name in str(e.value) for name in tt.presets())
    done = _cli("convert", models["llama"][1], str(tmp_path / "out"), "--preset", "llama:hf:flax")
    assert done.returncode == 2
    assert "llama:hf:reference" in done.stderr and "mistral:maxtext:hf" in done.stderr
    assert not os.path.exists(tmp_path / "out")


def test_a_checkpoint_that_does_not_fit_names_its_first_leaf(models, tmp_path):
    gpt2 = str(tmp_path / "gpt2")  # the shards without their config.json (whose model_type would say it first)
    os.makedirs(gpt2)
    for path in glob.glob(os.path.join(models["gpt2"][1], "model*")):
        shutil.copy(path, gpt2)
    with pytest.raises(RulesError) as e:
        tt.convert(gpt2, str(tmp_path / "out"), preset="llama:hf:reference")
    assert len(e.value.problems) == 1
    first = e.value.problems[0].split("`")[1]  # the leaf named: a GPT-2 tensor, which no llama row names
    assert first in _saved(gpt2) and "no leaf of a llama (hf layout) checkpoint is named so" in e.value.problems[0]
    assert not os.path.exists(tmp_path / "out")
    # another model's config: the first leaf whose shape differs, and what the config says it should be. With
    # 8 heads of 4 and 4 kv heads, k_proj and v_proj still fit ([4 * 4, 48] = [2 * 8, 48]); o_proj, the first in
    # the index's order after them, is [48, 6 * 8] where the config says [48, 8 * 4].
    other = dict(_config(models["llama"][1]), num_attention_heads=8, num_key_value_heads=4, head_dim=4)
    with pytest.raises(RulesError) as e:
        tt.convert(models["llama"][1], str(tmp_path / "out"), preset="llama:hf:reference", config=other)
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("`model.layers.0.self_attn.o_proj.weight`: shape (48, 48), but a llama "
                                          "(hf layout) checkpoint has (hidden=48, heads * head_dim=32)"), e.value
    assert not os.path.exists(tmp_path / "out")
    done = _cli("convert", gpt2, str(tmp_path / "out"), "--preset", "qwen2:hf:reference")
    assert done.returncode == 1 and "qwen2 (hf layout)" in done.stderr
    assert not os.path.exists(tmp_path / "out")


def test_reference_to_hf_without_a_config_is_a_usage_error(models, tmp_path):
    _, folder, _, _, _ = models["gemma"]
    ref = str(tmp_path / "ref.safetensors")  # one file: no config.json beside it
    report = tt.convert(folder, ref, preset="gemma:hf:reference")
    assert any("config.json" in note for note in report.notes)
    done = _cli("convert", ref, str(tmp_path / "back"), "--preset", "gemma:reference:hf")
    assert done.returncode == 2 and "--config" in done.stderr
    assert not os.path.exists(tmp_path / "back")
    done = _cli("convert", ref, str(tmp_path / "back"), "--preset", "gemma:reference:hf", "--config", folder)
    assert done.returncode == 0, done.stderr
    _check_back("gemma", models, str(tmp_path / "back"))


def test_dry_run_shows_every_step_and_writes_nothing(models, tmp_path):
    folder = models["llama"][1]
    done = _cli("convert", folder, str(tmp_path / "mt"), "--preset", "llama:hf:maxtext", "--dry-run",
                "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["to"] == "orbax"  # a preset to maxtext, no --to, a local folder: Orbax
    query = next(t for t in report["tensors"] if t["name"] == "decoder/layers/self_attention/query/kernel")
    assert query["shape"] == [48, 2, 6, 8] and "permute" in " ".join(query["ops"])
    assert query["ops"][-1] == "scale 1/sqrt(8)"  # MaxText's query scale, shown before any read
    assert "config.json" in report["files"] and "generation_config.json" in report["files"]
    assert not os.path.exists(tmp_path / "mt")
    done = _cli("convert", folder, str(tmp_path / "mt"), "--preset", "llama:hf:maxtext,scale_query=false",
                "--dry-run", "--format", "json")
    assert done.returncode == 0, done.stderr
    query = next(t for t in json.loads(done.stdout)["tensors"] if t["name"].endswith("self_attention/query/kernel"))
    assert "permute" in " ".join(query["ops"]) and not any("scale" in op for op in query["ops"])
    done = _cli("convert", folder, str(tmp_path / "mt"), "--preset", "llama:hf:maxtext,scale=false")
    assert done.returncode == 2 and "no option 'scale'; its options: scale_query (default true)" in done.stderr
    assert not os.path.exists(tmp_path / "mt")
    done = _cli("convert", folder, str(tmp_path / "mt"), "--config", folder)
    assert done.returncode == 2 and "--preset" in done.stderr


def test_a_preset_of_another_family_than_the_config_is_refused(models, tmp_path):
    with pytest.raises(UsageError, match="model_type 'llama', not 'mistral'"):
        tt.convert(models["llama"][1], str(tmp_path / "out"), preset="mistral:hf:reference")


# --- the reference model's logits, where the reference model reads HF configs -----------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_reference_logits_of_a_converted_model(models, case, tmp_path):
    model_module = pytest.importorskip("treetools.reference.model")
    if not hasattr(model_module.ModelConfig, "from_hf"):
        pytest.skip("the reference model does not read Hugging Face configs on this branch")
    family = CASES[case][0]
    _, folder, _, tokens, logits = models[case]
    ref = str(tmp_path / "ref")
    report = tt.convert(folder, ref, preset=f"{family}:hf:reference")  # no `to`: a preset to reference is Orbax
    assert report.to == "orbax"
    cfg = model_module.ModelConfig.from_hf(folder)
    out = np.asarray(model_module.Transformer(cfg).apply({"params": tt.load_parameters(ref)}, tokens))
    scale, diff = float(np.max(np.abs(logits))), float(np.max(np.abs(out - logits)))
    print(f"{case}: max |diff| {diff:.2e} of max |logits| {scale:.3f} ({diff / scale:.1e})")  # shown with -s
    assert diff <= 2e-4 * scale
