"""Every command of treetools on one checkpoint, checked against the writer's own arrays (issue 29's formats).

The checks go through the public surface only: ``treetools.cli.main`` in-process (``inspect``, ``--stats``,
``--show``, ``diff``, ``verify``, ``convert``) and ``import treetools as tt`` (``load_parameters``,
``restore_checkpoint``). ``truth`` is always ``{leaf path: numpy array in the dtype written}`` (bfloat16 as
``ml_dtypes.bfloat16``), taken from the writer, never from treetools.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any, Iterable

import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main
from treetools.pytree.paths import unflatten_dict


def run_fresh(*argv: Any, blocked: Iterable[str] = (), forbid: Iterable[str] = ()) -> subprocess.CompletedProcess:
    """``treetools ARGV`` in a fresh Python: the modules in ``blocked`` cannot be imported, and the run fails
    (exit 99) if a module in ``forbid`` (``jax``) was imported by the end."""
    code = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
            "from treetools.cli import main; rc = main(sys.argv[3:]); "
            "sys.exit(99 if [m for m in sys.argv[2].split(',') if m in sys.modules] else rc)")
    return subprocess.run([sys.executable, "-c", code, ",".join(blocked), ",".join(forbid), *map(str, argv)],
                          capture_output=True, text=True)


def run(*argv: Any) -> tuple[int, str, str]:
    """``treetools ARGV`` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def flat_arrays(tree: Any) -> dict[str, np.ndarray]:
    """The writer's own arrays by path, as numpy: what the checks below compare a reader against."""
    return {path: np.asarray(x) for path, x in tt.flatten(tree).items()}


def inspect_json(path: Any, *args: Any) -> dict:
    rc, out, err = run("inspect", path, *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def leaves_of(report: dict, item: str | None = None, index: int = 0) -> dict[str, dict]:
    """The leaf rows of one item (the only one when ``item`` is None) of the ``index``-th checkpoint shown."""
    items = report["checkpoints"][index]["items"]
    if item is None:
        assert len(items) == 1, f"expected one item, got {list(items)}"
        item = next(iter(items))
    return {leaf["path"]: leaf for leaf in items[item]["leaves"]}



def _is_bf16(x: Any) -> bool:
    return np.asarray(x).dtype == np.dtype(ml_dtypes.bfloat16)


def item_args(item: str | None) -> list[str]:
    return ["--item", item] if item else []


def check_inspect(path: Any, truth: dict[str, np.ndarray], *, item: str | None = None, args: Iterable = ()) -> dict:
    """``inspect --format json``: exactly the truth's leaves, each with its shape and dtype. Returns the report."""
    report = inspect_json(path, *item_args(item), *args)
    leaves = leaves_of(report, item)
    assert sorted(leaves) == sorted(truth)
    for name, want in truth.items():
        assert leaves[name]["shape"] == list(np.shape(want)), name
        assert leaves[name]["dtype"] == str(np.asarray(want).dtype), name
    return report


def check_stats(path: Any, truth: dict[str, np.ndarray], *, item: str | None = None, args: Iterable = ()) -> None:
    leaves = leaves_of(inspect_json(path, "--stats", *item_args(item), *args), item)
    for name, want in truth.items():
        w = np.asarray(want).astype(np.float64)
        stats = leaves[name]["stats"]
        assert stats["max"] == pytest.approx(float(w.max())), name
        assert stats["min"] == pytest.approx(float(w.min())), name
        assert stats["mean"] == pytest.approx(float(w.mean()), rel=1e-6, abs=1e-6), name


def check_show(path: Any, truth: dict[str, np.ndarray], *, item: str | None = None, args: Iterable = ()) -> None:
    """``--show LEAF`` gives every value; ``--show LEAF[0]`` the first row of a leaf with rows."""
    for name, want in truth.items():
        rc, out, err = run("inspect", path, "--show", name, *item_args(item), *args, "--format", "json")
        assert rc == 0, err
        got = np.asarray(json.loads(out)["value"], dtype=np.float64)
        np.testing.assert_array_equal(got, np.asarray(want).astype(np.float64), err_msg=name)
        if np.ndim(want) >= 1 and np.shape(want)[0] > 1:
            rc, out, err = run("inspect", path, "--show", f"{name}[0]", *item_args(item), *args, "--format", "json")
            assert rc == 0, err
            np.testing.assert_array_equal(np.asarray(json.loads(out)["value"], dtype=np.float64),
                                          np.asarray(want[0]).astype(np.float64), err_msg=name)


def check_verify(path: Any, *args: Any) -> str:
    rc, out, err = run("verify", path, *args)
    assert rc == 0, out + err
    assert "ok" in out
    return out


def check_load_parameters(path: Any, truth: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
    """``tt.load_parameters(path, **kwargs)``: host numpy, exactly the truth's leaves, dtypes and values."""
    got = tt.flatten(tt.load_parameters(path, **kwargs))
    assert sorted(got) == sorted(truth)
    for name, want in truth.items():
        assert isinstance(got[name], np.ndarray), name
        assert got[name].dtype == np.asarray(want).dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want), err_msg=name)
    return got


