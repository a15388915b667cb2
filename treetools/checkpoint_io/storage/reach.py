"""Reaching a bucket: failing fast offline, choosing GCS credentials without waiting, and the client libraries'
errors as one line each. Standard library only (a socket, not http.client: 18 ms of imports per command).

Credentials and endpoints are the ecosystem's: whatever the client libraries
already read (``AWS_*`` variables and profiles, ``AWS_ENDPOINT_URL`` for
MinIO or a local S3; Google default credentials, ``STORAGE_EMULATOR_HOST``
and ``TENSORSTORE_GCS_HTTP_URL`` for a GCS emulator). Offline, the first
``gs://`` URL fails within seconds with one line (``check_reachable``), and
GCS credentials are chosen without waiting on a metadata server that is not
there (``gcs_token``).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import socket
import threading
import urllib.parse
from typing import Any, Callable, Iterator

from treetools.checkpoint_io.storage.base import split_url as _split
from treetools.shared.errors import CheckpointError


class RemoteStorageError(CheckpointError):
    """A bucket could not be read: the extra is missing, no credentials, no such bucket, permission denied."""



REACH_TIMEOUT = 3.0
"""Seconds the first ``gs://`` URL of a process waits for a connection to the storage endpoint before failing with
one line (offline, gcsfs would retry for about 50 seconds in silence before its own error)."""

METADATA_TIMEOUT = 0.5
"""Seconds to wait for a cloud VM's metadata server (Google credentials of a GCE/GKE/Cloud Run machine)."""

GCS_ENDPOINT = "https://storage.googleapis.com"


def gcs_endpoint() -> str:
    """Where gcsfs sends requests: ``STORAGE_EMULATOR_HOST`` (an emulator; ``http://`` when it names no scheme),
    else Google's endpoint."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator in ("", "default"):
        return GCS_ENDPOINT
    return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"


def _within(timeout: float, fn: Callable[[], Any], late: Any) -> Any:
    """``fn()`` in a thread, or ``late`` when it has not returned within ``timeout`` seconds (a name lookup has no
    timeout of its own)."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(fn()), daemon=True, name="treetools-reach")
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else late


def _host_port(endpoint: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    return parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80)


def unreachable(endpoint: str, timeout: float) -> str | None:
    """Why no TCP connection to ``endpoint``'s host and port is made within ``timeout`` seconds (the name lookup
    included), or None when one is.

    >>> import socket
    >>> sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    >>> unreachable(f"http://127.0.0.1:{port}", 1.0)
    '127.0.0.1:... refused the connection'
    """
    host, port = _host_port(endpoint)

    def connect() -> str | None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return None
        except ConnectionRefusedError:
            return f"{host}:{port} refused the connection"
        except socket.gaierror as e:
            return f"{host}: {e.strerror or e}"
        except OSError as e:
            return f"{host}:{port}: {e.strerror or e or 'no answer'}"

    return _within(timeout + 0.5, connect, f"{host}:{port}: no answer within {timeout:g} s")


def _metadata_server() -> bool:
    """Whether a Google metadata server answers (a GCE/GKE/Cloud Run machine, whose credentials it hands out), asked
    as google-auth does (``Metadata-Flavor: Google`` both ways), within ``METADATA_TIMEOUT``."""
    host, port = _host_port(os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP")
                            or "169.254.169.254")

    def ask() -> bool:  # one HTTP/1.0 request on a socket: http.client would cost every command 18 ms of imports
        try:
            with socket.create_connection((host, port), timeout=METADATA_TIMEOUT) as sock:
                sock.sendall(f"GET /computeMetadata/v1/ HTTP/1.0\r\nHost: {host}\r\n"
                             "Metadata-Flavor: Google\r\n\r\n".encode("ascii"))
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 8192:
                    data = sock.recv(4096)
                    if not data:
                        break
                    head += data
        except (OSError, UnicodeError):
            return False
        lines = head.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
        return b"metadata-flavor: google" in [line.strip() for line in lines[1:]]

    return bool(_within(METADATA_TIMEOUT + 0.5, ask, False))


