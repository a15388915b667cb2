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

from treetools.checkpoint_tools.diff import diff_paths
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


def expected_values(a: dict[str, np.ndarray], b: dict[str, np.ndarray], *, atol=0.0, rtol=1e-5) -> dict[str, dict]:
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
    assert rc == 0 and text.strip().splitlines()[-2:] == [
        "same (leaves): 0 added, 0 removed, 0 with changed metadata, 1 with the same metadata,",
        "  values: 1 bit-identical, 0 within tolerance, 0 outside tolerance"]
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
    assert rc == 1 and "changed metadata: 1 leaf" in text.splitlines()
    assert re.search(r"^w\s+sharding\s+P\('fsdp'\)\s+P\(None, 'fsdp'\)$", text, re.M), text


def test_an_unmatched_pattern_offers_paths_in_the_form_diff_prints(run_dir, capsys):
    # Several items are joined as item/path in diff's rows: the nearby paths are too, not mixed with bare ones.
    rc, _, err = run(capsys, "diff", run_dir, run_dir, "--step", "100", "--include", "Dense_0/biaz")
    shown = eval(re.search(r"nearby paths: (\[.*?\])", one_error_line(err)).group(1))  # a list of strings
    assert rc == 2 and shown and all(p.split("/", 1)[0] in ("params", "opt_state", "meta") for p in shown), shown
    for path in shown:
        report = diff_json(capsys, run_dir, run_dir, "--step", "100", "--values", "--include", f"^{re.escape(path)}$")
        assert [v["path"] for v in report["values"]] == [path]


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
    last = text.strip().splitlines()[-2:]
    assert last == [f"different (leaves): {len(b.keys() - a.keys())} added, {len(a.keys() - b.keys())} removed, "
                    f"{meta_changed} with changed metadata, {len(common) - meta_changed} with the same metadata,",
                    f"  values: {bit_same} bit-identical, {within} within tolerance, {differ} outside tolerance"], last


def test_markdown_is_a_list_and_tables_follow_blank_lines(run_dir, capsys):
    rc, out, _ = run(capsys, "diff", run_dir, "--step", "100", "--step", "200", "--values", "--format", "markdown")
    lines = out.splitlines()
    assert rc == 1 and lines[0].startswith("- A: ") and lines[1].startswith("- B: ")
    headers = [i for i, line in enumerate(lines) if line.startswith("| path")]
    assert len(headers) == 2 and all(lines[i - 1] == "" for i in headers), out  # changed (meta/step) and values


def test_composite_against_a_single_tree_compares_its_params(run_dir, tmp_path, capsys):
    # Issue 39, point 11: a step of params, opt_state and meta against an .npz of params paired the params
    # item (params/Dense_0/kernel) with nothing; now its params item is compared, and the note says so.
    arrays = {p: x for p, x in flat(host_tree(1)).items() if x.dtype.kind != "V"}  # no bfloat16 in the npz
    np.savez(tmp_path / "p.npz", **arrays)
    rc, out, err = run(capsys, "diff", run_dir / "ckpt_0100", tmp_path / "p.npz")
    lines = out.strip().splitlines()
    assert rc == 1 and lines[0].endswith("(orbax, step 100, item params)") and lines[-2].startswith("different (leaves): ")
    assert lines[-2].startswith(f"different (leaves): 0 added, 1 removed, 0 with changed metadata, {len(arrays)} ")
    assert err.startswith("treetools: note: ") and "params" in err and "--item" in err
    assert len(err.strip().splitlines()) == 1
    # --item still picks another item; a side that is no params item (opt_state) gets no such pairing.
    rc, out, err = run(capsys, "diff", run_dir / "ckpt_0100", tmp_path / "p.npz", "--item", "opt_state")
    assert rc == 1 and "item opt_state" in out.splitlines()[0] and "params" not in err


