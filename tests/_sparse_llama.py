"""A Llama-shaped Hugging Face folder of any size that costs no disk: sharded safetensors whose data are holes.

Each shard is a safetensors header, then ``truncate`` (the holes read as zeros): ``tests/test_real_sizes.py``'s
``sparse_safetensors``; the index and a ``config.json`` (what the presets' placeholders
are filled from) beside them. ``put`` writes marker values at known elements, so what a conversion writes can be
sampled and checked. Used by tests/test_presets_real_sizes.py and benchmarks/preset_scale.py.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from tests.test_real_sizes import sparse_safetensors

TINYLLAMA = {"vocab": 32000, "hidden": 2048, "ffn": 5632, "heads": 32, "kv_heads": 4}
"""TinyLlama-1.1B's shapes (head_dim 64): float32, 250 MiB of embedding, 168 MiB a layer."""


def llama_tensors(*, vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int, layers: int,
                  tied: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a ``LlamaForCausalLM``'s float32 state dict, in the order transformers saves it."""
    hd = hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * hd, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * hd, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
                (p + "mlp.gate_proj.weight", (ffn, hidden)),
                (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def sparse_llama(folder: str, *, vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int, layers: int,
                 tied: bool = True, shard_bytes: int = 5 * 10**9) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Write the folder: shards of at most ``shard_bytes`` (a tensor larger than that alone), the index, the config.

    Returns ``{name: (shard path, byte offset of its data in the file, shape)}`` for ``put``.
    """
    os.makedirs(folder, exist_ok=True)
    tensors = llama_tensors(vocab=vocab, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, layers=layers,
                            tied=tied)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    where: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(folder, file)
        starts = sparse_safetensors(path, [(name, "F32", shape, 4) for name, shape in shard])
        for name, shape in shard:
            weight_map[name] = file
            where[name] = (path, starts[name], shape)
    total = sum(4 * math.prod(s) for _, s in tensors)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return where


def put(where: dict[str, tuple[str, int, tuple[int, ...]]], name: str, index: tuple[int, ...], value: float) -> None:
    """Write one float32 ``value`` at element ``index`` of tensor ``name``, in place (a seek and a write)."""
    path, offset, shape = where[name]
    with open(path, "r+b") as f:
        f.seek(offset + 4 * int(np.ravel_multi_index(index, shape)))
        f.write(np.float32(value).tobytes())


def folder_bytes(folder: str) -> int:
    """The bytes of tensor data the folder declares (its index's ``total_size``)."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return int(json.load(f)["metadata"]["total_size"])
