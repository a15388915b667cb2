"""Where checkpoint files live: the local disk, or ``gs://`` and ``s3://`` buckets read in place.

Every reader of a checkpoint (the step rule, the formats, the array readers)
asks this module instead of ``os``, so one code path reads a local folder and
the same folder in a bucket. Local paths go straight to ``os`` (same
semantics, symlinks and FIFOs included, no import cost). Remote paths go to
fsspec's ``gcsfs``/``s3fs`` for listings and small files, imported only when a
remote path is given; arrays are read by TensorStore's own ``gcs``/``s3``
key-value stores (``kvstore_spec``), in place, with byte ranges.

Checkpoints are untrusted input: a symlink inside one (a chunk file, an item
folder, a metadata file) may lead anywhere on the machine. ``confine(path)``
makes a path a checkpoint *root* (``open_source`` does it for the PATH it
opens): from then on every local read under it, by this module
(``open``, ``open_fd``, ``read_range``, the listings) or by a library handed a
``pin``-ned folder (TensorStore), resolves inside the root, or is refused.

Credentials and endpoints are the ecosystem's: whatever the client libraries
already read (``AWS_*`` variables and profiles, ``AWS_ENDPOINT_URL`` for
MinIO or a local S3; Google default credentials, ``STORAGE_EMULATOR_HOST``
and ``TENSORSTORE_GCS_HTTP_URL`` for a GCS emulator). Offline, the first
``gs://`` URL fails within seconds with one line (``check_reachable``), and
GCS credentials are chosen without waiting on a metadata server that is not
there (``gcs_token``).

Writes (``create``, ``replace``, ``remove``, ``makedirs``) serve ``treetools convert``, the one
command that writes: a local file is written under its name and fsynced; a bucket object is
uploaded in blocks (S3 multipart, GCS resumable), and appears only when its upload completes,
so an upload that fails or is killed leaves no object (``Upload.abort`` cancels it).

Standard library only at import time.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import stat as stat_
import threading
import urllib.parse
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from treetools.shared.errors import CheckpointError, CheckpointNotFoundError
from treetools.shared.install import install_hint


REMOTE_SCHEMES = {"gs": "gcsfs", "s3": "s3fs"}
"""URL scheme -> the fsspec package (the ``remote`` extra) that lists and reads it."""


class RemoteStorageError(CheckpointError):
    """A bucket could not be read: the extra is missing, no credentials, no such bucket, permission denied."""


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a ``gs://`` or ``s3://`` URL.

    >>> is_remote("gs://bucket/ckpt"), is_remote("/data/ckpt"), is_remote("S3://b")
    (True, False, True)
    """
    return isinstance(path, str) and path[:5].lower() in ("gs://", "s3://")