def test_a_run_against_its_own_params_export_compares_the_params(run_dir, tmp_path, capsys):
    # Issue 39, point 11: `diff RUN model.safetensors --values` (a run against the export `convert` made from it)
    # read 29 added, 89 removed, exit 1, with the --item hint only on stderr.
    from safetensors.numpy import save_file

    from treetools.cli import main

    assert main(["convert", str(run_dir), str(tmp_path / "model.safetensors")]) == 0
    capsys.readouterr()
    truth = flat(host_tree(2))  # step 200's params, as written
    for a, b, side in ((run_dir, tmp_path / "model.safetensors", "a"), (tmp_path / "model.safetensors", run_dir, "b")):
        out = diff_json(capsys, a, b, "--values", rc=0)
        assert out["added"] == out["removed"] == out["changed"] == [], out
        assert len(out["values"]) == len(truth) and all(v["bit_identical"] for v in out["values"])
        assert out[side]["item"] == "params" and out[side]["step"] == 200
        rc, text, err = run(capsys, "diff", a, b, "--values")
        assert rc == 0 and "item params" in text.splitlines()[0 if side == "a" else 1]
        assert "params" in err and "--item" in err  # said on stderr too
    # An export that was changed is still compared leaf by leaf: the one changed leaf, by name.
    changed = {p.replace("/", "."): x for p, x in truth.items() if x.dtype.kind != "V"}
    changed["embed"] = changed["embed"] + np.float32(0.5)
    save_file(changed, str(tmp_path / "changed.safetensors"))
    out = diff_json(capsys, run_dir, tmp_path / "changed.safetensors", "--values", rc=1)
    assert [r["path"] for r in out["removed"]] == ["half"] and out["added"] == []
    assert [v["path"] for v in out["values"] if not v["bit_identical"]] == ["embed"]


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

    import zlib

    rng = np.random.default_rng(zlib.crc32(case.encode()))  # the same data whatever PYTHONHASHSEED is
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
    elif case == "atol0_near_line":  # the default tolerance (atol 0): relative only, decided in float32
        atol = 0.0
        t = rtol * np.abs(b.astype(np.float64))
        a = (b + t * (1 + rng.uniform(-4e-7, 4e-7, n)) * rng.choice([-1, 1], n)).astype(np.float32)
    elif case == "atol0_subnormal_tolerance":  # rtol * |b| among float32 subnormals: too few bits for the margin
        atol = 0.0
        b = (b * 10.0 ** rng.uniform(-44, 2, n)).astype(np.float32)
        a = b.copy()
        for _ in range(3):
            moved = rng.random(n) < 0.5
            a[moved] = np.nextafter(a[moved], np.float32(np.inf))
        b[::97] = 0
    elif case == "atol0_tiny_adam_nu":  # Adam's nu, ~1e-9, moved by 0 to 2e-5 relative
        atol = 0.0
        b = (np.abs(b) * np.float32(1e-9)).astype(np.float32)
        a = (b * (1 + rng.uniform(0, 2e-5, n))).astype(np.float32)
    else:
        raise AssertionError(case)
    return a, b, atol, rtol


@pytest.mark.parametrize("case", ["near_line", "bf16", "f16_vs_f32", "f32_vs_f64", "nonfinite", "huge", "tiny",
                                  "zero_tolerance", "identical_with_nan", "sparse", "atol0_near_line",
                                  "atol0_subnormal_tolerance", "atol0_tiny_adam_nu"])
