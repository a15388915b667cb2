"""``gs://`` and ``s3://`` buckets, read in place: fsspec's ``gcsfs``/``s3fs`` for listings and small files,
TensorStore's own ``gcs``/``s3`` key-value stores for arrays (``kvstore_spec``), with byte ranges.

The client library is imported at the first URL of its scheme (the ``remote`` extra). Object stores have no
folders, only key prefixes, and no symlinks: a bucket needs no confinement. Writes upload in blocks (S3
multipart, GCS resumable): an object appears only when its upload completes, so an upload that fails or is
killed leaves no object (``BucketUpload.abort`` cancels it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from treetools.checkpoint_io.storage.base import Entry, Stat, Storage, Upload, entries, normalize, split_url
from treetools.checkpoint_io.storage.reach import RemoteStorageError, check_reachable, gcs_token, translate
from treetools.shared.errors import CheckpointError, CheckpointNotFoundError
from treetools.shared.install import install_hint


class RemoteNotFoundError(CheckpointNotFoundError):
    """No such bucket."""


@dataclasses.dataclass(frozen=True)
class _Info:
    kind: str  # "file" or "directory"
    size: int


REMOTE_IO_THREADS = 16
"""Round trips one bucket read keeps in flight at once (listings and small files of many steps)."""

TREE_LISTING_LIMIT = 10_000
"""The most objects ``prefetch_tree`` lists below a bucket folder (10 LIST pages on S3, 2 on GCS)."""

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
        with translate(path):
            self._file = storage.fs.open(storage.key(path), "wb", block_size=upload_block(size))

    def write(self, data: Any) -> None:
        with translate(self.path):
            self._file.write(data)
        self.written += memoryview(data).nbytes

    def commit(self) -> None:
        with translate(self.path):
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

    Implementation hint: a subclass names its ``scheme`` and ``package`` and
    makes its client (``make_client``), its TensorStore key-value store
    (``kvstore_spec``) and its whole-tree listing (``list_objects``).
    """

    remote = True
    package = ""

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

    def make_client(self) -> Any:
        raise NotImplementedError

    def list_objects(self, bucket: str, prefix: str, limit: int) -> list[dict[str, Any]]:
        """Every object whose key starts with ``prefix``, at most ``limit`` of them, in one paged LIST."""
        raise NotImplementedError

    # -- names

    def key(self, url: str) -> str:
        _, bucket, key = split_url(url)
        return f"{bucket}/{key}" if key else bucket

    def join(self, folder: str, name: str) -> str:
        return f"{folder}/{name}"

    def parent(self, path: str) -> str | None:
        _, bucket, key = split_url(path)
        return None if not key else path.rpartition("/")[0]

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
        with translate(url):
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
            with translate(url):
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
            with translate(url):
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

    def prefetch_tree(self, folder: str, *, limit: int = TREE_LISTING_LIMIT) -> bool:
        """List every object below ``folder`` at once (one paginated LIST, not one per folder): the listings and
        existence probes of every folder below are answered from it, a root of 500 steps included. A folder
        holding more than ``limit`` objects (steps that each keep thousands of chunk objects) is listed folder by
        folder when needed instead."""
        objects = self.objects_under(folder, limit)
        if not objects:
            return False
        self.remember_tree(folder, objects)
        return True

    def prefetch(self, folder: str) -> None:
        try:
            self.listing(folder)
        except (FileNotFoundError, CheckpointError):
            pass

    def map_io(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        items = list(items)
        if len(items) < 2:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(REMOTE_IO_THREADS, len(items)),
                                thread_name_prefix="treetools-io") as pool:
            return list(pool.map(fn, items))

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
            with translate(path):
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
        with translate(path):
            return self.fs.open(self.key(path), "rb", block_size=block_size, cache_type="readahead", size=info.size)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """One ranged GET."""
        with translate(path):
            return self.fs.cat_file(self.key(path), start=start, end=start + length)

    def tensorstore_context(self) -> dict[str, Any] | None:
        # Every open costs round trips (an OCDBT manifest and b-tree nodes, the credentials): sharing one context
        # shares those and the connections, and its small cache keeps the b-tree nodes every array looks up.
        return {"cache_pool": {"total_bytes_limit": 64 * 2**20}}

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
        with translate(path):
            try:
                self.fs.rm(self.key(path), recursive=True)
            except FileNotFoundError:
                pass
        self.forget(path)


class GcsStorage(BucketStorage):
    """``gs://``: gcsfs's plain client (credentials chosen without waiting, ``gcs_token``), TensorStore's ``gcs``."""

    scheme = "gs"
    package = "gcsfs"

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

    def kvstore_spec(self, folder: str) -> dict[str, Any]:
        """TensorStore's ``gcs`` driver.

        >>> GcsStorage.kvstore_spec(None, "gs://b/run/7/params")
        {'driver': 'gcs', 'bucket': 'b', 'path': 'run/7/params/'}
        """
        _, bucket, key = split_url(folder)
        return {"driver": "gcs", "bucket": bucket, "path": key + "/" if key else ""}


class S3Storage(BucketStorage):
    """``s3://``: s3fs, and TensorStore's ``s3`` with the endpoint and region botocore would use."""

    scheme = "s3"
    package = "s3fs"

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

    def kvstore_spec(self, folder: str) -> dict[str, Any]:
        """TensorStore's ``s3`` driver. The endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
        (TensorStore does not read them itself) and the region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``;
        without either, TensorStore asks AWS for the bucket's region."""
        _, bucket, key = split_url(folder)
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/" if key else ""}
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


def make(cls: type[BucketStorage], url: str) -> BucketStorage:
    """The client of ``url``'s scheme, after ``check_reachable`` (a ``gs://`` URL offline fails at once)."""
    check_reachable(url)
    return cls()
