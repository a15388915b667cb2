"""AlphaFold 3's parameter file (``af3.bin.zst``), written as AlphaFold 3 encodes it (alphafold3 does not install
here: it builds C++ extensions and pins its own jax).

The writer follows google-deepmind/alphafold3 ``src/alphafold3/model/params.py`` at commit
37bff5f76e3fa79a6ea7dfad500bc66c8747fac6: ``encode_record(scope, name, arr)`` is a ``'<5i'`` header (the lengths
of scope, name, dtype string, shape and array bytes), the scope, name and ``str(arr.dtype)`` as UTF-8, the shape
as int32s and the C-order bytes; the file is the records back to back, zstd-compressed (``open_for_reading``
reads it through ``zstandard.ZstdDecompressor().stream_reader``), and ``get_model_haiku_params`` builds
``params[scope][name] = array``. The truth is the writer's arrays; the hostile files are refused in one line.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_inspect,
                                  check_load_parameters, check_refused, check_restore, check_show, check_stats,
                                  check_verify, run, run_fresh)

zstandard = pytest.importorskip("zstandard")


def encode_record(scope: str, name: str, arr: np.ndarray) -> bytes:
    """AlphaFold 3's ``encode_record`` (little-endian host)."""
    s, n, d = scope.encode("utf-8"), name.encode("utf-8"), str(arr.dtype).encode("utf-8")
    buffer = np.ascontiguousarray(arr).tobytes("C")
    header = struct.pack("<5i", len(s), len(n), len(d), len(arr.shape), len(buffer))
    return header + b"".join((s, n, d, struct.pack(f"{len(arr.shape)}i", *arr.shape), buffer))


def _params(delta: float = 0.0) -> dict[str, dict[str, np.ndarray]]:
    """A haiku params dict shaped like AlphaFold 3's: module scopes with `/~/`, bfloat16 and float32 arrays."""
    rng = np.random.default_rng(0)
    return {
        "diffuser/~/diffusion_head/transition_block/ffw_transition1/ffw_layer_norm": {
            "scale": np.ones(8, np.float32), "offset": np.zeros(8, np.float32)},
        "diffuser/~/evoformer/__layer_stack_no_per_layer/trunk_pairformer/pair_attention1": {
            "weights": rng.standard_normal((2, 8, 4)).astype(ml_dtypes.bfloat16)},
        "diffuser/~/confidence_head/left_target_feat_project": {
            "weights": rng.standard_normal((4, 3)).astype(np.float32) + np.float32(delta)},
    }


def _flat(params) -> dict[str, np.ndarray]:
    return {f"{scope}/{name}": arr for scope, names in params.items() for name, arr in names.items()}


def write_af3(path, params, *, stream: bool = False) -> str:
    raw = b"".join(encode_record(scope, name, arr) for scope, names in params.items() for name, arr in names.items())
    if stream:  # a streamed save, as a writer feeding records one by one would make it
        with open(path, "wb") as out, zstandard.ZstdCompressor().stream_writer(out) as writer:
            writer.write(raw)
    else:
        with open(path, "wb") as out:
            out.write(zstandard.ZstdCompressor().compress(raw))
    return str(path)


@pytest.fixture(scope="module")
def af3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("af3")
    return write_af3(folder / "af3.bin.zst", _params()), _flat(_params())


def test_every_command(af3, tmp_path):
    path, truth = af3
    report = check_inspect(path, truth)
    assert report["format"] == "af3" and report["steps"] is None
    dtypes = {leaf["path"]: leaf["dtype"] for leaf in report["checkpoints"][0]["items"]["default"]["leaves"]}
    assert dtypes["diffuser/~/evoformer/__layer_stack_no_per_layer/trunk_pairformer/pair_attention1/weights"] == "bfloat16"
    check_stats(path, truth)
    check_show(path, truth)
    out = check_verify(path)
    assert f"{sum(v.nbytes for v in truth.values()):,} bytes read and decoded" in out, out
    check_load_parameters(path, truth)
    check_restore(path, truth, item="default")
    rules = tt.Rules(rename=[(r"^diffuser/~/", "")])
    check_restore(path, truth, item="default", rules=rules,
                  expect={k.removeprefix("diffuser/~/"): v for k, v in truth.items()})
    check_convert(path, truth, tmp_path)
    other = write_af3(tmp_path / "af3.bin.zst", _params(delta=0.5), stream=True)
    check_diff_names_the_changed_leaf(path, other, "diffuser/~/confidence_head/left_target_feat_project/weights", 0.5)


