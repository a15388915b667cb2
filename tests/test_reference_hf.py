"""The reference model against transformers itself (issue 46): logits of tiny random models of each family.

transformers builds each model (PyTorch on the CPU), every parameter is perturbed (biases and norm weights are
not 0/1), its ``state_dict`` is converted to the reference model's params by the table below, and the two
models' logits on the same tokens must agree within 2e-4 of the logit scale (max |diff| / max |logits|) in
float32, with the blocks scanned and unscanned. Skipped without the ``test-hf`` extra (torch, transformers).

The tables are this test's own, and temporary: the presets (``tt.preset("llama:hf:reference")``) will carry
the same rows as rules data. A row is ``(Hugging Face name, reference path, how)``: ``{i}`` is the layer,
``T`` transposes an ``nn.Linear`` weight ``[out, in]`` to a Dense kernel ``[in, out]``, ``copy`` keeps the
tensor as it is (GPT-2's ``Conv1D`` weights are ``[in, out]`` already), ``tie`` says the tensor is the
embedding itself (no leaf of its own: it must equal it). Rows whose Hugging Face name a model lacks (biases it
does not have, an lm_head it ties) are skipped, and the test checks that every tensor of the ``state_dict`` was
used and every leaf of the reference model was filled, at its shape.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treetools.reference.model import FAMILIES, HF_DEFAULTS, ModelConfig, Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 2e-4  # of max |logits|

# --- the mapping tables (Hugging Face -> reference), one per family ----------------------------------------------

_LLAMA_LAYER = [
    ("model.layers.{i}.input_layernorm.weight", "ln_attn/scale", "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", "q/kernel", "T"),
    ("model.layers.{i}.self_attn.q_proj.bias", "q/bias", "copy"),
    ("model.layers.{i}.self_attn.k_proj.weight", "k/kernel", "T"),
    ("model.layers.{i}.self_attn.k_proj.bias", "k/bias", "copy"),
    ("model.layers.{i}.self_attn.v_proj.weight", "v/kernel", "T"),
    ("model.layers.{i}.self_attn.v_proj.bias", "v/bias", "copy"),
    ("model.layers.{i}.self_attn.o_proj.weight", "proj/kernel", "T"),
    ("model.layers.{i}.self_attn.o_proj.bias", "proj/bias", "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight", "ln_mlp/scale", "copy"),
    ("model.layers.{i}.mlp.gate_proj.weight", "gate/kernel", "T"),
    ("model.layers.{i}.mlp.gate_proj.bias", "gate/bias", "copy"),
    ("model.layers.{i}.mlp.up_proj.weight", "up/kernel", "T"),
    ("model.layers.{i}.mlp.up_proj.bias", "up/bias", "copy"),
    ("model.layers.{i}.mlp.down_proj.weight", "down/kernel", "T"),
    ("model.layers.{i}.mlp.down_proj.bias", "down/bias", "copy"),
]
_LLAMA_TOP = [
    ("model.embed_tokens.weight", "embed/embedding", "copy"),
    ("model.norm.weight", "ln_f/scale", "copy"),
]
_LLAMA_HEAD = {False: [("lm_head.weight", "lm_head/kernel", "T")], True: [("lm_head.weight", "embed/embedding", "tie")]}

_GPT2_LAYER = [
    ("transformer.h.{i}.ln_1.weight", "ln_attn/scale", "copy"),
    ("transformer.h.{i}.ln_1.bias", "ln_attn/bias", "copy"),
    ("transformer.h.{i}.attn.c_attn.weight", "qkv/kernel", "copy"),  # Conv1D [d, 3d]: q, k, v columns in order
    ("transformer.h.{i}.attn.c_attn.bias", "qkv/bias", "copy"),
    ("transformer.h.{i}.attn.c_proj.weight", "proj/kernel", "copy"),
    ("transformer.h.{i}.attn.c_proj.bias", "proj/bias", "copy"),
    ("transformer.h.{i}.ln_2.weight", "ln_mlp/scale", "copy"),
    ("transformer.h.{i}.ln_2.bias", "ln_mlp/bias", "copy"),
    ("transformer.h.{i}.mlp.c_fc.weight", "up/kernel", "copy"),
    ("transformer.h.{i}.mlp.c_fc.bias", "up/bias", "copy"),
    ("transformer.h.{i}.mlp.c_proj.weight", "down/kernel", "copy"),
    ("transformer.h.{i}.mlp.c_proj.bias", "down/bias", "copy"),
]
_GPT2_TOP = [
    ("transformer.wte.weight", "embed/embedding", "copy"),
    ("transformer.wpe.weight", "pos_embed", "copy"),
    ("transformer.ln_f.weight", "ln_f/scale", "copy"),
    ("transformer.ln_f.bias", "ln_f/bias", "copy"),
]
_GPT2_HEAD = {False: [("lm_head.weight", "lm_head/kernel", "T")], True: [("lm_head.weight", "embed/embedding", "tie")]}

MAPPINGS = {  # family -> (top rows, per-layer rows, lm_head rows by tie_word_embeddings)
    "llama": (_LLAMA_TOP, _LLAMA_LAYER, _LLAMA_HEAD),
    "mistral": (_LLAMA_TOP, _LLAMA_LAYER, _LLAMA_HEAD),
    "qwen2": (_LLAMA_TOP, _LLAMA_LAYER, _LLAMA_HEAD),  # q/k/v biases: the bias rows
    "gemma": (_LLAMA_TOP, _LLAMA_LAYER, _LLAMA_HEAD),  # norm weights stored as w, applied as (1 + w)
    "gpt2": (_GPT2_TOP, _GPT2_LAYER, _GPT2_HEAD),
}


def hf_to_reference(state_dict, cfg: ModelConfig, family: str, scanned: bool) -> dict:
    """The reference model's params (plain nested dicts of numpy float32) from a transformers ``state_dict``."""
    tensors = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in state_dict.items()}
    used = set()
    top, layer, head = MAPPINGS[family]

    def take(name, how):
        used.add(name)
        return tensors[name].T if how == "T" else tensors[name]

    flat = {}
    for name, path, how in [*top, *head[cfg.tie_embeddings]]:
        if name not in tensors:
            continue
        if how == "tie":
            used.add(name)
            np.testing.assert_array_equal(tensors[name], flat[path], err_msg=f"{name} is tied to {path}")
            continue
        flat[path] = take(name, how)
    for name, path, how in layer:
        per_layer = [take(name.format(i=i), how) for i in range(cfg.n_layers) if name.format(i=i) in tensors]
        if not per_layer:
            continue
        assert len(per_layer) == cfg.n_layers, name
        if scanned:
            flat[f"layers/{path}"] = np.stack(per_layer)
        else:
            flat.update({f"layers_{i}/{path}": w for i, w in enumerate(per_layer)})
    assert used == set(tensors), f"state_dict tensors no row used: {sorted(set(tensors) - used)}"
    params: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


