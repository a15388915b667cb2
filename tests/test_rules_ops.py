"""The layout rules (issue 46): split, concat, reshape, permute, slice, pad, tie and scale.

Truth is numpy doing the same by hand, written here apart from the engine: ``np.split``, ``np.concatenate``,
``reshape``, the rotary permutation as Hugging Face's Llama conversion script writes it (``view(H, D/2, 2, d)
.transpose(1, 2)``), ``np.random.default_rng(seed).normal`` for new rows, a scale as numpy float64 rounded by
``astype`` (float32, float16) or, for bfloat16, to the nearest of all 65536 bfloat16 values (a search). Each
op is read whole and in blocks (tiles of several shapes, through ``RuledReader``), through ``tt.convert``
(npz/safetensors in, safetensors and Orbax out, read back with safetensors' own reader and Orbax's), through
``load_parameters`` and ``restore_checkpoint`` onto the 8 fake CPU devices; round trips are bit-exact (a scale
by 1/sqrt(N) and back: within one ulp); reads stay within the blocks a block needs (a recording reader counts
the largest block read); the CLI flags, the plan text and the errors.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treetools as tt
from treetools.checkpoint_io.mapping import RuledReader
from treetools.checkpoint_io.readers import InMemoryReader
from treetools.cli import main
from treetools.rules.spec import Rules
from treetools.shared.errors import RulesError

H, D, DM = 3, 4, 6  # heads, head_dim, model width


class Recording(InMemoryReader):
    """An in-memory source that records the number of elements of every block read from it."""

    def __init__(self, array, sizes):
        super().__init__(array)
        self.sizes = sizes

    def read(self, index):
        block = super().read(index)
        self.sizes.append(block.size)
        return block


def tiles(shape, block):
    ranges = [[slice(i, min(i + b, n)) for i in range(0, max(n, 1), b)] for n, b in zip(shape, block)]
    return list(itertools.product(*ranges))


def read_all(rules, arrays, *, blocks=((1,), (2, 3), (5, 1, 2), (3, 3, 3, 3)), sizes=None):
    """Every target leaf of ``rules`` over ``arrays``: read whole, and tiled in each block shape (all equal)."""
    plan = rules.plan(arrays)
    out = {}
    for t in plan:
        reader = RuledReader(t, {p: Recording(a, sizes if sizes is not None else []) for p, a in arrays.items()})
        whole = reader.read()
        assert whole.shape == t.shape and whole.dtype == t.dtype, t.path
        for block in blocks:
            block = (tuple(block) * len(t.shape))[:len(t.shape)]
            tiled = np.empty(reader.shape, reader.dtype)
            for index in tiles(reader.shape, block):
                tiled[index] = reader.read(index)
            assert np.array_equal(tiled, whole, equal_nan=True), (t.path, block)
        out[t.path] = whole
    return out


def bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def hf_permute(w, n_heads):
    """Hugging Face's convert_llama_weights_to_hf.permute, in numpy: Meta's interleaved rotary layout -> HF's."""
    dim1, dim2 = w.shape
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def rng_arrays(seed=0, **shapes):
    rng = np.random.default_rng(seed)
    return {name.replace("__", "."): rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


# ---------------------------------------------------------------------------------------------- each op vs numpy


def test_split_equal_and_by_sizes_is_np_split():
    c = rng_arrays(c=(DM, 3 * DM))["c"]
    arrays = {"h.0.attn.c_attn.weight": c, "h.1.mlp.w": c[:, :10]}
    rules = Rules(split=[(r"\.c_attn\.weight$", {"names": [".q.weight", ".k.weight", ".v.weight"], "axis": -1}),
                         (r"^h\.(\d+)\.mlp\.w$", {"names": [r"mlp.\1.a", r"mlp.\1.b"], "axis": 1, "sizes": [3, -1]})])
    got = read_all(rules, arrays)
    q, k, v = np.split(c, 3, axis=1)
    assert bits(got["h.0.attn.q.weight"], q) and bits(got["h.0.attn.k.weight"], k) and bits(got["h.0.attn.v.weight"], v)
    a, b = np.split(c[:, :10], [3], axis=1)
    assert bits(got["mlp.1.a"], a) and bits(got["mlp.1.b"], b)
    assert list(got) == ["h.0.attn.q.weight", "h.0.attn.k.weight", "h.0.attn.v.weight", "mlp.1.a", "mlp.1.b"]


def test_concat_joins_in_the_order_of_parts_not_of_the_leaves():
    arrays = rng_arrays(**{"l0__up_proj": (5, DM), "l0__gate_proj": (4, DM), "l0__norm": (DM,)})
    rules = Rules(concat=[(r"\.(?P<part>gate|up)_proj$",
                           {"name": ".gate_up_proj", "axis": 0, "parts": ["gate", "up"]})])
    got = read_all(rules, arrays)
    assert list(got) == ["l0.gate_up_proj", "l0.norm"]  # where its first leaf was
    assert bits(got["l0.gate_up_proj"], np.concatenate([arrays["l0.gate_proj"], arrays["l0.up_proj"]], axis=0))


def test_reshape_into_merge_and_shape_are_numpy_reshape():
    arrays = rng_arrays(**{"q": (H * D, DM), "o": (DM, H, D), "w": (2, 3, 4, 5)})
    rules = Rules(reshape=[("^q$", {"axis": 0, "into": [-1, D]}), ("^o$", {"merge": [1, 2]}), ("^w$", [0, -1, 10])])
    got = read_all(rules, arrays)
    assert bits(got["q"], arrays["q"].reshape(H, D, DM))
    assert bits(got["o"], arrays["o"].reshape(DM, H * D))
    assert bits(got["w"], arrays["w"].reshape(2, 6, 10))


def test_reshape_with_transpose_gives_the_heads_layout_and_back():
    # [H*D, d] (a PyTorch q_proj.weight) <-> [d, H, D] (a JAX DenseGeneral kernel), both ways, bit-exact
    q = rng_arrays(q=(H * D, DM))["q"]
    to_jax = Rules(reshape={"q$": {"axis": 0, "into": [-1, D]}}, transpose={"q$": (2, 0, 1)})
    kernel = read_all(to_jax, {"q": q})["q"]
    assert bits(kernel, q.reshape(H, D, DM).transpose(2, 0, 1))
    to_pt = Rules(reshape={"q$": {"merge": [1, 2]}}, transpose={"q$": (1, 0)})
    assert bits(read_all(to_pt, {"q": kernel})["q"], q)


@pytest.mark.parametrize("rotary_dim", [None, 2])
def test_permute_is_the_llama_conversion_permutation_and_its_inverse(rotary_dim):
    meta = rng_arrays(q=(H * D, DM))["q"]  # interleaved, as Meta's checkpoints store q and k
    spec = {"axis": 0, "head_dim": D, "to": "half", **({"rotary_dim": rotary_dim} if rotary_dim else {})}
    half = read_all(Rules(permute={"q": spec}), {"q": meta})["q"]
    if rotary_dim is None:
        assert bits(half, hf_permute(meta, H))
    else:  # only the first 2 of each head's 4 entries rotate, and (0, 1) interleaved is (0, 1) half: unchanged
        assert bits(half, meta)
    back = read_all(Rules(permute={"q": {**spec, "to": "interleaved"}}), {"q": half})["q"]
    assert bits(back, meta)  # the round trip, bit for bit


def test_permute_of_a_partial_rotary_head_moves_only_its_rotary_part():
    d6 = rng_arrays(k=(2 * 6, 3))["k"]
    got = read_all(Rules(permute={"k": {"axis": 0, "head_dim": 6, "rotary_dim": 4, "to": "interleaved"}}), {"k": d6})
    # per head: rotary half layout (0, 1 | 2, 3) -> interleaved (0, 2, 1, 3); entries 4, 5 stay
    order = [0, 2, 1, 3, 4, 5, 6, 8, 7, 9, 10, 11]
    assert bits(got["k"], d6[order])


def test_permute_along_a_later_axis_of_a_stacked_kernel():
    kernel = rng_arrays(k=(2, DM, H, D))["k"]  # [layers, d, heads, head_dim]
    got = read_all(Rules(permute={"k": {"axis": -1, "head_dim": D, "to": "interleaved"}}), {"k": kernel})["k"]
    want = kernel.reshape(2, DM, H, 2, D // 2).transpose(0, 1, 2, 4, 3).reshape(kernel.shape)  # half -> interleaved
    assert bits(got, want)


def test_slice_and_pad_zeros_and_seeded_normal():
    emb = rng_arrays(e=(10, DM))["e"]
    arrays = {"embed": emb, "head": emb.T.copy(), "mu": np.ones((10, DM), np.float32), "small": emb[:4]}
    rules = Rules(slice=[("^head$", {"axis": 1, "stop": 8, "start": 1})],
                  pad=[("^embed$", {"axis": 0, "size": 13, "init": "normal", "stddev": 0.02, "seed": 7}),
                       ("^mu$", {"axis": 0, "size": 12}),
                       ("^small$", {"axis": 1, "size": 9, "init": "uniform", "low": -1, "high": 1, "seed": 2})])
    got = read_all(rules, arrays)
    assert bits(got["head"], emb.T[:, 1:8])
    new = np.random.default_rng(7).normal(0.0, 0.02, size=(3, DM)).astype(np.float32)
    assert bits(got["embed"], np.concatenate([emb, new]))
    assert bits(got["mu"], np.concatenate([np.ones((10, DM), np.float32), np.zeros((2, DM), np.float32)]))
    drawn = np.random.default_rng(2).uniform(-1, 1, size=(4, 3)).astype(np.float32)
    assert bits(got["small"], np.concatenate([emb[:4], drawn], axis=1))


def test_tie_writes_a_leaf_again_transposed_or_not_and_its_cast_is_its_own():
    emb = rng_arrays(e=(7, DM))["e"]
    rules = Rules(tie=[("^embed$", {"name": "lm_head", "axes": [1, 0]}), ("^wpe$", {"name": "wpe_copy"})],
                  cast={"^lm_head$": "float16"})
    got = read_all(rules, {"embed": emb, "wpe": emb[:2]})
    assert list(got) == ["embed", "lm_head", "wpe", "wpe_copy"]
    assert bits(got["embed"], emb) and bits(got["lm_head"], emb.T.astype(np.float16))
    assert bits(got["wpe_copy"], emb[:2])


def test_everything_at_once_is_the_numpy_composition():
    # GPT-2 style: a fused c_attn (Conv1D [d, 3d]) split, each piece's columns as heads, the layers stacked
    L = 2
    arrays = {f"h.{i}.attn.c_attn.weight": rng_arrays(i, w=(DM, 3 * H * D))["w"] for i in range(L)}
    arrays["wte"] = rng_arrays(9, w=(11, DM))["w"]
    rules = Rules(split=[(r"\.c_attn\.weight$", {"names": ["/q", "/k", "/v"], "axis": 1})],
                  rename=[(r"^h\.(\d+)\.attn/(\w)$", r"layers/\1/\2/kernel")],
                  stack=["layers/"],
                  reshape=[("kernel$", {"axis": 2, "into": [H, D]})],
                  permute=[(r"(q|k)/kernel$", {"axis": 3, "head_dim": D, "to": "interleaved"})],
                  pad=[("^wte$", {"axis": 0, "size": 16})],
                  tie=[("^wte$", {"name": "head", "axes": [1, 0]})], dtype="bfloat16")
    got = read_all(rules, arrays, blocks=((1,), (2, 1, 2, 3)))
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    for j, name in enumerate("qkv"):
        want = np.stack([np.split(arrays[f"h.{i}.attn.c_attn.weight"], 3, axis=1)[j] for i in range(L)])
        want = want.reshape(L, DM, H, D)
        if name != "v":
            want = want.reshape(L, DM, H, 2, D // 2).swapaxes(3, 4).reshape(L, DM, H, D)
        assert bits(got[f"layers/{name}/kernel"], want.astype(bf16)), name
    padded = np.concatenate([arrays["wte"], np.zeros((5, DM), np.float32)])
    assert bits(got["wte"], padded.astype(bf16)) and bits(got["head"], padded.T.astype(bf16))


def nearest_bfloat16(values):
    """float64 ``values`` rounded to the nearest bfloat16 (ties to the even code), by a search over every finite
    bfloat16 value: apart from any float32 step."""
    import ml_dtypes

    codes = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # the NaN codes
        every = codes.view(ml_dtypes.bfloat16).astype(np.float64)
    keep = np.isfinite(every) & ~((every == 0) & (codes >= 0x8000))  # one zero
    order = np.argsort(every[keep], kind="stable")
    table, table_codes = every[keep][order], codes[keep][order]
    hi = np.clip(np.searchsorted(table, values), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = values - table[lo], table[hi] - values
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(table_codes[lo] % 2 == 0, lo, hi)))
    return table_codes[pick].view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("factor, by_hand", [
    ("1/sqrt(128)", lambda x: x / np.sqrt(np.float64(128))),
    ("sqrt(12)", lambda x: x * np.sqrt(np.float64(12))),
    (0.1, lambda x: x * np.float64(0.1)),
    ("-2.5e-3", lambda x: x * np.float64(-2.5e-3)),
])
def test_scale_is_numpy_float64_rounded_once_to_the_leafs_dtype(factor, by_hand):
    import ml_dtypes

    x = rng_arrays(w=(7, 2 * DM))["w"] * np.float32(3.0)
    exact = by_hand(x.astype(np.float64))
    arrays = {"w": x, "h": x.astype(np.float16), "b": x.astype(ml_dtypes.bfloat16), "c": x, "k": x}
    got = read_all(Rules(scale={"^(w|h|b|c)$": factor}, cast={"^c$": "bfloat16"}), arrays)
    assert bits(got["w"], exact.astype(np.float32))                      # numpy: float64 -> float32, one rounding
    assert bits(got["h"], by_hand(x.astype(np.float16).astype(np.float64)).astype(np.float16))
    b_exact = by_hand(x.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert bits(got["b"], nearest_bfloat16(b_exact))
    assert bits(got["c"], nearest_bfloat16(exact))                        # scaled and cast: rounded once, to bf16
    assert bits(got["k"], x)                                              # no rule: as stored
    # a scale, then a transpose's axes still read off the plan; a cast to integers after a scale is numpy's astype
    plan = Rules(transpose={"w": (1, 0)}, scale={"w": factor}, dtype="float16").plan({"w": x})
    shown = {"-2.5e-3": "-0.0025"}.get(str(factor), str(factor))
    assert plan["w"].axes == (1, 0) and plan["w"].row().ops == ("transpose (1, 0)", f"scale {shown}", "cast float16")
    as_int = read_all(Rules(scale={"w": factor}, cast={"w": "int32"}), {"w": x})["w"]
    assert bits(as_int, exact.astype(np.int32))


def test_a_scale_then_a_cast_rounds_once_where_float32_then_bfloat16_would_round_twice():
    # 1 + 2**-8 is a float32, and the midpoint of the bfloat16s 1 and 1 + 2**-7; times (1 + 2**-40) it is just
    # above that midpoint, so its nearest bfloat16 is 1 + 2**-7. Through float32 it would land on the midpoint
    # and round (to even) to 1.
    x = np.array([1 + 2**-8, -(1 + 2**-8)], np.float32)
    got = read_all(Rules(scale={"w": 1 + 2**-40}, dtype="bfloat16"), {"w": x}, blocks=((1,),))["w"]
    assert got.astype(np.float64).tolist() == [1 + 2**-7, -(1 + 2**-7)]
    assert bits(got, nearest_bfloat16(x.astype(np.float64) * (1 + 2**-40)))
    twice = (x.astype(np.float64) * (1 + 2**-40)).astype(np.float32).astype(got.dtype)
    assert twice.astype(np.float64).tolist() == [1.0, -1.0]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scale_by_1_over_sqrt_n_then_sqrt_n_is_within_one_ulp_and_exact_when_n_is_a_power_of_4(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    seed, n = data.draw(st.integers(0, 2**16)), data.draw(st.integers(1, 300))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-20, 20, shape)).astype(np.float32)
    there = read_all(Rules(scale={"w": f"1/sqrt({n})"}), {"w": x}, blocks=((1,), (2, 3)))["w"]
    assert bits(there, (x.astype(np.float64) / np.sqrt(np.float64(n))).astype(np.float32))
    back = read_all(Rules(scale={"w": f"sqrt({n})"}), {"w": there}, blocks=((2,),))["w"]
    assert bits(back, (there.astype(np.float64) * np.sqrt(np.float64(n))).astype(np.float32))
    ulps = np.abs(back.view(np.int32).astype(np.int64) - x.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, (n, x.ravel()[ulps.argmax()], back.ravel()[ulps.argmax()])
    if n in (1, 4, 16, 64, 256):  # sqrt(n) a power of 2: both ways exact
        assert bits(back, x)


# ---------------------------------------------------------------------------------------------- round trips


def test_split_then_concat_and_pad_then_slice_give_the_original_bit_for_bit():
    fused = rng_arrays(w=(2 * DM, 5))["w"]
    split = Rules(split={r"\.gate_up$": {"names": [".gate", ".up"], "axis": 0, "sizes": [4, -1]}})
    parts = read_all(split, {"mlp.gate_up": fused})
    join = Rules(concat={r"\.(?P<part>gate|up)$": {"name": ".gate_up", "axis": 0, "parts": ["gate", "up"]}})
    assert bits(read_all(join, parts)["mlp.gate_up"], fused)
    grown = read_all(Rules(pad={"w": {"axis": 1, "size": 8, "init": "normal", "stddev": 1.0}}), {"w": fused})
    assert bits(read_all(Rules(slice={"w": {"axis": 1, "stop": 5}}), grown)["w"], fused)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_reshape_of_random_shapes_read_in_random_blocks_is_numpy(data):
    dims = data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4))
    src = np.arange(int(np.prod(dims)), dtype=np.int32).reshape(dims)
    # a random target shape of the same size: the prime factors regrouped, with 1s sprinkled in
    factors = [f for d in dims for f in {1: [], 2: [2], 3: [3], 4: [2, 2], 6: [2, 3]}[d]]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(factors) - 1, 1)), max_size=3))) if len(factors) > 1 else []
    groups = [factors[a:b] for a, b in zip([0, *cuts], [*cuts, len(factors)])]
    shape = [int(np.prod(g)) for g in groups if g] or [1]
    ones = data.draw(st.lists(st.integers(0, len(shape)), max_size=2))
    for at in ones:
        shape.insert(at, 1)
    plan = Rules(reshape={"x": shape}).plan({"x": src})
    reader = RuledReader(plan["x"], {"x": InMemoryReader(src)})
    want = src.reshape(shape)
    for _ in range(4):
        index = []
        for n in shape:
            a = data.draw(st.integers(0, n))
            index.append(slice(a, data.draw(st.integers(a, n))))
        assert np.array_equal(reader.read(tuple(index)), want[tuple(index)]), (dims, shape, index)


