"""A few-layer decoder-only Transformer whose params carry FSDP partitioning names.

With ``scan_layers`` its blocks are one ``nn.scan`` named ``layers``: every
block parameter is one leaf of shape ``(n_layers, ...)`` (``layers/qkv/kernel``),
and flax inserts the scan's partition name ``layers`` into each box's names at
that axis, which is how ``tt.norm_metrics`` finds the layer axis and logs
``grad_norm/layers/<i>``. Unscanned, the blocks are ``layers_0`` ... ``layers_<n-1>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

FSDP = "fsdp"
LAYERS = "layers"  # the scan's partition name: the layer axis of a stacked leaf
# Scanned boxes name `layers`, which is no mesh axis: logical names with these rules keep the
# layer axis replicated and map `fsdp` to the mesh axis of that name (the same layout as unscanned).
SCAN_RULES = ((FSDP, FSDP), (LAYERS, None))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_len: int = 64
    scan_layers: bool = False


def _partitioned(init: Any, names: tuple, cfg: ModelConfig) -> Any:
    if cfg.scan_layers:
        return nn.with_logical_partitioning(init, names, rules=SCAN_RULES)
    return nn.with_partitioning(init, names)


def _dense(cfg: ModelConfig, features: int, name: str, *, fsdp_axis: int = 0) -> nn.Dense:
    # FSDP: every kernel is split over the `fsdp` mesh axis along one dimension.
    names = (FSDP, None) if fsdp_axis == 0 else (None, FSDP)
    return nn.Dense(features, name=name,
                    kernel_init=_partitioned(nn.initializers.normal(0.02), names, cfg),
                    bias_init=_partitioned(nn.initializers.zeros, (None,), cfg))


def _norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(name=name, scale_init=_partitioned(nn.initializers.ones, (None,), cfg),
                        bias_init=_partitioned(nn.initializers.zeros, (None,), cfg))


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, d = x.shape
        head = d // cfg.n_heads
        h = _norm(cfg, "ln_attn")(x)
        qkv = _dense(cfg, 3 * d, "qkv")(h).reshape(b, t, 3, cfg.n_heads, head)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        attn = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        x = x + _dense(cfg, d, "proj", fsdp_axis=1)(out)
        h = _norm(cfg, "ln_mlp")(x)
        h = _dense(cfg, d, "down", fsdp_axis=1)(nn.gelu(_dense(cfg, cfg.d_ff, "up")(h)))
        return x + h


class ScanBlock(Block):
    """A ``Block`` as the body of ``nn.scan``: ``(carry, _) -> (carry, None)``."""

    # nn.scan's body takes and returns (carry, x): a different signature from Block's, on purpose
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:  # type: ignore[override]
        return super().__call__(x), None


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed",
                         embedding_init=_partitioned(nn.initializers.normal(0.02), (FSDP, None), cfg))
        pos = self.param("pos_embed", _partitioned(nn.initializers.normal(0.02), (None, FSDP), cfg),
                         (cfg.max_len, cfg.d_model))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        if cfg.scan_layers:
            scan = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.n_layers,
                           metadata_params={nn.PARTITION_NAME: LAYERS})
            x, _ = scan(cfg, name=LAYERS)(x, None)
        else:
            for i in range(cfg.n_layers):
                x = Block(cfg, name=f"layers_{i}")(x)
        x = _norm(cfg, "ln_f")(x)
        return embed.attend(x)  # tied output embedding