# --- tiny transformers models ---------------------------------------------------------------------------------------

_COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
           "pad_token_id": None}
CASES = {
    # GQA 6:2, a large rotary base, untied
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              {**_COMMON, "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 6,
               "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": False}),
    # Llama 3.1's rotary scaling, tied, attention and MLP biases, head_dim apart from hidden / heads
    "llama3-tied-bias": ("LlamaForCausalLM", "LlamaConfig",
                         {**_COMMON, "vocab_size": 89, "hidden_size": 32, "intermediate_size": 72,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
                          "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
                          "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16}}),
    # MQA, head_dim 12, a sliding window shorter than the sequence
    "mistral": ("MistralForCausalLM", "MistralConfig",
                {**_COMMON, "vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 12, "sliding_window": 5}),
    # q/k/v biases, tied (as Qwen2-0.5B)
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              {**_COMMON, "vocab_size": 103, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    # MQA, head_dim 16 != 32 / 4, tied and scaled embeddings, (1 + w) norms, GeGLU
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              {**_COMMON, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 16}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             {"vocab_size": 101, "n_embd": 48, "n_head": 4, "n_layer": 2, "n_positions": 32, "bos_token_id": 0,
              "eos_token_id": 1}),
    "gpt2-untied": ("GPT2LMHeadModel", "GPT2Config",
                    {"vocab_size": 53, "n_embd": 32, "n_head": 2, "n_layer": 2, "n_positions": 24, "n_inner": 40,
                     "activation_function": "gelu", "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
                     "bos_token_id": 0, "eos_token_id": 1}),
}
SEQ = 12
LARGEST: dict = {}  # (case, scanned) -> (max |diff|, max |logits|), printed at the end of the module (-s)


def _family(case: str) -> str:
    return case.split("-")[0].replace("llama3", "llama")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """case -> (perturbed transformers model, the folder its config.json was saved to, its logits on TOKENS)."""
    torch.manual_seed(0)
    tokens = None
    out = {}
    for case, (model_cls, config_cls, kwargs) in CASES.items():
        config = getattr(transformers, config_cls)(**kwargs)
        config._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(config).float().eval()
        with torch.no_grad():
            for p in model.parameters():  # shared (tied) parameters are listed once
                p.add_(torch.randn_like(p) * 0.1)
        folder = tmp_path_factory.mktemp(case)
        config.save_pretrained(folder)  # config.json as transformers writes it (defaults left out)
        tokens = np.random.default_rng(len(out)).integers(0, kwargs["vocab_size"], (2, SEQ))
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens)).logits.numpy()
        out[case] = (model, folder, tokens, logits)
    yield out
    for (case, scanned), (diff, scale) in sorted(LARGEST.items()):
        print(f"\n{case:>18} {'scanned' if scanned else 'unscanned':>9}: max |diff| {diff:.2e}, max |logits| "
              f"{scale:.3f}, ratio {diff / scale:.2e}", end="")


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(hf_models, case, scanned):
    model, folder, tokens, want = hf_models[case]
    cfg = ModelConfig.from_hf(folder, scan_layers=scanned)
    params = hf_to_reference(model.state_dict(), cfg, _family(case), scanned)
    ours = Transformer(cfg)
    shapes = jax.eval_shape(lambda: ours.init(jax.random.key(0), jnp.asarray(tokens)))["params"]
    shapes = {jax.tree_util.keystr(k): v.value.shape if hasattr(v, "value") else v.shape
              for k, v in jax.tree_util.tree_leaves_with_path(shapes, is_leaf=lambda x: hasattr(x, "value"))}
    got_shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    assert got_shapes == shapes  # every leaf filled, at its shape, and nothing else
    logits = np.asarray(jax.jit(ours.apply)({"params": params}, jnp.asarray(tokens)))
    assert logits.dtype == np.float32 and logits.shape == want.shape == (2, SEQ, cfg.vocab)
    diff, scale = float(np.abs(logits - want).max()), float(np.abs(want).max())
    rel = diff / scale
    LARGEST[(case, scanned)] = (diff, scale)
    assert rel < TOLERANCE, f"{case}: max |diff| / max |logits| = {rel:.2e}"
    # The perturbed model is no trivial one: the logits vary along the sequence and over the vocabulary.
    assert np.abs(want).max() > 0.1 and want.std(axis=-1).min() > 1e-3


def test_a_wrong_layout_is_caught_by_the_logits(hf_models):
    """The check has teeth: q's columns in the other (interleaved) rotary convention change the logits, and so
    does Mistral's sliding window left out."""
    model, folder, tokens, want = hf_models["llama"]
    cfg = ModelConfig.from_hf(folder)
    params = hf_to_reference(model.state_dict(), cfg, "llama", False)
    q = params["layers_0"]["q"]["kernel"]
    hd = cfg.head_size
    perm = np.arange(q.shape[1]).reshape(cfg.n_heads, 2, hd // 2).transpose(0, 2, 1).reshape(-1)
    params["layers_0"]["q"]["kernel"] = q[:, perm]
    logits = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, jnp.asarray(tokens)))
    assert np.abs(logits - want).max() / np.abs(want).max() > 100 * TOLERANCE

    model, folder, tokens, want = hf_models["mistral"]
    cfg = ModelConfig.from_hf(folder)
    assert cfg.sliding_window == 5 < SEQ
    params = hf_to_reference(model.state_dict(), cfg, "mistral", False)
    no_window = dataclasses.replace(cfg, sliding_window=None)
    logits = np.asarray(jax.jit(Transformer(no_window).apply)({"params": params}, jnp.asarray(tokens)))
    assert np.abs(logits - want).max() / np.abs(want).max() > 100 * TOLERANCE
    # ... the first `window` positions see no more than the window either way: there, the logits agree.
    np.testing.assert_allclose(logits[:, :5], want[:, :5], atol=TOLERANCE * np.abs(want).max())


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_reads_what_save_pretrained_wrote(hf_models, case):
    model, folder, _, _ = hf_models[case]
    config = model.config
    cfg = ModelConfig.from_hf(folder / "config.json")
    assert cfg == ModelConfig.from_hf(folder) == ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert cfg == ModelConfig.from_hf(config)  # a transformers config object
    assert cfg.family == _family(case) and cfg.vocab == config.vocab_size and cfg.n_layers == config.num_hidden_layers
    assert cfg.d_model == config.hidden_size and cfg.n_heads == config.num_attention_heads
    assert cfg.tie_embeddings == config.tie_word_embeddings
    if cfg.family != "gpt2":
        # as modeling_*.py reads it
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert cfg.kv_heads == config.num_key_value_heads and cfg.head_size == head_dim
        assert cfg.d_ff == config.intermediate_size and cfg.rope_theta == config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("case", list(CASES))
