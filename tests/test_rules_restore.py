"""Restore with rules (issue 23): every rule kind, every source format, every error before any data, on 8 devices.

Truth is numpy applied to the writer's own arrays: the same mapping written by
hand (slicing, ``transpose``, ``astype``), compared bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import treetools as tt
from tests._t5x_writer import save_t5x

DOC = Path(__file__).resolve().parent.parent / "docs" / "rules.md"


def _doc_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Restoring with rules"):text.index("## Porting a T5X")]
    return re.findall(r"```python\n(.*?)\n```", section, flags=re.S)


def test_docs_t5x_example_runs_on_a_t5x_checkpoint(tmp_path, capsys):
    # The page's other examples run on their own (tests/test_readme.py); this one needs a T5X checkpoint, which
    # only T5X writes: here one written by tests/_t5x_writer.py (T5X's save code), named where the reader's goes.
    from tests.test_format_t5x import _state

    t5x_dir = tmp_path / "t5x"
    t5x_dir.mkdir()
    save_t5x(t5x_dir, 5, _state(5, 0))
    blocks = _doc_blocks()
    assert len(blocks) == 6  # new head, train state, linen->nnx, scanned, bf16, T5X
    placeholder = 't5x_dir = "path/to/t5x/model_dir"'
    assert blocks[-1].count(placeholder) == 1
    code = blocks[-1].replace(placeholder, f"t5x_dir = {str(t5x_dir)!r}")
    exec(compile(code, "docs/rules.md (Restoring with rules, T5X)", "exec"), {})
    out = capsys.readouterr().out
    assert "target/blocks_0/attn/q/kernel  <- encoder/layers_0/attention/query/kernel" in out


# ----------------------------------------------------------------------------- one checkpoint, every format

L, D_IN, D_OUT = 4, 8, 16
RULES = tt.Rules(unstack=[r"^layers/"], rename=[(r"^layers/(\d+)/w$", r"blocks/\1/kernel")],
                 transpose=[(r"kernel$", (1, 0))], dtype="bfloat16")


def _stored() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"embed": rng.standard_normal((16, D_IN), np.float32),
            "layers/w": rng.standard_normal((L, D_IN, D_OUT), np.float32),
            "step": np.array(9, np.int32)}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _truth(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """RULES applied by hand: layer i of layers/w, transposed, as bfloat16; other floats bfloat16."""
    out = {"embed": flat["embed"].astype(jnp.bfloat16), "step": flat["step"]}
    for i in range(L):
        out[f"blocks/{i}/kernel"] = flat["layers/w"][i].T.astype(jnp.bfloat16)
    return out


def _target(mesh) -> dict:
    fsdp = NamedSharding(mesh, P("fsdp"))
    return {"embed": jax.ShapeDtypeStruct((16, D_IN), jnp.bfloat16, sharding=fsdp),
            "blocks": [{"kernel": jax.ShapeDtypeStruct((D_OUT, D_IN), jnp.bfloat16, sharding=fsdp)} for _ in range(L)],
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}


def _write_orbax(tmp, flat):
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp / "orbax")
    tt.save_checkpoint(mngr, 1, {"params": _nested(flat)}, wait=True)
    mngr.close()
    return tmp / "orbax", "params"


def _write_safetensors(tmp, flat):
    from safetensors.numpy import save_file

    save_file(dict(flat), tmp / "model.safetensors")
    return tmp / "model.safetensors", "default"


def _write_hf_sharded(tmp, flat):
    import json

    from safetensors.numpy import save_file

    folder = tmp / "hf"
    folder.mkdir()
    names = list(flat)
    shards = {"model-00001-of-00002.safetensors": names[:1], "model-00002-of-00002.safetensors": names[1:]}
    for shard, keys in shards.items():
        save_file({k: flat[k] for k in keys}, folder / shard)
    index = {"metadata": {"total_size": sum(v.nbytes for v in flat.values())},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, "default"


def _write_npz(tmp, flat):
    np.savez(tmp / "w.npz", **flat)
    return tmp / "w.npz", "default"


def _write_npz_compressed(tmp, flat):  # members stream front to back: a transform reads them whole, in budget
    np.savez_compressed(tmp / "wc.npz", **flat)
    return tmp / "wc.npz", "default"


def _write_msgpack(tmp, flat):
    from flax import serialization

    (tmp / "state.msgpack").write_bytes(serialization.to_bytes(_nested(flat)))
    return tmp / "state.msgpack", "default"


def _write_flax_legacy(tmp, flat):
    from flax.training import checkpoints

    import flax

    with flax.config.temp_flip_flag("use_orbax_checkpointing", False):
        checkpoints.save_checkpoint(tmp / "legacy", _nested(flat), step=2, prefix="checkpoint_")
    return tmp / "legacy", "default"


def _write_t5x(tmp, flat):
    save_t5x(tmp / "t5x", 4, {"target": _nested(flat), "state": {"step": np.array(4, np.int32)}})
    return tmp / "t5x", "target"


WRITERS = {"orbax": _write_orbax, "safetensors": _write_safetensors, "safetensors-sharded": _write_hf_sharded,
           "npz": _write_npz, "npz-compressed": _write_npz_compressed, "msgpack": _write_msgpack,
           "flax-legacy": _write_flax_legacy, "t5x": _write_t5x}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_restore_with_rules_from_every_format_onto_an_8_device_mesh(fmt, tmp_path, devices):
    flat = _stored()
    path, item = WRITERS[fmt](tmp_path, flat)
    mesh = jax.make_mesh((8,), ("fsdp",))
    out = tt.restore_checkpoint(str(path), None, {item: _target(mesh)}, rules=RULES)[item]
    got = tt.flatten(out)
    want = _truth(flat)
    assert sorted(got) == sorted(want)
    for p, value in want.items():
        assert got[p].dtype == value.dtype, p
        np.testing.assert_array_equal(np.asarray(got[p]), value, err_msg=p)  # bit for bit (bf16 compared as bf16)
    assert got["blocks/2/kernel"].sharding == NamedSharding(mesh, P("fsdp"))
    # load_parameters: the same rules, the same leaves, as host numpy
    loaded = tt.flatten(tt.load_parameters(str(path), item=item, rules=RULES))
    for p, value in want.items():
        np.testing.assert_array_equal(np.asarray(loaded[p]), value, err_msg=p)


@pytest.mark.parametrize("version", ["0_3", "0_4", "0_6"])
def test_restore_with_renames_from_old_orbax_versions(version, devices):
    fixtures = Path(__file__).with_name("fixtures")
    prefix = "manager/2/" if version == "0_6" else "2/"
    with np.load(fixtures / f"orbax_{version}_truth.npz") as z:
        truth = {k[len(prefix):]: z[k] for k in z.files if k.startswith(prefix)}
    assert truth
    rules = tt.Rules(rename=[(r"^", "model/")])  # every leaf one level down
    target = _nested({f"model/{p}": jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in truth.items()})
    out = tt.flatten(tt.restore_checkpoint(str(fixtures / f"orbax_{version}_manager"), 2, {"params": target},
                                           rules=rules)["params"])
    for p, value in truth.items():
        np.testing.assert_array_equal(np.asarray(out[f"model/{p}"]), value, err_msg=p)


def test_restore_with_rules_from_a_bucket(tmp_path, remote_store, devices):
    flat = _stored()
    for write in (_write_orbax, _write_safetensors):
        path, item = write(tmp_path, flat)
        url = remote_store.upload(path, "rules", path.name)
        mesh = jax.make_mesh((8,), ("fsdp",))
        out = tt.flatten(tt.restore_checkpoint(url, None, {item: _target(mesh)}, rules=RULES)[item])
        for p, value in _truth(flat).items():
            np.testing.assert_array_equal(np.asarray(out[p]), value, err_msg=f"{url}: {p}")


# ----------------------------------------------------------------------------- each rule kind, and the plan


def _orbax(tmp_path, params: dict, name="ckpt") -> str:
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / name)
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True)
    mngr.close()
    return str(tmp_path / name)


def test_keep_drop_cast_and_stack_each_do_what_numpy_does(tmp_path, devices):
    rng = np.random.default_rng(0)
    layers = [rng.standard_normal((4, 6), np.float32) for _ in range(3)]
    ckpt = _orbax(tmp_path, {"layers": {str(i): {"w": w} for i, w in enumerate(layers)},
                             "head": rng.standard_normal(6, np.float32), "aux": np.zeros(2, np.float32)})
    target = {"layers": {"w": jax.ShapeDtypeStruct((3, 4, 6), jnp.float16)}, "head": jax.ShapeDtypeStruct((6,), jnp.float32)}
    rules = tt.Rules(keep=[r"^layers/", r"^head$"], stack=[r"^layers/"], cast={r"^layers/w$": "float16"})
    out = tt.restore_checkpoint(ckpt, None, {"params": target}, rules=rules)["params"]
    np.testing.assert_array_equal(np.asarray(out["layers"]["w"]), np.stack(layers).astype(np.float16))
    np.testing.assert_array_equal(np.asarray(out["head"]), tt.load_parameters(ckpt)["head"])
    plan = tt.plan_restore(ckpt, None, {"params": target}, rules=rules)
    assert plan.items["params"].dropped == ["aux"] and plan.items["params"].unused == []  # dropped is not unused
    (leaf,) = [x for x in plan.items["params"].leaves if x.path == "layers/w"]
    assert leaf.source == "layers/0/w .. layers/2/w (3)" or leaf.source.startswith("layers/0/w")
    assert "stack 3" in leaf.ops and "cast float16" in leaf.ops


def test_plan_lists_sources_fill_and_unused_and_reads_nothing(tmp_path, devices, monkeypatch):
    ckpt = _orbax(tmp_path, {"body": np.ones((2, 2), np.float32), "old_head": np.ones(3, np.float32)})
    target = {"body": jax.ShapeDtypeStruct((2, 2), jnp.float32), "head": jax.ShapeDtypeStruct((5,), jnp.float32)}

    def no_reads(*args, **kwargs):
        raise AssertionError("plan_restore read array data")

    monkeypatch.setattr("treetools.checkpoint_jax.restore._read", no_reads)
    monkeypatch.setattr("treetools.checkpoint_jax.restore._reader_values", no_reads)
    plan = tt.plan_restore(ckpt, None, {"params": target}, fill_missing={"head": np.zeros(5, np.float32)},
                           allow_unused=True)
    assert plan.ok
    text = str(plan)
    assert "1/2 target leaves from the checkpoint, 1 from fill_missing (params/head)" in text
    assert "1 checkpoint leaves unused (params/old_head)" in text and text.endswith("0 problems")
    described = plan.describe()
    assert re.search(r"params/body +<- body +\(2, 2\) +float32", described)
    assert re.search(r"params/head +<- fill_missing +\(5,\) +float32", described)
    assert "(params/old_head unused)" in described


# ----------------------------------------------------------------------------- every error, before any data


@pytest.fixture
def no_data_reads(monkeypatch):
    """Any array read fails the test: the errors below must come from metadata alone."""
    def fail(*args, **kwargs):
        raise AssertionError("array data was read before the error")

    monkeypatch.setattr("treetools.checkpoint_jax.restore._read", fail)


def test_a_rule_matching_nothing_names_the_rule_and_nearby_paths(tmp_path, devices, no_data_reads):
    ckpt = _orbax(tmp_path, {"encoder": {"kernel": np.ones((2, 2), np.float32)}})
    target = {"encoder": {"kernel": jax.ShapeDtypeStruct((2, 2), jnp.float32)}}
    with pytest.raises(tt.CheckpointMismatchError, match=r"params: `drop` pattern 'decoder' matches no leaf .*nearby "
                                                         r"paths: \['encoder/kernel'\]") as info:
        tt.restore_checkpoint(ckpt, None, {"params": target}, rules=tt.Rules(drop=["decoder"]))
    assert "fix the rules" in str(info.value)
    # allow_unmatched: the rule is ignored
    assert tt.plan_restore(ckpt, None, {"params": target}, rules=tt.Rules(drop=["decoder"], allow_unmatched=True)).ok


def test_two_leaves_renamed_onto_one_path_names_both(tmp_path, devices, no_data_reads):
    ckpt = _orbax(tmp_path, {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)})
    plan = tt.plan_restore(ckpt, None, {"params": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}},
                           rules=tt.Rules(rename=[(r"^[ab]$", "w")]))
    assert [(p.path, p.kind) for p in plan.problems] == [("params", "rules")]
    assert "`a` and `b` both become `w` after rename" in str(plan.problems[0])


def test_an_unstack_whose_axis_is_not_the_layer_count_is_a_problem_of_the_plan(tmp_path, devices, no_data_reads):
    # Issue 39.23: a 4-layer scanned checkpoint into a 6-layer per-layer model. The plan reports (plan_restore
    # returns, its problems list every mismatch: the rules' line and the other items' problems); the restore raises
    # the one documented error, CheckpointMismatchError, with the rules' problems in it, before reading any data.
    ckpt = _orbax(tmp_path, {"layers": {"w": np.ones((4, 3), np.float32)}})
    target = {"layers": [{"w": jax.ShapeDtypeStruct((3,), jnp.float32)} for _ in range(6)]}
    items = {"params": target, "ema": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}}  # no `ema` item: a problem too
    rules = tt.Rules(unstack=["^layers/"])
    plan = tt.plan_restore(ckpt, None, items, rules=rules)
    assert not plan.ok
    unstack = ("`unstack`: `layers/w` has shape (4, 3), 4 layers, but the target has 6 (`layers/0/w` .. `layers/5/w`); "
               "restore a checkpoint with as many layers or fix the target's layer count.")
    assert [(p.path, p.kind) for p in plan.problems] == [("ema", "missing"), ("params", "rules")]
    assert str(plan.problems[1]) == f"params: {unstack}"
    # the layers the checkpoint has are planned (issue 47, 26: the rest of the target is checked too); those past
    # them are unresolved, named by the rules' line, not called missing
    assert [(leaf.path, leaf.origin) for leaf in plan.items["params"].leaves] == [
        *((f"layers/{i}/w", "checkpoint") for i in range(4)), *((f"layers/{i}/w", "unresolved") for i in (4, 5))]
    assert plan.items["params"].unused == []
    assert str(plan).splitlines()[0].endswith("4/6 target leaves from the checkpoint, 0 from fill_missing, "
                                              "0 checkpoint leaves unused, 2 problems")
    assert f"  params: {unstack}" in str(plan).splitlines()
    assert re.search(r"params/layers/0/w +<- layers/w\[0\]", plan.describe())
    assert re.search(r"params/layers/5/w +<- \? \(the rules do not fit\)", plan.describe())
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.restore_checkpoint(ckpt, None, items, rules=rules)
    assert not isinstance(info.value, tt.RulesError)
    assert info.value.problems == plan.problems
    assert f"\n  params: {unstack}\n" in str(info.value) and "fix the rules (tt.Rules: docs/rules.md)" in str(info.value)
    # load_parameters with a target is a restore: the same error
    with pytest.raises(tt.CheckpointMismatchError, match=re.escape(unstack)):
        tt.load_parameters(ckpt, target=target, rules=rules)


def test_fewer_layers_than_the_target_still_reports_every_other_problem(tmp_path, devices, no_data_reads):
    # Issue 47 (26): an unstack finding fewer layers than the target listed only the layer-count problems and
    # stopped; the same target's dtype, shape, missing and unused leaves were not reported. DESIGN.md: one error
    # listing every problem, before reading. By hand: 2 layers stored, 4 wanted (one line per stacked leaf);
    # `emb` float32 where the target wants bfloat16; `pos` (8,) where it wants (16,); `head` absent; `extra` unused.
    ckpt = _orbax(tmp_path, {"layers": {"w": np.ones((2, 3), np.float32), "b": np.ones((2, 4), np.float32)},
                             "emb": np.ones((5, 3), np.float32), "pos": np.ones(8, np.float32),
                             "extra": np.ones(2, np.float32)})
    S = jax.ShapeDtypeStruct
    target = {"layers": [{"w": S((3,), jnp.float32), "b": S((4,), jnp.float32)} for _ in range(4)],
              "emb": S((5, 3), jnp.bfloat16), "pos": S((16,), jnp.float32), "head": S((3,), jnp.float32)}
    rules = tt.Rules(unstack=["^layers/"])
    plan = tt.plan_restore(ckpt, None, {"params": target}, rules=rules)
    got = [(p.path, p.kind) for p in plan.problems]
    assert got == [("params", "rules"), ("params", "rules"), ("params/head", "missing"), ("params/emb", "dtype"),
                   ("params/extra", "unexpected"), ("params/pos", "shape")], got
    assert "`layers/b` has shape (2, 4), 2 layers, but the target has 4" in str(plan.problems[0])
    assert "`layers/w` has shape (2, 3), 2 layers, but the target has 4" in str(plan.problems[1])
    assert str(plan.problems[3]) == "params/emb: dtype mismatch, target bfloat16 vs checkpoint float32"
    assert str(plan.problems[5]) == "params/pos: shape mismatch, target (16,) vs checkpoint (8,)"
    origins = {leaf.path: leaf.origin for leaf in plan.items["params"].leaves}
    assert origins["layers/1/w"] == "checkpoint" and origins["layers/2/w"] == origins["layers/3/b"] == "unresolved"
    assert plan.items["params"].unused == ["extra"]
    with pytest.raises(tt.CheckpointMismatchError) as info:  # one error, every problem, nothing read
        tt.restore_checkpoint(ckpt, None, {"params": target}, rules=rules)
    assert info.value.problems == plan.problems
    message = str(info.value)
    assert message.splitlines()[0].endswith("does not match the restore target (6 problems):")
    for words in ("fill_missing=TREE", "allow_unused=True", "allow_dtype_cast=True", "fix the rules"):
        assert words in message


def test_what_still_raises_at_once_is_usage_not_a_mismatch(tmp_path, devices, no_data_reads):
    ckpt = _orbax(tmp_path, {"w": np.ones(2, np.float32)})
    target = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    # a malformed rule never gets to a plan: a bad regex, an unknown dtype
    with pytest.raises(tt.PatternError, match=r"`drop` pattern '\(' is not a valid regex"):
        tt.plan_restore(ckpt, None, {"params": target}, rules=tt.Rules(drop=["("]))
    with pytest.raises(ValueError, match=r"`dtype` 'bfloat61' is not a numeric dtype"):
        tt.restore_checkpoint(ckpt, None, {"params": target}, rules=tt.Rules(dtype="bfloat61"))
    # rules for an item the restore does not have
    with pytest.raises(ValueError, match=r"`rules` keys \['opt'\] are not in `items` \['params'\]"):
        tt.plan_restore(ckpt, None, {"params": target}, rules={"opt": tt.Rules(drop=["w"])})
    # load_parameters without a target has no plan: rules that do not fit are the RulesError of the rules
    with pytest.raises(tt.RulesError, match=r"`drop` pattern 'nope' matches no leaf"):
        tt.load_parameters(ckpt, rules=tt.Rules(drop=["nope"]))


def test_a_12_layer_checkpoint_never_loads_silently_into_16_layers_or_back(tmp_path, devices, no_data_reads):
    def per_layer(n, dtype=np.float32):
        return {"layers": [{"w": np.zeros(2, dtype)} for _ in range(n)]}

    twelve = _orbax(tmp_path, per_layer(12), "twelve")
    sixteen = tt.make_abstract(per_layer(16))
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.restore_checkpoint(twelve, None, {"params": sixteen})
    assert [p.path for p in info.value.problems] == [f"params/layers/{i}/w" for i in (12, 13, 14, 15)]
    assert {p.kind for p in info.value.problems} == {"missing"} and "fill_missing" in str(info.value)
    with pytest.raises(tt.CheckpointMismatchError) as info:
        tt.restore_checkpoint(_orbax(tmp_path, per_layer(16), "sixteen"), None, {"params": tt.make_abstract(per_layer(12))})
    assert {p.kind for p in info.value.problems} == {"unexpected"} and len(info.value.problems) == 4
    assert "allow_unused=True" in str(info.value)


def test_a_dtype_change_needs_permission(tmp_path, devices, no_data_reads):
    ckpt = _orbax(tmp_path, {"w": np.ones(4, np.float32)})
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.bfloat16)}
    with pytest.raises(tt.CheckpointMismatchError, match=r"params/w: dtype mismatch, target bfloat16 vs checkpoint float32") as info:
        tt.restore_checkpoint(ckpt, None, {"params": target})
    assert "allow_dtype_cast=True (or a cast rule)" in str(info.value)


def test_fill_missing_that_does_not_fit_is_a_problem(tmp_path, devices, no_data_reads):
    ckpt = _orbax(tmp_path, {"body": np.ones(2, np.float32)})
    target = {"body": jax.ShapeDtypeStruct((2,), jnp.float32), "head": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(tt.CheckpointMismatchError, match=r"params/head: shape mismatch, target \(3,\) vs fill_missing \(4,\)"):
        tt.restore_checkpoint(ckpt, None, {"params": target}, fill_missing={"head": np.zeros(4, np.float32)})


# ----------------------------------------------------------------------------- Orbax's own restore, partial


def test_orbax_restore_reads_through_the_block_engine_and_never_reads_unused_leaves(tmp_path, devices, monkeypatch):
    import orbax.checkpoint as ocp

    from treetools.checkpoint_io import stream

    params = {"w": np.arange(8.0, dtype=np.float32), "b": np.ones(4, np.float32)}
    state = {"params": params, "opt_state": {"mu": {"w": np.zeros(8, np.float32), "b": np.zeros(4, np.float32)}}}
    folder = tmp_path / "state"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ckptr:
        ckptr.save(folder, state)
    # The optimizer moments' chunks are gone (their headers stay: metadata reads): reading their data fails.
    for name in ("opt_state.mu.w", "opt_state.mu.b"):
        chunks = [f for f in (folder / name).iterdir() if f.name != ".zarray"]
        assert chunks
        for f in chunks:
            f.unlink()
    calls = []
    real = stream.read_regions

    def spy(regions, then, **kwargs):
        calls.append(sorted({kwargs["names"][i] for i in range(len(regions))}))
        return real(regions, then, **kwargs)

    monkeypatch.setattr("treetools.checkpoint_jax.placing.read_regions", spy)
    rules = tt.Rules(rename=[(r"^params/", "model/")])  # a rename: the stored leaves' readers, renamed
    target = {"model": {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}}
    out = tt.restore_checkpoint(str(folder), None, {"default": target}, rules=rules, allow_unused=True)["default"]
    assert calls == [["default/model/b", "default/model/w"]]  # one engine call, for exactly the two leaves
    np.testing.assert_array_equal(np.asarray(out["model"]["w"]), params["w"])
    np.testing.assert_array_equal(np.asarray(out["model"]["b"]), params["b"])


# ----------------------------------------------------------------------------- host memory of an unstack


UNSTACK_CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import treetools as tt
path, L, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mesh = jax.make_mesh((8,), ("fsdp",))
target = {"layers": [{"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))}
                     for _ in range(L)]}
jnp.zeros(8).block_until_ready()


def status(key):  # kB in /proc/self/status
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS: jax's start-up peak does not count
base = status("VmRSS")
out = tt.restore_checkpoint(path, None, {"default": target}, rules=tt.Rules(unstack=["^layers/"]))["default"]
jax.block_until_ready(out)
peak = status("VmHWM")
ok = all(float(np.asarray(out["layers"][i]["w"].addressable_shards[0].data)[0, 0]) == i for i in range(L))
print("RESULT", peak - base, ok)
"""