def test_fast_float_comparison_is_numpys_float64_rule(case):
    from treetools.checkpoint_io.readers import InMemoryReader
    from treetools.checkpoint_io.leaves import array_row, Leaf
    from treetools.checkpoint_tools.diff import value_diffs

    a, b, atol, rtol = _fast_path_case(case)
    leaf = lambda x: Leaf(array_row(("w",), x.shape, x.dtype), InMemoryReader(x))  # noqa: E731
    (got,) = value_diffs([(leaf(a), leaf(b), "w")], atol=atol, rtol=rtol, block_bytes=300_000, workers=2)
    x, y = a.astype(np.float64), b.astype(np.float64)
    close = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    both = np.isfinite(x) & np.isfinite(y)
    assert got.mismatched == int((~close).sum()) and got.allclose == bool(close.all()), case
    want_max = math.inf if (np.isfinite(x) != np.isfinite(y)).any() else float(np.max(np.abs(x[both] - y[both])))
    np.testing.assert_allclose(got.max_abs_diff, want_max, rtol=1e-6, err_msg=case)
    diff_sq, ref_sq = float(np.sum((x[both] - y[both]) ** 2)), float(np.sum(x[np.isfinite(x)] ** 2))
    want_rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else 0.0
    if math.isinf(want_max):  # issue 39, point 6: a value that became non-finite is the most changed; the
        want_rel = math.inf   # finite elements' sums are still exact
        np.testing.assert_allclose(got.diff_sq / got.ref_sq, diff_sq / ref_sq, rtol=1e-6, err_msg=case)
    # rel_l2 is a summary (the counts above are exact): the fast path sums each piece's squares in float32, so over
    # 200,003 elements it lands within a few 1e-6 of the float64 sum (seen: 1.01e-6 with an unlucky seed).
    np.testing.assert_allclose(got.rel_l2, want_rel, rtol=4e-6, atol=1e-300, err_msg=case)
    assert (got.nonfinite_a, got.nonfinite_b) == (int((~np.isfinite(x)).sum()), int((~np.isfinite(y)).sum()))
    assert got.bit_identical == (a.dtype == b.dtype and a.tobytes() == b.tobytes())


# ---------------------------------------------------------------------------- issue 24, round 2


def _numpy_values(a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 1e-5) -> dict:
    """What ``diff --values`` must report for one leaf, in numpy float64."""
    x, y = a.astype(np.float64), b.astype(np.float64)
    outside = int((~np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)).sum())
    return {"max_abs_diff": float(np.max(np.abs(x - y))), "rel_l2": float(np.linalg.norm(x - y) / np.linalg.norm(x)),
            "mismatched": outside, "size": x.size, "bit_identical": a.tobytes() == b.tobytes()}


