"""Bit-exact, defined once (issue 45): ``bits_differ`` / ``bit_identical`` in ``treetools.checkpoint_io.readers``,
used by ``diff``'s values (``bit_identical``) and ``convert --verify`` (``bits_differ``), checked here against
numpy's own comparison of the arrays viewed as unsigned integers of their width."""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

from treetools.checkpoint_io.readers import bit_identical, bits_differ

# dtype -> the unsigned integer that holds one element's bits, or (uint64, 2) for a 16-byte element
WIDTHS = {
    np.dtype(np.float64): np.uint64, np.dtype(np.float32): np.uint32, np.dtype(np.float16): np.uint16,
    np.dtype(ml_dtypes.bfloat16): np.uint16, np.dtype(ml_dtypes.float8_e4m3fn): np.uint8,
    np.dtype(np.int8): np.uint8, np.dtype(np.int64): np.uint64, np.dtype(np.bool_): np.uint8,
    np.dtype(np.complex64): np.uint64, np.dtype(np.complex128): (np.uint64, 2),
}


def _numpy_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The independent reference: numpy's ``!=`` on the arrays viewed as unsigned integers (two uint64 per
    element for complex128, differing where either does)."""
    u = WIDTHS[a.dtype]
    if isinstance(u, tuple):
        return (a.view(u[0]).reshape(-1, u[1]) != b.view(u[0]).reshape(-1, u[1])).any(axis=1)
    return np.ravel(a.view(u) != b.view(u))


@pytest.mark.parametrize("dtype", list(WIDTHS), ids=str)
def test_bits_differ_is_numpys_view_as_uint_comparison(dtype):
    rng = np.random.default_rng(0)
    nbytes = 64 * dtype.itemsize
    raw_a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    raw_b = raw_a.copy()
    raw_b[rng.choice(nbytes, 9, replace=False)] ^= np.uint8(1)  # a few flipped bits, some elements alike
    if dtype == np.bool_:  # only 0 and 1 are bools
        raw_a, raw_b = raw_a & 1, raw_b & 1
    a, b = raw_a.view(dtype).reshape(8, -1), raw_b.view(dtype).reshape(8, -1)
    want = _numpy_differ(a, b)
    assert want.any() and not want.all()  # the case tests something both ways
    got = bits_differ(a, b)
    assert got.dtype == np.bool_ and got.shape == (a.size,)
    np.testing.assert_array_equal(got, want)
    assert bit_identical(a, a.copy()) and not bit_identical(a, b)


def test_nan_payloads_negative_zero_and_bfloat16():
    quiet = np.array([0x7FC00000], np.uint32).view(np.float32)
    payload = np.array([0x7FC00001], np.uint32).view(np.float32)  # a NaN too, another payload
    assert np.isnan(quiet).all() and np.isnan(payload).all()
    a = np.concatenate([quiet, quiet, np.float32([0.0, 1.0])])
    b = np.concatenate([quiet, payload, np.float32([-0.0, 1.0])])
    # NaN == NaN is False and 0.0 == -0.0 is True for values; bits say the opposite, as numpy's uint view does.
    assert (a == b).tolist() == [False, False, True, True]
    assert bits_differ(a, b).tolist() == [False, True, True, False] == _numpy_differ(a, b).tolist()
    h = np.array([0x7FC0, 0x7FC1, 0x8000, 0x0000, 0x3F80], np.uint16).view(ml_dtypes.bfloat16)
    k = np.array([0x7FC0, 0x7FC0, 0x0000, 0x0000, 0x3F80], np.uint16).view(ml_dtypes.bfloat16)
    assert bits_differ(h, k).tolist() == [False, True, True, False, False] == _numpy_differ(h, k).tolist()
    assert bit_identical(h, h.copy()) and not bit_identical(h, k)


def test_different_dtypes_or_shapes_are_never_bit_identical():
    x = np.zeros(4, np.float16)
    assert not bit_identical(x, x.view(ml_dtypes.bfloat16))  # the same bytes, another dtype
    assert not bit_identical(x, x.reshape(2, 2))
    with pytest.raises(ValueError, match="cast and shape one side"):
        bits_differ(x, x.view(ml_dtypes.bfloat16))


def test_diff_and_convert_verify_use_the_one_definition():
    from treetools.checkpoint_tools import convert, diff

    assert "bit_identical(" in inspect.getsource(diff._fold_piece)
    assert "bits_differ(" in inspect.getsource(convert._fold_bits)
    for module in (convert, diff):
        assert "bit_view" not in inspect.getsource(module)  # no second comparison of bit patterns


def test_diff_values_count_negative_zero_and_nan_payload_as_not_bit_identical(tmp_path):
    from treetools.checkpoint_io.leaves import Leaf
    from treetools.checkpoint_io.readers import InMemoryReader
    from treetools.checkpoint_tools.diff import value_diff
    from treetools.shared.rows import Row

    def leaf(x):
        return Leaf(Row(("w",), x.shape, str(x.dtype), x.size, x.nbytes), reader=InMemoryReader(x))

    a = np.float32([0.0, 1.0])
    assert value_diff(leaf(a), leaf(a.copy())).bit_identical
    assert not value_diff(leaf(a), leaf(np.float32([-0.0, 1.0]))).bit_identical  # equal values, other bits


def test_convert_verify_counts_what_numpy_counts_and_finds_the_first():
    from treetools.checkpoint_tools.convert import _BitDiff, _fold_bits

    rng = np.random.default_rng(1)
    want = rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    got = want.copy()
    bits = got.view(np.uint16)
    bits[1, 2] ^= 0x8000  # a sign: -x for x (a 0.0 becomes -0.0)
    bits[3, 5] = 0x7FC1  # a NaN where the source has a number
    acc = _BitDiff()
    _fold_bits(acc, (slice(0, 4), slice(0, 6)), (got, want))
    assert acc.differ == int(_numpy_differ(got, want).sum()) == 2
    assert acc.first == (1, 2)
    # the source block in another dtype is compared after the same cast, as the writer casts it
    same = _BitDiff()
    _fold_bits(same, None, (want, want.astype(np.float32)))
    assert same.differ == 0 and same.first is None
