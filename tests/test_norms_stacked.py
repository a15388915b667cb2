"""Per-layer norms of stacked (scanned) leaves, against float64 numpy norms of each layer's slice.

Three ways a model stacks its layers: linen ``nn.scan`` with
``metadata_params={nn.PARTITION_NAME: "layers"}`` (found from the boxes),
nnx layers built with ``nnx.vmap`` and a plain dict of stacked arrays (both
named with ``stacked={pattern: axis}``, or from ``transform_metadata``). Each
under jit, eagerly and inside ``shard_map`` on 8 devices, with the layer axis
replicated or split over a mesh axis.
"""

from __future__ import annotations

import ast
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import treetools as tt
from tests import _models
from treetools.shared.errors import PatternError
from treetools.pytree.norms import get_grad_norms, get_param_norms, get_sharded_global_norm, norm_metrics
from treetools.pytree.partitioning import is_box, leaf_sharding, rebox, unbox
from treetools.pytree.paths import flatten, unflatten_dict
from treetools.rules.plan import insert_index

RTOL = 2e-6  # float32 accumulation vs float64
L, D = _models.SCAN_LAYERS, _models.SCAN_D


def _sq64(x) -> float:
    return float(np.sum(np.asarray(x, dtype=np.float64) ** 2))


def _call(fn, *args):
    # Block on every sharded call: XLA:CPU can deadlock when several collective programs are in flight.
    return jax.block_until_ready(fn(*args))


def _per_layer(host: dict[str, np.ndarray], prefix: str, n: int, axis: int = 0) -> list[float]:
    """sqrt of the summed squares of layer l of every leaf under ``prefix``, by hand (float64)."""
    members = [v for p, v in host.items() if p.startswith(prefix + "/") or p == prefix]
    return [np.sqrt(sum(_sq64(np.take(v, layer, axis=axis)) for v in members)) for layer in range(n)]


def _global(host: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(_sq64(v) for v in host.values())))


# --------------------------------------------------------------------------- #
# Models: linen nn.scan with the `layers` partition name, nnx vmap, a plain dict
# --------------------------------------------------------------------------- #

# MaxText-style logical names: the layer axis replicated, or split over the `stage` mesh axis.
RULES = {"replicated": _models.scan_rules(None), "split": _models.scan_rules("stage")}


def _randomized(tree, seed=0, dtype=np.float32):
    """``tree`` with every array replaced by random normals (biases and scales too, so no norm is 0 or L-periodic)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda b: rebox(b, (rng.normal(size=unbox(b).shape) * (1 + rng.random())).astype(dtype)),
                        tree, is_leaf=is_box)


def _linen_params(rules="replicated", seed=0):
    variables = _models.ScannedLM(RULES[rules]).init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    return _randomized(variables["params"], seed)


def _host(tree) -> dict[str, np.ndarray]:
    return {p: np.asarray(jax.device_get(unbox(x)), np.float64) for p, x in flatten(tree).items()}


def _place(tree, mesh):
    """Each leaf on ``mesh`` per its box names (through the box's rules), bare leaves replicated."""
    abstract = tt.make_abstract(tree, mesh=mesh)
    return jax.tree.map(lambda b, a: rebox(b, jax.device_put(np.asarray(unbox(b)), unbox(a).sharding)),
                        tree, abstract, is_leaf=is_box)


def _in_shard_map(fn, mesh, tree):
    specs = jax.tree.map(lambda b: leaf_sharding(b).spec if is_box(b) else P(), tree, is_leaf=is_box)
    return _call(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=P())), tree)


def _check_linen(m, host, kind="grad_norm"):
    """Keys and values of norm_metrics(depth=3) on the linen LM: per layer (the index is the 3rd part), per leaf else."""
    layers = {k: v for k, v in host.items() if k.startswith("decoder/layers/")}
    want = {f"{kind}/decoder/layers/{i}": v for i, v in enumerate(_per_layer(layers, "decoder/layers", L))}
    for leaf in ("decoder/norm/bias", "decoder/norm/scale", "embed/embedding"):
        want[f"{kind}/{leaf}"] = np.sqrt(_sq64(host[leaf]))
    got = {k: v for k, v in m.items() if k.startswith(f"{kind}/")}
    assert list(got) == list(want)  # tree order: the layers in order, the norm, then embed
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=RTOL, err_msg=k)
    np.testing.assert_allclose(float(m[kind]), _global(host), rtol=RTOL)


