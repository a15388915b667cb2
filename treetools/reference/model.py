"""A few-layer decoder-only Transformer whose params carry FSDP partitioning names."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

FSDP = "fsdp"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_len: int = 64


def _dense(features: int, name: str, *, fsdp_axis: int = 0) -> nn.Dense:
    # FSDP: every kernel is split over the `fsdp` mesh axis along one dimension.
    names = (FSDP, None) if fsdp_axis == 0 else (None, FSDP)
    return nn.Dense(features, name=name,
                    kernel_init=nn.with_partitioning(nn.initializers.normal(0.02), names),
                    bias_init=nn.with_partitioning(nn.initializers.zeros, (None,)))


def _norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(name=name, scale_init=nn.with_partitioning(nn.initializers.ones, (None,)),
                        bias_init=nn.with_partitioning(nn.initializers.zeros, (None,)))


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, d = x.shape
        head = d // cfg.n_heads
        h = _norm("ln_attn")(x)
        qkv = _dense(3 * d, "qkv")(h).reshape(b, t, 3, cfg.n_heads, head)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        attn = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        x = x + _dense(d, "proj", fsdp_axis=1)(out)
        h = _norm("ln_mlp")(x)
        h = _dense(d, "down", fsdp_axis=1)(nn.gelu(_dense(cfg.d_ff, "up")(h)))
        return x + h


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed",
                         embedding_init=nn.with_partitioning(nn.initializers.normal(0.02), (FSDP, None)))
        pos = self.param("pos_embed", nn.with_partitioning(nn.initializers.normal(0.02), (None, FSDP)),
                         (cfg.max_len, cfg.d_model))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"layers_{i}")(x)
        x = _norm("ln_f")(x)
        return embed.attend(x)  # tied output embedding