def _changed_pair(tmp_path) -> tuple[Path, Path, dict, dict]:
    """Leaves that each come first under one --sort key: `many` (every element moved a little), `spike` (one
    element moved a lot), `small` (tiny values, some changed by half), `same` (untouched)."""
    rng = np.random.default_rng(1)
    a = {"many": rng.standard_normal(1000).astype(np.float32), "spike": rng.standard_normal(40).astype(np.float32),
         "small": (rng.standard_normal(100) * 1e-3).astype(np.float32), "same": np.ones(7, np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    b["many"] = (a["many"] * np.float32(1 + 1e-3)).astype(np.float32)
    b["spike"][3] += np.float32(5.0)
    b["small"][:10] *= np.float32(1.5)
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    return tmp_path / "a.npz", tmp_path / "b.npz", a, b


def test_values_sort_most_changed_first_and_outside_share(tmp_path, capsys):
    # Issue 24, point 9: `--sort rel_l2` was refused; the outside count had no size or share.
    fa, fb, a, b = _changed_pair(tmp_path)
    want = {p: _numpy_values(a[p], b[p]) for p in a}
    keys = {"max_abs_diff": lambda p: -want[p]["max_abs_diff"], "rel_l2": lambda p: -want[p]["rel_l2"],
            "outside": lambda p: -want[p]["mismatched"]}
    orders = set()
    for by, key in keys.items():
        expected = sorted(a, key=lambda p: (key(p), p))
        orders.add(tuple(expected[:3]))
        out = diff_json(capsys, fa, fb, "--values", "--sort", by, rc=1)
        assert [v["path"] for v in out["values"]] == expected, by
        for v in out["values"]:
            w = want[v["path"]]
            assert (v["mismatched"], v["size"]) == (w["mismatched"], w["size"])
            assert v["outside_fraction"] == pytest.approx(w["mismatched"] / w["size"], rel=1e-12)
            np.testing.assert_allclose(v["rel_l2"], w["rel_l2"], rtol=1e-6, atol=1e-12)
        rc, text, _ = run(capsys, "diff", fa, fb, "--values", "--sort", by)
        rows = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in a]
        assert rc == 1 and rows == [p for p in expected if not want[p]["bit_identical"]], (by, text)
    assert len(orders) == 3  # each key puts another leaf first: the sort is really by that key
    # The table's "outside tol" cell: the count with its share of the leaf's elements.
    for p in ("many", "spike", "small"):
        w = want[p]
        m = re.search(rf"^{p}\s.*?\s({w['mismatched']:,}) \(([\d.]+)%\)", text, re.M)
        assert m, (p, text)
        assert float(m.group(2)) == pytest.approx(100 * w["mismatched"] / w["size"], abs=0.05)
    # A value sort without --values is a usage error naming the fix.
    rc, out, err = run(capsys, "diff", fa, fb, "--sort", "rel_l2")
    assert rc == 2 and out == "" and err.startswith("treetools diff: error: --sort rel_l2") and "add --values" in err
    assert len(err.strip().splitlines()) == 1


def test_values_table_fits_100_columns(tmp_path, capsys, monkeypatch):
    # Issue 24, point 17: `diff --values` printed up to 159 columns.
    rng = np.random.default_rng(2)
    stem = "model.encoder.layers.17.self_attention.query_key_value_projection.kernel_of_a_very_long_name"
    a = {f"{stem}.{i}": rng.standard_normal((30, 40)).astype(np.float32) for i in range(3)}
    b = {k: v.copy() for k, v in a.items()}
    b[f"{stem}.0"][0, :4] = np.nan  # a non-finite change: the widest row
    b[f"{stem}.1"] *= np.float32(1.01)
    b[f"{stem}.new"] = np.zeros(3, np.float32)
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    monkeypatch.chdir(tmp_path)  # the A:/B: lines echo the paths as typed: short ones, whatever the temp folder
    rc, text, _ = run(capsys, "diff", "a.npz", "b.npz", "--values")
    lines = text.splitlines()
    assert rc == 1 and lines[-2].startswith("different (leaves): ")
    assert max(len(line) for line in lines) <= 100, "\n".join(line for line in lines if len(line) > 100)
    header = next(line for line in lines if line.startswith("path") and "rel_l2" in line)
    assert "nonfinite A->B" in header
    # Each listed row starts with a cut of its real path, and its numbers are numpy's.
    rows = [line for line in lines if "(" in line and "%" in line and not line.startswith("values")]
    assert len(rows) == 2
    for line, p in zip(rows, (f"{stem}.0", f"{stem}.1")):
        w = _numpy_values(a[p], b[p])
        cells = re.split(r"\s{2,}", line)
        # Cut: what is left are pieces of the path, in order, its last part kept: the two paths, which differ only
        # in their last character, stay apart (issue 39, point 12: the parts both rows share go first).
        pieces = cells[0].split("…")
        assert len(pieces) > 1 and len(cells[0]) < len(p) and p.endswith(pieces[-1]) and pieces[-1].endswith(p[-2:])
        at = 0
        for piece in pieces:
            at = p.index(piece, at) + len(piece)
        if p.endswith(".1"):
            assert float(cells[1]) == pytest.approx(w["max_abs_diff"], rel=1e-3)
            assert float(cells[2]) == pytest.approx(w["rel_l2"], rel=1e-3)
    if "allclose" not in header:  # left out to fit: said so
        assert any("allclose left out to fit 100 columns" in line for line in lines)
    # JSON keeps the paths whole.
    out = diff_json(capsys, tmp_path / "a.npz", tmp_path / "b.npz", "--values", rc=1)
    assert {v["path"] for v in out["values"]} == set(a)


def test_depth_counts_leaves_in_titles_and_verdict_alike(tmp_path, capsys):
    # Issue 24, point 21: `--depth` counted groups in the section titles and leaves in the verdict, and a group
    # holding one changed leaf counted all its leaves as outside the tolerance.
    rng = np.random.default_rng(3)
    a = {f"model.layers.{i}.w": rng.standard_normal((8, 8)).astype(np.float32) for i in range(3)}
    a["model.embed"] = rng.standard_normal((5, 8)).astype(np.float32)
    b = {k: v.copy() for k, v in a.items()}
    b["model.layers.1.w"] += np.float32(0.5)
    b["model.extra.x"], b["model.extra.y"] = np.zeros(2, np.float32), np.zeros(3, np.float32)
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    fa, fb = tmp_path / "a.npz", tmp_path / "b.npz"
    flat_out = diff_json(capsys, fa, fb, "--values", rc=1)
    grouped = diff_json(capsys, fa, fb, "--values", "--depth", "2", rc=1)
    same = sum(a[p].tobytes() == b[p].tobytes() for p in a)  # 3: layers 0 and 2, embed
    assert grouped["counts"] == flat_out["counts"]
    assert (grouped["counts"]["bit_identical"], grouped["counts"]["outside_tolerance"]) == (same, len(a) - same)
    # Groups are named by the stored names' parts (split on "."), as the added group is.
    groups = {v["path"]: v for v in grouped["values"]}
    assert set(groups) == {"model.layers", "model.embed"} and groups["model.layers"]["num_leaves"] == 3
    assert (groups["model.layers"]["bit_identical_leaves"], groups["model.layers"]["outside_leaves"]) == (2, 1)
    assert [(r["path"], r["num_leaves"]) for r in grouped["added"]] == [("model.extra", 2)]
    rc, text, _ = run(capsys, "diff", fa, fb, "--values", "--depth", "2")
    lines = text.splitlines()
    assert "added (only in B): 2 leaves (in 1 group, --depth 2)" in lines
    assert (f"values (atol=0, rtol=1e-05): {len(a)} leaves compared, 1 leaf (in 1 group, --depth 2) "
            "not bit-identical") in lines
    verdict = lines[-2:]
    assert verdict[1] == f"  values: {same} bit-identical, 0 within tolerance, {len(a) - same} outside tolerance"
    assert verdict[0].startswith("different (leaves): 2 added, 0 removed, 0 with changed metadata, 4 with the same")


def test_tiny_adam_nu_that_changed_60_percent_is_outside_the_default_tolerance(tmp_path, capsys):
    # Issue 24, point 29: between two steps of a run, Adam's `nu` (~1e-9) changed by 60% and read as "within
    # tolerance": the old default atol=1e-8 swallowed every small tensor.
    import optax

    rng = np.random.default_rng(4)
    params = {"dense": {"kernel": rng.standard_normal((16, 8)).astype(np.float32)}}
    state = optax.adam(1e-3).init(params)
    nu1 = (rng.uniform(0.5, 1.5, (16, 8)) * 1e-9).astype(np.float32)
    nu2 = (nu1 * np.float32(1.6)).astype(np.float32)
    mu = (rng.standard_normal((16, 8)) * 1e-4).astype(np.float32)
    trees = {}
    with ocp.CheckpointManager(str(tmp_path / "run")) as mngr:
        for step, nu in ((1, nu1), (2, nu2)):
            opt = (state[0]._replace(count=np.int32(step), mu={"dense": {"kernel": mu}}, nu={"dense": {"kernel": nu}}),
                   state[1])
            trees[step] = opt
            mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                    opt_state=ocp.args.StandardSave(opt)))
        mngr.wait_until_finished()
    out = diff_json(capsys, tmp_path / "run", "--step", "1", "--step", "2", "--values", "--item", "opt_state", rc=1)
    got = {v["path"]: v for v in out["values"]}
    (nu_path,) = [p for p in got if "nu" in p.split("/")]
    v, w = got[nu_path], _numpy_values(nu1, nu2)
    assert v["allclose"] is False and not v["bit_identical"]
    assert (v["mismatched"], v["size"]) == (w["mismatched"], w["size"]) == (nu1.size, nu1.size)
    np.testing.assert_allclose(v["rel_l2"], w["rel_l2"], rtol=1e-6)
    assert w["rel_l2"] == pytest.approx(0.6, rel=1e-3)
    np.testing.assert_allclose(v["max_abs_diff"], w["max_abs_diff"], rtol=1e-6)
    (mu_path,) = [p for p in got if "mu" in p.split("/")]
    assert got[mu_path]["bit_identical"] is True
    assert out["atol"] == 0.0 and out["rtol"] == 1e-5
    # The defaults are said where users look.
    rc, help_text, _ = run(capsys, "diff", "--help")
    assert rc == 0 and re.search(r"--atol ATOL\s+absolute tolerance .*\(default\s+0", help_text, re.S)
    assert "Defaults atol 0, rtol 1e-5" in help_text


