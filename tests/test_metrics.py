"""treetools.pytree.metrics: writing metrics files (fresh or resumed) and reading them back."""

from __future__ import annotations

import doctest
import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import treetools as tt
from treetools.pytree import metrics
from treetools.pytree.metrics import JsonlWriter, MetricsLogger, read_metrics


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _log(path, steps, *, every=1, resume_step=None):
    log = MetricsLogger(str(path), every=every, resume_step=resume_step)
    for step in steps:
        log(step, {"loss": jnp.float32(10.0 / step), "nonfinite_grads": jnp.int32(0)})


def test_docstring_examples():
    result = doctest.testmod(metrics, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_a_fresh_logger_starts_the_file_afresh(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    _log(path, range(1, 11), every=2)
    _log(path, range(1, 5), every=2)  # a second, fresh run at the same path: no leftovers of the first
    assert [r["step"] for r in _lines(path)] == [2, 4]
    assert _lines(path)[0] == {"step": 2, "loss": 5.0, "nonfinite_grads": 0}


def test_resume_continues_as_a_straight_run(tmp_path):
    straight = tmp_path / "straight.jsonl"
    _log(straight, range(1, 21), every=2)

    resumed = tmp_path / "resumed.jsonl"
    _log(resumed, range(1, 15), every=2)  # logged up to 14, but the last checkpoint was step 10
    with open(resumed, "a") as f:
        f.write('{"step": 16, "lo')  # and it was killed mid-write
    _log(resumed, range(11, 21), every=2, resume_step=10)
    assert resumed.read_text() == straight.read_text()
    steps = [r["step"] for r in _lines(resumed)]
    assert steps == list(range(2, 21, 2))
    assert sorted(tmp_path.iterdir()) == sorted([resumed, straight])  # rewritten in place, no temporary left


def test_resume_keeps_a_file_with_nothing_after_the_step_as_is(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 5, "loss": 1.0}\n\n{"step": 10, "loss": NaN}\n')
    before = path.stat().st_mtime_ns, path.read_text()
    JsonlWriter(path, resume_step=10)
    assert (path.stat().st_mtime_ns, path.read_text()) == before
    JsonlWriter(path, resume_step=7)
    assert path.read_text() == '{"step": 5, "loss": 1.0}\n'
    JsonlWriter(tmp_path / "new" / "m.jsonl", resume_step=3)(4, {"x": 1.0})  # nothing to resume: starts one
    assert _lines(tmp_path / "new" / "m.jsonl") == [{"step": 4, "x": 1.0}]


def test_resume_refuses_a_file_that_is_not_metrics(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\nmore notes\n")
    with pytest.raises(ValueError, match=r"notes\.txt:1: .*resume_step=None") as e:
        JsonlWriter(path, resume_step=3)
    assert "\n" not in str(e.value)
    assert path.read_text() == "my notes\nmore notes\n"  # untouched
    with pytest.raises(ValueError, match="resume_step"):
        JsonlWriter(tmp_path / "m.jsonl", resume_step=-1)


def test_logger_argument_errors():
    with pytest.raises(ValueError, match="resume_step.*JsonlWriter"):
        MetricsLogger(print, resume_step=3)
    with pytest.raises(ValueError, match="every"):
        MetricsLogger(print, every=0)
    with pytest.raises(TypeError, match="writer"):
        MetricsLogger(3)


def test_logger_writes_host_numbers_on_due_steps(tmp_path):
    seen = []
    log = MetricsLogger(lambda step, m: seen.append((step, m)), every=3)
    assert [log(step, {"x": jnp.float32(step), "n": jnp.int32(step)}) for step in range(7)] == [
        True, False, False, True, False, False, True]
    assert seen == [(0, {"x": 0.0, "n": 0}), (3, {"x": 3.0, "n": 3}), (6, {"x": 6.0, "n": 6})]
    assert type(seen[1][1]["x"]) is float and type(seen[1][1]["n"]) is int
    path = tmp_path / "m.jsonl"
    JsonlWriter(path)(1, {"loss": float("nan"), "g": float("inf")})
    (record,) = read_metrics(path)
    assert np.isnan(record["loss"]) and record["g"] == np.inf


def test_read_metrics_drops_records_a_rerun_superseded(tmp_path):
    # An append-only file (older treetools): steps 2..8, then a rerun resumed from step 4 logged 6 and 8 again.
    path = tmp_path / "metrics.jsonl"
    rows = [(2, 1.0), (4, 2.0), (6, 3.0), (8, 4.0), (6, 30.0), (8, 40.0), (10, 50.0)]
    path.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in rows))
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(2, 1.0), (4, 2.0), (6, 30.0), (8, 40.0),
                                                                     (10, 50.0)]
    assert len(read_metrics(path, drop_superseded=False)) == 7
    # A fresh rerun from step 2 supersedes everything before it.
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 9.0}\n')
    assert read_metrics(tmp_path) == [{"step": 2, "loss": 9.0}]


def test_read_metrics_skips_an_unterminated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a run still writing
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


@pytest.mark.parametrize("name, content, expected", [
    ("w.npz", None, "zip archive"),
    ("blob.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
    ("latin.jsonl", '{"step": 1, "name": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8"),
    ("config.json", b'{\n  "lr": 0.1\n}\n', "not a JSON line"),
    ("nostep.jsonl", b'{"loss": 1.0}\n', "numeric `step`"),
    ("empty.jsonl", b"\n\n", "no records"),
])
def test_read_metrics_not_metrics_is_one_line_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is None:
        np.savez(path, w=np.ones(3))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_metrics(path)
    message = str(e.value)
    assert name in message and expected in message and "\n" not in message
    assert "codec" not in message


def test_read_metrics_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such metrics file"):
        read_metrics(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="folder has no metrics.jsonl"):
        read_metrics(tmp_path)


def test_reading_does_not_import_jax(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n')
    code = (f"import sys; from treetools.pytree.metrics import read_metrics; read_metrics({str(path)!r}); "
            "print('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_reference_trainer_restart_logs_the_same_steps_as_a_straight_run(tmp_path):
    from treetools.reference.train import TrainConfig, train

    def cfg(workdir, steps):
        return TrainConfig(workdir=str(workdir), steps=steps, ckpt_every=8, log_every=2, quiet=True)

    straight = train(cfg(tmp_path / "straight", 16))
    # A run that logged up to step 12 and was killed before its step-12 checkpoint was kept...
    train(cfg(tmp_path / "restarted", 12))
    ckpt_dir = tmp_path / "restarted" / "checkpoints"
    assert tt.list_steps(ckpt_dir) == [8, 12]
    shutil.rmtree(ckpt_dir / "12")
    # ...then resumed from step 8 and run to 16.
    resumed = train(cfg(tmp_path / "restarted", 16))
    assert resumed["start_step"] == 8
    records = read_metrics(resumed["metrics_path"], drop_superseded=False)
    assert [r["step"] for r in records] == list(range(2, 17, 2))  # monotone, each step once
    assert records == read_metrics(straight["metrics_path"], drop_superseded=False)  # resume is bit-identical
    # And a fresh run in a workdir whose metrics file is left from an earlier run (no checkpoints) starts afresh.
    shutil.rmtree(ckpt_dir)
    fresh = train(cfg(tmp_path / "restarted", 4))
    assert [r["step"] for r in read_metrics(fresh["metrics_path"], drop_superseded=False)] == [2, 4]