def test_linen_scan_layers_are_found_from_the_boxes():
    params = _linen_params()
    up = params["decoder"]["layers"]["up"]
    # flax put the scan's partition name at the scan axis; the bias stayed an unboxed (L, 2D) array.
    assert up["kernel"].names == ("layers", "embed", "mlp") and up["bias"].shape == (L, 2 * D)
    host = _host(params)
    m = jax.jit(lambda t: norm_metrics(grads=t, depth=4))({"params": params})
    _check_linen({k.replace("grad_norm/params/", "grad_norm/"): v for k, v in m.items()}, host)
    # Per parameter: the index sits after the scanned module `layers`; the unboxed bias is split too.
    per = norm_metrics(grads=params, per_param=True)
    for leaf in ("up/kernel", "up/bias", "down/kernel", "down/bias"):
        for i in range(L):
            np.testing.assert_allclose(float(per[f"grad_norm/decoder/layers/{i}/{leaf}"]),
                                       np.sqrt(_sq64(host[f"decoder/layers/{leaf}"][i])), rtol=RTOL)
    assert "grad_norm/decoder/layers/up/kernel" not in per and "grad_norm/decoder/norm/scale" in per


def test_depth_counts_the_layer_index_as_a_path_part():
    # Issue 39, point 17: one meaning of `depth` (the first K parts of the path as printed, the index one of them),
    # as `inspect --unstack --depth` (tests/test_inspect.py pins that they agree on a saved checkpoint).
    params = _linen_params()
    host = _host(params)
    # depth 1: `decoder`; depth 2: `decoder/layers`, every layer together; depth 3 reaches the index: per layer;
    # depth 4: per sub-module of each layer.
    assert sorted(norm_metrics(grads=params, depth=1)) == ["grad_norm", "grad_norm/decoder", "grad_norm/embed",
                                                           "nonfinite_grads", "nonfinite_grads/decoder",
                                                           "nonfinite_grads/embed"]
    m2 = norm_metrics(grads=params, depth=2)
    assert [k for k in m2 if k.startswith("grad_norm/decoder/")] == ["grad_norm/decoder/layers", "grad_norm/decoder/norm"]
    m3 = norm_metrics(grads=params, depth=3)
    assert [k for k in m3 if k.startswith("grad_norm/decoder/")] == [
        *(f"grad_norm/decoder/layers/{i}" for i in range(L)), "grad_norm/decoder/norm/bias", "grad_norm/decoder/norm/scale"]
    m4 = norm_metrics(grads=params, depth=4)
    for i in range(L):
        for sub in ("up", "down"):
            want = np.sqrt(sum(_sq64(host[f"decoder/layers/{sub}/{p}"][i]) for p in ("kernel", "bias")))
            np.testing.assert_allclose(float(m4[f"grad_norm/decoder/layers/{i}/{sub}"]), want, rtol=RTOL)
    # Whatever the split, the global norm is the same number.
    for m in (m2, m3, m4, norm_metrics(grads=params, depth=2, stacked=False)):
        np.testing.assert_allclose(float(m["grad_norm"]), _global(host), rtol=RTOL)


def test_depth_means_the_same_in_norm_metrics_and_inspect_unstack(tmp_path, capsys):
    # Issue 39, point 17: `norm_metrics(depth=2)` gave `decoder/layers/0/...`-deep keys where `inspect --unstack
    # --depth 2` gave `decoder/layers`: the same checkpoint now groups the same way at every depth.
    from treetools.cli import main

    params = _linen_params()
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path, async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": params})
    mngr.close()
    for depth in (1, 2, 3, 4):
        argv = ["inspect", str(tmp_path), "--item", "params", "--unstack", "^decoder/layers/", "--depth", str(depth)]
        assert main([*argv, "--format", "json"]) == 0
        (checkpoint,) = json.loads(capsys.readouterr().out)["checkpoints"]
        shown = [leaf["path"] for leaf in checkpoint["items"]["params"]["leaves"]]
        keys = [k.removeprefix("grad_norm/") for k in norm_metrics(grads=params, depth=depth) if k.startswith("grad_norm/")]
        assert sorted(shown) == sorted(keys), depth
        assert all(len(k.split("/")) <= depth for k in keys) and any(len(k.split("/")) == depth for k in keys)


