"""`treetools plot` / treetools.checkpoint_tools.plot (tt.plot_metrics, tt.plot_stats): panels, keys, per-module norms, axes
and overlays, checked on the Figure."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
import matplotlib.image  # noqa: E402

import treetools as tt  # noqa: E402
from treetools.cli import main as cli_main  # noqa: E402
from treetools.cli.plot import plot_files, run_labels  # noqa: E402
from treetools.checkpoint_tools.plot import heatmap_figure, metrics_figure, stats_figure, stats_report  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _panels(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def _cli(capsys, *args):
    code = cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treetools: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def _trainer_like(steps, *, scale=1.0):
    return [{"step": s, "loss": 4.0 * math.exp(-s / 50 * scale) + 0.7, "grad_norm": 2.0 / s, "param_norm": 30.0 + s,
             "update_norm": 0.3 * math.exp(-s / 40), "update_ratio": 0.01 * math.exp(-s / 40), "nonfinite_grads": 0}
            for s in steps]


def test_custom_keys_get_panels_with_curves(tmp_path, capsys):
    # A file with other keys than the trainer's gave an empty figure before.
    f = _write(tmp_path / "run" / "metrics.jsonl",
               [{"step": s, "train/loss": 3.0 / s, "lr": 1e-3 * s, "acc": 0.1 * s} for s in range(1, 11)])
    fig = plot_files([f])
    panels = _panels(fig)
    assert list(panels) == ["train/loss", "lr"]  # default: loss-like and the learning rate; `acc` needs --keys
    np.testing.assert_allclose(panels["train/loss"].lines[0].get_ydata(), [3.0 / s for s in range(1, 11)])
    np.testing.assert_array_equal(panels["lr"].lines[0].get_xdata(), range(1, 11))
    assert fig._suptitle.get_text() == "run"

    code, out, err = _cli(capsys, "plot", f, "-o", tmp_path / "p.png")
    assert code == 0 and out.strip() == str(tmp_path / "p.png") and err == ""
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_every_metric_when_none_is_a_default_one(tmp_path):
    f = _write(tmp_path / "m.jsonl", [{"step": s, "acc": 0.1 * s, "tokens_per_s": 1000.0 + s} for s in (1, 2)])
    assert [ax.get_title() for ax in plot_files([f]).axes] == ["acc", "tokens_per_s"]


def test_default_panels_for_the_trainers_metrics(tmp_path):
    f = _write(tmp_path / "demo" / "metrics.jsonl", _trainer_like(range(20, 201, 20)))
    fig = plot_files([f])
    # nonfinite_grads is a default panel when logged: where a run broke, it counts the NaN/Inf gradients.
    assert [ax.get_title() for ax in fig.axes] == ["loss", "grad_norm", "param_norm", "update_norm", "update_ratio",
                                                   "nonfinite_grads"]
    assert all(len(ax.lines) == 1 for ax in fig.axes)
    assert all(ax.get_xlabel() == "step" for ax in fig.axes[-3:])


def test_keys_pick_metrics_by_regex_and_repeat(tmp_path, capsys):
    f = _write(tmp_path / "demo" / "metrics.jsonl", _trainer_like(range(1, 6)))
    assert [ax.get_title() for ax in plot_files([f], keys="norm$").axes] == ["grad_norm", "param_norm", "update_norm"]
    assert [ax.get_title() for ax in plot_files([f], keys=["^loss$", "nonfinite"]).axes] == ["loss", "nonfinite_grads"]
    code, _, _ = _cli(capsys, "plot", f, "--keys", "^loss$", "--keys", "ratio", "-o", tmp_path / "k.png")
    assert code == 0 and (tmp_path / "k.png").read_bytes()[:8] == PNG


def test_keys_matching_nothing_is_an_error_not_an_empty_figure(tmp_path, capsys):
    f = _write(tmp_path / "demo" / "metrics.jsonl", _trainer_like(range(1, 6)))
    with pytest.raises(ValueError, match=r"--keys 'accuracy' matches none of the logged metrics \(loss, grad_norm"):
        plot_files([f], keys="accuracy")
    code, out, err = _cli(capsys, "plot", f, "--keys", "accuracy", "-o", tmp_path / "none.png")
    line = _error_line(err)
    assert code == 1 and "accuracy" in line and "update_ratio" in line and out == ""
    assert not (tmp_path / "none.png").exists()
    code, _, err = _cli(capsys, "plot", f, "--keys", "(", "-o", tmp_path / "none.png")
    assert code == 1 and "not a valid regex" in _error_line(err)


def _module_metrics(tmp_path):
    """A metrics file from norm_metrics(depth=1) on a 10-layer tree, logged by MetricsLogger."""
    params = {f"layers_{i}": {"w": jnp.full((4,), float(i + 1)), "b": jnp.zeros(2)} for i in range(10)}
    step_fn = jax.jit(lambda p, s: tt.norm_metrics(grads=jax.tree.map(lambda x: x / s, p), params=p, depth=1))
    path = tmp_path / "mods" / "metrics.jsonl"
    log = tt.MetricsLogger(str(path), every=1)
    for step in range(1, 5):
        metrics = step_fn(params, jnp.float32(step))
        metrics["loss"] = jnp.float32(1.0 / step)
        log(step, metrics)
    return path


def test_per_module_norms_get_one_panel_per_kind(tmp_path):
    fig = plot_files([_module_metrics(tmp_path)], keys="norm")
    panels = _panels(fig)
    assert list(panels) == ["grad_norm", "param_norm", "grad_norm per module (largest 8 of 10)",
                            "param_norm per module (largest 8 of 10)"]
    ax = panels["grad_norm per module (largest 8 of 10)"]
    # Largest last value first: layer i's grad norm is 2 (i + 1) / step.
    assert [line.get_label() for line in ax.lines] == [f"layers_{i}" for i in range(9, 1, -1)]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [20.0 / s for s in range(1, 5)], rtol=1e-6)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"layers_{i}" for i in range(9, 1, -1)]
    # By default too, next to the loss.
    titles = [ax.get_title() for ax in plot_files([_module_metrics(tmp_path)]).axes]
    assert titles[:3] == ["loss", "grad_norm", "param_norm"] and "grad_norm per module (largest 8 of 10)" in titles
    # --keys on one module.
    only = plot_files([_module_metrics(tmp_path)], keys="^grad_norm/layers_3$")
    assert [(ax.get_title(), [line.get_label() for line in ax.lines]) for ax in only.axes] == [
        ("grad_norm per module", ["layers_3"])]


def test_a_module_has_one_colour_in_every_panel(tmp_path):
    # Two per-module panels ranked in opposite orders (grad_norm: layers_3 largest; param_norm: layers_0 largest),
    # two runs: each module's lines have one colour across both panels and both runs, and modules differ.
    records = [{"step": s, "loss": 1.0 / s, "grad_norm": 1.0, "param_norm": 1.0,
                **{f"grad_norm/layers_{i}": (i + 1) / s for i in range(4)},
                **{f"param_norm/layers_{i}": 10.0 - i for i in range(4)}} for s in range(1, 6)]
    first = _write(tmp_path / "a" / "metrics.jsonl", records)
    second = _write(tmp_path / "b" / "metrics.jsonl", records)
    fig = tt.plot_metrics({"a": tt.read_metrics(str(first)), "b": tt.read_metrics(str(second))}, keys="norm/")
    FigureCanvasAgg(fig).draw()
    panels = _panels(fig)
    assert set(panels) == {"grad_norm per module", "param_norm per module"}
    assert [line.get_label() for line in panels["grad_norm per module"].lines][:4] == [f"layers_{i}" for i in (3, 2, 1, 0)]
    assert [line.get_label() for line in panels["param_norm per module"].lines][:4] == [f"layers_{i}" for i in range(4)]
    seen: dict[str, set] = {}
    for ax in panels.values():
        assert len(ax.lines) == 8  # 4 modules x 2 runs
        for n, line in enumerate(ax.lines):
            module = ax.lines[n % 4].get_label()  # the second run's lines come in the first run's order, unlabelled
            seen.setdefault(module, set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert set(seen) == {f"layers_{i}" for i in range(4)}
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert len({c for colours in seen.values() for c in colours}) == 4
    # The legend's swatches carry the same colours.
    for ax in panels.values():
        legend = ax.get_legend()
        for text, handle in zip(legend.get_texts(), legend.legend_handles):
            if text.get_text() in seen:
                assert {matplotlib.colors.to_hex(handle.get_color())} == seen[text.get_text()]


def _visible_major_ticks(fig, ax):
    FigureCanvasAgg(fig).draw()
    lo, hi = ax.get_ylim()
    return [t for t in ax.yaxis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_text()]


@pytest.mark.parametrize("span", [4.0, 30.0, 1e4])
def test_update_ratio_is_a_log_axis_with_several_labelled_ticks(span, tmp_path):
    steps = range(1, 21)
    records = [{"step": s, "update_ratio": 1e-2 * span ** (-(s - 1) / 19)} for s in steps]
    fig = metrics_figure({"run": records})
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    ticks = _visible_major_ticks(fig, ax)
    assert len(ticks) >= 3, [t.label1.get_text() for t in ticks]
    assert len(ticks) <= 12
    assert all("10^" not in t.label1.get_text() and "$" not in t.label1.get_text() for t in ticks)


def test_plot_help_says_which_panels_have_a_log_axis_as_the_code_draws_them(capsys):
    # Issue 24.24: `plot --help` said update_ratio is on a log axis; the code draws it linear unless max/min >= 3.
    out = _cli(capsys, "plot", "--help")[1]
    text = " ".join(out.split())
    found = re.search(r"logarithmic when a panel's values are all positive and span a factor of (\d+) or more for a "
                      r"ratio \(update_ratio, any metric named \*ratio\*\), of (\d+) or more for any other", text)
    assert found and "The y axis is linear" in text, text
    ratio_span, other_span = int(found.group(1)), int(found.group(2))
    for key, span in (("update_ratio", ratio_span), ("loss", other_span)):
        for factor, scale in ((span * 0.99, "linear"), (span, "log")):
            records = [{"step": 1, key: 1e-3}, {"step": 2, key: 1e-3 * factor}]
            (ax,) = metrics_figure({"run": records}).axes
            assert ax.get_yscale() == scale, (key, factor)
    # Per-module panels: "the largest 8", as drawn.
    records = [{"step": s, "grad_norm": 1.0, **{f"grad_norm/layers_{i}": float(i + 1) for i in range(10)}}
               for s in (1, 2)]
    assert "largest 8 by their last value" in text
    assert _panels(metrics_figure({"run": records}))["grad_norm per module (largest 8 of 10)"]


def test_flat_or_linear_curves_keep_a_linear_axis(tmp_path):
    records = [{"step": s, "update_ratio": 1e-3, "loss": 2.0 - 0.1 * s} for s in range(1, 6)]
    panels = _panels(metrics_figure({"run": records}))
    assert panels["update_ratio"].get_yscale() == "linear" and panels["loss"].get_yscale() == "linear"


def test_step_ticks_are_integers_on_short_runs(tmp_path):
    fig = metrics_figure({"run": _trainer_like([1, 2, 3])})
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        locs = [t for t in ax.xaxis.get_majorticklocs() if lo <= t <= hi]
        assert locs and all(float(t).is_integer() for t in locs), locs


def test_several_runs_are_overlaid_with_a_legend(tmp_path, capsys):
    a = _write(tmp_path / "x" / "base" / "metrics.jsonl", _trainer_like(range(10, 101, 10)))
    b = _write(tmp_path / "y" / "base" / "metrics.jsonl", _trainer_like(range(10, 61, 10), scale=2.0))
    c = _write(tmp_path / "y" / "wide.jsonl", _trainer_like(range(10, 101, 10), scale=0.5))
    fig = plot_files([a, b, c])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["x/base", "y/base", "y/wide"]
    loss = _panels(fig)["loss"]
    assert [line.get_label() for line in loss.lines] == ["x/base", "y/base", "y/wide"]
    assert len({line.get_color() for line in loss.lines}) == 3
    np.testing.assert_array_equal(loss.lines[1].get_xdata(), range(10, 61, 10))

    code, out, _ = _cli(capsys, "plot", a, b, c, "-o", tmp_path / "abc.png")
    assert code == 0 and (tmp_path / "abc.png").read_bytes()[:8] == PNG


def test_runs_overlaid_on_per_module_panels_by_line_style(tmp_path):
    first = _module_metrics(tmp_path / "a")
    second = _module_metrics(tmp_path / "b")
    fig = plot_files([first, second], keys="^grad_norm/layers_[01]$")
    (ax,) = fig.axes
    assert [line.get_linestyle() for line in ax.lines] == ["-", "-", "--", "--"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["layers_1", "layers_0", "a/mods", "b/mods"]


def test_run_labels_disambiguate():
    assert run_labels(["r/a/metrics.jsonl", "r/b/metrics.jsonl"]) == ["a", "b"]
    assert run_labels(["p/a/metrics.jsonl", "q/a/metrics.jsonl"]) == ["p/a", "q/a"]
    assert run_labels(["r/a/metrics.jsonl", "r/a/metrics.jsonl"]) == ["a", "a (2)"]


def test_a_rerun_appended_to_the_file_plots_the_latest_run(tmp_path):
    # Written by an older MetricsLogger that appended across reruns: the curve used to zig-zag back.
    records = _trainer_like([2, 4, 6, 8]) + _trainer_like([6, 8, 10], scale=2.0)
    fig = plot_files([_write(tmp_path / "m.jsonl", records)])
    steps = _panels(fig)["loss"].lines[0].get_xdata()
    assert list(steps) == [2, 4, 6, 8, 10]


def _nonfinite_marks(ax):
    return [c for c in ax.collections if c.get_gid() == "nonfinite"]


def test_non_finite_values_break_the_curve_and_are_marked(tmp_path):
    # The curve used to be drawn straight through a NaN step, as if nothing happened there.
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 1.0},
               {"step": 4, "grad_norm": float("inf")}]
    panels = _panels(metrics_figure({"run": records}))
    line = panels["loss"].lines[0]
    assert list(line.get_xdata()) == [1, 2, 3]
    assert np.isnan(line.get_ydata()[1]) and list(line.get_ydata()[[0, 2]]) == [2.0, 1.0]  # a gap at step 2
    (marks,) = _nonfinite_marks(panels["loss"])
    assert marks.get_offsets().data[:, 0].tolist() == [2.0] and marks.get_label() == "NaN/Inf"
    assert panels["loss"].get_legend() is not None
    # A metric with no finite value at all: an empty panel, saying so, with its step marked.
    ax = panels["grad_norm (no finite values)"]
    assert [np.isnan(ln.get_ydata()).all() for ln in ax.lines] == [True]
    assert _nonfinite_marks(ax)[0].get_offsets().data[:, 0].tolist() == [4.0]
    # Finite curves get no marks.
    assert not _nonfinite_marks(_panels(metrics_figure({"run": records[:1] + records[2:3]}))["loss"])


def test_a_nan_step_changes_the_png(tmp_path):
    finite = [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0 + s} for s in range(1, 11)]
    broken = [dict(r, grad_norm=float("nan")) if r["step"] == 6 else r for r in finite]
    images = []
    for name, records in (("finite", finite), ("nan", broken)):
        out = tmp_path / f"{name}.png"
        metrics_figure({"run": records}).savefig(out, dpi=60)
        images.append(matplotlib.image.imread(str(out)))
    assert images[0].shape == images[1].shape and images[0].shape[0] > 100 and images[0].shape[1] > 200
    red = [np.sum((img[..., 0] > 0.9) & (img[..., 1] < 0.2) & (img[..., 2] < 0.2)) for img in images]
    assert red[0] == 0 and red[1] > 10  # the red NaN marks are drawn, in the NaN picture only


@pytest.mark.parametrize("name, content, expected", [
    ("w.npz", None, "zip archive"),
    ("config.json", b'{"lr": 0.1, "steps": 100}\n', "numeric `step`"),
    ("image.png", PNG + b"\x00\x00\x00\rIHDR", "binary"),
])
def test_a_file_that_is_not_metrics_is_one_error_line(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    if content is None:
        np.savez(path, w=np.ones(3))
    else:
        path.write_bytes(content)
    code, out, err = _cli(capsys, "plot", path, "-o", tmp_path / "out.png")
    line = _error_line(err)
    assert code == 1 and name in line and expected in line and "codec" not in line and out == ""
    assert not (tmp_path / "out.png").exists()


def test_too_many_panels_asks_for_keys(tmp_path):
    records = [{"step": 1, **{f"m{i}": float(i) for i in range(20)}}]
    with pytest.raises(ValueError, match="20 metrics to plot.*--keys"):
        metrics_figure({"run": records})


def test_several_files_default_output_in_the_current_folder(tmp_path, capsys, monkeypatch):
    a = _write(tmp_path / "a" / "metrics.jsonl", _trainer_like([1, 2]))
    b = _write(tmp_path / "b" / "metrics.jsonl", _trainer_like([1, 2]))
    monkeypatch.chdir(tmp_path)
    code, out, _ = _cli(capsys, "plot", a, b)
    assert code == 0 and out.strip() == "norms.png" and (tmp_path / "norms.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "a" / "norms.png").exists()


# --------------------------------------------------------------------------- #
# --heatmap: layers x steps
# --------------------------------------------------------------------------- #


def _layer_records(n_layers, steps, *, nan_at=None, kind="grad_norm"):
    out = []
    for s in steps:
        r = {"step": s, "loss": 1.0 / s, kind: 1.0}
        for i in range(n_layers):
            r[f"{kind}/layers/{i}"] = float("nan") if (s, i) == nan_at else (i + 1) * 10.0 ** (-s / 20)
            r[f"{kind}/layers/{i}/attn/q"] = 0.5  # per-parameter entries beside: the `$` keeps them out
        out.append(r)
    return out


def _mesh(ax, gid="values"):
    (mesh,) = [c for c in ax.collections if c.get_gid() == gid]
    return mesh


@pytest.mark.parametrize("n_layers", [2, 48])
def test_heatmap_rows_colours_and_labels(n_layers, tmp_path):
    from matplotlib.colors import LogNorm

    records = _layer_records(n_layers, range(10, 201, 10))
    fig = heatmap_figure({"run": records}, r"grad_norm/layers/(\d+)$")
    ax, bar = fig.axes[0], fig.axes[-1]
    mesh = _mesh(ax)
    assert isinstance(mesh.norm, LogNorm) and bar.get_ylabel() == "grad_norm/layers/* (log scale)"
    data = mesh.get_array().reshape(n_layers, 20)
    # Row i, column j holds layer i at step 10 (j + 1), by hand: (i + 1) * 10 ** (-step / 20).
    np.testing.assert_allclose(data, [[(i + 1) * 10.0 ** (-s / 20) for s in range(10, 201, 10)] for i in range(n_layers)])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [str(i) for i in range(0, n_layers, 1 if n_layers <= 24 else 2)]  # 48 rows: every other labelled
    lo, hi = ax.get_ylim()
    assert lo > hi  # layer 0 on top
    width, height = fig.get_size_inches()
    assert width == 10 and (2.5 <= height <= 3.5 if n_layers == 2 else 9 <= height <= 11)
    assert not [c for c in ax.collections if c.get_gid() in ("nonfinite", "nonfinite-cells")]
    out = tmp_path / "h.png"
    fig.savefig(out, dpi=60)
    img = matplotlib.image.imread(str(out))
    assert img.shape[:2] == (round(height * 60), round(width * 60)) and img.std() > 0


def test_heatmap_marks_nan_cells_and_steps(tmp_path, capsys):

    fine = _layer_records(4, range(1, 9))
    broken = _layer_records(4, range(1, 9), nan_at=(5, 2))
    fig = heatmap_figure({"run": broken}, r"grad_norm/layers/(\d+)$")
    ax = fig.axes[0]
    bad = ~np.ma.getmaskarray(_mesh(ax, "nonfinite-cells").get_array()).reshape(4, 8)
    assert bad.sum() == 1 and bad[2, 4]  # layer 2, step 5 (the fifth column)
    assert _nonfinite_marks(ax)[-1].get_offsets().data[:, 0].tolist() == [5.0]
    assert np.ma.is_masked(_mesh(ax).get_array().reshape(4, 8)[2, 4])  # not coloured as a value
    a, b = _write(tmp_path / "fine" / "metrics.jsonl", fine), _write(tmp_path / "broken" / "metrics.jsonl", broken)
    images = []
    for f in (a, b):
        code, out, _ = _cli(capsys, "plot", f.parent, "--heatmap", r"grad_norm/layers/(\d+)$")
        assert code == 0 and out.strip() == str(f.parent / "heatmap.png")
        images.append(matplotlib.image.imread(out.strip()))
    assert images[0].shape == images[1].shape and not np.array_equal(images[0], images[1])


def test_heatmap_rows_in_numeric_order_and_runs_stacked(tmp_path):

    runs = {"a": _layer_records(12, [1, 2, 3]), "b": _layer_records(12, [2, 4])}
    fig = heatmap_figure(runs, r"^grad_norm/layers/(\d+)$")
    assert [ax.get_title() for ax in fig.axes[:2]] == ["a", "b"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [str(i) for i in range(12)]  # 2 before 10
    # One colour scale for both runs.
    assert _mesh(fig.axes[0]).norm.vmin == _mesh(fig.axes[1]).norm.vmin


def test_heatmap_errors(tmp_path, capsys):

    runs = {"run": _layer_records(3, [1, 2])}
    with pytest.raises(ValueError, match="no capture group"):
        heatmap_figure(runs, r"grad_norm/layers/\d+")
    with pytest.raises(ValueError, match=r"matches none of the logged metrics \(loss, grad_norm"):
        heatmap_figure(runs, r"update_norm/layers/(\d+)")
    with pytest.raises(ValueError, match=r"gives row '0' to both 'grad_norm/layers/0' and 'grad_norm/layers/0/attn/q'.*`\$`"):
        heatmap_figure(runs, r"grad_norm/layers/(\d+)")
    f = _write(tmp_path / "r" / "metrics.jsonl", runs["run"])
    code, _, err = _cli(capsys, "plot", f, "--heatmap", "(")
    assert code == 1 and "not a valid regex" in _error_line(err)
    code, _, err = _cli(capsys, "plot", f, "--heatmap", r"layers/(\d+)$", "--keys", "loss")
    assert code == 2 and "--keys and --heatmap" in err


# --------------------------------------------------------------------------- #
# --stats: a checkpoint's statistics across its steps
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An Orbax run with params at steps 1-3; step 3 has a NaN in layers_1/w."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    rng = np.random.default_rng(0)
    manager = tt.get_checkpoint_manager(1, max_to_keep=5, checkpoint_dir=root)
    hosts = {}
    for step in (1, 2, 3):
        params = {f"layers_{i}": {"w": rng.normal(size=(4, 8)).astype(np.float32) * step * (i + 1),
                                  "b": np.full(8, float(step), np.float32)} for i in range(3)}
        if step == 3:
            params["layers_1"]["w"][0, 0] = np.nan
        hosts[step] = params
        tt.save_checkpoint(manager, step, {"params": jax.tree.map(jnp.asarray, params), "data_iter": {"index": step}},
                           wait=True)
    manager.close()
    return root, hosts


def _l2(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.sum(x[np.isfinite(x)] ** 2)))


def test_stats_per_leaf_across_steps(checkpoint, tmp_path, capsys):
    root, hosts = checkpoint
    report = stats_report(root, item="params")
    assert [c.step for c in report.by_step] == [1, 2, 3]
    fig = stats_figure(report)
    (ax,) = fig.axes
    assert ax.get_title() == "params: l2"
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {f"layers_{i}/{p}" for i in range(3) for p in "wb"}
    for path, line in lines.items():
        module, leaf = path.split("/")
        assert list(line.get_xdata()) == [1, 2, 3]
        np.testing.assert_allclose(line.get_ydata(), [_l2(hosts[s][module][leaf]) for s in (1, 2, 3)], rtol=1e-6)
    # The NaN in layers_1/w at step 3 (l2 is over finite elements): the step is marked.
    assert _nonfinite_marks(ax)[0].get_offsets().data[:, 0].tolist() == [3.0]

    out = tmp_path / "l2.png"
    code, printed, err = _cli(capsys, "plot", root, "--stats", "--item", "params", "-o", out)
    assert code == 0 and printed.strip() == str(out)
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0


def test_stats_per_module_other_stat_and_keys(checkpoint, tmp_path, capsys):
    root, hosts = checkpoint
    fig = stats_figure(stats_report(root, depth=1, item="params"), "abs_max", keys="^layers_[02]")
    (ax,) = fig.axes
    got = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    want = {m: [max(float(np.nanmax(np.abs(hosts[s][m][p]))) for p in "wb") for s in (1, 2, 3)]
            for m in ("layers_0", "layers_2")}
    assert got.keys() == want.keys()
    for m in want:
        np.testing.assert_allclose(got[m], want[m], rtol=1e-6)
    assert not _nonfinite_marks(ax)  # the NaN is in layers_1, not shown
    # Every item by default: params and data_iter, one panel each.
    code, _, _ = _cli(capsys, "plot", root, "--stats", "nan", "-o", tmp_path / "nan.png")
    assert code == 0 and (tmp_path / "nan.png").read_bytes()[:8] == PNG


def test_stats_errors(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    code, _, err = _cli(capsys, "plot", root, "--stats", "median", "-o", tmp_path / "x.png")
    assert code == 2 and "unknown statistic 'median'" in err and "abs_max" in err
    code, _, err = _cli(capsys, "plot", root, root, "--stats", "-o", tmp_path / "x.png")
    assert code == 2 and "one checkpoint root" in err
    code, _, err = _cli(capsys, "plot", root, "--depth", "1", "-o", tmp_path / "x.png")
    assert code == 2 and "--stats" in err
    code, _, err = _cli(capsys, "plot", root, "--stats", "-o", root / "inside.png")
    assert code == 1 and "nothing is written under a path that is read" in _error_line(err)
    assert not (root / "inside.png").exists()
    code, _, err = _cli(capsys, "plot", root, "--stats", "--keys", "^nothing", "-o", tmp_path / "x.png")
    assert code == 1 and "matches none of the checkpoint's paths" in _error_line(err)
    code, _, err = _cli(capsys, "plot", tmp_path / "missing", "--stats", "-o", tmp_path / "x.png")
    assert code == 1 and "missing" in _error_line(err)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """An Orbax run at steps 1-3: float params with a stacked leaf (3 layers) and an optimizer state with an integer
    step count (100 x step), whose l2 is far larger than any weight's."""
    root = tmp_path_factory.mktemp("counted") / "checkpoints"
    rng = np.random.default_rng(1)
    manager = tt.get_checkpoint_manager(1, max_to_keep=5, checkpoint_dir=root)
    hosts = {}
    for step in (1, 2, 3):
        params = {"embed": rng.normal(size=(4, 4)).astype(np.float32), "layers": {"w": rng.normal(size=(3, 4, 2))
                                                                                  .astype(np.float32) * step}}
        opt = {"count": np.array(100 * step, np.int32), "mu": {"embed": np.full((4, 4), 0.1 * step, np.float32)}}
        hosts[step] = {"params": params, "opt_state": opt}
        tt.save_checkpoint(manager, step, {"params": jax.tree.map(jnp.asarray, params),
                                           "opt_state": jax.tree.map(jnp.asarray, opt)}, wait=True)
    manager.close()
    return root, hosts