def test_unstacking_holds_a_few_device_blocks_not_the_stacked_leaf(tmp_path):
    """A 256 MiB stacked leaf onto 8 per-layer targets split over 8 devices: host memory grows by the result
    (on CPU the devices' buffers are host memory) plus a few device blocks, not by another copy of the leaf."""
    import subprocess
    import sys

    from safetensors.numpy import save_file

    layers, rows, cols = 8, 2048, 4096  # 8 x 32 MiB
    stacked = np.empty((layers, rows, cols), np.float32)
    for i in range(layers):
        stacked[i] = i
    save_file({"layers/w": stacked}, tmp_path / "s.safetensors")
    del stacked
    import os

    workers = 2  # the block engine reads ahead 2 x workers device blocks (issue 45): pinned, whatever the cores
    proc = subprocess.run([sys.executable, "-c", UNSTACK_CHILD, str(tmp_path / "s.safetensors"), str(layers),
                           str(rows), str(cols)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TREETOOLS_WORKERS": str(workers)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, growth, ok = proc.stdout.strip().splitlines()[-1].split()
    result = layers * rows * cols * 4
    assert ok == "True"
    # The result itself (256 MiB) plus at most 64 MiB (a device block is 4 MiB, a layer 32 MiB; measured: +28 MiB
    # on one thread; allocator arenas under load add a few MiB: 321 MiB was seen against a 320 MiB bound) plus the
    # engine's read-ahead, 2 x workers device blocks (measured: +48 MiB on 2 threads). Reading the stacked leaf
    # whole would add 256 MiB.
    bound = result + 64 * 2**20 + 2 * workers * (rows // 8) * cols * 4
    assert int(growth) < bound, f"grew {int(growth) / 2**20:.0f} MiB for a {result / 2**20:.0f} MiB result"


# ----------------------------------------------------------------------------- the CLI: inspect --unstack, diff --rules


def test_inspect_unstack_shows_a_scanned_leaf_per_layer_with_its_own_stats(tmp_path, capsys):
    import json

    from treetools.cli import main

    flat = _stored()
    path, _ = _write_safetensors(tmp_path, flat)
    assert main(["inspect", str(path), "--unstack", "^layers/", "--stats", "--format", "json"]) == 0
    leaves = {leaf["path"]: leaf for leaf in json.loads(capsys.readouterr().out)["checkpoints"][0]["items"]["default"]["leaves"]}
    assert "layers/w" not in leaves
    for i in range(L):
        layer = flat["layers/w"][i].astype(np.float64)
        got = leaves[f"layers/{i}/w"]
        assert got["shape"] == [D_IN, D_OUT]
        assert got["stats"]["mean"] == pytest.approx(layer.mean(), abs=1e-6)  # float32 pieces, float64 merge
        assert got["stats"]["l2"] == pytest.approx(np.sqrt((layer ** 2).sum()), rel=1e-6)
    # A pattern that matches nothing anywhere is one error naming it.
    assert main(["inspect", str(path), "--unstack", "^blocks/"]) == 1
    assert "`unstack` pattern '^blocks/' matches no leaf" in capsys.readouterr().err


def test_diff_with_rules_pairs_an_export_with_its_source(tmp_path, capsys):
    import json

    from safetensors.numpy import save_file

    from treetools.cli import main

    flat = _stored()
    source, _ = _write_orbax(tmp_path, flat)
    # The export: per-layer, transposed, Hugging Face names, the step left out.
    export = {f"model.h.{i}.weight": flat["layers/w"][i].T.copy() for i in range(L)} | {"model.embed": flat["embed"]}
    save_file(export, tmp_path / "export.safetensors")
    rules = {"drop": ["^step$"], "unstack": ["^layers/"], "rename": [[r"^layers/(\d+)/w$", r"model.h.\1.weight"],
                                                                     ["^embed$", "model.embed"]],
             "transpose": [["weight$", [1, 0]]]}
    (tmp_path / "to_hf.json").write_text(json.dumps(rules))
    assert main(["diff", str(source), str(tmp_path / "export.safetensors"), "--values"]) == 1  # without the rules
    capsys.readouterr()
    code = main(["diff", str(source), str(tmp_path / "export.safetensors"), "--rules", str(tmp_path / "to_hf.json"),
                 "--values"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"values: {L + 1} bit-identical" in out
    # The same rules as flags
    code = main(["diff", str(source), str(tmp_path / "export.safetensors"), "--drop", "^step$", "--unstack", "^layers/",
                 "--rename", r"^layers/(\d+)/w$=>model.h.\1.weight", "--rename", "^embed$=>model.embed",
                 "--transpose", "weight$=1,0", "--values"])
    assert code == 0, capsys.readouterr()
    # A malformed flag is a usage error
    assert main(["diff", str(source), str(tmp_path / "export.safetensors"), "--rename", "no-arrow"]) == 2
    assert "--rename" in capsys.readouterr().err


def test_two_processes_restore_with_rules_exactly_as_one_process(tmp_path, devices):
    """Two processes (2 devices each, gloo) restore a safetensors file through rules onto a 2x2 mesh, each
    reading its own blocks; one process with a 2x2 mesh of its own devices gets the same values and shardings."""
    from tests._multiprocess import load_module, run_two_processes

    worker_path = Path(__file__).with_name("_multiprocess_rules_worker.py")
    worker = load_module(worker_path)
    path, _ = _write_safetensors(tmp_path, _stored())
    results = run_two_processes(worker_path, path, devices_per_process=2, timeout_s=120)
    single, ok = worker.restore(str(path), jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4]))
    assert ok and all(r["local_shards_ok"] and r["processes"] == 2 for r in results)
    assert results[0]["leaves"] == results[1]["leaves"] == single
    assert all(leaf["equal"] for leaf in single.values())
    assert single["blocks/1/kernel"]["spec"] == str(P("data", "model"))