# ---------------------------------------------------------------------------------------------- bounded reads


def test_blocks_read_only_what_they_need():
    # a [H*D, d] leaf as [d, H, D] (reshape + transpose) read one head-column at a time: each block reads at most
    # one head's D rows of the source, never the whole leaf
    big_h, big_d, big_m = 16, 8, 32
    q = np.arange(big_h * big_d * big_m, dtype=np.float32).reshape(big_h * big_d, big_m)
    rules = Rules(reshape={"q": {"axis": 0, "into": [-1, big_d]}}, transpose={"q": (2, 0, 1)},
                  permute={"q": {"axis": 1, "head_dim": big_d, "to": "interleaved"}})
    plan = rules.plan({"q": q})
    sizes: list[int] = []
    reader = RuledReader(plan["q"], {"q": Recording(q, sizes)})
    whole = reader.read()
    assert bits(hf_permute(whole.transpose(1, 2, 0).reshape(big_h * big_d, big_m), big_h), q)  # HF's permute undoes it
    sizes.clear()
    for h in range(big_h):
        block = reader.read((slice(None), slice(h, h + 1)))
        assert bits(block, whole[:, h:h + 1])
    assert max(sizes) == big_d * big_m  # one head's rows per block, of the 16 heads' 128
    # split: a piece reads its window only; concat: a block inside one part reads that part only
    sizes.clear()
    plan = Rules(split={"c": {"names": ["a", "b", "c2", "d"], "axis": 0}}).plan({"c": q})
    RuledReader(plan["b"], {"c": Recording(q, sizes)}).read((slice(0, 2),))
    assert sizes == [2 * big_m]
    parts = {"x.gate": q[:64], "x.up": q[64:]}
    plan = Rules(concat={r"\.(?P<part>gate|up)$": {"name": ".both", "axis": 0, "parts": ["gate", "up"]}}).plan(parts)
    sizes.clear()
    block = RuledReader(plan["x.both"], {p: Recording(a, sizes) for p, a in parts.items()}).read((slice(70, 72),))
    assert sizes == [2 * big_m] and bits(block, q[70:72])
    # pad: a block of stored rows reads those rows; a block of new rows reads nothing
    plan = Rules(pad={"q": {"axis": 0, "size": 200}}).plan({"q": q})
    sizes.clear()
    reader = RuledReader(plan["q"], {"q": Recording(q, sizes)})
    assert bits(reader.read((slice(150, 160),)), np.zeros((10, big_m), np.float32)) and sizes == []
    reader.read((slice(120, 130),))
    assert sizes == [8 * big_m]


