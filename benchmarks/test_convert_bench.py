"""``treetools convert`` to safetensors against ``cp`` of the same bytes, in the same run.

A 1 GiB uncompressed checkpoint (a safetensors file of 16 float32 tensors of
64 MiB; scaled by TREETOOLS_BENCH_SCALE) is converted to a Hugging Face
folder of 256 MiB shards with their index, through the whole pipeline (header
parse, rules plan, block reads, block writes, temporary name, rename). The
anchor is ``cp`` of the source file, the least any tool writing those bytes
does. Rounds are interleaved (cp, convert, cp, ...) and the fastest of each is
kept, so other work on the machine shifts both alike; throughput in GB/s.

Two pairs: without fsync (``fsync=False``: both leave the bytes in the page
cache, what ``cp`` does) and durable (``convert``'s default, fsync before the
rename) against ``cp`` followed by ``sync`` of the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import numpy as np
from conftest import SCALE, report

import treetools as tt
from treetools.checkpoint_io.writers import safetensors as st_writer

FULL = 2**30
TENSORS = 16
ROUNDS = 5


def _source(path: str, nbytes: int) -> int:
    n = max(1, nbytes // (TENSORS * 4))
    tensors = [st_writer.Tensor(f"model.layers.{i}.weight", np.broadcast_to(np.float32(0), (n,))) for i in range(TENSORS)]
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(st_writer.header(tensors, {"format": "pt"}))
        for _ in range(TENSORS):
            f.write(rng.standard_normal(n, dtype=np.float32).tobytes())
    return os.path.getsize(path)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_convert_to_safetensors_vs_cp(tmp_path):
    src = str(tmp_path / "src.safetensors")
    size = _source(src, int(FULL * SCALE))
    shard = max(1, size // 4)
    out, copy = str(tmp_path / "hf"), str(tmp_path / "copy.safetensors")

    def clean():
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(copy):
            os.remove(copy)

    times: dict[str, list[float]] = {"cp": [], "convert": [], "cp+sync": [], "convert fsync": []}
    for _ in range(ROUNDS):
        times["cp"].append(_timed(lambda: subprocess.run(["cp", src, copy], check=True)))
        clean()
        times["convert"].append(_timed(lambda: tt.convert(src, out, shard_size=shard, fsync=False)))
        clean()
        times["cp+sync"].append(_timed(lambda: subprocess.run(["sh", "-c", f"cp '{src}' '{copy}' && sync '{copy}'"],
                                                             check=True)))
        clean()
        times["convert fsync"].append(_timed(lambda: tt.convert(src, out, shard_size=shard)))
        clean()
    best = {k: min(v) for k, v in times.items()}
    gbs = {k: size / v / 1e9 for k, v in best.items()}
    print(f"[bench] convert {size / 2**30:.2f} GiB to safetensors shards: convert {gbs['convert']:.2f} GB/s, "
          f"cp {gbs['cp']:.2f} GB/s; durable: convert {gbs['convert fsync']:.2f} GB/s, cp+sync {gbs['cp+sync']:.2f} GB/s")
    report("convert to safetensors (page cache)", best["convert"], best["cp"], "cp", target="convert >= 1 GB/s")
    report("convert to safetensors (fsync)", best["convert fsync"], best["cp+sync"], "cp + sync")
