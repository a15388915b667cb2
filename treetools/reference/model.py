"""The reference model: a config-driven decoder-only Transformer whose params carry FSDP partitioning names.

One ``ModelConfig`` covers the five families of Hugging Face causal LMs the presets convert (issue 46):

========  =========  ==========  ==================  =====  ====================  ==========================
family    norm       positions   MLP                 heads  embeddings            biases
========  =========  ==========  ==================  =====  ====================  ==========================
llama     RMSNorm    RoPE        SwiGLU              GQA    untied (or tied)      none (or attention_bias)
mistral   RMSNorm    RoPE        SwiGLU              GQA    untied                none; sliding window
qwen2     RMSNorm    RoPE        SwiGLU              GQA    untied (or tied)      q, k, v
gemma     RMSNorm    RoPE        GeGLU (gelu tanh)   MQA/   tied, scaled by       none
          (1 + w)                                    GQA    sqrt(d_model)
gpt2      LayerNorm  learned     GELU (tanh)         MHA    tied                  everywhere (c_attn fused)
========  =========  ==========  ==================  =====  ====================  ==========================

``ModelConfig.from_hf(path_or_config_dict)`` reads a ``config.json`` of these five ``model_type`` values and
``ModelConfig.to_hf()`` writes one back; ``Transformer(cfg).apply({"params": params}, tokens)`` returns
float32 logits ``[batch, seq, vocab]``. The default ``ModelConfig()`` is the small GPT the reference trainer
has always trained (a gpt2-family model of 2 layers, d_model 64).

The params, by path (``L`` the layer, ``H``/``K`` the query/key-value heads, ``hd`` the head size, ``F`` d_ff)::

    embed/embedding         [vocab, d]           (fsdp, None)
    pos_embed               [max_len, d]         (None, fsdp)   learned positions only
    layers_<L>/ln_attn/scale, /bias  [d]         (None,)        bias: LayerNorm only
    layers_<L>/qkv/kernel   [d, (H+2K)*hd]       (fsdp, None)   fused_qkv (gpt2's c_attn: q, k, v in that order)
    layers_<L>/q/kernel     [d, H*hd]            (fsdp, None)   separate q, k, v otherwise
    layers_<L>/k/kernel, v/kernel  [d, K*hd]     (fsdp, None)
    layers_<L>/proj/kernel  [H*hd, d]            (None, fsdp)   the attention output (o_proj)
    layers_<L>/ln_mlp/scale, /bias  [d]          (None,)
    layers_<L>/gate/kernel  [d, F]               (fsdp, None)   gated MLPs (SwiGLU, GeGLU) only
    layers_<L>/up/kernel    [d, F]               (fsdp, None)
    layers_<L>/down/kernel  [F, d]               (None, fsdp)
    ln_f/scale, ln_f/bias   [d]                  (None,)
    lm_head/kernel          [d, vocab]           (fsdp, None)   untied embeddings only

Each Dense's ``bias`` (shape its output features, ``(None,)``) is there where the config asks for it
(``qkv_bias``, ``out_bias``, ``mlp_bias``). Kernels are ``[in, out]`` (Hugging Face's ``nn.Linear`` weights
are ``[out, in]``; GPT-2's ``Conv1D`` are ``[in, out]`` already). Query and key columns keep Hugging Face's
order (RoPE is applied in its rotate-half convention), so no rotary permutation separates the two layouts.

With ``scan_layers`` the blocks are one ``nn.scan`` named ``layers``: every block parameter is one leaf of shape
``(n_layers, ...)`` (``layers/qkv/kernel``), and flax inserts the scan's partition name ``layers`` into each
box's names at that axis, which is how ``tt.norm_metrics`` finds the layer axis and logs
``grad_norm/layers/<i>``. Unscanned, the blocks are ``layers_0`` ... ``layers_<n-1>``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

FSDP = "fsdp"
LAYERS = "layers"  # the scan's partition name: the layer axis of a stacked leaf
# Scanned boxes name `layers`, which is no mesh axis: logical names with these rules keep the
# layer axis replicated and map `fsdp` to the mesh axis of that name (the same layout as unscanned).
SCAN_RULES = ((FSDP, FSDP), (LAYERS, None))

FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gpt2")
"""The Hugging Face ``model_type`` values ``ModelConfig.from_hf`` reads."""

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # HF's gelu_new / gelu_pytorch_tanh
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF's gelu (erf)
    "relu": jax.nn.relu,
}
# Hugging Face's activation names (ACT2FN keys) -> ours.
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu": "gelu", "relu": "relu"}
_ROPE_TYPES = {"default": (), "linear": ("factor",),  # the rope_scaling keys each type needs
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_CHOICES = {"family": FAMILIES, "norm": ("layernorm", "rmsnorm"), "positions": ("learned", "rope"),
            "mlp": ("plain", "gated"), "activation": tuple(ACTIVATIONS)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The reference model's shape and family options. The defaults are the trainer's small GPT (gpt2 family).

    ``n_kv_heads`` None: as many as ``n_heads`` (1: multi-query); ``head_dim`` None: ``d_model // n_heads``.
    ``norm_plus_one``: the norm multiplies by ``1 + scale`` (Gemma; its scale starts at 0). ``embed_scale``:
    the embeddings are multiplied by ``sqrt(d_model)`` (Gemma). ``rope_scaling``: the items of Hugging Face's
    ``rope_parameters`` beyond ``rope_theta`` (``rope_type`` ``linear`` or ``llama3`` and their factors), a
    dict or ``(key, value)`` pairs, kept as sorted pairs. ``sliding_window``: each query sees at most that many
    keys, itself included (Mistral). ``fused_qkv``: one ``qkv`` kernel (GPT-2's ``c_attn``) instead of ``q``,
    ``k``, ``v``.
    """

    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_len: int = 64
    scan_layers: bool = False
    family: str = "gpt2"
    n_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    norm_plus_one: bool = False
    positions: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    mlp: str = "plain"
    activation: str = "gelu_tanh"
    tie_embeddings: bool = True
    embed_scale: bool = False
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    fused_qkv: bool = True
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        # One spelling (sorted pairs, hashable as a flax module's field), whether given as a dict or as pairs.
        object.__setattr__(self, "rope_scaling", tuple(sorted(dict(self.rope_scaling or ()).items())))
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig {name}={getattr(self, name)!r}: use one of {', '.join(allowed)}.")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelConfig n_heads={self.n_heads} is no multiple of n_kv_heads={self.kv_heads}; "
                             "each key-value head serves a whole group of query heads.")
        if self.positions == "rope" and self.head_size % 2:
            raise ValueError(f"ModelConfig head_dim={self.head_size} is odd; RoPE rotates pairs: use an even head_dim.")
        scaling = dict(self.rope_scaling)
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"ModelConfig rope_scaling rope_type={rope_type!r}: use one of {', '.join(_ROPE_TYPES)}.")
        missing = [k for k in _ROPE_TYPES[rope_type] if k not in scaling]
        if missing:
            raise ValueError(f"ModelConfig rope_scaling of rope_type {rope_type!r} lacks {', '.join(missing)}.")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """The config of a Hugging Face ``config.json``: a path to it, to the folder holding it, or its dict.

        ``model_type`` must be one of ``FAMILIES``; a field the file leaves out takes the value transformers'
        config class gives it (``save_pretrained`` leaves defaults out). ``overrides`` replace fields of the
        result (``scan_layers=True``).
        """
        hf, where = _read_hf(source)
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"{where}: model_type {model_type!r} is not supported; the reference model reads "
                             f"{', '.join(FAMILIES)}.")
        fields = _gpt2_fields(hf, where) if model_type == "gpt2" else _llama_fields(hf, model_type, where)
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict[str, Any]:
        """This config as a Hugging Face ``config.json`` dict of its ``family`` (``from_hf`` reads it back).

        ``ValueError`` naming the field when the family cannot express it (a gpt2 with RMSNorm, a llama with
        learned positions).
        """
        return _gpt2_hf(self) if self.family == "gpt2" else _llama_hf(self)


