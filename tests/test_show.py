"""`inspect --show LEAF[SLICE]`: the values of one leaf or a slice, equal to the writer's array."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from treetools.cli import main
from treetools.inspect.show import parse_leaf_spec, show_leaf

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
    assert out == {"path": "params/embed", "value": TRUTH["embed"][0, 0:2].tolist()}
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
    from treetools.ckpt import readers as arrays

    monkeypatch.setattr(arrays, "SLAB_BYTES", slab)
    truth = np.arange(6 * 5 * 4, dtype=np.float32).reshape(6, 5, 4)
    np.savez(tmp_path / "m.npz", w=truth, f=np.asfortranarray(truth))
    for leaf in ("w", "f"):
        for index in ("[:, 1:3, 2]", "[1:5, :, 0:3]", "[2:6, 4, :]", "[:, 0:4, 1:2]"):
            _, value = show_leaf(str(tmp_path / "m.npz"), f"{leaf}{index}")
            np.testing.assert_array_equal(value, eval(f"truth{index}"))  # noqa: S307
