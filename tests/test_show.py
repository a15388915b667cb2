"""`inspect --show LEAF[SLICE]`: the values of one leaf or a slice, equal to the writer's array."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from treetools.cli import main
from treetools.checkpoint_tools.show import parse_leaf_spec, show_leaf

FIXTURE = Path(__file__).parent / "fixtures" / "treetools_v0_1"
TRUTH = dict(np.load(Path(__file__).parent / "fixtures" / "treetools_v0_1_truth.npz"))


@pytest.mark.parametrize("index", ["", "[0]", "[1:3]", "[-1, ::2]", "[::3, 1:]", "[2, 3]"])
def test_slices_equal_numpy_on_the_writers_array(index):
    name, value = show_leaf(str(FIXTURE), f"params/Dense_0/kernel{index}")
    assert name == "params/Dense_0/kernel"
    want = TRUTH["Dense_0/kernel"] if not index else eval(f"TRUTH['Dense_0/kernel']{index}")  # noqa: S307
    np.testing.assert_array_equal(value, want)


def test_item_option_and_unique_paths(capsys):
    np.testing.assert_array_equal(show_leaf(str(FIXTURE), "embed[1]", item="params")[1], TRUTH["embed"][1])
    assert main(["inspect", str(FIXTURE), "--show", "params/embed[0, 0:2]", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"schema": 1, "step": 1, "path": "params/embed", "value": TRUTH["embed"][0, 0:2].tolist()}
    assert main(["inspect", str(FIXTURE), "--show", "data_iter/index"]) == 0
    assert "7" in capsys.readouterr().out


def test_unknown_leaf_and_bad_index_are_one_line(capsys):
    assert main(["inspect", str(FIXTURE), "--show", "params/embd"]) == 1
    assert "close paths: params/embed" in capsys.readouterr().err
    assert main(["inspect", str(FIXTURE), "--show", "params/embed[9]"]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an integer"):
        parse_leaf_spec("w[a]")


def test_big_leaf_output_is_bounded(tmp_path, capsys):
    np.savez(tmp_path / "big.npz", w=np.arange(10**6, dtype=np.float32))
    assert main(["inspect", str(tmp_path / "big.npz"), "--show", "w"]) == 0
    out = capsys.readouterr().out
    assert "..." in out and len(out) < 2000


@pytest.mark.parametrize("layout", ["safetensors", "npz", "npz-fortran"])
@pytest.mark.parametrize("index", ["[0:2, 0:4]", "[1:3, 5:]", "[:, 3]", "[2, 1:3, 0:2]", "[:, :, 1]"])
def test_raw_file_slices_across_rows_equal_numpy(tmp_path, layout, index):
    """Safetensors and uncompressed npz are read by byte ranges: a slice spanning rows is not one contiguous run
    (before the fix, `w[0:2, 0:4]` returned 8 consecutive elements)."""
    truth = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4, 6, 3)
    if layout == "safetensors":
        from safetensors.numpy import save_file

        path = tmp_path / "m.safetensors"
        save_file({"w": truth}, str(path))
    else:
        path = tmp_path / "m.npz"
        np.savez(path, w=np.asfortranarray(truth) if layout == "npz-fortran" else truth)
    if index.count(",") == 1:  # a 2-D view of the same bytes for the two-index cases
        truth = truth.reshape(4, 18)
        path = tmp_path / ("m2" + path.suffix)
        if layout == "safetensors":
            from safetensors.numpy import save_file

            save_file({"w": truth}, str(path))
        else:
            np.savez(path, w=np.asfortranarray(truth) if layout == "npz-fortran" else truth)
    _, value = show_leaf(str(path), f"w{index}")
    np.testing.assert_array_equal(value, eval(f"truth{index}"))  # noqa: S307


@pytest.mark.parametrize("slab", [8, 40, 200])
def test_raw_file_slices_read_in_small_slabs(tmp_path, monkeypatch, slab):
    """A non-contiguous block is read in slabs of at most SLAB_BYTES (several rows per read, or one row in
    pieces when a row is larger): every way of cutting it gives numpy's answer."""
    from treetools.checkpoint_io import readers as arrays

    monkeypatch.setattr(arrays, "SLAB_BYTES", slab)
    truth = np.arange(6 * 5 * 4, dtype=np.float32).reshape(6, 5, 4)
    np.savez(tmp_path / "m.npz", w=truth, f=np.asfortranarray(truth))
    for leaf in ("w", "f"):
        for index in ("[:, 1:3, 2]", "[1:5, :, 0:3]", "[2:6, 4, :]", "[:, 0:4, 1:2]"):
            _, value = show_leaf(str(tmp_path / "m.npz"), f"{leaf}{index}")
            np.testing.assert_array_equal(value, eval(f"truth{index}"))  # noqa: S307