def test_stacked_false_and_unstacked_models_keep_their_keys():
    params = _linen_params()
    off = norm_metrics(grads=params, depth=2, stacked=False)
    assert [k for k in off if k.startswith("grad_norm/")] == ["grad_norm/decoder/layers", "grad_norm/decoder/norm",
                                                              "grad_norm/embed/embedding"]
    # A scan without the partition name (tests/_models.Net) has no `layers` axis name: nothing is split,
    # and a warning says so, with the pattern that would split it (issue 39, point 8).
    net = _models.init_net()
    for kw in ({"per_param": True}, {"depth": 2}):
        with pytest.warns(UserWarning, match=r"lump the layers of `params/blocks`.*stacked=\{'\^params/blocks/': 0\}"):
            default = norm_metrics(grads=net, **kw)
        assert list(default) == list(norm_metrics(grads=net, stacked=False, **kw))
    assert "grad_norm/params/blocks/up/kernel" in norm_metrics(grads=net, per_param=True, stacked=False)


MESHES = {
    # name: (shape, axes, rules): FSDP x 8 with the layer axis replicated, or the layer axis split over `stage`.
    "fsdp8-layers-replicated": ((8,), ("fsdp",), "replicated"),
    "stage2xfsdp4-layers-split": ((2, 4), ("stage", "fsdp"), "split"),
}


@pytest.fixture(params=[(m, t) for m in MESHES for t in ("explicit", "auto")],
                ids=[f"{m}-{t}" for m in MESHES for t in ("explicit", "auto")])
def linen_sharded(request, devices):
    name, kind = request.param
    shape, axes, rules = MESHES[name]
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, axes, devices=devices, axis_types=(axis_type,) * len(axes))
    params = _linen_params(rules)
    placed = _place(params, mesh)
    kernel = unbox(placed["decoder"]["layers"]["up"]["kernel"])
    split = rules == "split"
    assert kernel.sharding.spec == (P("stage", None, "fsdp") if split else P(None, None, "fsdp"))
    return mesh, placed, _host(params), split


def test_linen_sharded_under_jit_and_eagerly(linen_sharded):
    mesh, placed, host, _ = linen_sharded
    _check_linen(_call(jax.jit(lambda t: norm_metrics(grads=t, depth=3)), placed), host)
    _check_linen(_call(lambda t: norm_metrics(grads=t, depth=3), placed), host)
    bare = jax.tree.map(unbox, placed, is_leaf=is_box)  # the same arrays without their boxes: by pattern
    _check_linen(_call(jax.jit(lambda t: norm_metrics(grads=t, depth=3, stacked={"^decoder/layers/": 0})), bare), host)


def test_linen_sharded_inside_shard_map(linen_sharded):
    mesh, placed, host, split = linen_sharded

    def inside(t):
        # The local shard: with the layer axis split over `stage`, each device holds L / 2 layers.
        assert t["decoder"]["layers"]["up"]["kernel"].value.shape == (L // 2 if split else L, D, 2 * D // 4 if split else 2 * D // 8)
        return norm_metrics(grads=t, params=t, depth=3)

    m = _in_shard_map(inside, mesh, placed)
    _check_linen(m, host)
    _check_linen(m, host, kind="param_norm")
    assert int(m["nonfinite_grads"]) == 0


def test_per_layer_vectors_of_get_sharded_global_norm(linen_sharded):
    mesh, placed, host, _ = linen_sharded
    for fn in (jax.jit(lambda t: get_sharded_global_norm(t, stacked=True)),
               lambda t: _in_shard_map(lambda u: get_sharded_global_norm(u, stacked=True), mesh, t)):
        g, per_leaf = _call(fn, placed)
        np.testing.assert_allclose(float(g), _global(host), rtol=RTOL)
        flat = flatten(per_leaf)
        np.testing.assert_allclose(np.asarray(flat["decoder/layers/up/kernel"]),
                                   [np.sqrt(_sq64(layer)) for layer in host["decoder/layers/up/kernel"]], rtol=RTOL)
        assert np.shape(flat["decoder/norm/scale"]) == ()
    # Default: one scalar per leaf, as before.
    assert np.shape(flatten(get_sharded_global_norm(placed)[1])["decoder/layers/up/kernel"]) == ()


def test_layer_axis_split_only_partly_manual_is_an_error(devices):
    # The layer axis over (stage, fsdp) in a shard_map manual over `fsdp` alone: which layers a block holds is unknown.
    mesh = jax.make_mesh((2, 4), ("stage", "fsdp"), devices=devices, axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(np.ones((8, 3), np.float32), NamedSharding(mesh, P(("stage", "fsdp"))))
    box = nn.Partitioned(x, names=(("stage", "fsdp"), None))
    fn = jax.shard_map(lambda b: norm_metrics(grads={"w": b}, per_param=True, stacked={"w": 0}), mesh=mesh,
                       in_specs=(P("fsdp"),), out_specs=P(), axis_names={"fsdp"})
    with pytest.raises(ValueError, match=r"leaf `w`: its layer axis 0 is split over mesh axes \('stage', 'fsdp'\)"):
        with jax.set_mesh(mesh):
            jax.jit(fn)(box)


# --------------------------------------------------------------------------- #
# nnx: layers built with nnx.vmap
# --------------------------------------------------------------------------- #


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), (None, "fsdp"))
        self.up = nnx.Linear(D, 2 * D, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, metadata: bool):
        self.embed = nnx.Embed(32, D, rngs=rngs)
        transform = {"transform_metadata": {nnx.PARTITION_NAME: "layers"}} if metadata else {}

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0, **transform)
        def layers(rngs):
            return _NnxBlock(rngs)

        self.layers = layers(rngs)