# ---------------------------------------------------------------------------------------------- plan text, errors


def test_plan_text_shows_each_op_with_shapes_before_any_read():
    rules = Rules(split={r"c_attn$": {"names": ["q", "k", "v"], "axis": 1}},
                  reshape={"^q$": {"axis": 1, "into": [H, D]}},
                  permute={"^q$": {"axis": 2, "head_dim": D, "to": "interleaved"}},
                  pad={"^wte$": {"axis": 0, "size": 16, "init": "normal", "stddev": 0.02, "seed": 1}},
                  tie={"^wte$": {"name": "head", "axes": [1, 0]}})
    text = str(rules.plan([("c_attn", (DM, 3 * H * D), "float32"), ("wte", (11, DM), "float32")])).splitlines()
    assert text[0].split() == ["source", "->", "target", "shape", "dtype", "rules"]
    assert " ".join(text[1].split()) == ("c_attn -> q (6, 36) -> (6, 3, 4) float32 split axis 1 [0:12], "
                                         "reshape (6, 3, 4), permute to interleaved axis 2 head_dim 4")
    assert " ".join(text[3].split()) == "c_attn -> v (6, 36) -> (6, 12) float32 split axis 1 [24:36]"
    assert " ".join(text[4].split()) == ("wte -> wte (11, 6) -> (16, 6) float32 pad axis 0 to 16 "
                                         "(normal stddev 0.02 seed 1)")
    assert text[5].split()[:3] == ["wte", "->", "head"] and "tie of wte, transpose (1, 0)" in text[5]
    # paths alone: the mapping of the names, the shapes unknown
    rows = rules.describe(["c_attn", "wte"])
    assert [r.target for r in rows] == ["q", "k", "v", "wte", "head"]