def check_reachable(url: str, credentials: str = "") -> None:
    """Fail at once, with one line, when ``url``'s storage endpoint cannot be reached (a ``gs://`` URL offline);
    ``credentials``: how to give the scheme credentials, said when none were found either.

    Only for ``gs://``: offline, gcsfs retries each request with backoff for
    about 50 seconds before failing; boto (``s3://``) fails on its own within
    seconds.

    Raises:
      RemoteStorageError: naming the URL, the endpoint and the likely cause.
    """
    if _split(url)[0] != "gs":
        return
    endpoint = gcs_endpoint()
    why = unreachable(endpoint, REACH_TIMEOUT)
    if why is None:
        return
    if endpoint == GCS_ENDPOINT:
        cause = "no network, or a firewall in the way: check the connection"
        if gcs_token() is not None:
            cause += f" (no Google credentials were found either: {credentials})"
    else:
        cause = "is the GCS emulator that STORAGE_EMULATOR_HOST names running? Start it, or unset the variable"
    raise RemoteStorageError(f"{url}: cannot reach {endpoint} ({why}): {cause}.")


def _adc_files() -> list[str]:
    """Where Google's Application Default Credentials may be: the variable's file, gcloud's file."""
    config = os.environ.get("CLOUDSDK_CONFIG") or (
        os.path.join(os.environ.get("APPDATA", ""), "gcloud") if os.name == "nt"
        else os.path.join(os.path.expanduser("~"), ".config", "gcloud"))
    return [f for f in (os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"),
                        os.path.join(config, "application_default_credentials.json"),
                        os.path.join(os.path.expanduser("~"), ".gcs_tokens")) if f]  # the last: gcsfs's own cache


def _on_google_cloud() -> bool:
    """A machine whose metadata server hands out credentials: Google's DMI name, or a metadata server answering."""
    try:
        with builtins.open("/sys/class/dmi/id/product_name", encoding="utf-8") as f:
            if "Google" in f.read():
                return True
    except OSError:
        pass
    return _metadata_server()


def gcs_token() -> str | None:
    """The ``token`` gcsfs gets: ``"anon"`` for an emulator or where no Google credentials can be found, else None
    (gcsfs's own search: Application Default Credentials, then the metadata server).

    Decided without gcsfs's wait: with no credentials file and no metadata server, gcsfs would ask for one for
    about 15 seconds before going anonymous. Anonymous still reads public buckets; a private one answers 401,
    which reads as "no credentials" (``translate``).
    """
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return "anon"  # an emulator takes no credentials
    if any(os.path.exists(f) for f in _adc_files()) or _on_google_cloud():
        return None
    return "anon"



@contextlib.contextmanager
def translate(url: str, credentials: str = "check the credentials the client library reads") -> Iterator[None]:
    """Client-library errors as one line each: no credentials (ending with ``credentials``, the scheme's hint: its
    ``BucketStorage.credentials``), permission denied, no such bucket.

    A missing key stays a ``FileNotFoundError`` (callers decide what a missing file means).
    """
    scheme, bucket, _ = _split(url)
    try:
        yield
    except FileNotFoundError:
        raise
    except PermissionError as e:
        raise RemoteStorageError(
            f"{url}: permission denied ({_first_line(e)}); the credentials in use cannot read this bucket."
        ) from None
    except Exception as e:
        name = type(e).__name__
        text = _first_line(e)
        code = getattr(e, "code", None)  # gcsfs's HttpError carries the HTTP status
        if ("NoCredentials" in name or "DefaultCredentialsError" in name or "Unable to locate credentials" in text
                or code == 401 or text.startswith("Anonymous caller")):
            raise RemoteStorageError(
                f"{url}: no credentials for {scheme}:// ({text}); {credentials}."
            ) from None
        if code == 403 or text.startswith("Forbidden"):  # gcsfs raises a plain OSError for a 403
            detail = " ".join(str(e).split("\n")[1:2]).strip() or text
            raise RemoteStorageError(
                f"{url}: permission denied ({detail[:300]}); the credentials in use cannot read this bucket."
            ) from None
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            raise RemoteStorageError(f"{url}: no such bucket {bucket!r}.") from None
        if isinstance(e, (OSError, ValueError)) or "botocore" in type(e).__module__ or "gcsfs" in type(e).__module__:
            raise RemoteStorageError(f"{url}: cannot read ({name}: {text}).") from None
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


