"""treetools.pytree.health: the spike/NaN detector, the on-device recorder, the dumps (issue 40).

Planted faults in known places: a gradient scaled in one module, a NaN in one leaf inside shard_map. The
running statistics are checked against numpy's mean/var of the same values (while fewer steps than
1 / (1 - decay) are folded in, the exponential weighting is a plain running average).
"""

from __future__ import annotations

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import treetools as tt
from tests.test_norms import _program
from treetools.pytree.health import HealthDumper, HealthRecorder, SpikeDetector, every_n, write_health_dump
from treetools.pytree.partitioning import is_box
from treetools.pytree.paths import unflatten_dict

MODULES = ("embed", "layers_0", "layers_1", "head")


def _grads(step: int, scale: dict[str, float] | None = None) -> dict:
    rng = np.random.default_rng(step)
    host = {f"{m}/w": rng.normal(size=(6, 4)).astype(np.float32) * (1 + 0.05 * rng.random()) for m in MODULES}
    for module, factor in (scale or {}).items():
        host[f"{module}/w"] = host[f"{module}/w"] * factor
    return unflatten_dict(host)


def _metrics(grads, loss):
    m = tt.norm_metrics(grads=grads, depth=1)
    m["loss"] = jnp.float32(loss)
    return m


def test_running_statistics_are_numpys_mean_and_variance():
    detector = SpikeDetector(keys=("loss", "grad_norm"), decay=0.99, warmup=5)
    state = detector.init(_metrics(_grads(0), 1.0))
    update = jax.jit(detector.update)
    seen = []
    for step in range(30):  # 30 < 1 / (1 - 0.99): a plain running average
        m = _metrics(_grads(step), 2.0 + 0.1 * np.sin(step))
        state, report = update(state, m)
        seen.append([float(m["loss"]), float(m["grad_norm"])])
        assert not bool(report["flagged"])
    np.testing.assert_allclose(np.asarray(state.mean), np.mean(seen, axis=0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.var), np.var(seen, axis=0), rtol=1e-3)
    assert int(state.count) == 30 and state.keys == ("loss", "grad_norm") and state.modules == tuple(sorted(MODULES))


def test_a_scaled_gradient_in_one_module_is_flagged_and_attributed_to_it():
    detector = SpikeDetector(k=6.0, warmup=10)
    state = detector.init(_metrics(_grads(0), 1.0))
    update = jax.jit(detector.update)
    for step in range(20):
        state, report = update(state, _metrics(_grads(step), 1.0 + 0.01 * (step % 3)))
        assert not bool(report["flagged"])
    before = jax.device_get(state)
    state, report = update(state, _metrics(_grads(20, {"layers_1": 30.0}), 1.0))  # a bad batch hits layers_1
    why = detector.explain(state, report)
    assert why["flagged"] and bool(report["spike"]) and not bool(report["nonfinite"])
    assert why["attributed"][0] == "layers_1" and why["ratios"]["layers_1"] > 20 > why["ratios"][why["attributed"][1]]
    assert why["reasons"] and re.match(r"spike in grad_norm \(\d+\.\d sigma", why["reasons"][0])
    assert why["nonfinite_modules"] == []
    # A flagged step leaves the statistics as they were: the next spike is measured against healthy steps.
    after = jax.device_get(state)
    for field in ("count", "mean", "var", "module_mean"):
        np.testing.assert_array_equal(getattr(after, field), getattr(before, field))
    # The same scale in every module: every ratio jumps (what a bad loss scale looks like).
    _, report = update(state, _metrics(_grads(20, {m: 30.0 for m in MODULES}), 1.0))
    assert bool(report["spike"]) and np.asarray(report["ratio"]).min() > 20


def test_no_flag_during_warmup_but_nan_at_once():
    detector = SpikeDetector(keys=("grad_norm",), warmup=10)
    state = detector.init(_metrics(_grads(0), 1.0))
    state, report = detector.update(state, _metrics(_grads(1), 1.0))
    state, report = detector.update(state, _metrics(_grads(2, {"head": 100.0}), 1.0))
    assert not bool(report["flagged"])  # step 2 of a warmup of 10
    state, report = detector.update(state, _metrics(_grads(3, {"embed": np.nan}), 1.0))
    why = detector.explain(state, report)
    assert why["flagged"] and why["nonfinite_modules"] == ["embed"] and why["reasons"] == ["NaN/Inf in embed"]