def test_leaves_read_out_of_order_restart_the_stream(af3):
    # Each leaf's data lies at its offset in the decompressed stream: a read behind the stream's position starts
    # over, a read ahead skips; both give the writer's bytes.
    path, truth = af3
    leaves = tt.ckpt.open_source(path).snapshot().items["default"].leaves
    for leaf in reversed(leaves):
        np.testing.assert_array_equal(leaf.reader.read_all(), truth[leaf.name], err_msg=leaf.name)
    last = leaves[-1]
    np.testing.assert_array_equal(last.reader.read((slice(1, 3), slice(0, 2))), truth[last.name][1:3, 0:2])


def test_a_later_record_of_the_same_name_replaces_the_earlier(tmp_path):
    # get_model_haiku_params: params.setdefault(scope, {})[name] = arr.
    raw = encode_record("m", "w", np.zeros(2, np.float32)) + encode_record("m", "w", np.ones(3, np.float32))
    path = tmp_path / "af3.bin.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    check_load_parameters(path, {"m/w": np.ones(3, np.float32)})


def test_jax_is_not_imported_for_metadata(af3):
    path, _ = af3
    done = run_fresh("inspect", path, forbid=["jax"])
    assert done.returncode == 0, done.stderr


def _file(tmp_path, raw: bytes, name: str = "af3.bin.zst") -> str:
    path = tmp_path / name
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return str(path)


def test_a_truncated_file_is_refused_naming_the_record(tmp_path):
    raw = encode_record("m", "w", np.arange(1000, dtype=np.float32))
    path = _file(tmp_path, raw[:-100])  # the record's array is cut short
    check_refused(path, "truncated", "m/w")
    whole = tmp_path / "whole.bin.zst"
    whole.write_bytes(zstandard.ZstdCompressor().compress(raw))
    cut = tmp_path / "cut.bin.zst"
    cut.write_bytes(whole.read_bytes()[:-20])  # the compressed stream itself is cut short
    rc, out, err = run("inspect", cut)
    assert rc == 1 and err.startswith("treetools: error:") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("record, words", [
    # a record whose declared array length goes past what the stream holds
    (struct.pack("<5i", 1, 1, 7, 1, 2**31 - 4) + b"mwfloat32" + struct.pack("<i", 2**29 - 1), ["truncated"]),
    # lengths below zero
    (struct.pack("<5i", -1, 1, 7, 0, 4) + b"wfloat32", ["impossible lengths"]),
    # a declared length beyond its dtype x shape
    (struct.pack("<5i", 1, 1, 7, 1, 400) + b"mwfloat32" + struct.pack("<i", 2) + bytes(400), ["declares 400"]),
    # an object dtype (a pickle): never read as one
    (struct.pack("<5i", 1, 1, 6, 1, 8) + b"mwobject" + struct.pack("<i", 1) + bytes(8), ["not a number type"]),
    # a structured dtype of one huge element
    (struct.pack("<5i", 1, 1, 15, 0, 8) + b"mw(1073741824,)f8", ["(1073741824,)f8"]),
    # a name escaping the checkpoint
    (struct.pack("<5i", 2, 1, 7, 0, 4) + b"..wfloat32" + bytes(4), ["escape"]),
])
def test_hostile_records_are_refused_in_one_line(tmp_path, record, words):
    path = _file(tmp_path, encode_record("m", "ok", np.ones(2, np.float32)) + record)
    check_refused(path, *words)
    rc, out, err = run("verify", path)  # a verify problem, exit 1
    assert rc == 1 and all(word in out for word in words), out + err


