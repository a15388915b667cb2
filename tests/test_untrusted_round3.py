"""Issue 49: the third hostile-input round, aimed at the turn-4 readers and writers (docs/untrusted.md).

Every hostile input is built here by the test itself; each case asserts one error line and a non-zero exit (or
a correct read), and, where a header declares more than it stores, memory or work within the budget (peaks
measured in a child process, as ``tests/test_untrusted.py`` does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.test_untrusted import _clean, _one_error, _run, grown_mib


def _flax_array(shape, dtype: str = "float32", data: bytes = b"") -> msgpack.ExtType:
    """An ndarray as flax.serialization packs it: ext 1 holding ``[shape, dtype name, bytes]``."""
    return msgpack.ExtType(1, msgpack.packb([list(shape), dtype, data]))


# ----------------------------------------------------------------------------- msgpack


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [2**32, 0, 2**32]])
def test_a_zero_size_msgpack_array_of_absurd_dimensions_is_one_line(tmp_path, capsys, shape):
    # No data bytes bound them (0 elements); numpy cannot build either shape (a dimension over 2^63, a product of
    # the non-zero dimensions over 2^63), so --stats, diff --values and convert ended in a ValueError traceback.
    with pytest.raises(ValueError):
        np.empty(tuple(shape), np.float32)  # why it cannot be read as a zero-size array
    f = tmp_path / "state.msgpack"
    f.write_bytes(msgpack.packb({"params": {"w": _flax_array(shape), "b": _flax_array([2], "float32", bytes(8))}}))
    out_file = tmp_path / "out.safetensors"
    for argv in (("inspect", f), ("inspect", f, "--stats"), ("diff", f, f, "--values"),
                 ("convert", f, out_file), ("inspect", f, "--show", "params/w")):
        err = _one_error(capsys, *argv, code=2 if argv[0] == "diff" else 1)
        assert str(list(shape)) in err and "Flax msgpack" in err, err
    code, out, err = _run(capsys, "verify", f)
    assert code == 1 and "Traceback" not in out + err and str(list(shape)) in out + err
    assert not out_file.exists()


def test_a_zero_size_msgpack_array_numpy_holds_is_read_as_one(tmp_path, capsys):
    f = tmp_path / "state.msgpack"
    f.write_bytes(msgpack.packb({"w": _flax_array([0, 2**40]), "b": _flax_array([2], "float32", bytes(8))}))
    code, out, err = _run(capsys, "inspect", f, "--stats", "--format", "json")
    assert code == 0, err
    leaves = {leaf["path"]: leaf for leaf in json.loads(out)["checkpoints"][0]["items"]["default"]["leaves"]}
    assert leaves["w"]["shape"] == [0, 2**40] and leaves["w"]["params"] == 0 and leaves["b"]["params"] == 2