def _nnx_state(metadata: bool, mesh):
    with jax.set_mesh(mesh):
        state = nnx.state(_NnxModel(nnx.Rngs(0), metadata=metadata), nnx.Param)
    return _randomized(state, seed=3)


@pytest.mark.parametrize("metadata", [False, True], ids=["vmap-pattern", "vmap-transform-metadata"])
def test_nnx_vmap_stacked_layers(metadata, devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices, axis_types=(AxisType.Explicit,))
    state = _nnx_state(metadata, mesh)
    kernel = state["layers"]["up"]["kernel"]
    assert kernel.get_value().shape == (L, D, 2 * D)
    assert kernel.get_metadata()["out_sharding"] == (("layers", None, "fsdp") if metadata else (None, "fsdp"))
    host = _host(state)
    stacked = None if metadata else {"^layers/": 0}
    # On the mesh: the stacked kernels split over fsdp, the rest replicated.
    spec = {"layers/up/kernel": P(None, None, "fsdp")}
    placed = tt.map_with_path(
        lambda p, v: v.replace(jax.device_put(np.asarray(v.get_value()), NamedSharding(mesh, spec.get(p, P())))), state)
    for fn in (jax.jit(lambda t: norm_metrics(grads=t, depth=2, stacked=stacked)),
               lambda t: norm_metrics(grads=t, depth=2, stacked=stacked)):
        m = _call(fn, placed)
        assert [k for k in m if k.startswith("grad_norm/")] == ["grad_norm/embed/embedding",
                                                               *(f"grad_norm/layers/{i}" for i in range(L))]
        for i, v in enumerate(_per_layer(host, "layers", L)):
            np.testing.assert_allclose(float(m[f"grad_norm/layers/{i}"]), v, rtol=RTOL)
        np.testing.assert_allclose(float(m["grad_norm"]), _global(host), rtol=RTOL)
    # Inside shard_map: the kernel's box names fsdp (psum over it), the vmapped layer axis is replicated;
    # `layers` is no mesh axis, so a rule says so (as MaxText's rules do), else the layout would be unknown.
    with nn.logical_axis_rules((("layers", None),)):
        m = _in_shard_map(lambda t: norm_metrics(grads=t, per_param=True, stacked=stacked), mesh, placed)
    for i in range(L):
        np.testing.assert_allclose(float(m[f"grad_norm/layers/{i}/up/kernel"]),
                                   np.sqrt(_sq64(host["layers/up/kernel"][i])), rtol=RTOL)
    np.testing.assert_allclose(float(m["grad_norm"]), _global(host), rtol=RTOL)