def test_a_decompression_bomb_is_refused_before_it_is_decompressed(tmp_path):
    # One record declaring 2 GiB of zeros: the compressed file is a few hundred KB; decompressing it all would
    # take 2 GiB of the stream. Refused once the stream outgrows 1024 times the file.
    header = struct.pack("<5i", 1, 1, 5, 1, 2**31 - 4) + b"mwuint8" + struct.pack("<i", 2**31 - 4)
    compressor = zstandard.ZstdCompressor(level=19)
    path = tmp_path / "af3.bin.zst"
    with open(path, "wb") as out, compressor.stream_writer(out) as writer:
        writer.write(header)
        zeros = bytes(2**24)
        for _ in range(2**31 // 2**24):
            writer.write(zeros)
    assert path.stat().st_size < 2**20
    check_refused(path, "decompression bomb")


def test_a_file_named_otherwise_or_not_zstd_is_not_claimed(tmp_path, af3):
    path, _ = af3
    renamed = tmp_path / "params.zst"
    renamed.write_bytes(open(path, "rb").read())
    rc, _, err = run("inspect", renamed)
    assert rc == 1 and "af3" not in err.split("Readable formats")[0], err
    plain = tmp_path / "af3.bin.zst"
    plain.write_bytes(b"not zstd at all")
    rc, _, err = run("inspect", plain)
    assert rc == 1, err


def test_the_list_of_records_is_held_to_the_memory_budget(tmp_path):
    # 4,000 one-byte records: a 1 MiB budget holds about 1,000 listed leaves (1 KiB each, LEAF_COST).
    raw = b"".join(encode_record("m", f"w{i}", np.zeros(1, np.uint8)) for i in range(4000))
    path = _file(tmp_path, raw)
    rc, out, err = run("inspect", path, "--memory-budget-mb", "1")
    assert rc == 1 and "over the memory budget" in err and "records" in err, err
    rc, out, err = run("inspect", path, "--memory-budget-mb", "64")
    assert rc == 0 and "4,000 params" in out.replace("elements", "params"), out + err


def _split(data: bytes, parts: int) -> list[bytes]:
    cut = [len(data) * k // parts for k in range(parts + 1)]
    return [data[cut[k]:cut[k + 1]] for k in range(parts)]


@pytest.mark.parametrize("names", [
    ["af3.0.bin.zst", "af3.1.bin.zst", "af3.2.bin.zst"],  # select_model_files' first pattern
    ["af3.bin.zst.0", "af3.bin.zst.1", "af3.bin.zst.2"],  # its second
])
def test_a_model_in_parts_is_one_stream(tmp_path, names):
    # Issue 49: the loader's select_model_files/_MultiFileIO read a model split into parts as one zstd stream cut
    # anywhere (mid-frame here). The folder, any part and every command read the whole model.
    whole = tmp_path / "whole.bin.zst"
    write_af3(whole, _params())
    folder = tmp_path / "model"
    folder.mkdir()
    for name, part in zip(names, _split(whole.read_bytes(), 3)):
        (folder / name).write_bytes(part)
    truth = _flat(_params())
    for path in (folder, folder / names[1]):
        check_inspect(path, truth)
        check_show(path, truth)
        check_load_parameters(path, truth)
    check_stats(folder, truth)
    check_verify(folder)
    rc, _, err = run("inspect", folder / names[2])
    assert rc == 0 and "part 2 of a model in 3 parts" in err, err


def test_uncompressed_parts_and_a_missing_part(tmp_path):
    # select_model_files' uncompressed patterns (`af3.N.bin`): the records back to back, no zstd.
    raw = b"".join(encode_record(s, n, a) for s, names in _params().items() for n, a in names.items())
    folder = tmp_path / "model"
    folder.mkdir()
    for k, part in enumerate(_split(raw, 2)):
        (folder / f"af3.{k}.bin").write_bytes(part)
    check_inspect(folder, _flat(_params()))
    check_load_parameters(folder / "af3.1.bin", _flat(_params()))
    # A part lost: the stream ends inside a record, one error naming the truncation.
    (folder / "af3.1.bin").unlink()
    check_refused(folder, "truncated")


def test_a_folder_of_other_bin_files_is_not_claimed(tmp_path):
    # pytorch_model-0000k-of-0000N.bin files (zip pickles) are no AlphaFold 3 model: not claimed by af3.
    for k in (1, 2):
        (tmp_path / f"pytorch_model-0000{k}-of-00002.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    rc, _, err = run("inspect", tmp_path)
    assert rc != 0 and "AlphaFold" not in err, err
