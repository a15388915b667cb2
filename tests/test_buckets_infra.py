"""The bucket emulators of ``tests/_buckets.py`` work, so remote-reading tests can trust them.

Each test runs against both S3 (moto) and GCS (fake-gcs-server), through the
counting proxy, with only the environment variables the client libraries read.
"""

from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tensorstore as ts

from tests._buckets import CountingProxy, Store


def _kvstore(store: Store, path: str) -> dict:
    """The TensorStore kvstore of ``path`` in the store's bucket (S3 needs endpoint and region in the spec)."""
    if store.scheme == "s3":
        return {
            "driver": "s3",
            "bucket": store.bucket,
            "path": path,
            "endpoint": os.environ["AWS_ENDPOINT_URL"],
            "aws_region": "us-east-1",
        }
    return {"driver": "gcs", "bucket": store.bucket, "path": path}


def _write_zarr(kvstore: dict) -> np.ndarray:
    data = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    spec = {"driver": "zarr", "kvstore": kvstore}
    layout = ts.ChunkLayout(chunk_shape=[4, 4])  # four chunks: a read touches several objects
    arr = ts.open(spec, create=True, dtype=ts.float32, shape=data.shape, chunk_layout=layout).result()
    arr.write(data).result()
    return data


def test_upload_lists_back_through_the_proxy(remote_store, tmp_path):
    (tmp_path / "ckpt" / "params" / "w").mkdir(parents=True)
    (tmp_path / "ckpt" / "empty").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text("{}")
    (tmp_path / "ckpt" / "params" / "w" / "0.0").write_bytes(b"abc")

    url = remote_store.upload(tmp_path / "ckpt", "run", "7")

    assert url == remote_store.url("run", "7") == f"{remote_store.scheme}://{remote_store.bucket}/run/7"
    remote_store.counter.reset()
    found = sorted(remote_store.fs().find(url))
    assert found == [f"{remote_store.bucket}/run/7/meta.json", f"{remote_store.bucket}/run/7/params/w/0.0"]
    requests, nbytes = remote_store.counter.snapshot()
    assert requests >= 1 and nbytes > 0


def test_tensorstore_reads_uploaded_zarr(remote_store, tmp_path):
    data = _write_zarr({"driver": "file", "path": str(tmp_path / "arr")})
    remote_store.upload(tmp_path / "arr", "arr")
    remote_store.counter.reset()

    arr = ts.open({"driver": "zarr", "kvstore": _kvstore(remote_store, "arr/")}, open=True).result()

    np.testing.assert_array_equal(arr.read().result(), data)
    assert remote_store.counter.snapshot()[0] >= 5  # .zarray and four chunks, all through the proxy


def test_tensorstore_reads_uploaded_ocdbt(remote_store, tmp_path):
    data = _write_zarr({"driver": "ocdbt", "base": {"driver": "file", "path": str(tmp_path / "db")}})
    remote_store.upload(tmp_path / "db", "db")

    kvstore = {"driver": "ocdbt", "base": _kvstore(remote_store, "db/")}
    arr = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()

    np.testing.assert_array_equal(arr.read().result(), data)


def test_counter_counts_response_body_bytes(remote_store, tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(1 << 20))
    remote_store.upload(tmp_path / "big.bin", "big.bin")
    fs, key = remote_store.fs(), remote_store.url("big.bin")

    remote_store.counter.reset()
    assert len(fs.cat_file(key)) == 1 << 20
    requests, nbytes = remote_store.counter.snapshot()
    assert requests >= 1 and nbytes >= 1 << 20

    remote_store.counter.reset()
    assert len(fs.cat_file(key, start=1000, end=1100)) == 100
    requests, nbytes = remote_store.counter.snapshot()
    assert requests >= 1 and nbytes < 1000
    seen = remote_store.counter.seen()  # each request as sent: the object named in its path
    assert len(seen) == requests and all(m == "GET" and "big.bin" in p for m, p in seen), seen


def test_env_reaches_a_subprocess(remote_store, tmp_path):
    """A CLI run with ``{**os.environ, **store.env}`` reads the same bucket, with no other configuration."""
    import numpy as np

    np.savez(tmp_path / "w.npz", hello=np.arange(3.0))
    remote_store.upload(tmp_path / "w.npz", "w.npz")
    env = {k: v for k, v in os.environ.items() if k not in remote_store.env}
    out = subprocess.run(
        [sys.executable, "-m", "treetools", "inspect", remote_store.url("w.npz"), "--show", "hello"],
        env={**env, **remote_store.env}, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[0. 1. 2.]" in out.stdout


def test_proxy_rechunks_chunked_responses_and_keeps_connections():
    """An upstream that answers chunked reaches the client with a Content-Length; ranges and HEAD pass through."""

    class Chunked(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(206 if "Range" in self.headers else 200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("X-Range", self.headers.get("Range", ""))
            self.end_headers()
            for part in (b"hello ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", "12345")
            self.end_headers()

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    threading.Thread(target=upstream.serve_forever, args=(0.05,), daemon=True).start()
    proxy = CountingProxy(upstream.server_address[1])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/x", headers={"Range": "bytes=0-10"})
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Content-Length"), resp.read()) == (206, "11", b"hello world")
        assert resp.getheader("X-Range") == "bytes=0-10" and resp.getheader("Transfer-Encoding") is None
        conn.request("HEAD", "/x")  # same connection: keep-alive held
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Content-Length"), resp.read()) == (200, "12345", b"")
        conn.close()
        assert proxy.snapshot() == (2, 11)
        proxy.reset()
        assert proxy.snapshot() == (0, 0)
    finally:
        proxy.close()
        upstream.shutdown()
        upstream.server_close()


def test_proxy_reports_a_dead_upstream_as_502():
    proxy = CountingProxy(upstream_port=1)  # nothing listens on port 1
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{proxy.url}/x", timeout=10)
        assert e.value.code == 502
    finally:
        proxy.close()