def test_default_tolerance_takes_the_float32_fast_path():
    # atol 0 (the default) must not send every float32 leaf down the float64 reference code.
    from treetools.checkpoint_tools.diff import _Rule
    from treetools.checkpoint_tools.options import DiffOptions

    f32 = np.dtype(np.float32)
    rule = _Rule.of(f32, f32, DiffOptions().atol, DiffOptions().rtol)
    assert DiffOptions().atol == 0.0 and rule.work == f32


# ----------------------------------------------------------------------------- issue 39 (points 5, 6, 11, 12, 22)


def test_a_leaf_that_became_non_finite_is_the_most_changed_by_rel_l2(tmp_path, capsys):
    # Issue 39, point 6: a leaf that became all NaN had rel_l2 0 (its finite part did not move) and sorted last
    # under --sort rel_l2. A finite value that became NaN/Inf (or back) makes rel_l2 infinite, as max_abs_diff.
    rng = np.random.default_rng(7)
    a = {"nan": rng.standard_normal(16).astype(np.float32), "inf": rng.standard_normal(16).astype(np.float32),
         "big": rng.standard_normal(16).astype(np.float32), "small": rng.standard_normal(16).astype(np.float32),
         "back": np.full(4, np.nan, np.float32)}
    b = {"nan": np.full(16, np.nan, np.float32), "inf": a["inf"].copy(), "big": a["big"] * np.float32(3),
         "small": a["small"] * np.float32(1.001), "back": np.ones(4, np.float32)}
    b["inf"][5] = np.inf
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    finite = {p: _numpy_values(a[p], b[p])["rel_l2"] for p in ("big", "small")}  # numpy float64, by hand
    assert finite["big"] > finite["small"] > 0
    out = diff_json(capsys, tmp_path / "a.npz", tmp_path / "b.npz", "--values", "--sort", "rel_l2", rc=1)
    order = [v["path"] for v in out["values"]]
    assert order == ["back", "inf", "nan", "big", "small"], order  # the non-finite changes first (ties by path)
    got = {v["path"]: v for v in out["values"]}
    assert all(got[p]["rel_l2"] is None for p in ("back", "inf", "nan"))  # infinite: null in JSON
    for p, want in finite.items():
        np.testing.assert_allclose(got[p]["rel_l2"], want, rtol=1e-6)
    r = diff_paths(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), values=True, sort="rel_l2")
    assert [v.rel_l2 for v in r.values][:3] == [math.inf] * 3
    # A group holding such a leaf is infinite too (--depth sums squares; the infinity is not summed away).
    np.savez(tmp_path / "c.npz", **{f"g/{k}": v for k, v in a.items() if k in ("nan", "big")})
    np.savez(tmp_path / "d.npz", **{f"g/{k}": v for k, v in b.items() if k in ("nan", "big")})
    grouped = diff_paths(str(tmp_path / "c.npz"), str(tmp_path / "d.npz"), values=True, depth=1)
    assert [(v.path, v.rel_l2) for v in grouped.values] == [("g", math.inf)]
    # The table shows it first, as inf.
    rc, text, _ = run(capsys, "diff", tmp_path / "a.npz", tmp_path / "b.npz", "--values", "--sort", "rel_l2")
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0] in a]
    assert [r[0] for r in rows] == order and all(r[2] == "inf" for r in rows[:3])