def _split(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a URL; the key has no leading or trailing ``/``."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.strip("/").partition("/")
    return scheme.lower(), bucket, "/".join(p for p in key.split("/") if p)


def normalize(path: str) -> str:
    """An absolute local path (``~`` expanded), or a URL without doubled or trailing slashes.

    >>> normalize("s3://b//run/ckpt/")
    's3://b/run/ckpt'
    """
    if is_remote(path):
        scheme, bucket, key = _split(path)
        return f"{scheme}://{bucket}/{key}" if key else f"{scheme}://{bucket}"
    return os.path.abspath(os.path.expanduser(path))


def location(path: Any, *, name: str = "path") -> str:
    """Where a path given by a user points: an absolute local path (``~`` expanded; Orbax needs absolute
    ones) from a str, PathLike or ``etils.epath.Path``, or a ``gs://`` / ``s3://`` URL as it is.

    Raises:
      TypeError: ``path`` is not a path (the message names the argument ``name``).

    >>> location("gs://b//run/"), location("/tmp/../tmp/x")
    ('gs://b/run', '/tmp/x')
    """
    if isinstance(path, (str, os.PathLike)):
        return normalize(os.fspath(path))
    if hasattr(path, "as_posix"):  # etils.epath.Path
        return normalize(str(path) if is_remote(str(path)) else path.as_posix())
    raise TypeError(f"`{name}` must be a path, got {type(path).__name__}.")


def realpath(path: str) -> str:
    return normalize(path) if is_remote(path) else os.path.realpath(path)


def kvstore_spec(folder: str) -> dict[str, Any]:
    """The TensorStore key-value store of a folder: ``file`` locally, ``gcs`` or ``s3`` in a bucket.

    For S3 the endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    (TensorStore does not read them itself) and the region from ``AWS_REGION`` /
    ``AWS_DEFAULT_REGION``; without either, TensorStore asks AWS for the bucket's region.

    >>> kvstore_spec("gs://b/run/7/params")
    {'driver': 'gcs', 'bucket': 'b', 'path': 'run/7/params/'}
    """
    if not is_remote(folder):
        return {"driver": "file", "path": os.path.abspath(folder) + "/"}
    scheme, bucket, key = _split(folder)
    spec: dict[str, Any] = {"driver": "gcs" if scheme == "gs" else "s3", "bucket": bucket,
                            "path": key + "/" if key else ""}
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
            region = region or "us-east-1"
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
            # The keys botocore would use first; without this TensorStore walks its provider chain
            # (profile files first) and logs every file it does not find.
            spec["context"] = {"aws_credentials": {"type": "environment"}}
    return spec


# ---------------------------------------------------------------------------- the checkpoint root


HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
"""Folder names of a Hugging Face hub cache repo, whose ``snapshots/<rev>/`` files link into its ``blobs/``."""


class Root:
    """A checkpoint root: the folder a checkpoint was opened at, and where the reads under it may lead.

    Every local file read under ``path`` must resolve (symlinks followed)
    inside the folder's real path, or be one of the files a user named (a
    checkpoint file given as PATH may itself be a link: the user chose it). One
    layout links out of its folder by design, the Hugging Face hub cache
    (``models--org--name/snapshots/<rev>/model.safetensors -> ../../blobs/<sha>``):
    a root inside a ``snapshots/`` folder of such a repo may also read anything
    inside that same repo folder, nothing beyond it.

    >>> import tempfile, os
    >>> repo = os.path.join(os.path.realpath(tempfile.mkdtemp()), "models--org--m")
    >>> Root(os.path.join(repo, "snapshots", "abc")).allows(os.path.join(repo, "blobs", "f00"))
    True
    >>> Root(os.path.join(repo, "snapshots", "abc")).allows(os.path.dirname(repo))
    False
    """

    def __init__(self, path: str):
        self.path = path
        self.allowed: tuple[str, ...] = ()
        self.allow(path)

    def allow(self, path: str) -> None:
        """Let reads under this root lead to ``path`` (its real path, and its Hugging Face repo folder if any)."""
        real = os.path.realpath(path)
        allowed = [*self.allowed, real]
        for candidate in (path, real):  # a snapshot file given as PATH is itself a link into blobs/
            parts = candidate.split(os.sep)
            for i in range(1, len(parts) - 1):
                if parts[i + 1] == "snapshots" and parts[i].startswith(HF_REPO_PREFIXES):
                    allowed.append(os.path.realpath(os.sep.join(parts[:i + 1])))
        self.allowed = tuple(dict.fromkeys(allowed))

    def allows(self, real: str) -> bool:
        """Whether the real path ``real`` lies inside this root (or its Hugging Face repo folder)."""
        return any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in self.allowed)

    def __repr__(self) -> str:
        return f"Root({self.path!r})"


_ROOTS: "weakref.WeakValueDictionary[str, Root]" = weakref.WeakValueDictionary()
_ROOTS_LOCK = threading.Lock()