@pytest.mark.parametrize("rules, leaves, message", [
    (Rules(split={"w": {"names": ["a", "b"], "axis": 0}}), [("w", (5, 2), "f4")],
     r"`split` rule 'w': axis 0 of `w` \(5, 2\) has 5 entries, which do not split into 2 equal pieces"),
    (Rules(split={"w": {"names": ["a", "b"], "axis": 0, "sizes": [2, 2]}}), [("w", (5, 2), "f4")],
     r"`split` rule 'w': sizes \[2, 2\] do not sum to 5, the length of axis 0 of `w` \(5, 2\)"),
    (Rules(split={"w": {"names": ["a", "b"], "axis": 2}}), [("w", (4, 2), "f4")],
     r"`split` rule 'w': axis 2 is out of range for `w` of shape \(4, 2\) \(rank 2\)"),
    (Rules(concat={r"(?P<part>a|b)$": {"name": "ab", "axis": 0, "parts": ["a", "b"]}}), [("a", (2, 3), "f4")],
     r"`concat` rule '\(\?P<part>a\|b\)\$': `ab` lacks part\(s\) \['b'\] \(it has `a`\)"),
    (Rules(concat={r"(?P<part>a|b)$": {"name": "ab", "axis": 0, "parts": ["a", "b"]}}),
     [("a", (2, 3), "f4"), ("b", (2, 4), "f4")], r"the parts of `ab` do not join along axis 0 \(`a` \(2, 3\) float32; "
                                                 r"`b` \(2, 4\) float32\)"),
    (Rules(reshape={"w": {"axis": 0, "into": [-1, 4]}}), [("w", (6, 2), "f4")],
     r"`reshape` rule \('w', axis 0 into \[-1, 4\]\) does not fit `w` of shape \(6, 2\) \(12 elements\): axis 0 "
     r"holds 6 elements, which the sizes \[-1, 4\] \(-1: the rest\) do not divide"),
    (Rules(reshape={"w": [5, 5]}), [("w", (6, 2), "f4")], r"does not fit `w` of shape \(6, 2\)"),
    (Rules(permute={"w": {"axis": 0, "head_dim": 4, "to": "half"}}), [("w", (6, 2), "f4")],
     r"`permute` rule 'w': axis 0 of `w` \(6, 2\) has 6 entries, not a multiple of head_dim 4"),
    (Rules(slice={"w": {"axis": 0, "stop": 9}}), [("w", (6, 2), "f4")],
     r"`slice` rule 'w': stop 9 is past the 6 entries of axis 0 of `w` \(6, 2\)"),
    (Rules(pad={"w": {"axis": 1, "size": 1}}), [("w", (6, 2), "f4")],
     r"`pad` rule 'w': size 1 is below the 2 entries of axis 1 of `w` \(6, 2\)"),
    (Rules(pad={"w": {"axis": 0, "size": 9, "init": "normal", "stddev": 1.0}}), [("w", (6,), "int32")],
     r"`pad` rule 'w': init 'normal' draws floating values, but `w` is int32"),
    (Rules(tie={"w": {"name": "v"}}), [("w", (2,), "f4"), ("v", (2,), "f4")],
     r"`w` and `v` both become `v` after tie"),
    (Rules(tie={"w": {"name": "t", "axes": [0, 0]}}), [("w", (2, 3), "f4")],
     r"`tie` rule 'w': axes \[0, 0\] are not a permutation of the 2 axes of `w` \(2, 3\)"),
    (Rules(scale={"^s": "1/sqrt(8)"}), [("w", (2,), "f4"), ("step", (), "int32")],
     r"^`scale` rule \('\^s', 1/sqrt\(8\)\) matches `step` of dtype int32, which is not floating; .*narrow"),
    (Rules(scale={"^s": 2}), [("w", (2,), "f4"), ("step", None, None)],
     r"^`scale` rule \('\^s', 2\) matches `step`, which is not an array"),
])
def test_a_rule_that_does_not_fit_is_a_rules_error_naming_the_leaf(rules, leaves, message):
    with pytest.raises(RulesError, match=message):
        rules.plan(leaves)