def test_a_diff_without_values_says_the_values_were_not_compared(run_dir, capsys):
    # Issue 39, point 5: without --values, two steps whose values all differ read "same (leaves): ... with the same
    # metadata", exit 0, as if "same" had been said of the values.
    a, b = flat(host_tree(1)), flat(host_tree(2))
    moved = [p for p in a if a[p].tobytes() != b[p].tobytes()]
    assert len(moved) == len(a) - 2  # every leaf but layers/1/w and scale (the same constants in both steps)
    argv = [run_dir, "--step", "100", "--step", "200", "--item", "params"]
    rc, text, _ = run(capsys, "diff", *argv)
    verdict = text.splitlines()[-2:]
    assert rc == 0, text  # the same leaves and metadata: exit 0, which now says what it means
    assert verdict[0].startswith("same metadata (leaves): 0 added, 0 removed, 0 with changed metadata, "
                                 f"{len(a)} with the same metadata"), verdict
    assert verdict[1].strip().startswith("values: not compared") and "--values" in verdict[1], verdict
    assert max(map(len, text.splitlines())) <= 100
    out = diff_json(capsys, *argv, rc=0)
    assert out["values_compared"] is False and "values" not in out and out["identical"] is True
    # With --values the same two steps differ, and the JSON says the values were compared.
    out = diff_json(capsys, *argv, "--values", rc=1)
    assert out["values_compared"] is True and out["counts"]["outside_tolerance"] == len(moved)
    rc, text, _ = run(capsys, "diff", *argv, "--values")
    verdict = text.splitlines()[-2:]
    assert rc == 1 and verdict[0].startswith("different (leaves): ") and "not compared" not in text
    assert verdict[1].strip() == f"values: 2 bit-identical, 0 within tolerance, {len(moved)} outside tolerance"
    # A metadata difference without --values: different, and still no word about values being the same.
    rc, text, _ = run(capsys, "diff", run_dir, "--step", "100", "--step", "200")
    assert rc == 1 and text.splitlines()[-2].startswith("different (leaves): ")
    assert text.splitlines()[-1].strip().startswith("values: not compared")