def confine(path: str) -> Root | None:
    """Make ``path`` a root: every local read under it stays inside it while the returned ``Root`` lives.

    A folder is its own root; a file's root is its folder (a T5X ``checkpoint``
    file names the zarr folders beside it), which may also read the file itself
    wherever it links. The root stays registered while the object returned is
    referenced (the ``Source`` holds it, and each reader it hands out); None for
    a URL (a bucket has no symlinks).
    """
    if is_remote(path):
        return None
    path = os.path.abspath(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    with _ROOTS_LOCK:
        root = _ROOTS.get(folder)
        if root is None:
            root = _ROOTS[folder] = Root(folder)
        if folder != path:
            root.allow(path)
        return root


def root_over(path: str) -> Root | None:
    """The innermost live root that ``path`` lies under (by name): the checkpoint whose reads must stay in it."""
    if is_remote(path) or not _ROOTS:
        return None
    path = os.path.abspath(path)
    with _ROOTS_LOCK:
        while True:
            root = _ROOTS.get(path)
            if root is not None:
                return root
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent


def _outside(path: str, root: Root) -> CheckpointError:
    return CheckpointError(f"{path}: resolves outside the checkpoint {root.path} (a symlink leading out of it?); "
                           "refusing to read it.")


def check_inside(path: str, real: str | None = None) -> None:
    """Refuse ``path`` unless its real path (``real``, else ``os.path.realpath``) lies inside the root over it."""
    root = root_over(path)
    if root is not None and not root.allows(real if real is not None else os.path.realpath(path)):
        raise _outside(path, root)


def _fd_path(fd: int) -> str | None:
    """The real path of an open descriptor (Linux: its /proc link), None where the OS does not say."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target[: -len(" (deleted)")] if target.endswith(" (deleted)") else target


def open_fd(path: str, flags: int = 0) -> int:
    """A local regular file (or, with ``os.O_DIRECTORY``, folder) opened read-only, after checking what was opened.

    The check is of the descriptor itself (its real path through /proc, else
    its inode against ``realpath``), so a link swapped in between a check and
    the open cannot redirect the read.

    Raises:
      CheckpointError: it resolves outside the root over ``path``, is not a regular file (a FIFO, a device),
        or ``path`` holds a NUL byte.
      OSError: it cannot be opened.
    """
    if "\0" in path:
        raise CheckpointError(f"{path!r}: a NUL byte in a path; the checkpoint names a file that cannot exist.")
    # O_NONBLOCK: a FIFO swapped in for a file opens at once (and is refused below) instead of hanging the open.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | flags)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat_.S_ISDIR(mode) if flags & getattr(os, "O_DIRECTORY", 0) else stat_.S_ISREG(mode)):
            raise CheckpointError(f"{path}: not a regular file; refusing to read it.")
        root = root_over(path)
        if root is not None:
            real = _fd_path(fd)
            if real is None:  # no /proc: the real path, proven to be the file opened
                real = os.path.realpath(path)
                st, opened = os.stat(real), os.fstat(fd)
                if (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino):
                    raise CheckpointError(f"{path}: changed while it was opened; refusing to read it.")
            if not root.allows(real):
                raise _outside(path, root)
    except BaseException:
        os.close(fd)
        raise
    return fd


_WALKS: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
_WALKS_LOCK = threading.Lock()


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


class Pinned:
    """A local folder opened once and checked, for a library that opens the files in it by path (TensorStore).

    ``path`` is what to hand the library: ``/proc/self/fd/N`` on Linux, so the
    folder read is the one checked even if a link is swapped in for it later
    (elsewhere its real path). ``identity`` changes when entries of the folder
    are added, removed or renamed. Close it when the library is done.
    """

    def __init__(self, folder: str, fd: int | None, path: str):
        self.folder, self.fd, self.path = folder, fd, path
        self.identity: tuple[int, ...] = ()
        if fd is not None:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def real(self, name: str = "") -> str:
        """The real path of ``name`` inside the folder (symlinks resolved)."""
        return os.path.realpath(os.path.join(self.path, name) if name else self.path)

    def check_file(self, name: str) -> None:
        """Refuse ``name`` (relative) unless it resolves inside the root over it and is a regular file or missing."""
        if self.fd is None:
            return
        real = self.real(name)
        check_inside(os.path.join(self.folder, name), real)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            return  # missing: the library's own error names it
        if not (stat_.S_ISREG(mode) or stat_.S_ISDIR(mode)):
            raise CheckpointError(f"{os.path.join(self.folder, name)}: not a regular file; refusing to read it.")

    def check_tree(self) -> None:
        """Refuse the folder unless every entry below it resolves inside the checkpoint root (links followed) and
        is a regular file or folder (no FIFO, socket or device).

        A walk that found nothing wrong is remembered by the identity of every
        folder it went through (inode, modification and change times): while none
        of them has changed (an entry added, removed, renamed or relinked changes
        its folder's times), the next check of the same folder is those stats only.
        """
        if self.fd is None:
            return
        root = root_over(self.folder)
        key = (self.identity, root.allowed if root is not None else ())
        with _WALKS_LOCK:
            dirs = _WALKS.get(key)
        if dirs is not None and all(_identity(os.path.join(self.path, rel)) == ident for rel, ident in dirs):
            return
        dirs = self._walk()
        with _WALKS_LOCK:
            _WALKS[key] = dirs
            while len(_WALKS) > 4096:
                _WALKS.pop(next(iter(_WALKS)))

    def _walk(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every entry below the folder checked; ``(relative folder, identity)`` of each folder gone through."""
        seen: set[tuple[int, int]] = set()
        dirs: list[tuple[str, tuple[int, ...]]] = []
        stack = [(os.dup(self.fd), self.real(), self.folder, "")]
        nofollow = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while stack:
            fd, real, shown, rel = stack.pop()
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                dirs.append((rel, (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)))
                with os.scandir(fd) as it:
                    for e in it:
                        name, sub = os.path.join(shown, e.name), os.path.join(rel, e.name)
                        if e.is_symlink():
                            target = os.path.realpath(os.path.join(real, e.name))
                            check_inside(name, target)
                            if os.path.isdir(target):
                                stack.append((open_fd(target, os.O_DIRECTORY), target, name, sub))
                            elif os.path.exists(target) and not os.path.isfile(target):
                                raise CheckpointError(f"{name}: not a regular file; refusing to read it.")
                        elif e.is_dir(follow_symlinks=False):
                            stack.append((os.open(e.name, nofollow, dir_fd=fd), os.path.join(real, e.name), name, sub))
                        elif not e.is_file(follow_symlinks=False):
                            raise CheckpointError(
                                f"{name}: not a regular file (a FIFO, socket or device); refusing to read it.")
            except BaseException:
                for other, *_ in stack:
                    os.close(other)
                raise
            finally:
                os.close(fd)
        return dirs

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def pin(folder: str) -> Pinned:
    """``folder`` opened and checked (inside the root over it); a URL is handed on as it is.

    Raises:
      CheckpointError: the folder resolves outside the root over it.
      OSError: it cannot be opened (missing, not a folder).
    """
    if is_remote(folder):
        return Pinned(folder, None, folder)
    fd = open_fd(folder, os.O_DIRECTORY)
    path = f"/proc/self/fd/{fd}" if _fd_path(fd) is not None else os.path.realpath(folder)
    return Pinned(folder, fd, path)


# ---------------------------------------------------------------------------- remote file systems


@dataclasses.dataclass(frozen=True)
class _Info:
    kind: str  # "file" or "directory"
    size: int


class _Remote:
    """One bucket scheme through fsspec, with the listings this process has made remembered.

    Object stores have no folders, only key prefixes: a "folder" exists when
    some key starts with it. Every existence and kind question about a path is
    answered from its parent's listing when that was made (one LIST per folder,
    the way a format's ``claims`` probes many names of one folder), else from one
    ``info`` call. ``forget()`` drops what was remembered (each ``open_source``
    starts fresh, so a long-lived process sees new steps).
    """

    def __init__(self, scheme: str):
        self.scheme = scheme
        package = REMOTE_SCHEMES[scheme]
        try:
            # gcsfs logs each refused request with its traceback before raising; with no logging configured,
            # Python prints that to stderr. The error itself reaches the user as one line; a NullHandler keeps
            # the log for applications that configure logging, and off the terminal otherwise.
            logging.getLogger(package).addHandler(logging.NullHandler())
            if scheme == "gs":
                # gcsfs's plain client: the package's default class is an experimental subclass that first asks
                # the Storage Control API what kind each bucket is (a minute's wait against an emulator).
                import gcsfs.core

                self.fs = gcsfs.core.GCSFileSystem(token=gcs_token())
            else:
                import s3fs

                self.fs = s3fs.S3FileSystem()
        except ImportError as e:
            raise RemoteStorageError(
                f"reading {scheme}:// paths needs the `remote` extra ({package}): {install_hint('remote')} "
                f"({e})."
            ) from None
        self._listings: dict[str, dict[str, _Info]] = {}
        self._infos: dict[str, _Info | None] = {}
        self._probes: dict[str, int] = {}
        self._lock = threading.Lock()

    def forget(self) -> None:
        with self._lock:
            self._listings.clear()
            self._infos.clear()
            self._probes.clear()
        self.fs.invalidate_cache()

    def _key(self, url: str) -> str:
        _, bucket, key = _split(url)
        return f"{bucket}/{key}" if key else bucket

    def listing(self, url: str) -> dict[str, _Info]:
        """name -> info of the entries directly in folder ``url``; raises FileNotFoundError when it has none."""
        url = normalize(url)
        with self._lock:
            cached = self._listings.get(url)
            gone = cached is None and self._known_missing(url)
        if cached is not None:
            return cached
        if gone:
            raise FileNotFoundError(url)
        with translate(url):
            entries = self.fs.ls(self._key(url), detail=True)
        out: dict[str, _Info] = {}
        base = self._key(url).rstrip("/") + "/"
        for e in entries:
            name = e["name"].rstrip("/")
            if not name.startswith(base) or name == base.rstrip("/"):
                continue  # the folder's own placeholder object
            rel = name[len(base):]
            if "/" in rel or not rel:
                continue
            kind = "directory" if e.get("type") == "directory" else "file"
            if rel in out and out[rel].kind == "directory":
                continue  # a placeholder object "a/" beside keys under "a/": a folder
            out[rel] = _Info(kind, int(e.get("size") or 0))
        if not out:
            raise FileNotFoundError(url)
        with self._lock:
            self._listings[url] = out
        return out

    def _known_missing(self, url: str) -> bool:
        """Whether a listing already made shows there is no folder ``url`` (an ancestor's listing lacks the way
        down to it): a probe below it needs no request. Called with the lock held."""
        child = url
        parent = url.rpartition("/")[0]
        while parent and "/" in parent.partition("://")[2]:
            entries = self._listings.get(parent)
            if entries is not None:
                found = entries.get(child.rpartition("/")[2])
                return found is None or found.kind != "directory"
            child, parent = parent, parent.rpartition("/")[0]
        return False

    def info(self, url: str) -> _Info | None:
        url = normalize(url)
        _, bucket, key = _split(url)
        if not key:
            return _Info("directory", 0)  # a bucket; whether it exists shows at its first listing
        parent, _, name = url.rpartition("/")
        with self._lock:
            if parent in self._listings:
                return self._listings[parent].get(name)
            if self._known_missing(parent):
                return None
            if url in self._infos:
                return self._infos[url]
            probes = self._probes[parent] = self._probes.get(parent, 0) + 1
        if probes > 1 and _split(parent)[2]:
            # Readers probe several names of one folder (marker files, item folders): from the second probe
            # on, one LIST of the folder answers them all. A folder probed once (an array-data folder of
            # thousands of objects asked for one marker) is not listed, nor a bucket's top level.
            try:
                return self.listing(parent).get(name)
            except FileNotFoundError:
                return None
        try:
            with translate(url):
                raw = self.fs.info(self._key(url))
            found: _Info | None = _Info("directory" if raw.get("type") == "directory" else "file",
                                        int(raw.get("size") or 0))
        except FileNotFoundError:
            found = None
        with self._lock:
            self._infos[url] = found
        return found

    def objects_under(self, url: str, limit: int) -> list[tuple[str, int]] | None:
        """``(key relative to url, size)`` of every object below folder ``url``, in one paginated LIST without a
        delimiter; None when there are more than ``limit`` (or the client cannot page a listing)."""
        _, bucket, key = _split(url)
        prefix = key + "/" if key else ""
        fs = self.fs
        try:
            from fsspec.asyn import sync

            with translate(url):
                if self.scheme == "s3":
                    async def collect() -> list[dict]:
                        out = []
                        async for o in fs._iterdir(bucket, max_items=limit + 1, delimiter="", prefix=prefix):
                            out.append(o)
                        return out

                    found = sync(fs.loop, collect)
                else:
                    found, _ = sync(fs.loop, fs._do_list_objects, f"{bucket}/{key}" if key else bucket,
                                    max_results=limit + 1, delimiter="")
        except (AttributeError, TypeError):  # a client without these (private, paged) listings: list per folder
            return None
        head = f"{bucket}/{prefix}"  # both clients name an object "<bucket>/<key>"
        objects = [(o["name"][len(head):], int(o.get("size") or 0)) for o in found if o["name"].startswith(head)]
        return None if len(objects) > limit else [(k, n) for k, n in objects if k and not k.endswith("/")]

    def remember_tree(self, url: str, objects: list[tuple[str, int]]) -> None:
        """Remember the listing of ``url`` and of every folder below it, from ``objects_under``."""
        url = normalize(url)
        listings: dict[str, dict[str, _Info]] = {}
        for key, size in objects:
            parts = key.split("/")
            folder = url
            for i, part in enumerate(parts):
                entries = listings.setdefault(folder, {})
                last = i == len(parts) - 1
                if not last or part not in entries:
                    entries[part] = _Info("file", size) if last else _Info("directory", 0)
                folder = f"{folder}/{part}"
        with self._lock:
            self._listings.update(listings)

    def read(self, url: str, start: int = 0, end: int | None = None) -> bytes:
        with translate(url):
            return self.fs.cat_file(self._key(url), start=start, end=end)

    def open(self, url: str, block_size: int) -> Any:
        info = self.info(url)  # known from a listing: no HEAD request for the size
        if info is None or info.kind != "file":
            raise FileNotFoundError(url)
        with translate(url):
            return self.fs.open(self._key(url), "rb", block_size=block_size, cache_type="readahead", size=info.size)


_REMOTES: dict[str, _Remote] = {}
_REMOTES_LOCK = threading.Lock()


def remote(url: str) -> _Remote:
    """The client of ``url``'s scheme, made at the first URL of that scheme (after ``check_reachable``)."""
    scheme = _split(url)[0]
    with _REMOTES_LOCK:
        if scheme not in _REMOTES:
            check_reachable(url)
            _REMOTES[scheme] = _Remote(scheme)
        return _REMOTES[scheme]


# ---------------------------------------------------------------------------- failing fast offline

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


def check_reachable(url: str) -> None:
    """Fail at once, with one line, when ``url``'s storage endpoint cannot be reached (a ``gs://`` URL offline).

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
            cause += f" (no Google credentials were found either: {_CREDENTIAL_HINTS['gs']})"
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


def forget(path: str) -> None:
    """Drop remembered listings, so the next look at ``path`` asks the bucket again (no-op locally)."""
    if is_remote(path):
        remote(path).forget()


_CREDENTIAL_HINTS = {
    "gs": "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS",
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
}


@contextlib.contextmanager
def translate(url: str) -> Iterator[None]:
    """Client-library errors as one line each: no credentials, permission denied, no such bucket.

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
                f"{url}: no credentials for {scheme}:// ({text}); {_CREDENTIAL_HINTS[scheme]}."
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


def missing(url: str) -> CheckpointNotFoundError:
    """The error for a URL with nothing under it: naming a missing bucket as such."""
    r = remote(url)
    scheme, bucket, _ = _split(url)
    try:
        with translate(url):
            bucket_there = r.fs.exists(bucket)
    except RemoteStorageError:
        raise
    except FileNotFoundError:
        bucket_there = False
    if not bucket_there:
        return RemoteNotFoundError(f"{url}: no such bucket {bucket!r} (or it is not visible to these credentials).")
    return CheckpointNotFoundError(f"{url}: no such file or folder.")


class RemoteNotFoundError(CheckpointNotFoundError):
    """No such bucket."""


# ---------------------------------------------------------------------------- os-like functions


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    info = remote(path).info(path)
    return info is not None and info.kind == "directory"


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    info = remote(path).info(path)
    return info is not None and info.kind == "file"


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    return remote(path).info(path) is not None


def lexists(path: str) -> bool:
    return os.path.lexists(path) if not is_remote(path) else exists(path)


def islink(path: str) -> bool:
    return os.path.islink(path) if not is_remote(path) else False


def getsize(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    info = remote(path).info(path)
    if info is None:
        raise FileNotFoundError(path)
    return info.size


@dataclasses.dataclass(frozen=True)
class _Stat:
    st_mode: int
    st_size: int


def stat(path: str) -> Any:
    """``os.stat`` (following symlinks); for a URL, a regular file or a folder with its size."""
    if not is_remote(path):
        return os.stat(path)
    info = remote(path).info(path)
    if info is None:
        raise FileNotFoundError(path)
    return _Stat((stat_.S_IFDIR if info.kind == "directory" else stat_.S_IFREG) | 0o444, info.size)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """What ``os.scandir`` yields, for an entry of a bucket folder."""

    name: str
    path: str
    _info: _Info

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return self._info.kind == "directory"

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return self._info.kind == "file"

    def is_symlink(self) -> bool:
        return False

    def stat(self, follow_symlinks: bool = True) -> _Stat:
        mode = stat_.S_IFDIR if self._info.kind == "directory" else stat_.S_IFREG
        return _Stat(mode | 0o444, self._info.size)


@contextlib.contextmanager
def scandir(path: str) -> Iterator[Any]:
    """``os.scandir``; in a bucket, the folder's entries (FileNotFoundError when nothing is under it)."""
    if not is_remote(path):
        check_inside(path)
        with os.scandir(path) as it:
            yield it
        return
    url = normalize(path)
    entries = remote(url).listing(url)
    yield iter([_Entry(name, f"{url}/{name}", info) for name, info in sorted(entries.items())])


REMOTE_IO_THREADS = 16
"""Round trips one bucket read keeps in flight at once (listings and small files of many steps)."""


def map_io(fn: Callable[[Any], Any], items: Iterable[Any], path: str) -> list[Any]:
    """``[fn(x) for x in items]``: for a ``path`` in a bucket, ``REMOTE_IO_THREADS`` at a time (each call waits
    on the network, not on a core); locally in this thread, in order."""
    items = list(items)
    if not is_remote(path) or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(REMOTE_IO_THREADS, len(items)), thread_name_prefix="treetools-io") as pool:
        return list(pool.map(fn, items))


TREE_LISTING_LIMIT = 10_000
"""The most objects ``prefetch_tree`` lists below a bucket folder (10 LIST pages on S3, 2 on GCS)."""


def prefetch_tree(folder: str, *, limit: int = TREE_LISTING_LIMIT) -> bool:
    """In a bucket, list every object below ``folder`` at once (one paginated LIST, not one per folder): the
    listings and existence probes of every folder below are answered from it, a root of 500 steps included.

    A folder holding more than ``limit`` objects (a root of steps that each keep thousands of chunk objects)
    is not listed whole: each folder is then listed when first needed. Returns whether it was listed.
    No-op locally.
    """
    if not is_remote(folder):
        return False
    r = remote(folder)
    objects = r.objects_under(folder, limit)
    if not objects:
        return False
    r.remember_tree(folder, objects)
    return True


def prefetch(folder: str) -> None:
    """In a bucket, list ``folder`` now (one request): the existence probes of names in it that follow are
    answered from that listing. No-op locally, and when the folder is empty or cannot be listed."""
    if is_remote(folder):
        try:
            remote(folder).listing(folder)
        except (FileNotFoundError, CheckpointError):
            pass


def listdir(path: str) -> list[str]:
    if not is_remote(path):
        check_inside(path)
        return os.listdir(path)
    return sorted(remote(path).listing(path))


def walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` (top down), for a local folder or a bucket folder."""
    if not is_remote(top):
        check_inside(top)
        for folder, dirs, files in os.walk(top):
            check_inside(folder)
            yield folder, dirs, files
        return
    pending = [normalize(top)]
    while pending:
        folder = pending.pop()
        try:
            entries = remote(folder).listing(folder)
        except FileNotFoundError:
            continue
        dirs = sorted(n for n, i in entries.items() if i.kind == "directory")
        yield folder, dirs, sorted(n for n, i in entries.items() if i.kind == "file")
        pending.extend(f"{folder}/{d}" for d in reversed(dirs))


def open(path: str, mode: str = "rb", *, block_size: int = 64 * 2**10) -> Any:  # noqa: A001 - os-like on purpose
    """A file opened for reading (binary; checked to lie inside its checkpoint root, ``open_fd``); in a bucket, a seekable file fetching ranges of ``block_size`` bytes
    ahead of what is read (small for headers, large for a stream read front to back)."""
    if mode != "rb":
        raise ValueError(f"treetools.storage.open reads only ('rb'), got mode {mode!r}.")
    if not is_remote(path):
        return os.fdopen(open_fd(path), "rb")
    return remote(path).open(path, block_size)


def read_range(path: str, start: int, length: int) -> bytes:
    """``length`` bytes at ``start`` (fewer at the end of the file): one ranged GET in a bucket."""
    if not is_remote(path):
        fd = open_fd(path)
        try:
            parts = []
            while length > 0:
                data = os.pread(fd, length, start)
                if not data:
                    break
                parts.append(data)
                start, length = start + len(data), length - len(data)
            return b"".join(parts)
        finally:
            os.close(fd)
    return remote(path).read(path, start, start + length)


# ---------------------------------------------------------------------------- writes


UPLOAD_BLOCK = 32 * 2**20
"""Bytes per uploaded part (S3 multipart part, GCS resumable chunk) unless the object's size asks for more."""
_MAX_PARTS = 9_000  # S3 allows 10,000 parts per upload


def upload_block(size: int | None) -> int:
    """The part size for an object of ``size`` bytes: ``UPLOAD_BLOCK``, larger when 9,000 parts would not hold it.

    A multiple of 256 KiB (GCS's chunk granule) and at least 5 MiB (S3's smallest part).

    >>> upload_block(10 * 2**30) // 2**20, upload_block(2**40) // 2**20
    (32, 116)
    """
    need = -(-int(size or 0) // _MAX_PARTS)
    block = max(UPLOAD_BLOCK, need)
    return -(-block // 2**18) * 2**18


class Upload:
    """One file being written: ``write`` bytes, then ``commit`` (the file exists, whole) or ``abort`` (it does not).

    Local: a file opened for writing at ``path`` (the caller picks a temporary
    name and renames it); ``commit`` flushes and fsyncs it, ``abort`` removes it.
    In a bucket: fsspec's block upload to ``path`` itself; the object appears
    only at ``commit`` (S3 completes the multipart upload, GCS the resumable
    one), and ``abort`` cancels the upload, so nothing partial is ever visible.
    Used as a context manager, an exception aborts.
    """

    def __init__(self, path: str, *, size: int | None = None, fsync: bool = True):
        self.path = path
        self._fsync = fsync
        self.written = 0
        if is_remote(path):
            r = remote(path)
            with translate(path):
                self._file = r.fs.open(r._key(path), "wb", block_size=upload_block(size))
        else:
            self._file = builtins.open(path, "wb")

    def write(self, data: Any) -> None:
        """Append ``data`` (any bytes-like object, a contiguous ``uint8`` array included)."""
        if is_remote(self.path):
            with translate(self.path):
                self._file.write(data)
        else:
            self._file.write(data)
        self.written += memoryview(data).nbytes

    def commit(self) -> None:
        """Finish the file: flushed and fsynced locally, the upload completed in a bucket."""
        if is_remote(self.path):
            with translate(self.path):
                self._file.close()
            forget(self.path)
            return
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Give up: the local file is removed; the bucket upload is cancelled (no object appears)."""
        if is_remote(self.path):
            try:
                self._file.discard()  # S3: abort the multipart upload; GCS: cancel the resumable session
            except Exception:  # noqa: BLE001 - best effort: an unfinished upload is never visible anyway
                pass
            self._file.closed = True  # so close() (and garbage collection) can never complete it
            return
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def create(path: str, *, size: int | None = None, fsync: bool = True) -> Upload:
    """A file opened for writing, local or in a bucket (see ``Upload``); ``size`` sizes the upload's parts."""
    return Upload(path, size=size, fsync=fsync)


def makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``; nothing in a bucket (folders are key prefixes)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def replace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (local paths, one file system), replacing a file at ``dst``; fsyncs the folder.

    Raises:
      ValueError: a URL (object stores have no rename: writers upload to the final key instead).
    """
    if is_remote(src) or is_remote(dst):
        raise ValueError("storage.replace renames local paths only; object stores have no rename.")
    os.replace(src, dst)
    fsync_dir(os.path.dirname(dst) or ".")


def fsync_file(path: str) -> None:
    """Flush a local file's data to disk (durable before a rename makes it visible)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename in folder ``path`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a file or a whole folder, local or in a bucket; nothing there is no error."""
    if is_remote(path):
        r = remote(path)
        with translate(path):
            try:
                r.fs.rm(r._key(path), recursive=True)
            except FileNotFoundError:
                pass
        forget(path)
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
