"""Every size flag reads its units the same way (issue 47, point 12): ``16G`` is GiB, as docker, ulimit and Slurm
read it; ``64MiB`` binary, ``500MB`` decimal; a bare number is the flag's own unit (bytes, or MiB for
``--memory-budget-mb``). One parser, ``treetools.shared.rows.parse_size``, behind ``--device-memory``,
``--shard-size``, ``--memory-budget-mb`` and ``TREETOOLS_MEMORY_BUDGET_MB``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from treetools.cli import main
from treetools.shared.rows import parse_size

KiB, MiB, GiB = 2**10, 2**20, 2**30


@pytest.mark.parametrize("text, bare, want", [
    ("16G", 1, 16 * GiB), ("16g", 1, 16 * GiB), ("16GiB", 1, 16 * GiB), ("16GB", 1, 16 * 10**9),
    ("64MiB", 1, 64 * MiB), ("64M", 1, 64 * MiB), ("500MB", 1, 500 * 10**6), ("2K", 1, 2048), ("1T", 1, 2**40),
    ("1.5G", 1, 3 * 2**29), ("1024", 1, 1024), ("2048", MiB, 2048 * MiB), ("0.5", MiB, MiB // 2),
    ("4G", MiB, 4 * GiB),  # a unit wins over the flag's bare unit
])
def test_one_parser_reads_every_unit(text, bare, want):
    assert parse_size(text, bare=bare) == want


@pytest.mark.parametrize("text", ["lots", "16X", "G", "-1G", "0", "16 G B", "inf"])
def test_what_is_no_size_is_refused(text):
    with pytest.raises(ValueError, match="is not a size|must be positive"):
        parse_size(text, what="--device-memory")
    assert parse_size("inf", unbounded=True) == math.inf


def test_device_memory_16G_is_16_GiB(tmp_path, capsys):
    # Before: `--device-memory 16G` was a usage error (only 16GB and 16GiB were read).
    np.savez(tmp_path / "w.npz", w=np.ones((4, 4), np.float32))
    for text in ("16G", "16GiB", str(16 * GiB)):
        assert main(["plan", str(tmp_path / "w.npz"), "--device-memory", text, "--format", "json"]) == 0, text
        assert json.loads(capsys.readouterr().out)["device_memory"] == 16 * GiB
    assert main(["plan", str(tmp_path / "w.npz"), "--device-memory", "16GB", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == 16 * 10**9


def test_shard_size_and_memory_budget_take_the_same_units(tmp_path, capsys, monkeypatch):
    # 2 tensors of 1,024 float32 (4 KiB each): shards of at most 4K (4,096 bytes) hold one tensor each; of 8K, both.
    np.savez(tmp_path / "w.npz", a=np.ones(1024, np.float32), b=np.zeros(1024, np.float32))
    for size, shards in (("4K", 2), ("8K", 1), ("8KiB", 1), (str(8 * KiB), 1)):
        out = tmp_path / f"hf_{size}"
        assert main(["convert", str(tmp_path / "w.npz"), str(out), "--shard-size", size]) == 0, size
        files = sorted(p.name for p in out.glob("*.safetensors"))
        assert len(files) == shards, (size, files)
        names = [n for f in files for n in safe_open(str(out / f), "numpy").keys()]
        assert sorted(names) == ["a", "b"]
    capsys.readouterr()
    # --show of a whole leaf holds it (8 KiB): a budget of 4K is over, 16K is not; a bare number is MiB.
    np.savez(tmp_path / "big.npz", w=np.ones(2048, np.float32))
    src = str(tmp_path / "big.npz")
    assert main(["inspect", src, "--show", "w", "--memory-budget-mb", "4K"]) == 1
    assert "over the memory budget of 4.00 KiB" in capsys.readouterr().err
    assert main(["inspect", src, "--show", "w", "--memory-budget-mb", "16K"]) == 0
    assert main(["inspect", src, "--show", "w", "--memory-budget-mb", "0.004"]) == 1
    assert "over the memory budget of 4.10 KiB" in capsys.readouterr().err  # 0.004 MiB = 4,194 bytes
    monkeypatch.setenv("TREETOOLS_MEMORY_BUDGET_MB", "4K")
    assert main(["inspect", src, "--show", "w"]) == 1
    assert "over the memory budget of 4.00 KiB" in capsys.readouterr().err
    assert main(["inspect", src, "--show", "w", "--memory-budget-mb", "lots"]) == 2
    assert "argument --memory-budget-mb: 'lots' is not a size" in capsys.readouterr().err