# --- Hugging Face config.json <-> ModelConfig ---------------------------------------------------------------------

# transformers' config-class defaults of the fields read below (a config.json may leave any of them out).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "attention_bias": False},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False},
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "gemma": "GemmaForCausalLM", "gpt2": "GPT2LMHeadModel"}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default_theta for these families


def _read_hf(source: Any) -> tuple[dict[str, Any], str]:
    """The config dict and how to name it in an error."""
    if isinstance(source, Mapping):
        return dict(source), "the config dict"
    if hasattr(source, "to_dict") and not isinstance(source, (str, os.PathLike)):
        return dict(source.to_dict()), "the config object"  # a transformers PretrainedConfig
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"{path}: cannot read a Hugging Face config.json ({e.__class__.__name__}: {why}); pass the "
                         "model folder, its config.json, or the dict.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not a Hugging Face config object.")
    return data, path


def _get(hf: Mapping[str, Any], family: str, key: str) -> Any:
    """``hf[key]``, or transformers' default for the family where the file leaves it out (or null)."""
    value = hf.get(key)
    return HF_DEFAULTS[family].get(key) if value is None else value


def _activation(name: Any, where: str, key: str) -> str:
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"{where}: {key} {name!r} is not supported; the reference model has "
                         f"{', '.join(sorted(_HF_ACTIVATIONS))}.")
    return _HF_ACTIVATIONS[name]


