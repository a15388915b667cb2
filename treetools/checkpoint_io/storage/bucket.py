"""``gs://`` and ``s3://`` buckets, read in place through fsspec's ``gcsfs``/``s3fs``, with byte ranges; both
schemes registered here (``register_scheme``). TensorStore reads arrays in them through its own ``gcs``/``s3``
key-value stores: those are the TensorStore adapter's (``formats/_ts_kvstore.py``), not this module's.

The client library is imported at the first URL of its scheme (the ``remote`` extra). Object stores have no
folders, only key prefixes, and no symlinks: a bucket needs no confinement. Writes upload in blocks (S3
multipart, GCS resumable): an object appears only when its upload completes, so an upload that fails or is
killed leaves no object (``BucketUpload.abort`` cancels it).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from typing import Any, Callable, Iterator

from treetools.checkpoint_io.storage.base import (REMOTE_IO_THREADS, Entry, Stat, Storage, Upload, entries,
                                                  normalize, split_url)
from treetools.checkpoint_io.storage.reach import RemoteStorageError, check_reachable, gcs_token, translate
from treetools.checkpoint_io.storage.schemes import register_scheme
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError
from treetools.shared.install import install_hint


class RemoteNotFoundError(CheckpointNotFoundError):
    """No such bucket."""


@dataclasses.dataclass(frozen=True)
class _Info:
    kind: str  # "file" or "directory"
    size: int


__all__ = ["REMOTE_IO_THREADS", "BucketStorage", "BucketUpload", "GcsStorage", "RemoteNotFoundError", "S3Storage"]

TREE_LISTING_LIMIT = 10_000
"""The most objects ``prefetch(tree=True)`` lists below a bucket folder (10 LIST pages on S3, 2 on GCS)."""

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


class BucketUpload(Upload):
    """fsspec's block upload to ``path`` itself: the object appears only at ``commit``; ``abort`` cancels it."""

    def __init__(self, storage: "BucketStorage", path: str, *, size: int | None = None):
        self.path, self._storage, self.written = path, storage, 0
        with translate(path, storage.credentials):
            self._file = storage.fs.open(storage.key(path), "wb", block_size=upload_block(size))

    def write(self, data: Any) -> None:
        with translate(self.path, self._storage.credentials):
            self._file.write(data)
        self.written += memoryview(data).nbytes

    def commit(self) -> None:
        with translate(self.path, self._storage.credentials):
            self._file.close()
        self._storage.forget(self.path)

    def abort(self) -> None:
        try:
            self._file.discard()  # S3: abort the multipart upload; GCS: cancel the resumable session
        except Exception:  # best effort: an unfinished upload is never visible anyway
            pass
        self._file.closed = True  # so close() (and garbage collection) can never complete it


