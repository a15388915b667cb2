"""The reference model's configs without transformers: real config.json files read by ``ModelConfig.from_hf``,
their parameter counts against the published ones (derived by hand below), and the one-line errors.

The logits against transformers' own models are tests/test_reference_hf.py (the test-hf extra).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treetools as tt
from treetools.reference.model import FAMILIES, ModelConfig, Transformer, attention_mask, rope_frequencies

# config.json files as the Hub has them (transformers 4 wrote them: rope_theta and rope_scaling at the top)
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_activation": None, "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 16384, "max_position_embeddings": 8192, "model_type": "gemma",
    "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 256000}
GPT2_SMALL = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": 50257}

# The published sizes, each derived by hand from its config (d: hidden, F: intermediate, kv: K * head_dim):
#   Llama 3.1 8B: 2 * 128256*4096 (embed, lm_head) + 32 * (2*4096*4096 + 2*4096*1024 + 3*4096*14336 + 2*4096)
#                 + 4096 = 8,030,261,248
#   Mistral 7B:   2 * 32000*4096 + 32 * (the same block, 218,112,000) + 4096 = 7,241,732,096
#   Qwen2 0.5B:   151936*896 (tied) + 24 * (2*896*896 + 896 + 2*(896*128 + 128) + 3*896*4864 + 2*896) + 896
#                 = 494,032,768
#   Gemma 2B:     256000*2048 (tied) + 18 * (2*2048*2048 + 2*2048*256 + 3*2048*16384 + 2*2048) + 2048
#                 = 2,506,172,416
#   GPT-2 small:  50257*768 + 1024*768 (tied) + 12 * (768*2304 + 2304 + 768*768 + 768 + 2*768*3072 + 3072 + 768
#                 + 4*768) + 2*768 = 124,439,808
REAL = {"llama": (LLAMA_31_8B, 8_030_261_248), "mistral": (MISTRAL_7B_V01, 7_241_732_096),
        "qwen2": (QWEN2_05B, 494_032_768), "gemma": (GEMMA_2B, 2_506_172_416), "gpt2": (GPT2_SMALL, 124_439_808)}


@pytest.mark.parametrize("family", FAMILIES)
def test_real_configs_have_their_published_parameter_counts(family):
    hf, count = REAL[family]
    cfg = ModelConfig.from_hf(hf, scan_layers=True)
    abstract = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert tt.get_num_params(abstract["params"]) == count
    assert cfg.family == family and ModelConfig.from_hf(cfg.to_hf(), scan_layers=True) == cfg


def test_real_configs_read_field_by_field():
    llama = ModelConfig.from_hf(LLAMA_31_8B)
    assert (llama.vocab, llama.d_model, llama.n_heads, llama.kv_heads, llama.head_size, llama.n_layers, llama.d_ff) \
        == (128256, 4096, 32, 8, 128, 32, 14336)
    assert (llama.norm, llama.norm_eps, llama.positions, llama.rope_theta, llama.mlp, llama.activation) \
        == ("rmsnorm", 1e-5, "rope", 500000.0, "gated", "silu")
    assert not (llama.tie_embeddings or llama.qkv_bias or llama.out_bias or llama.mlp_bias or llama.fused_qkv)
    assert dict(llama.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert llama == ModelConfig.from_hf(LLAMA_31_8B, rope_scaling=dict(llama.rope_scaling))  # a dict or pairs
    assert ModelConfig.from_hf(MISTRAL_7B_V01).sliding_window == 4096
    qwen = ModelConfig.from_hf(QWEN2_05B)
    assert qwen.qkv_bias and not qwen.out_bias and qwen.tie_embeddings and qwen.sliding_window is None
    gemma = ModelConfig.from_hf(GEMMA_2B)
    # Gemma's legacy hidden_act "gelu" is the tanh approximation (as transformers reads it)
    assert gemma.activation == "gelu_tanh" and gemma.norm_plus_one and gemma.embed_scale and gemma.tie_embeddings
    assert (gemma.kv_heads, gemma.head_size) == (1, 256)
    gpt2 = ModelConfig.from_hf(GPT2_SMALL)
    assert (gpt2.d_model, gpt2.n_heads, gpt2.d_ff, gpt2.max_len, gpt2.norm_eps) == (768, 12, 3072, 1024, 1e-5)
    assert gpt2.fused_qkv and gpt2.tie_embeddings and gpt2.positions == "learned" and gpt2.norm == "layernorm"


def test_the_default_config_is_the_trainers_small_gpt():
    cfg = ModelConfig()
    assert (cfg.family, cfg.vocab, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff, cfg.max_len) \
        == ("gpt2", 64, 64, 4, 2, 256, 64)
    params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
    names = {path: box.names for path, box in tt.flatten(params).items()}
    assert names == {
        "embed/embedding": ("fsdp", None), "pos_embed": (None, "fsdp"), "ln_f/scale": (None,), "ln_f/bias": (None,),
        **{f"layers_{i}/{leaf}": spec for i in range(2) for leaf, spec in {
            "ln_attn/scale": (None,), "ln_attn/bias": (None,), "qkv/kernel": ("fsdp", None), "qkv/bias": (None,),
            "proj/kernel": (None, "fsdp"), "proj/bias": (None,), "ln_mlp/scale": (None,), "ln_mlp/bias": (None,),
            "up/kernel": ("fsdp", None), "up/bias": (None,), "down/kernel": (None, "fsdp"),
            "down/bias": (None,)}.items()}}


def test_a_gated_gqa_config_names_its_leaves_and_partitions_them():
    cfg = ModelConfig.from_hf({**LLAMA_31_8B, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 50},
                              scan_layers=True)
    params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
    flat = tt.flatten(params)
    shapes = {path: (box.names, tt.unbox(box).shape) for path, box in flat.items()}
    stacked_in, stacked_out = ("layers", "fsdp", None), ("layers", None, "fsdp")
    assert shapes == {
        "embed/embedding": (("fsdp", None), (50, 32)), "lm_head/kernel": (("fsdp", None), (32, 50)),
        "ln_f/scale": ((None,), (32,)), "layers/ln_attn/scale": (("layers", None), (3, 32)),
        "layers/q/kernel": (stacked_in, (3, 32, 32)), "layers/k/kernel": (stacked_in, (3, 32, 16)),
        "layers/v/kernel": (stacked_in, (3, 32, 16)), "layers/proj/kernel": (stacked_out, (3, 32, 32)),
        "layers/ln_mlp/scale": (("layers", None), (3, 32)), "layers/gate/kernel": (stacked_in, (3, 32, 48)),
        "layers/up/kernel": (stacked_in, (3, 32, 48)), "layers/down/kernel": (stacked_out, (3, 48, 32))}
    logits = Transformer(cfg).apply({"params": params}, jnp.zeros((2, 8), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 8, 50)


def test_rope_frequencies_and_the_window_mask_by_hand():
    cfg = ModelConfig(family="llama", positions="rope", head_dim=8, rope_theta=100.0)
    np.testing.assert_allclose(rope_frequencies(cfg), [1.0, 100 ** -0.25, 0.1, 100 ** -0.75], rtol=1e-7)
    # Llama 3.1's rule, its 8B head (128 wide): wavelengths under 8192/4 = 2048 positions keep their
    # frequency, those over 8192/1 are divided by 8, the ones between are smoothed between the two.
    llama = ModelConfig.from_hf(LLAMA_31_8B)
    base = 500000.0 ** -(np.arange(0, 128, 2) / 128)
    got, wavelen = rope_frequencies(llama), 2 * np.pi / base
    np.testing.assert_allclose(got[wavelen < 2048], base[wavelen < 2048], rtol=1e-6)
    np.testing.assert_allclose(got[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and np.all((got[mid] <= base[mid] * (1 + 1e-6)) & (got[mid] >= base[mid] / 8 * (1 - 1e-6)))
    assert np.asarray(attention_mask(4, None)).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert np.asarray(attention_mask(4, 2)).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_from_hf_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf({"model_type": "mixtral", "hidden_size": 8})
    msg = str(e.value)
    assert "\n" not in msg and "'mixtral'" in msg and "llama, mistral, qwen2, gemma, gpt2" in msg
    (tmp_path / "config.json").write_text(json.dumps({**GPT2_SMALL, "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'bert' is not supported; .*gpt2\.$"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match=r"nowhere: cannot read a Hugging Face config.json \(FileNotFoundError") as e:
        ModelConfig.from_hf(tmp_path / "nowhere")
    assert "\n" not in str(e.value)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list.json: holds a JSON list, not a Hugging Face config"):
        ModelConfig.from_hf(tmp_path / "list.json")
    with pytest.raises(ValueError, match=r"rope_type 'yarn' is not supported; .*llama3"):
        ModelConfig.from_hf({**LLAMA_31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"^the config dict: rope_type 'linear' lacks factor\.$"):
        ModelConfig.from_hf({**LLAMA_31_8B, "rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(ValueError, match=r"max_window_layers 2 < num_hidden_layers 24"):
        ModelConfig.from_hf({**QWEN2_05B, "use_sliding_window": True, "max_window_layers": 2})
    with pytest.raises(ValueError, match=r"hidden_act 'tanh' is not supported"):
        ModelConfig.from_hf({**LLAMA_31_8B, "hidden_act": "tanh"})
    with pytest.raises(ValueError, match=r"scale_attn_by_inverse_layer_idx True is not supported"):
        ModelConfig.from_hf({**GPT2_SMALL, "scale_attn_by_inverse_layer_idx": True})


def test_config_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^ModelConfig norm='batchnorm': use one of layernorm, rmsnorm\.$"):
        ModelConfig(norm="batchnorm")
    with pytest.raises(ValueError, match=r"n_heads=4 is no multiple of n_kv_heads=3"):
        ModelConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match=r"^ModelConfig rope_scaling of rope_type 'llama3' lacks high_freq_factor\.$"):
        ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match=r"head_dim=5 is odd"):
        ModelConfig(positions="rope", head_dim=5)
    with pytest.raises(ValueError, match=r"^ModelConfig norm='layernorm' has no llama config.json \(the llama "
                                         r"family has norm='rmsnorm'\); change family or norm\.$"):
        ModelConfig(family="llama").to_hf()


def test_the_trainer_trains_a_gemma_config_scanned(tmp_path):
    """The reference trainer takes any family's config (no bias, no pos_embed: its weight-decay exclude list
    matches what the family has); here a tiny Gemma, scanned: MQA, tied, (1 + w) norms."""
    from treetools.reference.train import TrainConfig, train

    cfg = ModelConfig.from_hf({**GEMMA_2B, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}, scan_layers=True)
    result = train(TrainConfig(workdir=str(tmp_path), steps=4, batch_size=8, seq_len=16, log_every=2, ckpt_every=4,
                               quiet=True, model=cfg))
    live = {k: np.asarray(tt.unbox(v)) for k, v in tt.flatten(result["state"]["params"]).items()}
    assert {"layers/gate/kernel", "layers/k/kernel", "layers/ln_attn/scale", "embed/embedding"} <= set(live)
    assert not any(k.endswith("bias") or k == "pos_embed" or k.startswith("lm_head") for k in live)
    assert live["layers/k/kernel"].shape == (2, 32, 8) and np.isfinite(result["last_loss"])
    loaded = tt.flatten(tt.load_parameters(result["checkpoint_dir"], item="params"))
    assert set(loaded) == set(live)
    for k in live:
        np.testing.assert_array_equal(loaded[k], live[k], err_msg=k)