def test_to_hf_builds_the_same_model_in_transformers(hf_models, case):
    """``to_hf()`` is a config transformers builds the same model from, and ``from_hf`` reads it back."""
    model, folder, tokens, want = hf_models[case]
    cfg = ModelConfig.from_hf(folder)
    written = cfg.to_hf()
    assert ModelConfig.from_hf(written) == cfg
    config = transformers.AutoConfig.for_model(**written, bos_token_id=0, eos_token_id=1)  # GPT-2's 50256: no such id
    config._attn_implementation = "eager"
    rebuilt = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    assert type(rebuilt) is type(model)
    missing, unexpected = rebuilt.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight"]
    if config.tie_word_embeddings:
        rebuilt.tie_weights()
    with torch.no_grad():
        np.testing.assert_array_equal(rebuilt(torch.as_tensor(tokens)).logits.numpy(), want)


def test_hf_defaults_are_transformers_config_defaults():
    """A field a config.json leaves out takes transformers' default: the table is that class's."""
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma": "GemmaConfig",
               "gpt2": "GPT2Config"}
    assert set(HF_DEFAULTS) == set(FAMILIES) == set(classes)
    for family, defaults in HF_DEFAULTS.items():
        fields = getattr(transformers, classes[family]).__dataclass_fields__
        for key, value in defaults.items():
            assert fields[key].default == value, (family, key)