@pytest.mark.parametrize("field, value, message", [
    ("split", {"names": ["a"], "axis": 0, "sizes": [1, 2]}, r"one size \(>= 0\) per name"),
    ("split", {"names": ["a"]}, r"missing \['axis'\]"),
    ("concat", {"name": "x", "axis": 0, "parts": ["a"]}, r"has no group named `part`"),
    ("permute", {"axis": 0, "head_dim": 5, "to": "half"}, r"come in pairs"),
    ("permute", {"axis": 0, "head_dim": 4, "to": "sideways"}, r"one of half, interleaved"),
    ("pad", {"axis": 0, "size": 3, "init": "normal"}, r"give \['stddev'\]"),
    ("pad", {"axis": 0, "size": 3, "seed": 1}, r"takes no other keys, not \['seed'\]"),
    ("reshape", {"axis": 0}, r"give one of shape"),
    ("tie", {"nom": "x"}, r"unknown key\(s\) \['nom'\]"),
    ("scale", "1/sqrt(head_dim)", r"^`scale` factor '1/sqrt\(head_dim\)': write a number .*sqrt\(N\) or 1/sqrt\(N\) .*"
                                  r"\(rule 'w'\)$"),
    ("scale", "2*sqrt(2)", r"factor '2\*sqrt\(2\)': write a number"),
    ("scale", "__import__('os').getcwd()", r"write a number"),  # nothing is evaluated
    ("scale", "1/sqrt(0)", r"N in sqrt\(N\) must be a finite number > 0"),
    ("scale", "nan", r"write a number"),
    ("scale", True, r"factor True: write a number"),
])
def test_malformed_values_are_errors_when_the_rules_are_made(field, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Rules(**{field: {"w" if field != "concat" else "w": value}})


# ---------------------------------------------------------------------------------------------- convert, CLI


LLAMA_RULES = Rules(
    rename=[(r"^model\.layers\.(\d+)\.self_attn\.(q|k)_proj\.weight$", r"layers/\1/attn/\2/kernel"),
            (r"^model\.embed_tokens\.weight$", "embed/embedding")],
    stack=["layers/"],
    reshape=[(r"attn/(q|k)/kernel$", {"axis": 1, "into": [-1, D]})],          # [L, H*D, d] -> [L, H, D, d]
    permute=[(r"attn/(q|k)/kernel$", {"axis": 2, "head_dim": D, "to": "interleaved"})],
    transpose=[(r"attn/(q|k)/kernel$", (0, 3, 1, 2))],                         # -> [L, d, H, D]
    pad=[(r"^embed/embedding$", {"axis": 0, "size": 16, "init": "normal", "stddev": 0.02, "seed": 3})],
    tie=[(r"^embed/embedding$", {"name": "lm_head/kernel", "axes": [1, 0]})],
    scale=[(r"attn/q/kernel$", "1/sqrt(3)")],
)


def _llama(L=2, vocab=13):
    rng = np.random.default_rng(5)
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, DM)).astype(np.float32)}
    for i in range(L):
        for p in "qk":
            out[f"model.layers.{i}.self_attn.{p}_proj.weight"] = rng.standard_normal((H * D, DM)).astype(np.float32)
    return out