def test_a_nan_in_one_leaf_inside_shard_map_is_found_and_the_update_skipped(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    box = lambda x: nn.Partitioned(jax.device_put(x, NamedSharding(mesh, P("fsdp"))), names=("fsdp", None))  # noqa: E731
    host = {f"{m}/w": np.full((16, 4), 0.1, np.float32) for m in MODULES}
    params = jax.tree.map(box, unflatten_dict(host))
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    detector, recorder = SpikeDetector(keys=("grad_norm",), warmup=2), HealthRecorder(length=8)
    abstract = jax.eval_shape(lambda g: _metrics(g, 0.0), params)
    det, rec = detector.init(abstract), recorder.init(abstract)
    specs = jax.tree.map(lambda b: P("fsdp") if is_box(b) else P(), (params, opt_state, det, rec), is_leaf=is_box)

    def step(params, opt_state, det, rec, grads, i):
        metrics = _metrics(grads, 1.0)
        det, report = detector.update(det, metrics)
        rec = recorder.record(rec, i, metrics, report["flagged"])
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # Skip the update on a flagged step, as optax.apply_if_finite does.
        params, opt_state = optax.tree.where(report["flagged"], (params, opt_state), (new_params, new_opt))
        return params, opt_state, det, rec, report

    g_specs = specs[0]
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(*specs, g_specs, P()),
                               out_specs=(*specs, P()), check_vma=False))
    for i in range(4):
        grads = jax.tree.map(lambda b: nn.Partitioned(b.value * (1 + 0.1 * i), names=b.names), params, is_leaf=is_box)
        params, opt_state, det, rec, report = jax.block_until_ready(fn(params, opt_state, det, rec, grads, i))
        assert not bool(report["flagged"])
    kept = jax.device_get((params, opt_state))
    bad = {f"{m}/w": np.full((16, 4), 0.1, np.float32) for m in MODULES}
    bad["layers_0/w"][13, 2] = np.nan  # one element, on device 6 of 8
    grads = jax.tree.map(box, unflatten_dict(bad))
    params, opt_state, det, rec, report = jax.block_until_ready(fn(params, opt_state, det, rec, grads, 4))
    why = detector.explain(det, report)
    assert why["flagged"] and why["nonfinite_modules"] == ["layers_0"]
    for a, b in zip(jax.tree.leaves(jax.device_get((params, opt_state))), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(a, b)  # the update was skipped: params and moments as before
    rows = HealthRecorder.rows(rec)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and [r["flagged"] for r in rows] == [False] * 4 + [True]
    assert rows[-1]["nonfinite_grads/layers_0"] == 1.0 and np.isnan(rows[-1]["grad_norm/layers_0"])


# --------------------------------------------------------------------------- #
# The recorder and the dumps
# --------------------------------------------------------------------------- #


def _row(step):
    return {"loss": jnp.float32(1.0 / step), "grad_norm/a": jnp.float32(step), "grad_norm/b": jnp.float32(-step),
            "other": jnp.float32(0)}


def test_ring_keeps_the_last_steps_in_order_across_a_resume(tmp_path):
    recorder = HealthRecorder(length=4)
    state = recorder.init(_row(1))
    assert state.names == ("loss", "grad_norm/a", "grad_norm/b")  # `other` does not match the default keys
    record = jax.jit(recorder.record)
    for step in range(1, 11):
        state = record(state, step, _row(step), step == 9)
    rows = HealthRecorder.rows(state)
    assert [r["step"] for r in rows] == [7, 8, 9, 10] and [r["flagged"] for r in rows] == [False, False, True, False]
    assert rows[0] == {"step": 7, "flagged": False, "loss": pytest.approx(1 / 7), "grad_norm/a": 7.0,
                       "grad_norm/b": -7.0}
    # Saved with the run's checkpoint, restored, continued: the ring goes on where it was.
    manager = tt.get_checkpoint_manager(10, checkpoint_dir=str(tmp_path / "ckpt"))
    tt.save_checkpoint(manager, 10, {"health": state}, wait=True)
    restored = tt.restore_checkpoint(manager, 10, {"health": tt.make_abstract(recorder.init(_row(1)))})["health"]
    manager.close()
    assert restored.names == state.names and int(restored.written) == 10
    for step in range(11, 13):
        restored = record(restored, step, _row(step), False)
    assert [r["step"] for r in HealthRecorder.rows(restored)] == [9, 10, 11, 12]
    path = write_health_dump(tmp_path / "d.json", restored, reason="every")
    dump = json.loads((tmp_path / "d.json").read_text())
    assert path.endswith("d.json") and dump["step"] == 12 and dump["names"] == list(state.names)
    assert [(r["step"], r["flagged"], r["grad_norm/a"]) for r in dump["records"]] == [(9, 1, 9.0), (10, 0, 10.0),
                                                                                       (11, 0, 11.0), (12, 0, 12.0)]


def test_an_unwritten_row_is_no_nan_and_a_recorded_nan_is_reported(tmp_path, capsys):
    # A ring not full yet goes into the run's checkpoint: its empty rows (step -1) must not read as NaN to
    # `inspect --stats --fail-on-nonfinite`; a NaN the run recorded must.
    from treetools.cli import main as cli_main

    recorder = HealthRecorder(length=4)
    state = recorder.init(_row(1))
    assert np.isfinite(np.asarray(state.values)).all() and (np.asarray(state.steps) == -1).all()
    assert HealthRecorder.rows(state) == []
    state = recorder.record(state, 0, {**_row(1), "loss": jnp.float32(0.0)})  # step 0, a value 0: a row like any
    assert [(r["step"], r["loss"]) for r in HealthRecorder.rows(state)] == [(0, 0.0)]
    path = write_health_dump(tmp_path / "d.json", state, reason="every")
    assert [r["step"] for r in json.loads(open(path).read())["records"]] == [0]  # the empty rows are not dumped
    manager = tt.get_checkpoint_manager(1, checkpoint_dir=str(tmp_path / "ckpt"))
    tt.save_checkpoint(manager, 1, {"health": state}, wait=True)
    nan = recorder.record(state, 1, {**_row(1), "grad_norm/a": jnp.float32(np.nan)})
    tt.save_checkpoint(manager, 2, {"health": nan}, wait=True)
    manager.close()
    assert np.isnan(HealthRecorder.rows(nan)[1]["grad_norm/a"])
    check = ["inspect", str(tmp_path / "ckpt"), "--stats", "--fail-on-nonfinite", "--step"]
    capsys.readouterr()
    assert cli_main([*check, "1"]) == 0, capsys.readouterr().err
    assert cli_main([*check, "2"]) == 3
    assert "non-finite values in 1 leaf(s): health/values" in capsys.readouterr().err


def test_record_where_false_leaves_the_ring_and_every_n_skips_the_work():
    recorder = HealthRecorder(length=3)
    state = recorder.init(_row(1))

    @jax.jit
    def step(state, i):
        ran, metrics = every_n(i, 2, lambda: _row(1) | {"grad_norm/a": jnp.float32(i)})
        return recorder.record(state, i, metrics, where=ran)

    for i in range(1, 8):
        state = step(state, i)
    assert [(r["step"], r["grad_norm/a"]) for r in HealthRecorder.rows(state)] == [(2, 2.0), (4, 4.0), (6, 6.0)]


def test_every_n_puts_the_per_layer_reductions_behind_the_branch():
    tree = {f"l{i}": jax.ShapeDtypeStruct((64, 32), jnp.float32) for i in range(3)}
    fn = lambda t: every_n(t[1], 10, lambda g: tt.norm_metrics(grads=g, depth=1), t[0])[1]  # noqa: E731
    reductions, conditionals = _program(fn, (tree, jax.ShapeDtypeStruct((), jnp.int32)), "cpu")
    assert "cond" in conditionals
    assert all(red and all(inside for _, _, inside in red) for red in reductions[:3])  # none outside the branch


def test_dumper_writes_after_a_flag_and_every_n_steps(tmp_path):
    detector = SpikeDetector(keys=("grad_norm",), warmup=3)
    recorder = HealthRecorder(length=6)
    det, rec = detector.init(_metrics(_grads(0), 1.0)), recorder.init(_metrics(_grads(0), 1.0))
    dumper = HealthDumper(tmp_path / "health", detector, every=20, after=2, check_every=2)

    @jax.jit
    def step(det, rec, grads, i):
        m = _metrics(grads, 1.0)
        det, report = detector.update(det, m)
        return det, recorder.record(rec, i, m, report["flagged"]), report

    events = []
    for i in range(1, 23):
        det, rec, report = step(det, rec, _grads(i, {"head": 40.0} if i == 12 else None), i)
        events += [(i, e) for e in dumper(i, rec, det, report)]
    flagged = [(i, e) for i, e in events if e["event"] == "flagged"]
    # Read at the first check after it (steps 11 and 12 at step 13's call: never the step just dispatched).
    assert [(i, e["step"], e["attributed"][0]) for i, e in flagged] == [(13, 12, "head")]
    dumps = [(i, e["reason"], e["path"]) for i, e in events if e["event"] == "dump"]
    assert [(i, reason) for i, reason, _ in dumps] == [(14, "flagged"), (20, "every")]
    dump = json.loads(open(dumps[0][2]).read())
    assert dumps[0][2].endswith("health_00000014.json") and dump["kind"] == "treetools.health_dump"
    assert [r["step"] for r in dump["records"]] == list(range(9, 15))  # the 6 steps around the spike
    assert dump["flagged"][0]["step"] == 12 and dump["flagged"][0]["attributed"][0] == "head"
    assert [r["flagged"] for r in dump["records"]] == [0, 0, 0, 1, 0, 0]
    assert dumper.close() == []  # nothing owed


def test_dumper_close_writes_what_is_owed(tmp_path):
    detector = SpikeDetector(keys=("grad_norm",), warmup=5)  # NaN/Inf are flagged during the warmup too
    recorder = HealthRecorder(length=4)
    det, rec = detector.init(_metrics(_grads(0), 1.0)), recorder.init(_metrics(_grads(0), 1.0))
    dumper = HealthDumper(tmp_path, detector, after=5)
    for i in range(1, 4):
        m = _metrics(_grads(i, {"embed": np.nan} if i == 3 else None), 1.0)
        det, report = detector.update(det, m)
        rec = recorder.record(rec, i, m, report["flagged"])
        assert dumper(i, rec, det, report) == []  # step 3's flag is not read while step 3 may still run
    flagged, event = dumper.close()
    assert flagged["event"] == "flagged" and flagged["step"] == 3
    assert event["event"] == "dump" and event["step"] == 3
    assert json.loads(open(event["path"]).read())["flagged"][0]["nonfinite_modules"] == ["embed"]


# --------------------------------------------------------------------------- #
# The compiled step: no host callback, no extra read of the arrays
# --------------------------------------------------------------------------- #

_CALLBACKS = ("callback", "io_callback", "pure_callback", "debug_callback", "outside_call", "host_callback")


def _primitives(jaxpr) -> set[str]:
    from jax.extend.core import ClosedJaxpr, Jaxpr

    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(j, (Jaxpr, ClosedJaxpr)):
                    out |= _primitives(j.jaxpr if isinstance(j, ClosedJaxpr) else j)
    return out


def test_the_health_step_has_no_host_callback_and_reads_each_gradient_as_before():
    detector, recorder = SpikeDetector(), HealthRecorder(length=16)
    tree = _grads(0)
    abstract = jax.eval_shape(lambda g: _metrics(g, 0.0), tree)
    det, rec = detector.init(abstract), recorder.init(abstract)

    def plain(t):
        return _metrics(t[0], 1.0)

    def with_health(t):
        grads, det, rec = t
        metrics = _metrics(grads, 1.0)
        det, report = detector.update(det, metrics)
        return metrics, det, recorder.record(rec, 7, metrics, report["flagged"])

    closed = jax.make_jaxpr(with_health)((tree, det, rec))
    assert not any(c in p for p in _primitives(closed.jaxpr) for c in _CALLBACKS)
    targets = lambda fn: re.findall(r'custom_call_target="([^"]+)"', jax.jit(fn).lower((tree, det, rec)).compile().as_text())  # noqa: E731
    assert not any("callback" in t for t in targets(with_health))  # nothing leaves the device in the compiled step
    # The checker can fail: the same step with a jax.debug.callback in it.
    noisy = lambda t: (jax.debug.callback(lambda x: None, t[0]["head"]["w"].sum()), with_health(t))[1]  # noqa: E731
    assert any("callback" in p for p in _primitives(jax.make_jaxpr(noisy)((tree, det, rec)).jaxpr))
    assert any("callback" in t for t in targets(noisy))
    # The detector and the recorder add no reduction of the gradients: each is read as by norm_metrics alone.
    n = len(MODULES)
    for platform in ("cpu", "cuda"):
        base, _ = _program(plain, (tree,), platform)
        health, _ = _program(with_health, (tree, det, rec), platform)
        assert [len(r) for r in health[:n]] == [len(r) for r in base[:n]], platform


def test_a_step_dict_without_the_recorded_names_is_an_error_naming_them():
    recorder, detector = HealthRecorder(length=2), SpikeDetector(keys=("loss",))
    state = recorder.init(_row(1))
    with pytest.raises(ValueError, match=r"HealthRecorder state was made for metrics .*\(grad_norm/b\)"):
        recorder.record(state, 1, {k: v for k, v in _row(1).items() if k != "grad_norm/b"})
    det = detector.init(_row(1))
    with pytest.raises(ValueError, match=r"SpikeDetector state .*\(loss\)"):
        detector.update(det, {"grad_norm/a": 1.0, "grad_norm/b": 1.0})
    with pytest.raises(ValueError, match=r"watches \['grad_norm'\], which the metrics do not have"):
        SpikeDetector(keys=("grad_norm",)).init({"loss": 1.0})


def test_a_lasting_new_level_is_taken_after_patience_steps_not_flagged_forever():
    detector = SpikeDetector(keys=("grad_norm",), warmup=5, patience=3)
    state = detector.init(_metrics(_grads(0), 1.0))
    flags = []
    for step in range(1, 20):
        scale = {m: 10.0 for m in MODULES} if step >= 10 else None  # from step 10 on, every gradient is 10x
        state, report = detector.update(state, _metrics(_grads(step, scale), 1.0))
        flags.append(bool(report["flagged"]))
    # Steps 10-12 are flagged (a spike, maybe); from the 4th step on it is the new level, and the statistics follow.
    assert [s for s, f in zip(range(1, 20), flags) if f] == [10, 11, 12]