class BucketStorage(Storage):
    """One bucket scheme through fsspec, with the listings this process has made remembered.

    Every existence and kind question about a path is answered from its
    parent's listing when that was made (one LIST per folder, the way a
    format's ``claims`` probes many names of one folder), else from one
    ``info`` call. ``forget()`` drops what was remembered (each
    ``open_source`` starts fresh, so a long-lived process sees new steps).

    A subclass names its ``scheme``, ``package`` and ``credentials`` (the
    hint a refused request ends with), makes its client (``make_client``) and
    its whole-tree listing (``list_objects``), and registers itself
    (``register_scheme``) in its module.
    """

    remote = True
    package = ""
    credentials = "check the credentials its client library reads"
    """How to give this scheme's client credentials: the end of a "no credentials" error."""

    def __init__(self) -> None:
        try:
            # The client logs each refused request with its traceback before raising; with no logging configured,
            # Python prints that to stderr. The error itself reaches the user as one line; a NullHandler keeps
            # the log for applications that configure logging, and off the terminal otherwise.
            logging.getLogger(self.package).addHandler(logging.NullHandler())
            self.fs = self.make_client()
        except ImportError as e:
            raise RemoteStorageError(
                f"reading {self.scheme}:// paths needs the `remote` extra ({self.package}): "
                f"{install_hint('remote')} ({e})."
            ) from None
        self._listings: dict[str, dict[str, _Info]] = {}
        self._infos: dict[str, _Info | None] = {}
        self._probes: dict[str, int] = {}
        self._lock = threading.Lock()

    @abc.abstractmethod
    def make_client(self) -> Any:
        """The fsspec file system of this scheme (imported here: the ``remote`` extra)."""

    @abc.abstractmethod
    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[dict[str, Any]]:
        """Every object whose key starts with ``prefix``, at most ``limit`` of them, in one paged LIST."""

    def confine(self, path: str, *, follow_links: bool = False) -> "BucketStorage":
        """Itself: a bucket has no symlinks, so no read through a key under ``path`` can lead out of it."""
        return self

    # -- names

    def key(self, url: str) -> str:
        _, bucket, key = split_url(url)
        return f"{bucket}/{key}" if key else bucket

    # -- listings

    def forget(self, path: str = "") -> None:
        with self._lock:
            self._listings.clear()
            self._infos.clear()
            self._probes.clear()
        self.fs.invalidate_cache()

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
        with translate(url, self.credentials):
            found = self.fs.ls(self.key(url), detail=True)
        out: dict[str, _Info] = {}
        base = self.key(url).rstrip("/") + "/"
        for e in found:
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
            found_entries = self._listings.get(parent)
            if found_entries is not None:
                found = found_entries.get(child.rpartition("/")[2])
                return found is None or found.kind != "directory"
            child, parent = parent, parent.rpartition("/")[0]
        return False

    def info(self, url: str) -> _Info | None:
        url = normalize(url)
        _, bucket, key = split_url(url)
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
        if probes > 1 and split_url(parent)[2]:
            # Readers probe several names of one folder (marker files, item folders): from the second probe
            # on, one LIST of the folder answers them all. A folder probed once (an array-data folder of
            # thousands of objects asked for one marker) is not listed, nor a bucket's top level.
            try:
                return self.listing(parent).get(name)
            except FileNotFoundError:
                return None
        try:
            with translate(url, self.credentials):
                raw = self.fs.info(self.key(url))
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
        _, bucket, key = split_url(url)
        prefix = key + "/" if key else ""
        try:
            with translate(url, self.credentials):
                found = self.list_objects(bucket, prefix, limit + 1)
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
                found = listings.setdefault(folder, {})
                last = i == len(parts) - 1
                if not last or part not in found:
                    found[part] = _Info("file", size) if last else _Info("directory", 0)
                folder = f"{folder}/{part}"
        with self._lock:
            self._listings.update(listings)

    def prefetch(self, folder: str, *, tree: bool = False) -> bool:
        """List ``folder`` now (one LIST answers the probes of its entries that follow).

        With ``tree``, every object below ``folder`` at once (one paginated
        LIST, not one per folder): the listings and existence probes of every
        folder below are answered from it, a root of 500 steps included. A
        folder holding more than ``TREE_LISTING_LIMIT`` objects (steps that each
        keep thousands of chunk objects) is listed folder by folder when needed
        instead."""
        if tree:
            objects = self.objects_under(folder, TREE_LISTING_LIMIT)
            if not objects:
                return False
            self.remember_tree(folder, objects)
            return True
        try:
            self.listing(folder)
        except (FileNotFoundError, CheckpointError):
            return False
        return True

    # -- probes

    def exists(self, path: str) -> bool:
        return self.info(path) is not None

    def isdir(self, path: str) -> bool:
        info = self.info(path)
        return info is not None and info.kind == "directory"

    def isfile(self, path: str) -> bool:
        info = self.info(path)
        return info is not None and info.kind == "file"

    def stat(self, path: str) -> Stat:
        info = self.info(path)
        if info is None:
            raise FileNotFoundError(path)
        return Stat.of(info.kind, info.size)

    def scandir(self, path: str) -> Any:
        url = normalize(path)
        found = self.listing(url)
        return entries(Entry(name, f"{url}/{name}", info.kind, info.size) for name, info in sorted(found.items()))

    def listdir(self, path: str) -> list[str]:
        return sorted(self.listing(path))

    def walk(self, top: str) -> Iterator[tuple[str, list[str], list[str]]]:
        return super().walk(normalize(top))

    def missing(self, path: str) -> Exception:
        """The error for a URL with nothing under it: naming a missing bucket as such."""
        _, bucket, _ = split_url(path)
        try:
            with translate(path, self.credentials):
                bucket_there = self.fs.exists(bucket)
        except FileNotFoundError:
            bucket_there = False
        if not bucket_there:
            return RemoteNotFoundError(f"{path}: no such bucket {bucket!r} (or it is not visible to these credentials).")
        return CheckpointNotFoundError(f"{path}: no such file or folder.")

    # -- reads

    def open(self, path: str, *, block_size: int = 64 * 2**10) -> Any:
        """A seekable file fetching ranges of ``block_size`` bytes ahead of what is read (small for headers,
        large for a stream read front to back)."""
        info = self.info(path)  # known from a listing: no HEAD request for the size
        if info is None or info.kind != "file":
            raise FileNotFoundError(path)
        with translate(path, self.credentials):
            return self.fs.open(self.key(path), "rb", block_size=block_size, cache_type="readahead", size=info.size)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """One ranged GET."""
        with translate(path, self.credentials):
            return self.fs.cat_file(self.key(path), start=start, end=start + length)

    # -- writes

    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> BucketUpload:
        return BucketUpload(self, path, size=size)

    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        if folder and self.exists(dst):  # old shards must never read as a checkpoint beside new ones
            self.remove(dst)
        write(dst)
        self.forget(dst)

    def remove(self, path: str) -> None:
        with translate(path, self.credentials):
            try:
                self.fs.rm(self.key(path), recursive=True)
            except FileNotFoundError:
                pass
        self.forget(path)