class _PlainBlock(nnx.Module):
    """A block whose Variables carry no sharding names (plain nnx.Linear / nnx.LayerNorm)."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, 2 * D, rngs=rngs)
        self.norm = nnx.LayerNorm(2 * D, rngs=rngs)


class _PlainVmapModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def layers(rngs):
            return _PlainBlock(rngs)

        self.layers = layers(rngs)


def test_nnx_vmap_without_sharding_names_warns_once_with_the_fix():
    # Issue 39, point 8: flax records the vmap's `layers` axis only in sharding names; with none, per-layer norms
    # silently lumped every layer. Now one warning names the stacked module and the `stacked=` that splits it.
    state = _randomized(nnx.state(_PlainVmapModel(nnx.Rngs(0)), nnx.Param), seed=5)
    kernel = state["layers"]["lin"]["kernel"]
    assert kernel.get_value().shape == (L, D, 2 * D) and "out_sharding" not in kernel.get_metadata()
    host = _host(state)
    fn = jax.jit(lambda t: norm_metrics(grads=t, per_param=True))
    with pytest.warns(UserWarning) as caught:
        lumped = fn(state)
        fn(state)  # traced once: warned once
    (warning,) = caught
    message = str(warning.message)
    assert warning.filename == __file__  # the user's line, through jit and treetools' own frames
    assert message.startswith(f"per-layer results lump the layers of `layers` (`layers/lin/bias` ({L}, {2 * D}), ")
    assert "`embed" not in message  # (32, D): not stacked
    assert "grad_norm/layers/lin/kernel" in lumped and "grad_norm/layers/0/lin/kernel" not in lumped
    # The fix it names, as written, splits them: per layer, against float64 numpy.
    fix = ast.literal_eval(re.search(r"stacked=(\{.*?\})", message).group(1))
    assert fix == {"^layers/": 0}
    split = jax.jit(lambda t: norm_metrics(grads=t, per_param=True, stacked=fix))(state)
    for leaf in ("lin/kernel", "lin/bias", "norm/scale", "norm/bias"):
        for i in range(L):
            np.testing.assert_allclose(float(split[f"grad_norm/layers/{i}/{leaf}"]),
                                       np.sqrt(_sq64(host[f"layers/{leaf}"][i])), rtol=RTOL)
    np.testing.assert_allclose(float(split["grad_norm"]), _global(host), rtol=RTOL)
    # stacked=False says "no layers here": no warning (filterwarnings=error would raise).
    norm_metrics(grads=state, per_param=True, stacked=False)


def test_unstacked_look_alikes_do_not_warn():
    # Ordinary modules that share a leading size are not taken for stacks (filterwarnings=error raises on a warning).
    trees = {
        "attn without bias: (d, d) kernels": {"attn": {n: {"kernel": np.ones((8, 8))} for n in "qkvo"}},
        "gate and up: no stacked vector": {"mlp": {"gate": np.ones((8, 32)), "up": np.ones((8, 32))}},
        "experts: no stacked vector": {"moe": {"w_in": np.ones((4, 8, 16)), "w_out": np.ones((4, 16, 8))}},
        "a dense layer: 1-D bias": {"dense": {"kernel": np.ones((8, 16)), "bias": np.ones(16)}},
        "the leading size on another axis": {"blk": {"w": np.ones((4, 4, 8)), "b": np.ones((4, 8))}},
    }
    for name, tree in trees.items():
        assert "grad_norm" in norm_metrics(grads=tree, per_param=True), name


# --------------------------------------------------------------------------- #
# A plain dict of stacked arrays, named by pattern
# --------------------------------------------------------------------------- #


def _stacked_dict(n=L, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (32, 8), "blocks/attn/q": (n, 8, 16), "blocks/attn/o": (n, 16, 8), "blocks/ln/scale": (n, 8),
              "head/kernel": (8, 16)}
    return {k: (rng.normal(size=s) * (i + 1)).astype(dtype) for i, (k, s) in enumerate(shapes.items())}


@pytest.mark.parametrize("layer_spec", [None, "fsdp"], ids=["layers-replicated", "layers-split"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_plain_stacked_dict_on_eight_devices(devices, layer_spec, kind):
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices, axis_types=(axis_type,))
    host = _stacked_dict(n=8)
    # FSDP: the stacked leaves split over fsdp along their layer axis, or along their last axis.
    specs = {k: (P(layer_spec) if layer_spec else P(*([None] * (v.ndim - 1)), "fsdp")) if k.startswith("blocks/") else P()
             for k, v in host.items()}
    placed = unflatten_dict({k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()})
    stacked = {"^blocks": 0}
    want = _per_layer({k: v for k, v in host.items() if k.startswith("blocks/")}, "blocks", 8)
    for fn in (jax.jit(lambda t: norm_metrics(grads=t, depth=2, stacked=stacked)),
               lambda t: norm_metrics(grads=t, depth=2, stacked=stacked)):
        m = _call(fn, placed)
        for i, v in enumerate(want):
            np.testing.assert_allclose(float(m[f"grad_norm/blocks/{i}"]), v, rtol=RTOL)
        np.testing.assert_allclose(float(m["grad_norm"]), _global(host), rtol=RTOL)
    # Boxed inside shard_map: the local block of a split layer axis holds one layer of 8.
    boxed = unflatten_dict({k: nn.Partitioned(placed_leaf, names=tuple(specs[k]))
                            for k, placed_leaf in flatten(placed).items()})
    m = _in_shard_map(lambda t: norm_metrics(grads=t, per_param=True, stacked=stacked), mesh, boxed)
    for i in range(8):
        np.testing.assert_allclose(float(m[f"grad_norm/blocks/{i}/attn/q"]), np.sqrt(_sq64(host["blocks/attn/q"][i])),
                                   rtol=RTOL)
    np.testing.assert_allclose(float(m["grad_norm"]), _global(host), rtol=RTOL)


def test_pattern_places_the_index_where_the_match_ends():
    host = _stacked_dict()
    tree = unflatten_dict(host)
    ends = {"blocks": "blocks/{}/attn/q", "blocks/": "blocks/{}/attn/q", "attn/q": "blocks/attn/q/{}",
            r"q$": "blocks/attn/q/{}", "^": "{}/blocks/attn/q", "att": "blocks/attn/{}/q"}
    for pattern, key in ends.items():
        m = norm_metrics(grads=tree, per_param=True, stacked={pattern: 0})
        # The same place as Rules' unstack puts it: one rule for where a layer index goes.
        assert insert_index("blocks/attn/q", re.search(pattern, "blocks/attn/q"), 3) == key.format(3)
        for i in range(L):
            np.testing.assert_allclose(float(m["grad_norm/" + key.format(i)]), np.sqrt(_sq64(host["blocks/attn/q"][i])),
                                       rtol=RTOL, err_msg=pattern)
    # Another axis: the index counts along it.
    m = get_grad_norms(tree, True, stacked={"attn/o$": -1})
    for i in range(8):
        np.testing.assert_allclose(float(m[f"grad_norm/blocks/attn/o/{i}"]), np.sqrt(_sq64(host["blocks/attn/o"][..., i])),
                                   rtol=RTOL)


def test_bf16_stacked_grads_accumulate_in_float32():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(6, 256, 64)) * 3, jnp.bfloat16)
    host = np.asarray(x.astype(jnp.float32), np.float64)  # the bf16 values, exactly
    m = jax.jit(lambda t: norm_metrics(grads=t, params=t, depth=2, stacked={"w": 0}))({"w": x})
    for i in range(6):
        assert m[f"grad_norm/w/{i}"].dtype == jnp.float32
        np.testing.assert_allclose(float(m[f"grad_norm/w/{i}"]), np.sqrt(np.sum(host[i] ** 2)), rtol=RTOL)
    np.testing.assert_allclose(float(m["param_norm"]), np.sqrt(np.sum(host**2)), rtol=RTOL)


def test_one_layer_stack():
    tree = {"layers": {"w": jnp.array([[3.0, 4.0]]), "b": jnp.array([[12.0]])}}
    m = norm_metrics(grads=tree, depth=2, stacked={"layers": 0})
    assert {k: float(v) for k, v in m.items()} == {"grad_norm": 13.0, "nonfinite_grads": 0, "grad_norm/layers/0": 13.0,
                                                   "nonfinite_grads/layers/0": 0}
    assert get_param_norms(tree, True, stacked={"layers": 0}).keys() == {"param_norm", "param_norm/layers/0/b",
                                                                          "param_norm/layers/0/w"}


def test_nonfinite_layer_shows_in_its_own_key_and_the_count():
    host = _stacked_dict()
    host["blocks/attn/q"][2, 0, 0] = np.nan
    m = norm_metrics(grads=unflatten_dict(host), depth=2, stacked={"blocks": 0})
    assert np.isnan(float(m["grad_norm/blocks/2"])) and np.isnan(float(m["grad_norm"]))
    assert all(np.isfinite(float(m[f"grad_norm/blocks/{i}"])) for i in (0, 1, 3)) and int(m["nonfinite_grads"]) == 1
    # Issue 40: the count per layer names the layer holding it.
    assert [int(m[f"nonfinite_grads/blocks/{i}"]) for i in range(4)] == [0, 0, 1, 0]


def test_two_stacks_of_different_lengths():
    # DeepSeek-style: a few dense layers, then MoE layers, each scanned on its own.
    def box(shape):
        return nn.Partitioned(np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32),
                              names=("layers",) + (None,) * (len(shape) - 1))

    tree = {"decoder": {"dense_layers": {"w": box((2, 4, 4))}, "moe_layers": {"w": box((3, 4, 4)), "g": box((3, 4))}},
            "final": nn.Partitioned(np.ones(4, np.float32), names=(None,))}
    m = norm_metrics(grads=tree, depth=3)
    assert [k for k in m if k.startswith("grad_norm/")] == ["grad_norm/decoder/dense_layers/0", "grad_norm/decoder/dense_layers/1",
                                         *(f"grad_norm/decoder/moe_layers/{i}" for i in range(3)), "grad_norm/final"]
    host = _host(tree)
    for i in range(3):
        want = np.sqrt(_sq64(host["decoder/moe_layers/w"][i]) + _sq64(host["decoder/moe_layers/g"][i]))
        np.testing.assert_allclose(float(m[f"grad_norm/decoder/moe_layers/{i}"]), want, rtol=RTOL)


def test_pattern_errors_name_the_pattern():
    tree = unflatten_dict(_stacked_dict())
    with pytest.raises(PatternError, match=r"`stacked` pattern 'layers' matches no leaf; nearby paths: \[.*blocks"):
        norm_metrics(grads=tree, depth=1, stacked={"layers": 0})
    with pytest.raises(ValueError, match=r"matches leaf `head/kernel` \(shape \(8, 16\)\), which has no axis 2"):
        norm_metrics(grads=tree, per_param=True, stacked={"kernel|attn": 2})
    with pytest.raises(TypeError, match="`stacked` must be"):
        norm_metrics(grads=tree, per_param=True, stacked="blocks")
    # Without per-module entries nothing is split, and nothing is looked up.
    assert set(norm_metrics(grads=tree, stacked={"layers": 0})) == {"grad_norm", "nonfinite_grads"}


def test_per_layer_split_reads_each_array_once():
    # XLA's own accounting of the compiled program: the per-layer sums are the same read as the global one.
    tree = {"blocks": {f"w{i}": jax.ShapeDtypeStruct((24, 64, 64 * (i + 1)), jnp.float32) for i in range(3)}}
    nbytes = sum(x.size * 4 for x in tree["blocks"].values())
    for fn in (lambda t: norm_metrics(params=t, depth=2, stacked={"blocks": 0}),
               lambda t: norm_metrics(params=t, per_param=True, stacked={"blocks": 0}),
               lambda t: get_sharded_global_norm(t, stacked={"blocks": 0})):
        cost = jax.jit(fn).lower(tree).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert nbytes <= cost["bytes accessed"] <= 1.01 * nbytes


def test_accelerators_count_per_layer_beside_the_per_layer_squares():
    # On GPU/TPU the non-finite count of a gradient is a sibling of its sum of squares (one fused read):
    # for a stacked leaf both reduce over the same axes, all but the layer axis.
    from tests.test_norms import _program

    tree = {"layers": {"q": jax.ShapeDtypeStruct((6, 64, 64), jnp.float32)}, "embed": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
    for platform in ("cuda", "tpu"):
        reductions, conditionals = _program(lambda t: norm_metrics(grads=t, depth=2, stacked={"layers": 0}), tree, platform)
        assert conditionals == []
        embed, q = reductions  # tree order: embed, layers/q
        assert [(name, axes) for name, axes, _ in q] == [("reduce_sum", (1, 2)), ("reduce_sum", (1, 2))]
        assert [(name, axes) for name, axes, _ in embed] == [("reduce_sum", (0, 1)), ("reduce_sum", (0, 1))]