def _rope_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` +
    ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; the reference model has "
                         f"{', '.join(_ROPE_TYPES)}.")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {params['partial_rotary_factor']} is not supported "
                         "(the reference model rotates whole heads).")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": ()}
    if rope_type == "llama3":  # as transformers' standardize_rope_params
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    missing = [k for k in _ROPE_TYPES[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope_type {rope_type!r} lacks {', '.join(missing)}.")
    return {"rope_theta": float(theta),
            "rope_scaling": (("rope_type", rope_type), *((k, params[k]) for k in _ROPE_TYPES[rope_type]))}


def _llama_fields(hf: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    d, heads = _get(hf, family, "hidden_size"), _get(hf, family, "num_attention_heads")
    bias = bool(_get(hf, family, "attention_bias")) if family in ("llama", "gemma") else family == "qwen2"
    act_key = "hidden_activation" if family == "gemma" and hf.get("hidden_activation") else "hidden_act"
    act = _activation(hf.get(act_key, _get(hf, family, "hidden_act")), where, act_key)
    if family == "gemma" and act == "gelu":
        act = "gelu_tanh"  # transformers reads Gemma's legacy `gelu` as the tanh approximation
    window = None
    if family == "mistral":
        window = hf.get("sliding_window", HF_DEFAULTS["mistral"]["sliding_window"])
    elif family == "qwen2" and _get(hf, family, "use_sliding_window"):
        layers, first = _get(hf, family, "num_hidden_layers"), _get(hf, family, "max_window_layers")
        if first < layers:
            raise ValueError(f"{where}: use_sliding_window with max_window_layers {first} < num_hidden_layers "
                             f"{layers} (a window on some layers only) is not supported by the reference model.")
    return {"family": family, "vocab": _get(hf, family, "vocab_size"), "d_model": d, "n_heads": heads,
            "n_kv_heads": _get(hf, family, "num_key_value_heads") or heads,
            "head_dim": _get(hf, family, "head_dim") or d // heads,
            "n_layers": _get(hf, family, "num_hidden_layers"), "d_ff": _get(hf, family, "intermediate_size"),
            "max_len": _get(hf, family, "max_position_embeddings"), "norm": "rmsnorm",
            "norm_eps": float(_get(hf, family, "rms_norm_eps")), "norm_plus_one": family == "gemma",
            "positions": "rope", **_rope_fields(hf, where), "mlp": "gated", "activation": act,
            "tie_embeddings": bool(_get(hf, family, "tie_word_embeddings")), "embed_scale": family == "gemma",
            "qkv_bias": bias, "out_bias": bias and family != "qwen2",
            "mlp_bias": bool(hf.get("mlp_bias", False)) if family == "llama" else False,
            "fused_qkv": False, "sliding_window": window}


def _gpt2_fields(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False)):
        if bool(_get(hf, "gpt2", key)) != ok:
            raise ValueError(f"{where}: {key} {hf[key]!r} is not supported by the reference model (it needs {ok}).")
    if hf.get("add_cross_attention"):
        raise ValueError(f"{where}: add_cross_attention is not supported (the reference model is decoder-only).")
    d = hf.get("n_embd", hf.get("hidden_size", HF_DEFAULTS["gpt2"]["n_embd"]))
    heads = hf.get("n_head", hf.get("num_attention_heads", HF_DEFAULTS["gpt2"]["n_head"]))
    return {"family": "gpt2", "vocab": _get(hf, "gpt2", "vocab_size"), "d_model": d, "n_heads": heads,
            "n_kv_heads": heads, "head_dim": d // heads,
            "n_layers": hf.get("n_layer", hf.get("num_hidden_layers", HF_DEFAULTS["gpt2"]["n_layer"])),
            "d_ff": _get(hf, "gpt2", "n_inner") or 4 * d,
            "max_len": hf.get("n_positions", hf.get("max_position_embeddings", HF_DEFAULTS["gpt2"]["n_positions"])),
            "norm": "layernorm", "norm_eps": float(_get(hf, "gpt2", "layer_norm_epsilon")), "norm_plus_one": False,
            "positions": "learned", "mlp": "plain",
            "activation": _activation(_get(hf, "gpt2", "activation_function"), where, "activation_function"),
            "tie_embeddings": bool(_get(hf, "gpt2", "tie_word_embeddings")), "embed_scale": False,
            "qkv_bias": True, "out_bias": True, "mlp_bias": True, "fused_qkv": True, "sliding_window": None}


def _hf_activation(cfg: ModelConfig) -> str:
    if cfg.family == "gpt2":
        return {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation)
    return {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.activation, cfg.activation)


def _check_expressible(cfg: ModelConfig, want: dict[str, Any]) -> None:
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise ValueError(f"ModelConfig {key}={getattr(cfg, key)!r} has no {cfg.family} config.json "
                             f"(the {cfg.family} family has {key}={value!r}); change family or {key}.")


def _llama_hf(cfg: ModelConfig) -> dict[str, Any]:
    family = cfg.family
    bias = {"llama": cfg.qkv_bias, "gemma": cfg.qkv_bias, "qwen2": True, "mistral": False}[family]
    _check_expressible(cfg, {"norm": "rmsnorm", "positions": "rope", "mlp": "gated", "fused_qkv": False,
                             "norm_plus_one": family == "gemma", "embed_scale": family == "gemma", "qkv_bias": bias,
                             "out_bias": bias and family != "qwen2"})
    if family != "llama":
        _check_expressible(cfg, {"mlp_bias": False})
    if family != "mistral":
        _check_expressible(cfg, {"sliding_window": None})
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **dict(cfg.rope_scaling)}
    out: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "hidden_act": _hf_activation(cfg), "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope}
    if family in ("llama", "gemma"):
        out["attention_bias"] = cfg.qkv_bias
    if family == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if family == "qwen2":
        out["use_sliding_window"] = False
    return out


def _gpt2_hf(cfg: ModelConfig) -> dict[str, Any]:
    _check_expressible(cfg, {"norm": "layernorm", "positions": "learned", "mlp": "plain", "norm_plus_one": False,
                             "embed_scale": False, "qkv_bias": True, "out_bias": True, "mlp_bias": True,
                             "kv_heads": cfg.n_heads, "head_size": cfg.d_model // cfg.n_heads,
                             "sliding_window": None})
    return {"architectures": [_HF_ARCHITECTURES["gpt2"]], "model_type": "gpt2", "vocab_size": cfg.vocab,
            "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_layer": cfg.n_layers, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_len, "activation_function": _hf_activation(cfg),
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings}


# --- the model -----------------------------------------------------------------------------------------------------

def _partitioned(init: Callable[..., Any], names: tuple, cfg: ModelConfig) -> Callable[..., Any]:
    if cfg.scan_layers:
        return nn.with_logical_partitioning(init, names, rules=SCAN_RULES)
    return nn.with_partitioning(init, names)


def _dense(cfg: ModelConfig, features: int, name: str, *, bias: bool, fsdp_axis: int = 0) -> nn.Dense:
    # FSDP: every kernel is split over the `fsdp` mesh axis along one dimension.
    names = (FSDP, None) if fsdp_axis == 0 else (None, FSDP)
    return nn.Dense(features, name=name, use_bias=bias,
                    kernel_init=_partitioned(nn.initializers.normal(0.02), names, cfg),
                    bias_init=_partitioned(nn.initializers.zeros, (None,), cfg))


class Norm(nn.Module):
    """LayerNorm (``scale``, ``bias``) or RMSNorm (``scale``), in float32; ``norm_plus_one``: ``x * (1 + scale)``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        d = x.shape[-1]
        init = nn.initializers.zeros if cfg.norm_plus_one else nn.initializers.ones
        scale = self.param("scale", _partitioned(init, (None,), cfg), (d,), jnp.float32)
        h = x.astype(jnp.float32)
        if cfg.norm == "layernorm":
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.norm_eps)
        h = h * (1.0 + scale if cfg.norm_plus_one else scale)
        if cfg.norm == "layernorm":
            h = h + self.param("bias", _partitioned(nn.initializers.zeros, (None,), cfg), (d,), jnp.float32)
        return h.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The inverse frequencies of RoPE, ``[head_dim // 2]`` float32, as transformers computes them (with
    ``rope_scaling``'s ``linear`` or ``llama3`` adjustment)."""
    dim = cfg.head_size
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``x [batch, seq, heads, head_dim]`` rotated at positions ``0 .. seq-1``, Hugging Face's rotate-half
    convention: the first half of each head pairs with the second half."""
    t = x.shape[1]
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * jnp.asarray(rope_frequencies(cfg))[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def attention_mask(t: int, window: int | None) -> jax.Array:
    """``[t, t]`` True where query ``i`` may see key ``j``: ``j <= i`` and, with a window, ``j > i - window``."""
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = j <= i
    return mask if window is None else mask & (j > i - window)


class Block(nn.Module):
    cfg: ModelConfig

    def _qkv(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        b, t, _ = h.shape
        hd, nq, nk = cfg.head_size, cfg.n_heads, cfg.kv_heads
        if cfg.fused_qkv:
            qkv = _dense(cfg, (nq + 2 * nk) * hd, "qkv", bias=cfg.qkv_bias)(h)
            q, k, v = jnp.split(qkv, [nq * hd, (nq + nk) * hd], axis=-1)
        else:
            q = _dense(cfg, nq * hd, "q", bias=cfg.qkv_bias)(h)
            k = _dense(cfg, nk * hd, "k", bias=cfg.qkv_bias)(h)
            v = _dense(cfg, nk * hd, "v", bias=cfg.qkv_bias)(h)
        return q.reshape(b, t, nq, hd), k.reshape(b, t, nk, hd), v.reshape(b, t, nk, hd)

    def _attend(self, h: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = h.shape
        q, k, v = self._qkv(h)
        if cfg.positions == "rope":
            q, k = apply_rope(q, cfg), apply_rope(k, cfg)
        nk, group, hd = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_size
        # Query head n uses key-value head n // group (transformers' repeat_kv).
        q = q.reshape(b, t, nk, group, hd)
        logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(hd).astype(h.dtype)
        logits = jnp.where(attention_mask(t, cfg.sliding_window), logits, -1e9)
        attn = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", attn, v).reshape(b, t, cfg.n_heads * hd)
        return _dense(cfg, cfg.d_model, "proj", bias=cfg.out_bias, fsdp_axis=1)(out)

    def _mlp(self, h: jax.Array) -> jax.Array:
        cfg = self.cfg
        act = ACTIVATIONS[cfg.activation]
        up = _dense(cfg, cfg.d_ff, "up", bias=cfg.mlp_bias)(h)
        if cfg.mlp == "gated":
            up = act(_dense(cfg, cfg.d_ff, "gate", bias=cfg.mlp_bias)(h)) * up
        else:
            up = act(up)
        return _dense(cfg, cfg.d_model, "down", bias=cfg.mlp_bias, fsdp_axis=1)(up)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self._attend(Norm(self.cfg, name="ln_attn")(x))
        return x + self._mlp(Norm(self.cfg, name="ln_mlp")(x))


class ScanBlock(Block):
    """A ``Block`` as the body of ``nn.scan``: ``(carry, _) -> (carry, None)``."""

    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:  # type: ignore[override]
        return super().__call__(x), None


class Transformer(nn.Module):
    """The causal LM: ``apply({"params": params}, tokens [batch, seq])`` -> float32 logits ``[batch, seq, vocab]``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed",
                         embedding_init=_partitioned(nn.initializers.normal(0.02), (FSDP, None), cfg))
        x = embed(tokens)
        if cfg.embed_scale:
            x = x * jnp.asarray(cfg.d_model ** 0.5, x.dtype)
        if cfg.positions == "learned":
            pos = self.param("pos_embed", _partitioned(nn.initializers.normal(0.02), (None, FSDP), cfg),
                             (cfg.max_len, cfg.d_model))
            x = x + pos[None, : tokens.shape[1]]
        if cfg.scan_layers:
            scan = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.n_layers,
                           metadata_params={nn.PARTITION_NAME: LAYERS})
            x, _ = scan(cfg, name=LAYERS)(x, None)
        else:
            for i in range(cfg.n_layers):
                x = Block(cfg, name=f"layers_{i}")(x)
        x = Norm(cfg, name="ln_f")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg, cfg.vocab, "lm_head", bias=False)(x)
        return logits.astype(jnp.float32)
