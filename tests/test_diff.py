"""`treetools diff`: metadata changes, value comparisons, across formats and between steps."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from treetools.inspect.diff import diff_paths
from tests.test_inspect import flat, host_tree, meta_of, one_error_line, run, write_run


def diff_json(capsys, *argv, rc: int | None = None) -> dict:
    """The JSON report; the exit code follows GNU diff (0 same, 1 different) and must agree with ``identical``."""
    got, out, err = run(capsys, "diff", *argv, "--format", "json")
    assert got in (0, 1), err
    data = json.loads(out)
    assert got == (0 if data["identical"] else 1), (got, data["identical"])
    if rc is not None:
        assert got == rc
    return data


def expected_values(a: dict[str, np.ndarray], b: dict[str, np.ndarray], *, atol=1e-8, rtol=1e-5) -> dict[str, dict]:
    """max |a-b|, ||a-b|| / ||a||, allclose and mismatch count per common leaf, in numpy float64."""
    out = {}
    for p in a.keys() & b.keys():
        if a[p].shape != b[p].shape:
            continue
        x, y = a[p].astype(np.float64), b[p].astype(np.float64)
        close = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        out[p] = {"max_abs_diff": float(np.max(np.abs(x - y))) if x.size else 0.0,
                  "rel_l2": float(np.linalg.norm(x - y) / np.linalg.norm(x)) if np.linalg.norm(x) else 0.0,
                  "allclose": bool(close.all()), "mismatched": int((~close).sum())}
    return out


def check_values(report: dict, want: dict[str, dict]) -> None:
    got = {v["path"]: v for v in report["values"]}
    assert set(got) == set(want)
    for p, w in want.items():
        assert got[p]["allclose"] == w["allclose"] and got[p]["mismatched"] == w["mismatched"], p
        np.testing.assert_allclose(got[p]["max_abs_diff"], w["max_abs_diff"], rtol=1e-6, atol=1e-12, err_msg=p)
        np.testing.assert_allclose(got[p]["rel_l2"], w["rel_l2"], rtol=1e-6, atol=1e-12, err_msg=p)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, devices) -> Path:
    return write_run(tmp_path_factory.mktemp("diff") / "checkpoints")


def _pair(tmp_path) -> tuple[Path, Path, dict, dict]:
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((20, 7)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32),
         "old": np.ones(3, np.float32), "ids": np.arange(6, dtype=np.int32)}
    b = {"w": a["w"] + rng.standard_normal((20, 7)).astype(np.float32) * 1e-3,
         "b": a["b"].copy(), "new": np.zeros(2, np.float32), "ids": np.arange(6, dtype=np.int64)}
    fa, fb = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(fa, **a)
    np.savez_compressed(fb, **b)
    return fa, fb, a, b


def test_metadata_diff_added_removed_changed(tmp_path, capsys):
    fa, fb, a, b = _pair(tmp_path)
    out = diff_json(capsys, fa, fb, rc=1)
    assert [r["path"] for r in out["added"]] == [p for p in b if p not in a]
    assert [r["path"] for r in out["removed"]] == [p for p in a if p not in b]
    changed = {c["path"]: c for c in out["changed"]}
    assert set(changed) == {p for p in a.keys() & b.keys() if a[p].dtype != b[p].dtype or a[p].shape != b[p].shape}
    assert changed["ids"]["fields"] == ["dtype"]
    assert (changed["ids"]["a"]["dtype"], changed["ids"]["b"]["dtype"]) == ("int32", "int64")
    assert out["identical"] is False and "values" not in out
    common = a.keys() & b.keys()
    assert out["counts"] == {"added": len(b.keys() - a.keys()), "removed": len(a.keys() - b.keys()),
                             "changed_metadata": len(changed), "same_metadata": len(common) - len(changed)}


def test_values_match_numpy_in_small_blocks(tmp_path, capsys):
    fa, fb, a, b = _pair(tmp_path)
    out = diff_json(capsys, fa, fb, "--values", "--chunk-mb", "0.001", rc=1)
    check_values(out, expected_values(a, b))
    assert out["values"] and {v["path"] for v in out["values"]} == {"w", "b", "ids"}


@pytest.mark.parametrize("atol", [1e-2, 1e-6])
def test_allclose_verdict_follows_tolerances(tmp_path, capsys, atol):
    fa, fb, a, b = _pair(tmp_path)
    out = diff_json(capsys, fa, fb, "--values", "--atol", str(atol), "--rtol", "0", rc=1)  # "new"/"old" differ
    check_values(out, expected_values(a, b, atol=atol, rtol=0.0))
    w = next(v for v in out["values"] if v["path"] == "w")
    assert w["allclose"] == (atol == 1e-2)  # the perturbation is ~1e-3


def test_nan_equals_nan_and_table_view(tmp_path, capsys):
    x = np.array([1.0, np.nan, 3.0], np.float32)
    np.savez(tmp_path / "a.npz", x=x)
    np.savez(tmp_path / "b.npz", x=x.copy())
    out = diff_json(capsys, tmp_path / "a.npz", tmp_path / "b.npz", "--values", rc=0)
    assert out["identical"] is True and out["values"][0]["allclose"] is True
    assert out["values"][0]["bit_identical"] is True
    assert (out["values"][0]["nonfinite_a"], out["values"][0]["nonfinite_b"]) == (1, 1)
    rc, text, _ = run(capsys, "diff", tmp_path / "a.npz", tmp_path / "b.npz", "--values")
    assert rc == 0 and text.strip().splitlines()[-1] == (
        "same (leaves): 0 added, 0 removed, 0 with changed metadata, 1 with the same metadata, "
        "values: 1 bit-identical, 0 within tolerance, 0 outside tolerance")
    # A value that becomes NaN is outside any tolerance.
    y = x.copy()
    y[0] = np.nan
    np.savez(tmp_path / "c.npz", x=y)
    out = diff_json(capsys, tmp_path / "a.npz", tmp_path / "c.npz", "--values", "--atol", "1e9", rc=1)
    (v,) = out["values"]
    assert v["allclose"] is False and v["mismatched"] == 1 and (v["nonfinite_a"], v["nonfinite_b"]) == (1, 2)


def test_orbax_against_npz_of_the_same_tree(run_dir, tmp_path, capsys):
    arrays = flat(host_tree(1))  # step 100's params
    np.savez(tmp_path / "p.npz", **{p: x for p, x in arrays.items() if x.dtype.kind != "V"})
    out = diff_json(capsys, run_dir, tmp_path / "p.npz", "--step", "100", "--item", "params", "--values", rc=1)
    assert [r["path"] for r in out["removed"]] == ["half"]  # bfloat16: left out of the npz
    assert out["added"] == [] and out["changed"] == []  # shardings are not compared against a format without them
    assert all(v["allclose"] and v["max_abs_diff"] == 0 for v in out["values"])
    assert len(out["values"]) == len(arrays) - 1


def test_two_steps_of_one_run(run_dir, capsys):
    by_flag = diff_json(capsys, run_dir, "--step", "100", "--step", "200", "--values", rc=1)
    by_path = diff_json(capsys, run_dir / "ckpt_0100", run_dir / "ckpt_0200", "--values", rc=1)
    assert by_flag["a"]["step"] == 100 and by_flag["b"]["step"] == 200
    assert by_flag["changed"] == by_path["changed"] and by_flag["values"] == by_path["values"]
    changed = {c["path"]: c for c in by_flag["changed"]}
    assert set(changed) == {"meta/step"}
    assert (changed["meta/step"]["a"]["value"], changed["meta/step"]["b"]["value"]) == (meta_of(100)["step"], meta_of(200)["step"])
    a = {f"params/{p}": x for p, x in flat(host_tree(1)).items()}
    b = {f"params/{p}": x for p, x in flat(host_tree(2)).items()}
    got = {v["path"]: v for v in by_flag["values"]}
    for p, w in expected_values(a, b).items():
        np.testing.assert_allclose(got[p]["max_abs_diff"], w["max_abs_diff"], rtol=1e-6, err_msg=p)
        assert got[p]["allclose"] == w["allclose"], p
    same = diff_json(capsys, run_dir, run_dir, "--step", "100", "--values", rc=0)
    assert same["identical"] is True


def test_sharding_change_between_orbax_saves(tmp_path, capsys, devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    for name, spec in (("a", P("fsdp", None)), ("b", P(None, "fsdp")), ("c", P("fsdp"))):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(str(tmp_path / name), {"w": jax.device_put(x, NamedSharding(mesh, spec)), "v": x[0]})
    out = diff_json(capsys, tmp_path / "a", tmp_path / "b", "--values", rc=1)
    (change,) = out["changed"]
    assert change["path"] == "w" and change["fields"] == ["sharding"]
    assert change["a"]["sharding"] == {"mesh": {"fsdp": 8}, "spec": ["fsdp", None]}
    assert change["b"]["sharding"] == {"mesh": {"fsdp": 8}, "spec": [None, "fsdp"]}
    assert all(v["allclose"] and v["max_abs_diff"] == 0 for v in out["values"])
    # Shardings compare by meaning: P('fsdp', None) and P('fsdp') split the same dimension.
    same = diff_json(capsys, tmp_path / "a", tmp_path / "c", "--values", rc=0)
    assert same["changed"] == [] and same["counts"]["bit_identical"] == 2
    rc, text, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1 and "changed metadata: 1" in text.splitlines()
    assert re.search(r"^w\s+sharding\s+P\('fsdp'\)\s+P\(None, 'fsdp'\)$", text, re.M), text


def test_library_diff_paths(tmp_path):
    fa, fb, a, b = _pair(tmp_path)
    r = diff_paths(str(fa), str(fb), values=True)
    assert not r.identical and [x.name for x in r.added] == ["new"] and [x.name for x in r.removed] == ["old"]
    assert [x.path for x in r.added] == [("new",)]  # Row.path is the tuple of parts


@pytest.mark.parametrize("argv", [["A"], ["A", "--step", "1"], ["A", "A", "--step", "1", "--step", "2", "--step", "3"],
                                  ["A", "A", "--step", "all"]])
def test_diff_usage_errors(run_dir, capsys, argv):
    rc, out, err = run(capsys, "diff", *[str(run_dir) if a == "A" else a for a in argv])
    assert rc == 2 and out == "" and "error" in err


def test_diff_errors_are_one_line(run_dir, tmp_path, capsys):
    # diff exits 2 on trouble (GNU diff), with one error line and no traceback.
    rc, out, err = run(capsys, "diff", tmp_path / "missing", run_dir)
    assert rc == 2 and "no such file" in one_error_line(err)
    rc, out, err = run(capsys, "diff", run_dir, "--step", "100", "--step", "999")
    assert rc == 2 and "available steps" in one_error_line(err)
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "ckpt_0100" / "params", broken)
    (broken / "_METADATA").write_text("{")
    rc, out, err = run(capsys, "diff", broken, run_dir)
    assert rc == 2 and "_METADATA" in one_error_line(err)


def test_orbax_item_against_a_flax_msgpack_of_the_whole_state(run_dir, tmp_path, capsys):
    """`to_bytes({"params": ..., "step": ...})`, the legacy Flax layout: --item params pairs its params subtree."""
    from flax import serialization

    tree = host_tree(1)  # step 100's params
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes({"params": tree, "step": 100}))
    out = diff_json(capsys, run_dir, tmp_path / "state.msgpack", "--step", "100", "--item", "params", "--values", rc=0)
    assert out["added"] == out["removed"] == out["changed"] == []
    assert out["identical"] is True and len(out["values"]) == len(flat(tree))
    assert out["b"]["item"] == "params"


def test_verdict_line_counts_value_differences(tmp_path, capsys):
    fa, fb, a, b = _pair(tmp_path)
    rc, text, _ = run(capsys, "diff", fa, fb, "--values", "--atol", "0", "--rtol", "0")
    want = expected_values(a, b, atol=0.0, rtol=0.0)
    differ = sum(not w["allclose"] for w in want.values())
    bit_same = sum(a[p].dtype == b[p].dtype and a[p].tobytes() == b[p].tobytes() for p in want)
    within = len(want) - differ - bit_same
    common = a.keys() & b.keys()
    meta_changed = sum(a[p].dtype != b[p].dtype or a[p].shape != b[p].shape for p in common)
    assert rc == 1 and differ > 0 and bit_same > 0 and within > 0  # ids: int32 -> int64, equal values
    last = text.strip().splitlines()[-1]
    assert last == (f"different (leaves): {len(b.keys() - a.keys())} added, {len(a.keys() - b.keys())} removed, "
                    f"{meta_changed} with changed metadata, {len(common) - meta_changed} with the same metadata, "
                    f"values: {bit_same} bit-identical, {within} within tolerance, {differ} outside tolerance"), last


def test_markdown_is_a_list_and_tables_follow_blank_lines(run_dir, capsys):
    rc, out, _ = run(capsys, "diff", run_dir, "--step", "100", "--step", "200", "--values", "--format", "markdown")
    lines = out.splitlines()
    assert rc == 1 and lines[0].startswith("- A: ") and lines[1].startswith("- B: ")
    headers = [i for i, line in enumerate(lines) if line.startswith("| path")]
    assert len(headers) == 2 and all(lines[i - 1] == "" for i in headers), out  # changed (meta/step) and values


def test_composite_against_a_single_tree_suggests_item(run_dir, tmp_path, capsys):
    np.savez(tmp_path / "p.npz", **{p: x for p, x in flat(host_tree(1)).items() if x.dtype.kind != "V"})
    rc, out, err = run(capsys, "diff", run_dir / "ckpt_0100", tmp_path / "p.npz")
    assert rc == 1 and out.strip().splitlines()[-1].startswith("different (leaves): ")
    assert err.startswith("treetools: note: ") and "--item" in err and len(err.strip().splitlines()) == 1


def test_a_dotted_safetensors_export_pairs_with_the_slashed_msgpack_it_came_from(tmp_path, capsys):
    # Issue 24, point 28: the same Hugging Face Flax model as model.safetensors (dotted names) and
    # flax_model.msgpack (nested dicts, slashed paths) read as 2 added and 2 removed.
    from flax import serialization
    from safetensors.numpy import save_file

    from treetools.cli import main

    rng = np.random.default_rng(0)
    params = {"model": {"layers": {"0": {"q": rng.standard_normal((4, 4)).astype(np.float32)}},
                        "embed": rng.standard_normal((8, 4)).astype(np.float32)}}
    save_file({"model.layers.0.q": params["model"]["layers"]["0"]["q"], "model.embed": params["model"]["embed"]},
              tmp_path / "model.safetensors")
    (tmp_path / "flax_model.msgpack").write_bytes(serialization.to_bytes(params))
    report = diff_paths(str(tmp_path / "model.safetensors"), str(tmp_path / "flax_model.msgpack"), values=True)
    assert not report.added and not report.removed and report.identical
    assert sorted(v.path for v in report.values) == ["model.embed", "model.layers.0.q"]  # shown as A stores them
    # A pattern written either way selects the pair.
    for pattern in (r"layers\.0", "layers/0"):
        r = diff_paths(str(tmp_path / "model.safetensors"), str(tmp_path / "flax_model.msgpack"), include=[pattern])
        assert r.unchanged == 1 and not r.added and not r.removed
    assert main(["diff", str(tmp_path / "model.safetensors"), str(tmp_path / "flax_model.msgpack"), "--values"]) == 0


def _fast_path_case(case: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    import ml_dtypes

    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    n = 200_003  # several blocks of several cache-sized pieces, and a ragged end
    b = rng.standard_normal(n).astype(np.float32)
    atol, rtol = 1e-8, 1e-5
    if case == "near_line":  # |a - b| within a few float32 ulps of atol + rtol * |b|: decided again in float64
        atol, rtol = 1e-3, 1e-2
        t = atol + rtol * np.abs(b.astype(np.float64))
        a = (b + t * (1 + rng.uniform(-4e-7, 4e-7, n))).astype(np.float32)
    elif case == "bf16":
        a, b = b.astype(ml_dtypes.bfloat16), (b + 0.01).astype(ml_dtypes.bfloat16)
    elif case == "f16_vs_f32":
        a = (b + rng.standard_normal(n).astype(np.float32) * 1e-4).astype(np.float16)
    elif case == "f32_vs_f64":
        a = b.astype(np.float64) + rng.standard_normal(n) * 1e-6
    elif case == "nonfinite":
        a = b + np.float32(1e-6)
        a[::1000], b[5::2000], a[7::3000], b[7::3000] = np.nan, np.inf, -np.inf, -np.inf
    elif case == "huge":  # squares beyond float32
        b = b * np.float32(1e30)
        a = b * np.float32(1 + 1e-6)
    elif case == "tiny":  # squares below float32's normal range
        b = b * np.float32(1e-30)
        a = b * np.float32(1 + 1e-3)
    elif case == "zero_tolerance":
        atol = rtol = 0.0
        a = b.copy()
        a[::7] = np.nextafter(a[::7], np.float32(np.inf))
    elif case == "identical_with_nan":
        b[::5000] = np.nan
        a = b.copy()
    elif case == "sparse":  # mostly zeros on both sides: no element near the line by accident
        b[rng.random(n) < 0.9] = 0
        a = b.copy()
        a[::3] += np.float32(1e-3)
    else:
        raise AssertionError(case)
    return a, b, atol, rtol


@pytest.mark.parametrize("case", ["near_line", "bf16", "f16_vs_f32", "f32_vs_f64", "nonfinite", "huge", "tiny",
                                  "zero_tolerance", "identical_with_nan", "sparse"])
def test_fast_float_comparison_is_numpys_float64_rule(case):
    from treetools.ckpt.readers import InMemoryReader
    from treetools.ckpt.source import Leaf, array_row
    from treetools.inspect.diff import value_diffs

    a, b, atol, rtol = _fast_path_case(case)
    leaf = lambda x: Leaf(array_row(("w",), x.shape, x.dtype), InMemoryReader(x))  # noqa: E731
    (got,) = value_diffs([(leaf(a), leaf(b), "w")], atol=atol, rtol=rtol, chunk_bytes=300_000, workers=2)
    x, y = a.astype(np.float64), b.astype(np.float64)
    close = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    both = np.isfinite(x) & np.isfinite(y)
    assert got.mismatched == int((~close).sum()) and got.allclose == bool(close.all()), case
    want_max = math.inf if (np.isfinite(x) != np.isfinite(y)).any() else float(np.max(np.abs(x[both] - y[both])))
    np.testing.assert_allclose(got.max_abs_diff, want_max, rtol=1e-6, err_msg=case)
    diff_sq, ref_sq = float(np.sum((x[both] - y[both]) ** 2)), float(np.sum(x[np.isfinite(x)] ** 2))
    want_rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else 0.0
    np.testing.assert_allclose(got.rel_l2, want_rel, rtol=1e-6, atol=1e-300, err_msg=case)
    assert (got.nonfinite_a, got.nonfinite_b) == (int((~np.isfinite(x)).sum()), int((~np.isfinite(y)).sum()))
    assert got.bit_identical == (a.dtype == b.dtype and a.tobytes() == b.tobytes())
