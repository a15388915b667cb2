"""`treetools diff`: metadata changes, value comparisons, across formats and between steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from treetools.inspect import diff_paths
from tests.test_inspect import flat, host_tree, meta_of, one_error_line, run, write_run


def diff_json(capsys, *argv) -> dict:
    rc, out, err = run(capsys, "diff", *argv, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


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
    out = diff_json(capsys, fa, fb)
    assert [r["path"] for r in out["added"]] == [p for p in b if p not in a]
    assert [r["path"] for r in out["removed"]] == [p for p in a if p not in b]
    changed = {c["path"]: c for c in out["changed"]}
    assert set(changed) == {p for p in a.keys() & b.keys() if a[p].dtype != b[p].dtype or a[p].shape != b[p].shape}
    assert changed["ids"]["fields"] == ["dtype"]
    assert (changed["ids"]["a"]["dtype"], changed["ids"]["b"]["dtype"]) == ("int32", "int64")
    assert out["identical"] is False and "values" not in out


def test_values_match_numpy_in_small_blocks(tmp_path, capsys):
    fa, fb, a, b = _pair(tmp_path)
    out = diff_json(capsys, fa, fb, "--values", "--chunk-mb", "0.001")
    check_values(out, expected_values(a, b))
    assert out["values"] and {v["path"] for v in out["values"]} == {"w", "b", "ids"}


@pytest.mark.parametrize("atol", [1e-2, 1e-6])
def test_allclose_verdict_follows_tolerances(tmp_path, capsys, atol):
    fa, fb, a, b = _pair(tmp_path)
    out = diff_json(capsys, fa, fb, "--values", "--atol", str(atol), "--rtol", "0")
    check_values(out, expected_values(a, b, atol=atol, rtol=0.0))
    w = next(v for v in out["values"] if v["path"] == "w")
    assert w["allclose"] == (atol == 1e-2)  # the perturbation is ~1e-3


def test_nan_equals_nan_and_table_view(tmp_path, capsys):
    x = np.array([1.0, np.nan, 3.0], np.float32)
    np.savez(tmp_path / "a.npz", x=x)
    np.savez(tmp_path / "b.npz", x=x.copy())
    out = diff_json(capsys, tmp_path / "a.npz", tmp_path / "b.npz", "--values")
    assert out["identical"] is True and out["values"][0]["allclose"] is True
    rc, text, _ = run(capsys, "diff", tmp_path / "a.npz", tmp_path / "b.npz", "--values")
    assert rc == 0 and text.strip().splitlines()[-1].startswith("identical:")


def test_orbax_against_npz_of_the_same_tree(run_dir, tmp_path, capsys):
    arrays = flat(host_tree(1))  # step 100's params
    np.savez(tmp_path / "p.npz", **{p: x for p, x in arrays.items() if x.dtype.kind != "V"})
    out = diff_json(capsys, run_dir, tmp_path / "p.npz", "--step", "100", "--item", "params", "--values")
    assert [r["path"] for r in out["removed"]] == ["half"]  # bfloat16: left out of the npz
    assert out["added"] == [] and out["changed"] == []  # shardings are not compared against a format without them
    assert all(v["allclose"] and v["max_abs_diff"] == 0 for v in out["values"])
    assert len(out["values"]) == len(arrays) - 1


def test_two_steps_of_one_run(run_dir, capsys):
    by_flag = diff_json(capsys, run_dir, "--step", "100", "--step", "200", "--values")
    by_path = diff_json(capsys, run_dir / "ckpt_0100", run_dir / "ckpt_0200", "--values")
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
    same = diff_json(capsys, run_dir, run_dir, "--step", "100", "--values")
    assert same["identical"] is True


def test_sharding_change_between_orbax_saves(tmp_path, capsys, devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    for name, spec in (("a", P("fsdp", None)), ("b", P(None, "fsdp"))):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(str(tmp_path / name), {"w": jax.device_put(x, NamedSharding(mesh, spec)), "v": x[0]})
    out = diff_json(capsys, tmp_path / "a", tmp_path / "b", "--values")
    (change,) = out["changed"]
    assert change["path"] == "w" and change["fields"] == ["sharding"]
    assert change["a"]["sharding"] == {"mesh": {"fsdp": 8}, "spec": ["fsdp", None]}
    assert change["b"]["sharding"] == {"mesh": {"fsdp": 8}, "spec": [None, "fsdp"]}
    assert all(v["allclose"] and v["max_abs_diff"] == 0 for v in out["values"])


def test_library_diff_paths(tmp_path):
    fa, fb, a, b = _pair(tmp_path)
    r = diff_paths(str(fa), str(fb), values=True)
    assert not r.identical and [x.path for x in r.added] == ["new"] and [x.path for x in r.removed] == ["old"]


@pytest.mark.parametrize("argv", [["A"], ["A", "--step", "1"], ["A", "A", "--step", "1", "--step", "2", "--step", "3"],
                                  ["A", "A", "--step", "all"]])
def test_diff_usage_errors(run_dir, capsys, argv):
    rc, out, err = run(capsys, "diff", *[str(run_dir) if a == "A" else a for a in argv])
    assert rc == 2 and out == "" and "error" in err


def test_diff_errors_are_one_line(run_dir, tmp_path, capsys):
    rc, out, err = run(capsys, "diff", tmp_path / "missing", run_dir)
    assert rc == 1 and "no such file" in one_error_line(err)
    rc, out, err = run(capsys, "diff", run_dir, "--step", "100", "--step", "999")
    assert rc == 1 and "available steps" in one_error_line(err)
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "ckpt_0100" / "params", broken)
    (broken / "_METADATA").write_text("{")
    rc, out, err = run(capsys, "diff", broken, run_dir)
    assert rc == 1 and "_METADATA" in one_error_line(err)


def test_orbax_item_against_a_flax_msgpack_of_the_whole_state(run_dir, tmp_path, capsys):
    """`to_bytes({"params": ..., "step": ...})`, the legacy Flax layout: --item params pairs its params subtree."""
    from flax import serialization

    tree = host_tree(1)  # step 100's params
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes({"params": tree, "step": 100}))
    out = diff_json(capsys, run_dir, tmp_path / "state.msgpack", "--step", "100", "--item", "params", "--values")
    assert out["added"] == out["removed"] == out["changed"] == []
    assert out["identical"] is True and len(out["values"]) == len(flat(tree))
    assert out["b"]["item"] == "params"


def test_verdict_line_counts_value_differences(tmp_path, capsys):
    fa, fb, a, b = _pair(tmp_path)
    rc, text, _ = run(capsys, "diff", fa, fb, "--values", "--atol", "0", "--rtol", "0")
    want = expected_values(a, b, atol=0.0, rtol=0.0)
    differ = sum(not w["allclose"] for w in want.values())
    assert rc == 0 and differ > 0
    last = text.strip().splitlines()[-1]
    assert last.startswith("different:") and f"{differ} of {len(want)} compared leaves not allclose" in last, last


def test_markdown_is_a_list_and_tables_follow_blank_lines(run_dir, capsys):
    rc, out, _ = run(capsys, "diff", run_dir, "--step", "100", "--step", "200", "--values", "--format", "markdown")
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("- A: ") and lines[1].startswith("- B: ")
    headers = [i for i, line in enumerate(lines) if line.startswith("| path")]
    assert len(headers) == 2 and all(lines[i - 1] == "" for i in headers), out  # changed (meta/step) and values


def test_composite_against_a_single_tree_suggests_item(run_dir, tmp_path, capsys):
    np.savez(tmp_path / "p.npz", **{p: x for p, x in flat(host_tree(1)).items() if x.dtype.kind != "V"})
    rc, out, err = run(capsys, "diff", run_dir / "ckpt_0100", tmp_path / "p.npz")
    assert rc == 0 and "different:" in out
    assert err.startswith("treetools: note: ") and "--item" in err and len(err.strip().splitlines()) == 1