def test_the_values_verdict_fits_100_columns(tmp_path, capsys, monkeypatch):
    # Issue 39, point 22: the verdict of `diff --values` was one line of 161 columns (default views keep to 100).
    n = 1200  # four-digit counts in every field
    a = {f"l{i:04d}": np.full(2, i, np.float32) for i in range(n)}
    b = {k: (v + np.float32(1) if i % 3 == 0 else v * np.float32(1 + 2**-20) if i % 3 == 1 else v)
         for i, (k, v) in enumerate(a.items())}
    a.update({f"gone{i:04d}": np.ones(1, np.float32) for i in range(1000)})
    b.update({f"new{i:04d}": np.ones(1, np.float32) for i in range(1000)})
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    monkeypatch.chdir(tmp_path)  # the A:/B: lines echo the paths as typed: short ones, whatever the temp folder
    rc, text, _ = run(capsys, "diff", "a.npz", "b.npz", "--values")
    lines = text.splitlines()
    assert rc == 1 and max(map(len, lines)) <= 100, [line for line in lines if len(line) > 100]
    tail = lines[lines.index(next(x for x in lines if x.startswith("different (leaves): "))):]
    words = " ".join(tail)
    for count, what in ((1000, "added"), (1000, "removed"), (0, "with changed metadata"),
                        (n, "with the same metadata"), (400, "bit-identical"), (400, "within tolerance"),
                        (400, "outside tolerance")):
        assert f" {count} {what}" in f" {words}", (count, what, tail)  # every count, named, in the verdict