def test_integer_leaves_are_left_out_of_the_stats_unless_keys_pick_them(counted):
    # Issue 39.16: `count` (100, 200, 300) took the "largest" slots of opt_state and forced a log axis.
    root, hosts = counted
    fig = tt.plot_stats(root)
    panels = {ax.get_title().split(";")[0]: ax for ax in fig.axes}
    ax = panels["opt_state: l2"]
    assert ax.get_title() == "opt_state: l2; 1 integer leaf left out (--keys picks them)"
    assert [line.get_label() for line in ax.lines] == ["mu/embed"] and ax.get_yscale() == "linear"
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.1 * s * 4 for s in (1, 2, 3)], rtol=1e-6)  # sqrt(16) * v
    ax = tt.plot_stats(root, keys="count$").axes[0]
    assert [line.get_label() for line in ax.lines] == ["count"] and ax.get_title() == "opt_state: l2"
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [100, 200, 300])


def test_the_title_says_per_module_with_depth(counted):
    # Issue 39.16: `plot --stats --depth 1` was titled "per leaf" (the JSON it was drawn from has no depth).
    root, _ = counted
    assert tt.plot_stats(root, item="params")._suptitle.get_text() == f"{root}: l2 per leaf"
    fig = tt.plot_stats(root, "max", item="params", depth=1)
    assert fig._suptitle.get_text() == f"{root}: max per module"
    assert sorted(line.get_label() for line in fig.axes[0].lines) == ["embed", "layers"]