def _llama_truth(hf, L=2):
    """LLAMA_RULES by hand: np.stack, the heads' reshape, the rotary permutation (HF's inverse), the transpose, q
    divided by sqrt(3) in float64."""
    out = {}
    for p in "qk":
        layers = []
        for i in range(L):
            w = hf[f"model.layers.{i}.self_attn.{p}_proj.weight"]  # [H*D, d], half layout
            inter = w.reshape(H, 2, D // 2, DM).transpose(0, 2, 1, 3).reshape(H * D, DM)  # inverse of hf_permute
            assert bits(hf_permute(inter, H), w)
            layers.append(inter.reshape(H, D, DM).transpose(2, 0, 1))
        out[f"layers/attn/{p}/kernel"] = np.stack(layers)
    q = out["layers/attn/q/kernel"]
    out["layers/attn/q/kernel"] = (q.astype(np.float64) / np.sqrt(np.float64(3))).astype(np.float32)
    emb = hf["model.embed_tokens.weight"]
    emb = np.concatenate([emb, np.random.default_rng(3).normal(0, 0.02, size=(16 - len(emb), DM)).astype(np.float32)])
    out["embed/embedding"], out["lm_head/kernel"] = emb, emb.T
    return out


def test_convert_safetensors_to_safetensors_and_orbax_and_back(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf = _llama()
    save_file(hf, tmp_path / "model.safetensors")
    want = _llama_truth(hf)
    report = tt.convert(str(tmp_path / "model.safetensors"), str(tmp_path / "out.safetensors"), rules=LLAMA_RULES,
                        verify=True, block_bytes=64)
    assert report.ok
    got = load_file(tmp_path / "out.safetensors")  # safetensors' own reader
    assert sorted(got) == sorted(p.replace("/", ".") for p in want)
    for p, value in want.items():
        assert bits(got[p.replace("/", ".")], value), p
    # Orbax out, from npz in: read back by Orbax's own restore
    np.savez(tmp_path / "model.npz", **hf)
    assert tt.convert(str(tmp_path / "model.npz"), str(tmp_path / "orbax"), rules=LLAMA_RULES, to="orbax",
                      verify=True).ok
    import orbax.checkpoint as ocp

    restored = tt.flatten(ocp.StandardCheckpointer().restore(str((tmp_path / "orbax").resolve())))
    for p, value in want.items():
        assert bits(np.asarray(restored[p]), value), p
    # and back: the inverse rules give the HF tensors bit for bit (the vocabulary sliced, the tie dropped)
    back_rules = Rules(
        drop=["^lm_head/"],
        unstack=[r"^layers/"],
        rename=[(r"^layers/(\d+)/attn/(q|k)/kernel$", r"model.layers.\1.self_attn.\2_proj.weight"),
                (r"^embed/embedding$", "model.embed_tokens.weight")],
        reshape=[(r"_proj\.weight$", {"merge": [1, 2]})],
        permute=[(r"_proj\.weight$", {"axis": 1, "head_dim": D, "to": "half"})],
        transpose=[(r"_proj\.weight$", (1, 0))],
        slice=[(r"embed_tokens", {"axis": 0, "stop": 13})],
        scale=[(r"q_proj\.weight$", "sqrt(3)")])
    tt.convert(str(tmp_path / "orbax"), str(tmp_path / "hf.safetensors"), rules=back_rules)
    again = load_file(tmp_path / "hf.safetensors")
    assert sorted(again) == sorted(hf)
    for name, value in hf.items():
        if "q_proj" in name:  # x / sqrt(3) * sqrt(3), each rounded to float32: within one ulp of x
            ulps = np.abs(again[name].view(np.int32).astype(np.int64) - value.view(np.int32).astype(np.int64))
            assert again[name].shape == value.shape and ulps.max() <= 1 and ulps.max() == 1, name
        else:
            assert bits(again[name], value), name


def test_convert_dry_run_shows_the_plan_and_a_bad_rule_writes_nothing(tmp_path, capsys):
    from safetensors.numpy import save_file

    save_file(_llama(), tmp_path / "model.safetensors")
    src, dst = str(tmp_path / "model.safetensors"), str(tmp_path / "out")
    assert main(["convert", src, dst, "--dry-run",
                 "--rename", r"^model\.layers\.(\d+)\.self_attn\.(q|k)_proj\.weight$=>layers/\1/attn/\2/kernel",
                 "--stack", "layers/",
                 "--reshape", r"kernel$=>axis=1 into=-1,4",
                 "--permute", r"kernel$=>axis=2 head_dim=4 to=interleaved",
                 "--transpose", "kernel$=0,3,1,2",
                 "--pad", r"embed_tokens\.weight$=>axis=0 size=16 init=normal stddev=0.02 seed=3",
                 "--tie", r"^model\.embed_tokens\.weight$=>name=lm_head.weight axes=1,0",
                 "--scale", r"attn/q/kernel$=1/sqrt(4)"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    rows = {line.split(" -> ")[1].split()[0]: " ".join(line.split()) for line in out.splitlines()[1:] if " -> " in line}
    assert rows["layers.attn.q.kernel"].startswith("model.layers.0.self_attn.q_proj.weight .. model.layers.1.self_attn"
                                                   ".q_proj.weight (2) -> layers.attn.q.kernel (12, 6) -> (2, 6, 3, 4)")
    assert rows["layers.attn.q.kernel"].endswith("stack 2, reshape (2, 3, 4, 6), permute to interleaved axis 2 "
                                                 "head_dim 4, transpose (0, 3, 1, 2), scale 1/sqrt(4)")
    assert rows["layers.attn.k.kernel"].endswith("transpose (0, 3, 1, 2)")
    assert "(13, 6) -> (16, 6)" in rows["model.embed_tokens.weight"]
    assert rows["lm_head.weight"].endswith("tie of model.embed_tokens.weight, transpose (1, 0)")
    # a rule that does not fit: one RulesError line naming the leaf, exit 1 or 2, nothing written
    code = main(["convert", src, dst, "--permute", r"q_proj\.weight$=>axis=0 head_dim=5 to=half"])
    err = capsys.readouterr().err
    assert code != 0 and not (tmp_path / "out").exists()
    assert "head_dim 5" in err and "come in pairs" in err  # a malformed value: said when the rules are made
    code = main(["convert", src, dst, "--permute", r"q_proj\.weight$=>axis=0 head_dim=8 to=half"])
    err = capsys.readouterr().err
    assert code != 0 and not (tmp_path / "out").exists()
    assert "`model.layers.0.self_attn.q_proj.weight` (12, 6) has 12 entries, not a multiple of head_dim 8" in err
    code = main(["convert", src, dst, "--scale", r"q_proj\.weight$=1/sqrt(head_dim)"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out").exists()
    assert err.count("\n") == 1 and "`--scale` 'q_proj" in err and "(rule 'q_proj" in err  # one line, the rule named
    assert "`scale` factor '1/sqrt(head_dim)': write a number (0.5, 2e-3), sqrt(N) or 1/sqrt(N)" in err


def test_cli_flags_and_a_rules_file_give_the_same_rules(tmp_path):
    import argparse

    from treetools.cli.options import add_rules, rules_from

    parser = argparse.ArgumentParser()
    add_rules(parser)
    flags = ["--split", r"c_attn\.weight$=>names=q.weight,k.weight,v.weight axis=1",
             "--concat", r"\.(?P<part>gate|up)_proj\.weight$=>name=.gate_up_proj.weight axis=0 parts=gate,up",
             "--reshape", r"q_proj\.weight$=>axis=0 into=-1,64", "--reshape", "o$=>merge=1,2", "--reshape", "w$=0,-1",
             "--permute", r"(q|k)_proj\.weight$=>axis=0 head_dim=64 to=interleaved rotary_dim=32",
             "--slice", r"^lm_head=>axis=0 stop=32000 start=0",
             "--pad", r"embed_tokens\.weight$=>axis=0 size=32128 init=normal stddev=0.02 seed=1",
             "--tie", r"^embed/embedding$=>name=lm_head/kernel axes=1,0",
             "--scale", r"q_proj\.weight$=1/sqrt(128)", "--scale", "^lm_head=0.5"]
    from_flags = rules_from(parser.parse_args(flags))
    (tmp_path / "r.json").write_text(json.dumps(from_flags.to_dict()))
    assert Rules.from_file(tmp_path / "r.json") == from_flags
    assert from_flags.split[0][1].names == ("q.weight", "k.weight", "v.weight")
    assert from_flags.reshape[2][1].shape == (0, -1) and from_flags.to_dict()["reshape"][2] == ["w$", [0, -1]]
    assert from_flags.permute[0][1].rotary_dim == 32 and from_flags.pad[0][1].stddev == 0.02
    assert from_flags.to_dict()["scale"] == [[r"q_proj\.weight$", "1/sqrt(128)"], ["^lm_head", 0.5]]
    for bad in (["--split", "c_attn=>names=a,b axis"], ["--tie", "w=>axes=1,0"], ["--reshape", "w=x"],
                ["--scale", "w=2*sqrt(2)"], ["--scale", "w"]):
        from treetools.shared.errors import UsageError

        with pytest.raises(UsageError):
            rules_from(parser.parse_args(bad))


# ---------------------------------------------------------------------------------------------- load, restore


def test_load_parameters_and_restore_onto_8_devices_with_layout_rules(tmp_path, devices):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import save_file

    hf = _llama()
    save_file(hf, tmp_path / "model.safetensors")
    want = _llama_truth(hf)
    loaded = tt.flatten(tt.load_parameters(str(tmp_path / "model.safetensors"), rules=LLAMA_RULES))
    assert sorted(loaded) == sorted(want)
    for p, value in want.items():
        assert bits(np.asarray(loaded[p]), value), p
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    # every device its own block: a layer and one entry of head_dim (through the permute and the reshape) of each
    # kernel, two rows of the padded embedding (the last ones drawn), two columns of the tied head
    heads = NamedSharding(mesh, P("a", None, None, "b"))
    rows, cols = NamedSharding(mesh, P(("a", "b"))), NamedSharding(mesh, P(None, ("a", "b")))
    target = {"layers": {"attn": {p: {"kernel": jax.ShapeDtypeStruct((2, DM, H, D), jnp.float32, sharding=heads)}
                                  for p in "qk"}},
              "embed": {"embedding": jax.ShapeDtypeStruct((16, DM), jnp.float32, sharding=rows)},
              "lm_head": {"kernel": jax.ShapeDtypeStruct((DM, 16), jnp.float32, sharding=cols)}}
    out = tt.flatten(tt.restore_checkpoint(str(tmp_path / "model.safetensors"), None, {"default": target},
                                           rules=LLAMA_RULES)["default"])
    for p, value in want.items():
        assert bits(np.asarray(out[p]), value), p
    assert out["lm_head/kernel"].sharding == cols and out["layers/attn/q/kernel"].sharding == heads
    for shard in out["layers/attn/k/kernel"].addressable_shards:
        assert shard.data.shape == (1, DM, H, 1)
        assert bits(np.asarray(shard.data), want["layers/attn/k/kernel"][shard.index])
    # a rule that does not fit is a problem of the restore plan, raised before any read
    bad = Rules(**{**LLAMA_RULES.to_dict(), "permute": [[r"attn/(q|k)/kernel$", {"axis": 2, "head_dim": 8,
                                                                                 "to": "interleaved"}]]})
    with pytest.raises(tt.CheckpointMismatchError, match="not a multiple of head_dim 8"):
        tt.restore_checkpoint(str(tmp_path / "model.safetensors"), None, {"default": target}, rules=bad)


def test_docs_layout_section_python_toml_and_flags_are_one_rules(tmp_path, monkeypatch):
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    section = doc[doc.index("## Layout rules"):]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    python, = [b for lang, b in blocks if lang == "python" and "to_jax = " in b]
    toml, = [b for lang, b in blocks if lang == "toml"]
    flags, = [b for lang, b in blocks if lang == "" and b.startswith("--rename")]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(python, namespace)  # noqa: S102 - the page's own example, which checks itself against numpy
    (tmp_path / "layout.toml").write_text(toml)
    words = shlex.split(flags)
    kwargs: dict = {}
    for flag, value in zip(words[::2], words[1::2]):
        kwargs.setdefault(flag.removeprefix("--"), []).append(value)
    assert Rules.from_file(tmp_path / "layout.toml") == namespace["to_jax"]
    assert Rules.from_cli(**kwargs) == namespace["to_jax"]


def test_convert_streams_layout_rules_in_blocks_not_whole_leaves(tmp_path, monkeypatch):
    # A spy on the safetensors file reader: every block convert reads from the source, through reshape, permute,
    # transpose, stack, pad and tie, is a few target blocks' worth, never a whole leaf.
    from safetensors.numpy import load_file, save_file

    from treetools.checkpoint_io.readers import FileReader

    L, big_h, big_d, width = 2, 8, 16, 32
    rng = np.random.default_rng(1)
    hf = {f"model.layers.{i}.self_attn.{p}_proj.weight": rng.standard_normal((big_h * big_d, width)).astype(np.float32)
          for i in range(L) for p in "qk"}
    hf["model.embed_tokens.weight"] = rng.standard_normal((100, width)).astype(np.float32)
    save_file(hf, tmp_path / "model.safetensors")
    rules = Rules(**{**LLAMA_RULES.to_dict(),
                     "reshape": [[r"attn/(q|k)/kernel$", {"axis": 1, "into": [-1, big_d]}]],
                     "permute": [[r"attn/(q|k)/kernel$", {"axis": 2, "head_dim": big_d, "to": "interleaved"}]],
                     "pad": [[r"^embed/embedding$", {"axis": 0, "size": 128}]]})
    sizes: list[int] = []
    real = FileReader.read

    def spy(self, index):
        block = real(self, index)
        sizes.append(block.size)
        return block

    monkeypatch.setattr(FileReader, "read", spy)
    block_bytes = 1024  # 256 float32 per block; a leaf is 4096 (q, k) or 3200 (the embedding)
    assert tt.convert(str(tmp_path / "model.safetensors"), str(tmp_path / "out.safetensors"), rules=rules,
                      block_bytes=block_bytes).rows
    monkeypatch.setattr(FileReader, "read", real)
    assert sizes and max(sizes) <= 2 * block_bytes // 4, max(sizes)
    got = load_file(tmp_path / "out.safetensors")
    q0 = hf["model.layers.0.self_attn.q_proj.weight"]
    inter = q0.reshape(big_h, 2, big_d // 2, width).transpose(0, 2, 1, 3).reshape(big_h, big_d, width)
    q_scaled = (inter.transpose(2, 0, 1).astype(np.float64) / np.sqrt(np.float64(3))).astype(np.float32)
    assert bits(got["layers.attn.q.kernel"][0], q_scaled)  # LLAMA_RULES' scale, streamed too
    assert bits(got["lm_head.kernel"], np.concatenate([hf["model.embed_tokens.weight"],
                                                      np.zeros((28, width), np.float32)]).T)


def test_unstack_of_layers_on_another_axis_as_maxtext_keeps_them():
    # MaxText's scanned kernels keep the layers on axis 1: [d, L, H, D]; `(pattern, axis)` unstacks them there
    kernel = rng_arrays(k=(DM, 3, H, D))["k"]
    rules = Rules(unstack=[(r"^decoder/layers/", 1)], rename={r"^decoder/layers/(\d+)/q$": r"h.\1.q"},
                  reshape={r"^h\.\d+\.q$": {"merge": [1, 2]}}, transpose={r"^h\.\d+\.q$": (1, 0)})
    got = read_all(rules, {"decoder/layers/q": kernel})
    for i in range(3):
        assert bits(got[f"h.{i}.q"], kernel[:, i].reshape(DM, H * D).T), i
    plan = rules.plan({"decoder/layers/q": kernel})
    assert plan["h.1.q"].row().source == "decoder/layers/q[:, 1]"
    assert plan["h.1.q"].row().ops[0] == "unstack axis 1 [1]"
    # and back: stack (a new axis 0), then the layers moved to axis 1 by a transpose
    back = Rules(rename={r"^h\.(\d+)\.q$": r"decoder/layers/\1/q"}, stack=["decoder/layers/"],  # [L, H*D, d]
                 reshape={"^decoder/layers/q$": {"axis": 1, "into": [H, D]}},
                 transpose={"^decoder/layers/q$": (3, 0, 1, 2)})
    stacked = read_all(back, {f"h.{i}.q": got[f"h.{i}.q"] for i in range(3)})["decoder/layers/q"]
    assert bits(stacked, kernel)
    assert Rules(unstack=[("a", 0)]) == Rules(unstack=["a"]) and Rules(unstack=[("a", 1)]).to_dict() == {
        "unstack": [["a", 1]]}
    assert Rules.from_cli(unstack=["^decoder/layers/=>axis=1"]) == Rules(unstack=[("^decoder/layers/", 1)])
    with pytest.raises(RulesError, match=r"matches `w`, which has shape \(2,\), no layer axis 1"):
        Rules(unstack=[("w", 1)]).plan([("w", (2,), "f4")])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_split_concat_and_permute_round_trips_of_random_shapes_read_in_random_blocks(data):
    rank = data.draw(st.integers(1, 3))
    shape = data.draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    axis = data.draw(st.integers(0, rank - 1))
    heads, head_dim = data.draw(st.integers(1, 3)), 2 * data.draw(st.integers(1, 3))
    shape[axis] = heads * head_dim
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    cuts = sorted(data.draw(st.sets(st.integers(1, shape[axis] - 1), max_size=3))) if shape[axis] > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[axis]])]
    names = [f"p{i}" for i in range(len(sizes))]
    parts = read_all(Rules(split={"^w$": {"names": names, "axis": axis, "sizes": sizes}}), {"w": x}, blocks=((2,),))
    for name, want in zip(names, np.split(x, np.cumsum(sizes)[:-1], axis=axis)):
        assert bits(parts[name], want)
    joined = read_all(Rules(concat={"^(?P<part>p\\d+)$": {"name": "w", "axis": axis, "parts": names}}), parts,
                      blocks=((1,), (3,)))
    assert bits(joined["w"], x)
    rotary = 2 * data.draw(st.integers(1, head_dim // 2))
    spec = {"axis": axis, "head_dim": head_dim, "rotary_dim": rotary, "to": data.draw(st.sampled_from(["half",
                                                                                                        "interleaved"]))}
    moved = read_all(Rules(permute={"w": spec}), {"w": x}, blocks=((1,), (2, 3)))["w"]
    # by hand: each head's first `rotary` entries, half <-> interleaved
    heads_x = np.moveaxis(x, axis, -1).reshape(*np.moveaxis(x, axis, -1).shape[:-1], heads, head_dim).copy()
    rot = heads_x[..., :rotary]
    if spec["to"] == "interleaved":  # entry 2i + a from a * R/2 + i
        rot = rot.reshape(*rot.shape[:-1], 2, rotary // 2).swapaxes(-1, -2).reshape(rot.shape)
    else:  # entry a * R/2 + i from 2i + a
        rot = rot.reshape(*rot.shape[:-1], rotary // 2, 2).swapaxes(-1, -2).reshape(rot.shape)
    heads_x[..., :rotary] = rot
    want = np.moveaxis(heads_x.reshape(*heads_x.shape[:-2], heads * head_dim), -1, axis)
    assert bits(moved, np.ascontiguousarray(want))
    back = read_all(Rules(permute={"w": {**spec, "to": "half" if spec["to"] == "interleaved" else "interleaved"}}),
                    {"w": moved}, blocks=((1,),))["w"]
    assert bits(back, x)