def test_cut_paths_keep_the_parts_that_tell_rows_apart(tmp_path, capsys, monkeypatch):
    # Issue 39, point 12: paths cut in the middle hid `mu` vs `nu` (`opt_state/1/inner_s…[+32 chars]…ers_0/ln_attn/
    # bias`). The parts the rows share go first (their common prefix first); what tells them apart stays.
    stem = "opt_state/1/inner_state/0/{m}/params/decoder/layers_{i}/self_attention_norm/{leaf}"
    paths = [stem.format(m=m, i=i, leaf=leaf) for m in ("mu", "nu") for i in range(3) for leaf in ("bias", "scale")]
    a = {p: np.ones(4, np.float32) for p in paths}
    b = {p: a[p] + np.float32((k + 1) / 64) for k, p in enumerate(paths)}  # row k moved by (k + 1) / 64, exactly
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    monkeypatch.chdir(tmp_path)  # the A:/B: lines echo the paths as typed: short ones, whatever the temp folder
    rc, text, _ = run(capsys, "diff", "a.npz", "b.npz", "--values")
    lines = text.splitlines()
    assert rc == 1 and max(map(len, lines)) <= 100
    rows = [re.split(r"\s{2,}", line) for line in lines if "(100%)" in line]
    assert len(rows) == len(paths)
    cells = set()
    for cell, max_abs, *_ in rows:
        path = paths[round(float(max_abs) * 64) - 1]  # the row's own path, told by its number
        parts = path.split("/")
        assert len(cell) < len(path) and "…" in cell, cell  # cut...
        shown = re.split(r"[/.]", cell)
        assert parts[4] in shown and parts[7] in shown and parts[-1] in shown, (cell, path)  # ...keeping mu/nu
        cells.add(cell)
    assert len(cells) == len(paths)  # no two rows alike
    # The same cut in the library, with paths of other depths beside them, and a single long path.
    from treetools.shared.render import cut_paths

    cut = cut_paths(paths + ["params/w"], 40)
    assert cut[-1] == "params/w" and all(len(c) <= 40 for c in cut) and len(set(cut)) == len(cut)
    assert all(p.split("/")[4] in re.split(r"[/.…]", c) for p, c in zip(paths, cut)), cut
    (one,) = cut_paths([paths[0]], 30)
    assert len(one) <= 30 and one.endswith("bias")


def test_every_whole_row_pastes_into_show_and_a_shortened_one_says_where_it_is_whole(tmp_path, capsys, monkeypatch):
    # Issue 47, point 22: rows elided in the middle (`…/train/inner_state/...`) could not be pasted into `--show`,
    # though the README says any row pastes. At 100 columns (a pipe), a row either is its whole path, which
    # `inspect --show` takes, or is shortened with `…` and one note under the table says how to see it whole.
    long_stem = "train/opt_state/1/inner_state/0/{m}/params/decoder/layers_0/self_attention_norm/scale"
    longs = [long_stem.format(m=m) for m in ("mu", "nu")]  # 84 characters: shortened at 100 columns
    mid = "params/decoder/layers_0/self_attention/query_projection/kernel"  # 62: whole once allclose goes
    a = {p: np.full(4, 1.0, np.float32) for p in [*longs, mid]}
    b = {p: a[p] + np.float32(k + 1) for k, p in enumerate(a)}  # row k moved by k + 1
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    monkeypatch.chdir(tmp_path)
    for paths, cut in (([mid], False), ([*longs, mid], True)):
        keep = {p: a[p] for p in paths}
        np.savez("a1.npz", **keep)
        np.savez("b1.npz", **{p: b[p] for p in paths})
        rc, text, _ = run(capsys, "diff", "a1.npz", "b1.npz", "--values")
        lines = text.splitlines()
        assert rc == 1 and max(map(len, lines)) <= 100, text
        rows = [re.split(r"\s{2,}", line) for line in lines if "(100%)" in line]
        assert len(rows) == len(paths), text
        notes = [line for line in lines if line.startswith("(… shortens paths")]
        for cell, max_abs, *_ in rows:
            path = list(a)[round(float(max_abs)) - 1]  # the row's own path, told by its number
            if "…" in cell:
                assert notes, text  # shortened: the note says where the whole paths are
                continue
            assert cell == path, (cell, path)
            rc, out, err = run(capsys, "inspect", "a1.npz", "--show", cell, "--format", "json")
            assert rc == 0, err
            assert json.loads(out)["value"] == a[path].tolist()
        assert len(notes) == cut, text  # said once, only where a path is shortened
        if cut:
            assert "--format json" in notes[0] and "100 columns" in notes[0]
            assert any("…" in cell for cell, *_ in rows)
            whole = {v["path"] for v in diff_json(capsys, "a1.npz", "b1.npz", "--values", rc=1)["values"]}
            assert whole == set(paths)  # where the note points: every path whole, each pasting into --show
            for path in whole:
                assert run(capsys, "inspect", "a1.npz", "--show", path, "--format", "json")[0] == 0
        else:
            assert "allclose left out to fit 100 columns" in text  # left out so that the path shows whole