def test_unstack_plots_a_stacked_leaf_per_layer(counted, tmp_path, capsys):
    # Issue 39.16: `plot` had no --unstack (inspect has).
    root, hosts = counted
    ax = tt.plot_stats(root, item="params", rules=tt.Rules(unstack=["^layers/"])).axes[0]
    lines = {line.get_label(): line.get_ydata() for line in ax.lines}
    assert set(lines) == {"embed", "layers/0/w", "layers/1/w", "layers/2/w"}
    for k in range(3):
        np.testing.assert_allclose(lines[f"layers/{k}/w"], [_l2(hosts[s]["params"]["layers"]["w"][k]) for s in (1, 2, 3)],
                                   rtol=1e-6)
    code, out, err = _cli(capsys, "plot", root, "--stats", "--unstack", "^layers/", "-o", tmp_path / "u.png")
    assert code == 0 and (tmp_path / "u.png").read_bytes()[:8] == PNG, err
    code, _, err = _cli(capsys, "plot", root, "--unstack", "^layers/", "-o", tmp_path / "v.png")
    assert code == 2 and "apply to --stats" in err


def test_plot_stats_draws_the_report_object_without_its_json(counted, monkeypatch, tmp_path, capsys):
    # Issue 36: `plot --stats` round-tripped its report through to_json(); the figure is drawn from the Report.
    from treetools.checkpoint_tools.report import Report

    root, _ = counted
    report = tt.inspect_path(str(root), step="all", stats=True, leaves=True)

    def no_json(self):
        raise AssertionError("the plot read the JSON")

    monkeypatch.setattr(Report, "to_json", no_json)
    assert [ax.get_title().split(";")[0] for ax in tt.plot_stats(report).axes] == ["params: l2", "opt_state: l2"]
    code, _, err = _cli(capsys, "plot", root, "--stats", "-o", tmp_path / "s.png")
    assert code == 0, err
    with pytest.raises(tt.UsageError):
        tt.plot_stats(report, depth=1)  # how to read a path, given with a report


def test_the_figures_are_library_functions_that_import_no_jax(tmp_path):
    import subprocess
    import sys

    code = ("import sys, treetools as tt\n"
            "fig = tt.plot_metrics([{'step': s, 'loss': 1.0 / s} for s in (1, 2)])\n"
            "print([ax.get_title() for ax in fig.axes], [m for m in ('jax', 'flax', 'optax') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "['loss'] []", proc.stderr[-2000:]
    with pytest.raises(tt.UsageError):
        tt.plot_metrics({"run": [{"step": 1, "loss": 1.0}]}, keys="loss", heatmap="(loss)")