class GcsStorage(BucketStorage):
    """``gs://``: gcsfs's plain client (credentials chosen without waiting, ``gcs_token``)."""

    scheme = "gs"
    package = "gcsfs"
    credentials = "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS"

    def make_client(self) -> Any:
        # gcsfs's plain client: the package's default class is an experimental subclass that first asks the
        # Storage Control API what kind each bucket is (a minute's wait against an emulator).
        import gcsfs.core

        return gcsfs.core.GCSFileSystem(token=gcs_token())

    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[dict[str, Any]]:
        from fsspec.asyn import sync

        key = prefix.rstrip("/")
        found, _ = sync(self.fs.loop, self.fs._do_list_objects, f"{bucket}/{key}" if key else bucket,
                        max_results=limit, delimiter="")
        return found


class S3Storage(BucketStorage):
    """``s3://``: s3fs (the endpoint and credentials botocore reads: ``AWS_ENDPOINT_URL``, ``AWS_*``)."""

    scheme = "s3"
    package = "s3fs"
    credentials = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"

    def make_client(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem()

    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[dict[str, Any]]:
        from fsspec.asyn import sync

        async def collect() -> list[dict]:
            out = []
            async for o in self.fs._iterdir(bucket, max_items=limit, delimiter="", prefix=prefix):
                out.append(o)
            return out

        return sync(self.fs.loop, collect)


def make(cls: type[BucketStorage], url: str) -> BucketStorage:
    """The client of ``url``'s scheme, after ``check_reachable`` (a ``gs://`` URL offline fails at once)."""
    check_reachable(url, cls.credentials)
    return cls()


register_scheme("gs", lambda url: make(GcsStorage, url))
register_scheme("s3", lambda url: make(S3Storage, url))