def check_restore(path: Any, truth: dict[str, np.ndarray], *, item: str, step: Any = None,
                  rules: Any = None, expect: dict[str, np.ndarray] | None = None) -> None:
    """``tt.restore_checkpoint(path, step, {item: target})`` onto jax arrays (a ``make_abstract`` target)."""
    import jax

    want = expect if expect is not None else truth
    target = tt.make_abstract(unflatten_dict({k: np.asarray(v) for k, v in want.items()}))
    kwargs = {"rules": rules} if rules is not None else {}
    restored = tt.restore_checkpoint(os.fspath(path), step, {item: target}, **kwargs)[item]
    got = tt.flatten(restored)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert isinstance(got[name], jax.Array), name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


def check_convert(path: Any, truth: dict[str, np.ndarray], out_dir: Any, *, item: str | None = None,
                  args: Iterable = ()) -> None:
    """``convert PATH out.safetensors --verify``: the file holds the truth's leaves under HF's dotted names."""
    from safetensors import safe_open

    dst = os.path.join(os.fspath(out_dir), "converted.safetensors")
    rc, out, err = run("convert", path, dst, *item_args(item), *args, "--verify")
    assert rc == 0, out + err
    with safe_open(dst, "np") as f:
        names = set(f.keys())
        assert names == {name.replace("/", ".") for name in truth}
        for name, want in truth.items():
            if _is_bf16(want):
                continue  # safetensors' numpy API has no bfloat16; --verify compared it bit for bit
            np.testing.assert_array_equal(f.get_tensor(name.replace("/", ".")), want, err_msg=name)


def check_diff_names_the_changed_leaf(a: Any, b: Any, changed: str, delta: float, *,
                                      item: str | None = None, args: Iterable = ()) -> None:
    """``diff A A`` is identical (exit 0); ``diff A B --values`` (B: the writer changed one leaf by ``delta``)
    exits 1 and reports exactly that leaf, with its max abs difference."""
    rc, out, err = run("diff", a, a, "--values", *item_args(item), *args)
    assert rc == 0, out + err
    rc, out, err = run("diff", a, b, "--values", *item_args(item), *args, "--format", "json")
    assert rc == 1, out + err
    report = json.loads(out)
    assert not report["added"] and not report["removed"] and not report["changed"], report
    differing = [row for row in report["values"] if not row["bit_identical"]]
    assert [row["path"] for row in differing] == [changed], differing
    assert differing[0]["max_abs_diff"] == pytest.approx(delta)
    assert len(report["values"]) == report["unchanged"]  # every leaf compared by value


def check_single_file(path: Any, truth: dict[str, np.ndarray], out_dir: Any, fmt: str, *,
                      params: dict[str, np.ndarray] | None = None) -> None:
    """A one-checkpoint file of format ``fmt`` (no steps, one item ``default``) through every command but
    ``convert`` (``check_convert``); ``params``: what ``load_parameters`` returns where not the whole truth."""
    report = check_inspect(path, truth)
    assert report["format"] == fmt and report["steps"] is None
    assert list(report["checkpoints"][0]["items"]) == ["default"]
    check_stats(path, truth)
    check_show(path, truth)
    check_verify(path)
    check_load_parameters(path, truth if params is None else params)
    check_restore(path, truth, item="default")


def check_refused(path: Any, *words: str, argv: Iterable = ("inspect",)) -> str:
    """The command exits 1 with one ``treetools: error:`` line naming the path and every word given."""
    rc, out, err = run(*argv, path)
    assert rc == 1, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treetools: error:"), err
    for word in (os.path.basename(os.fspath(path)), *words):
        assert word in lines[0], (word, lines[0])
    return lines[0]
