"""treetools.checkpoint_tools.healthplot and `treetools plot DUMP.json`: a health dump drawn per layer (issue 40)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.test_health import _grads, _metrics
from treetools.checkpoint_tools.healthplot import health_figure, is_health_dump, read_health_dump
from treetools.pytree.health import HealthDumper, HealthRecorder, SpikeDetector

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    """A run of 16 steps: layers_1's gradient scaled 40x at step 10, a NaN in `embed` at step 13."""
    folder = tmp_path_factory.mktemp("health")
    detector, recorder = SpikeDetector(keys=("grad_norm",), warmup=5), HealthRecorder(length=12)
    det, rec = detector.init(_metrics(_grads(0), 1.0)), recorder.init(_metrics(_grads(0), 1.0))
    dumper = HealthDumper(folder, detector, after=4)
    paths = []
    for i in range(1, 17):
        scale = {"layers_1": 40.0} if i == 10 else {"embed": np.nan} if i == 13 else None
        m = _metrics(_grads(i, scale), 1.0)
        det, report = detector.update(det, m)
        rec = recorder.record(rec, i, m, report["flagged"])
        paths += [e["path"] for e in dumper(i, rec, det, report) if e["event"] == "dump"]
    paths += [e["path"] for e in dumper.close() if e["event"] == "dump"]
    assert len(paths) == 2  # step 14 (for step 10), and at close (for step 13, 3 steps after it)
    return paths[0], paths[1]


def test_read_a_dump_and_refuse_what_is_not_one(dump_path, tmp_path):
    dump = read_health_dump(dump_path[0])
    assert dump["step"] == 14 and [r["step"] for r in dump["records"]] == list(range(3, 15))
    assert dump["flagged"][0]["attributed"][0] == "layers_1"
    nan_dump = read_health_dump(dump_path[1])
    assert math.isnan(next(r for r in nan_dump["records"] if r["step"] == 13)["grad_norm/embed"])
    assert is_health_dump(dump_path[0])
    other = tmp_path / "metrics.json"
    other.write_text(json.dumps({"step": 1, "loss": 2.0}))
    assert not is_health_dump(other) and not is_health_dump(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"metrics\.json: not a health dump"):
        read_health_dump(other)


def test_figure_marks_the_flagged_step_and_the_attributed_layer(dump_path):
    fig = health_figure(read_health_dump(dump_path[0]))
    axes = [ax for ax in fig.axes if ax.get_title().endswith("per module")]
    # Step 13's NaN is in this ring too: the count gets its panel (a count of 0 everywhere would not).
    assert [ax.get_title() for ax in axes] == ["grad_norm per module", "nonfinite_grads per module"]
    ax = axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "head", "layers_0", "layers_1"]
    red = [t.get_text() for t in ax.get_yticklabels() if t.get_color() == "red"]
    assert red == ["layers_1"]
    assert [p.get_y() + 0.5 for p in ax.patches if p.get_gid() == "attributed"] == [3.0]  # row of layers_1
    (flags,) = [c for c in ax.collections if c.get_gid() == "flagged"]
    assert [float(x) for x, _ in flags.get_offsets()] == [10.0, 13.0]  # 13 is in the ring, flagged, explained next
    values = np.ma.filled(next(c for c in ax.collections if c.get_gid() == "values").get_array(), np.nan)
    grid = values.reshape(4, 12)
    col = list(range(3, 15)).index(10)
    assert int(np.argmax(grid[:, col] / np.nanmedian(grid, axis=1))) == 3  # the cell that jumped: layers_1
    assert "step 10: spike in grad_norm" in fig._suptitle.get_text() and "layers_1" in fig._suptitle.get_text()


def test_figure_of_a_nan_dump_has_red_cells_in_the_layer(dump_path):
    fig = health_figure(read_health_dump(dump_path[1]), kinds=["grad_norm"])
    (ax,) = [a for a in fig.axes if a.get_title() == "grad_norm per module"]
    cells = next(c for c in ax.collections if c.get_gid() == "nonfinite-cells").get_array()
    steps = [r["step"] for r in read_health_dump(dump_path[1])["records"]]
    bad = np.argwhere(~np.ma.getmaskarray(cells).reshape(4, len(steps)))
    assert [(int(r), steps[int(c)]) for r, c in bad] == [(0, 13)]  # embed, step 13
    assert [t.get_text() for t in ax.get_yticklabels() if t.get_color() == "red"] == ["embed"]
    with pytest.raises(ValueError, match=r"no per-module \['mu_norm'\]"):
        health_figure(read_health_dump(dump_path[1]), kinds=["mu_norm"])


def test_treetools_plot_draws_a_dump_beside_it(dump_path, tmp_path):
    out = tmp_path / "spike.png"
    proc = subprocess.run([sys.executable, "-m", "treetools", "plot", dump_path[0], "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out) and out.read_bytes().startswith(b"\x89PNG")
    # Without -o: beside the dump, with its name.
    proc = subprocess.run([sys.executable, "-m", "treetools", "plot", dump_path[1]], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == dump_path[1][:-len(".json")] + ".png"
