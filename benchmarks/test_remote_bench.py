"""Checkpoints in buckets: ``inspect --stats`` read in place vs downloading the checkpoint, then reading it locally.

The anchor is what a user does without treetools' bucket support: copy the
step to a local disk (fsspec ``get``, the tool gcsfs/s3fs users reach for;
``gsutil cp`` / ``aws s3 cp`` do the same transfer) and inspect the copy.
Both read the same bytes from the same local server (moto for S3,
fake-gcs-server for GCS, tests/_buckets.py), so the ratio measures the
reading strategy, not a network. A 32-layer Orbax checkpoint of 256 MiB
(scaled by TREETOOLS_BENCH_SCALE), FSDP-sharded from 8 devices, one item.

Also metadata mode, which moves only metadata: its time against the
download-then-inspect anchor, and the bytes it moves.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from conftest import SCALE, best, report
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: the servers of tests/_buckets.py
from tests._buckets import _gcs_service, _s3_service, gcs_store, remote_store, s3_store  # noqa: F401 (fixtures)
from treetools.checkpoint_tools.report import inspect_path

LAYERS = 32
FULL = 256 * 2**20


def _save(path: str, total_bytes: float) -> int:
    d = max(8, int(round(math.sqrt(total_bytes / (LAYERS * 4)) / 8)) * 8)
    mesh = jax.make_mesh((8,), ("fsdp",))

    def array(shape, seed):
        rng = np.random.default_rng(seed)
        host = rng.standard_normal(shape, np.float32)
        return jax.device_put(host, NamedSharding(mesh, P("fsdp", *([None] * (len(shape) - 1)))))

    tree = {f"layer_{i:02d}": {"w": array((d, d), 2 * i), "b": array((d,), 2 * i + 1)} for i in range(LAYERS)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_stats_in_place_vs_download_then_read(tmp_path, remote_store):
    local = str(tmp_path / "ckpt")
    nbytes = _save(local, FULL * SCALE)
    remote_store.upload(local, "ckpt")
    url = remote_store.url("ckpt")
    copy = str(tmp_path / "copy")

    def download_then_stats():
        shutil.rmtree(copy, ignore_errors=True)
        remote_store.fs().get(url.split("://", 1)[1] + "/", copy + "/", recursive=True)
        return inspect_path(copy, stats=True, progress=False)

    def in_place():
        return inspect_path(url, stats=True, progress=False)

    # the same statistics both ways (this also warms imports and connections)
    got, want = in_place().to_json(), download_then_stats().to_json()
    assert got["checkpoints"] == want["checkpoints"]
    repeat = 3
    ours = best(in_place, repeat)
    anchor = best(download_then_stats, repeat)
    mib = nbytes / 2**20
    report(f"{remote_store.scheme}:// --stats {mib:.0f} MiB (64 leaves), in place vs download + local --stats",
           ours, anchor, "download then read", target="< 1")
    print(f"[bench] {remote_store.scheme}:// --stats in place: {nbytes / ours / 1e6:.0f} MB/s; "
          f"download then read: {nbytes / anchor / 1e6:.0f} MB/s", flush=True)

    # What the server itself gives: one whole 64 MiB GET vs 1 MiB range GETs of it. moto builds every range
    # response from the whole object, so on S3-via-moto many range reads (TensorStore's chunk reads) are slow
    # where a real bucket serves them in parallel at full speed; fake-gcs-server serves ranges directly.
    fs = remote_store.fs()
    blob = np.random.default_rng(0).bytes(64 * 2**20)
    fs.pipe(f"{remote_store.bucket}/probe", blob)
    whole = best(lambda: fs.cat_file(f"{remote_store.bucket}/probe"), 2)
    ranged = best(lambda: [fs.cat_file(f"{remote_store.bucket}/probe", start=i * 2**20, end=(i + 1) * 2**20)
                            for i in range(8)], 2) / 8
    print(f"[bench] {remote_store.scheme}:// server: one 64 MiB GET {64 / whole:.0f} MiB/s, "
          f"1 MiB range GETs {1 / ranged:.0f} MiB/s each", flush=True)

    remote_store.counter.reset()
    meta = best(lambda: inspect_path(url), repeat)
    requests, moved = remote_store.counter.snapshot()
    anchor_meta = best(lambda: (shutil.rmtree(copy, ignore_errors=True),
                                 remote_store.fs().get(url.split("://", 1)[1] + "/", copy + "/", recursive=True),
                                 inspect_path(copy)), 1)
    report(f"{remote_store.scheme}:// metadata inspect {mib:.0f} MiB, in place vs download + local inspect",
           meta, anchor_meta, "download then inspect")
    print(f"[bench] {remote_store.scheme}:// metadata inspect moved {moved / repeat / 1024:.1f} KiB in "
          f"{requests / repeat:.0f} requests per run ({moved / repeat / nbytes:.2e} of the checkpoint)", flush=True)
    assert moved / repeat < 512 * 1024