# ----------------------------------------------------------------------------- issue 24, points 4 and 20


@pytest.fixture(scope="module")
def train_state_root(tmp_path_factory):
    """A whole flax TrainState saved with Orbax (``StandardSave(state)``, item ``default``) at steps 200 and 300,
    with different values at each step; returns ``(root, {step: flat truth})``."""
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from flax.training import train_state


    def part(k):
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))

    root = tmp_path_factory.mktemp("ts") / "ckpt"
    rng = np.random.default_rng(0)
    truth = {}
    with ocp.CheckpointManager(root) as mgr:
        for step in (200, 300):
            params = {"layers_0": {"qkv": {"bias": rng.standard_normal(6).astype(np.float32),
                                           "kernel": rng.standard_normal((3, 6)).astype(np.float32)}},
                      "head": {"kernel": rng.standard_normal((6, 2)).astype(np.float32)}}
            state = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, params),
                                                  tx=optax.adam(1e-3))
            state = state.replace(step=jnp.int32(step), opt_state=jax.tree.map(
                lambda x: x + jnp.asarray(rng.standard_normal(x.shape), x.dtype), state.opt_state))
            mgr.save(step, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
            tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
            truth[step] = {"/".join(map(part, kp)): np.asarray(v) for kp, v in jax.tree_util.tree_leaves_with_path(tree)}
    return root, truth


def _printed_paths(out: str) -> list[str]:
    """Every row path of a ``--leaves`` table (the first cell of each row under a ``---`` rule)."""
    paths, in_table = [], False
    for line in out.splitlines():
        if line.startswith("---"):
            in_table = True
        elif not line.strip() or line.startswith("Total") or line.startswith("["):
            in_table = False
        elif in_table:
            paths.append(line.split()[0])
    return paths


def test_every_printed_path_of_a_train_state_can_be_pasted_into_show(train_state_root, capsys):
    # Point 4: rows of the params and the opt_state sections of a whole TrainState (one Orbax item `default`),
    # pasted as printed, show the leaf the writer saved.
    root, truth = train_state_root
    assert main(["inspect", str(root), "--leaves"]) == 0
    paths = _printed_paths(capsys.readouterr().out)
    assert "params/layers_0/qkv/bias" in paths and any(p.startswith("opt_state/0/mu/") for p in paths)
    assert len(paths) == len(truth[300])  # hand count: step + 3 params + count + 3 mu + 3 nu = 11
    for path in paths:
        assert main(["inspect", str(root), "--show", path, "--format", "json"]) == 0, path
        got = json.loads(capsys.readouterr().out)
        np.testing.assert_array_equal(np.asarray(got["value"]), truth[300][path], err_msg=path)


@pytest.mark.parametrize("item,spec", [
    ("params", "params/layers_0/qkv/bias[:5]"),   # the path pasted whole beside --item
    ("params", "layers_0/qkv/bias[:5]"),          # the path below the item
    ("params/layers_0", "qkv/bias[:5]"),          # --item naming a group, as --item does for inspect
    (None, "params/layers_0/qkv/bias[:5]"),
    (None, "default/params/layers_0/qkv/bias[:5]"),  # as --show itself names it
])
def test_item_and_show_agree_on_paths(train_state_root, item, spec, capsys):
    root, truth = train_state_root
    args = ["--item", item] if item else []
    assert main(["inspect", str(root), *args, "--show", spec, "--format", "json"]) == 0, capsys.readouterr().err
    np.testing.assert_array_equal(json.loads(capsys.readouterr().out)["value"], truth[300]["params/layers_0/qkv/bias"][:5])


def test_a_group_and_a_typo_are_named_and_the_typed_string_is_no_close_path(train_state_root, capsys):
    root, _ = train_state_root
    assert main(["inspect", str(root), "--show", "params/layers_0/qkv"]) == 1
    err = capsys.readouterr().err
    assert "is a group of 2 leaves" in err and "qkv/bias" in err and len(err.strip().splitlines()) == 1
    assert main(["inspect", str(root), "--item", "params", "--show", "params/layers_0/qkv/bais"]) == 1
    err = capsys.readouterr().err
    close = err.split("close paths: ")[1]
    assert "layers_0/qkv/bias" in close and "params/layers_0/qkv/bais" not in close


def test_show_names_its_step_prints_plain_values_and_reads_every_step(train_state_root, capsys):
    # Point 20: `np.int32(200)` printed as 200; the header names the step; --step all shows each step.
    root, truth = train_state_root
    assert main(["inspect", str(root), "--show", "step"]) == 0
    out = capsys.readouterr().out
    assert "np." not in out and out.strip().endswith(": 300") and "(step 300)" in out
    assert main(["inspect", str(root), "--show", "params/head/kernel[0]", "--step", "all", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["schema"] == 1 and [e["step"] for e in got["steps"]] == [200, 300]
    for e in got["steps"]:
        np.testing.assert_array_equal(e["value"], truth[e["step"]]["params/head/kernel"][0])
    assert main(["inspect", str(root), "--show", "params/head/kernel", "--step", "all"]) == 0
    out = capsys.readouterr().out
    assert "(step 200)" in out and "(step 300)" in out


def test_show_with_stats_prints_the_statistics_of_what_it_shows(train_state_root, capsys):
    root, truth = train_state_root
    want = truth[300]["params/layers_0/qkv/kernel"][1:].astype(np.float64)
    assert main(["inspect", str(root), "--show", "params/layers_0/qkv/kernel[1:]", "--stats", "--format", "json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    np.testing.assert_allclose([stats["mean"], stats["std"], stats["max"], stats["l2"]],
                               [want.mean(), want.std(), want.max(), np.sqrt((want ** 2).sum())], rtol=1e-6)
    assert main(["inspect", str(root), "--show", "params/layers_0/qkv/kernel[1:]", "--stats-columns", "min,max"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("stats: min=") and f"max={want.max():.4g}" in line and "mean" not in line


def test_show_json_writes_nan_and_inf_as_null(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", w=np.array([1.0, np.nan, np.inf], np.float32))
    assert main(["inspect", str(tmp_path / "w.npz"), "--show", "w", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))["value"] == [1.0, None, None]


def test_show_report_is_the_library_of_show_and_the_cli_prints_it(tmp_path, capsys):
    # Issue 36: `inspect --show`'s statistics and JSON were computed in the CLI (cli/inspect.py `_show`); they are
    # the library's (show_report, ShowReport.to_json) and the CLI prints what it returns.
    from treetools.checkpoint_tools.show import show_report

    w = np.array([[1.0, np.nan, -3.0], [np.inf, 0.0, 2.0]], np.float32)
    np.savez(tmp_path / "w.npz", w=w)
    report = show_report(str(tmp_path / "w.npz"), "w[:, ::2]", stats=True)
    (shown,) = report.shown
    np.testing.assert_array_equal(shown.value, w[:, ::2])
    finite = w[:, ::2][np.isfinite(w[:, ::2])].astype(np.float64)  # [1, -3, 2] and one inf
    assert (shown.stats["nan"], shown.stats["posinf"], shown.stats["max"]) == (0, 1, finite.max())
    assert report.nonfinite == ["default/w"]
    assert main(["inspect", str(tmp_path / "w.npz"), "--show", "w[:, ::2]", "--stats", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report.to_json()))
    source = (Path(main.__code__.co_filename).parent / "inspect.py").read_text()
    assert "array_stats" not in source and "json_object" not in source and "np.array2string" not in source


def test_show_stats_line_counts_the_nonfinite_elements(tmp_path, capsys):
    # The default statistic columns end with `nonfinite` (nan + posinf + neginf); --show's line left it out.
    np.savez(tmp_path / "w.npz", w=np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32))
    assert main(["inspect", str(tmp_path / "w.npz"), "--show", "w", "--stats"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "stats: mean=1.5  std=0.5  min=1  max=2  nonfinite=3"


def test_fail_on_nonfinite_says_the_same_line_for_show_and_for_the_table(tmp_path, capsys):
    # Issue 45: `--fail-on-nonfinite` warned in two texts (--show: "non-finite values in a, b"; the table: with
    # the count). One function, one text: the count of leaves, then their names.
    np.savez(tmp_path / "w.npz", w=np.array([1.0, np.nan], np.float32), v=np.ones(2, np.float32))
    path = str(tmp_path / "w.npz")
    assert main(["inspect", path, "--show", "w", "--fail-on-nonfinite"]) == 3
    shown = capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["inspect", path, "--fail-on-nonfinite"]) == 3
    table = capsys.readouterr().err.strip().splitlines()[-1]
    assert shown == table and table.endswith("non-finite values in 1 leaf(s): default/w"), (shown, table)
    assert main(["inspect", path, "--show", "v", "--fail-on-nonfinite"]) == 0
