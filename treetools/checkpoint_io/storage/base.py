"""The storage interface: what every backend (the local disk, a bucket) answers, with the same methods.

Readers of checkpoints (the step rule, the formats, the array readers) ask a
``Storage`` instead of ``os``, so one code path reads a local folder and the
same folder in a bucket, and no caller branches on the scheme. A backend is
one class (``treetools.checkpoint_io.storage.local.LocalStorage``,
``treetools.checkpoint_io.storage.bucket.GcsStorage`` / ``S3Storage``), an ``abc.ABC`` subclass that
implements the abstract methods; a new scheme is one module holding one more, registered with
``register_scheme`` (``treetools.checkpoint_io.storage.schemes``).

Standard library only.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import stat as stat_
from typing import Any, Callable, ContextManager, Iterable, Iterator

from treetools.shared.errors import CheckpointError, CheckpointNotFoundError


class OutsideCheckpointError(CheckpointError):
    """A read that resolves outside the checkpoint it was opened at (a symlink leading out of it), refused: the
    message names the opt-in (``--follow-links``, ``follow_links=True``).

    Code that sniffs files (a format's ``claims``, a header probe) and takes a
    corrupt or unreadable one as "not mine" lets this one through: a link
    refused is said, never skipped in silence.
    """


class SpecialFileError(CheckpointError):
    """Something that is no regular file (a FIFO, a socket, a device; a folder where a file is read) where a
    checkpoint's file is read: refused before it is opened (a FIFO would block the open for ever).

    ``path`` is the file as the checkpoint names it, ``kind`` what stands there (``a FIFO``): a reader that
    lists what it cannot read (an Orbax item) says so instead of failing the whole command.
    """

    def __init__(self, message: str, *, path: str, kind: str):
        super().__init__(message)
        self.path, self.kind = path, kind


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path.

    >>> is_url("gs://bucket/ckpt"), is_url("/data/ckpt"), is_url("S3://b"), is_url("c:/x")
    (True, False, True, False)
    """
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.isalnum()


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a URL; the key has no leading or trailing ``/``.

    >>> split_url("S3://b//run/7/")
    ('s3', 'b', 'run/7')
    """
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.strip("/").partition("/")
    return scheme.lower(), bucket, "/".join(p for p in key.split("/") if p)


def normalize(path: str) -> str:
    """An absolute local path (``~`` expanded) naming what the OS names, or a URL without doubled or trailing
    slashes.

    A ``..`` goes up from where the part before it leads, as the OS resolves
    it, not by striking out a name: with ``lk -> ck/orbax``, ``lk/../x`` is
    ``ck/x``. The folder above the last part is resolved (symlinks followed)
    then; the last part is kept as it is (a checkpoint file that is a link, or
    a link a write replaces). Without ``..``, resolving and striking out agree,
    and the path is only made absolute.

    >>> normalize("s3://b//run/ckpt/")
    's3://b/run/ckpt'
    """
    if is_url(path):
        scheme, bucket, key = split_url(path)
        return f"{scheme}://{bucket}/{key}" if key else f"{scheme}://{bucket}"
    path = os.path.expanduser(path)
    parts = path.replace(os.altsep or os.sep, os.sep).split(os.sep)
    if ".." not in parts:
        return os.path.abspath(path)
    head, tail = os.path.split(path.rstrip(os.sep) or os.sep)
    if tail in ("", ".", ".."):
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head or os.curdir), tail)


def kind_of_mode(mode: int) -> str:
    """What stands somewhere, by its ``st_mode``: ``a folder``, ``a FIFO``, ``a regular file``...

    >>> import stat
    >>> kind_of_mode(stat.S_IFIFO | 0o600), kind_of_mode(stat.S_IFDIR | 0o755)
    ('a FIFO', 'a folder')
    """
    kinds = ((stat_.S_ISDIR, "a folder"), (stat_.S_ISFIFO, "a FIFO"), (stat_.S_ISSOCK, "a socket"),
             (stat_.S_ISCHR, "a character device"), (stat_.S_ISBLK, "a block device"), (stat_.S_ISLNK, "a symlink"))
    return next((name for test, name in kinds if test(mode)), "a regular file")


@dataclasses.dataclass(frozen=True)
class Stat:
    """What ``os.stat`` says that a bucket can say too: the kind (in ``st_mode``) and the size."""

    st_mode: int
    st_size: int

    @classmethod
    def of(cls, kind: str, size: int) -> "Stat":
        return cls((stat_.S_IFDIR if kind == "directory" else stat_.S_IFREG) | 0o444, size)


@dataclasses.dataclass(frozen=True)
class Entry:
    """What ``os.scandir`` yields, for a backend without ``os``: a name, its path, its kind and size."""

    name: str
    path: str
    kind: str  # "file" or "directory"
    size: int = 0

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return self.kind == "directory"

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return self.kind == "file"

    def is_symlink(self) -> bool:
        return False

    def stat(self, follow_symlinks: bool = True) -> Stat:
        return Stat.of(self.kind, self.size)


class Upload(abc.ABC):
    """One file being written: ``write`` bytes, then ``commit`` (the file exists, whole) or ``abort`` (it does not).

    Used as a context manager, an exception aborts. ``written`` counts the bytes written so far.
    """

    path: str
    written: int = 0

    @abc.abstractmethod
    def write(self, data: Any) -> None:
        """Append ``data`` (bytes-like) to the file; ``written`` grows by its size."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Finish the file: from now on it reads whole at ``path``."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Give the file up: nothing of it is left at ``path``."""

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def join(folder: str, name: str) -> str:
    """``name`` (relative, ``/``-separated) inside ``folder``: a local path or a URL of any scheme.

    >>> join("gs://b/run", "7/params"), join("/data/run", "7")
    ('gs://b/run/7/params', '/data/run/7')
    """
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def parent(path: str) -> str | None:
    """The folder holding ``path``; None at the top (``/``, a bucket).

    >>> parent("s3://b/run/7"), parent("s3://b"), parent("/data/run"), parent("/")
    ('s3://b/run', None, '/data', None)
    """
    if is_url(path):
        scheme, bucket, key = split_url(path)
        return None if not key else f"{scheme}://{bucket}/{key}".rpartition("/")[0]
    above = os.path.dirname(path)
    return None if above == path else above


def realpath(path: str) -> str:
    """Where ``path`` leads: a local path with every symlink resolved (``os.path.realpath``); a URL as it is,
    normalized (object stores have no links).

    >>> realpath("s3://b//run/")
    's3://b/run'
    """
    return normalize(path) if is_url(path) else os.path.realpath(path)


class Storage(abc.ABC):
    """Where a checkpoint's files live: bytes and names, with the same methods for every backend.

    Paths are strings: absolute local paths, or URLs of the backend's scheme
    (``normalize`` makes either; ``join``, ``parent`` and ``realpath`` are
    functions of the names alone). An instance may be *confined* to a
    checkpoint root (``confine``): every read through it must resolve inside
    the root, or is refused with a ``CheckpointError``; the unconfined instance
    of a scheme (``treetools.checkpoint_io.storage.backend``) reads anything,
    and serves probes that look around a checkpoint (the "did you mean"
    diagnostics) and writes.

    A backend implements the abstract methods: ``confine`` (a backend without
    links returns itself: say so, never inherit it), ``stat``, ``scandir``,
    ``open``, ``read_range``, ``create``, ``write_atomically`` and ``remove``.
    The rest have defaults written in terms of those. Nothing here is about a
    library that reads the files by path: TensorStore's key-value stores for a
    scheme are the TensorStore adapter's (``formats/_ts_kvstore.py``).
    """

    scheme: str = ""
    """The URL scheme this backend reads (``file`` for the local disk)."""
    remote: bool = False
    """True when every read is a network round trip (more threads than cores help, ranged reads are GETs)."""

    # -- confinement

    @abc.abstractmethod
    def confine(self, path: str, *, follow_links: bool = False) -> "Storage":
        """A storage whose reads must stay inside ``path`` (a folder; for a file, its folder and the file itself);
        with ``follow_links``, one that follows links out of it (held open all the same). A backend without
        symlinks (a bucket) returns itself."""

    # -- probes (follow symlinks, like os.path)

    @abc.abstractmethod
    def stat(self, path: str) -> Any:
        """``os.stat``-like (``st_mode``: the kind; ``st_size``) of what ``path`` leads to; FileNotFoundError when
        nothing is there."""

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except (OSError, ValueError):
            return False
        return True

    def lexists(self, path: str) -> bool:
        """Whether anything stands at ``path``, a broken link included."""
        return self.exists(path) or self.link_target(path) is not None

    def isdir(self, path: str) -> bool:
        try:
            return stat_.S_ISDIR(self.stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def isfile(self, path: str) -> bool:
        try:
            return stat_.S_ISREG(self.stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def getsize(self, path: str) -> int:
        return self.stat(path).st_size

    def link_target(self, path: str) -> str | None:
        """Where the symlink at ``path`` points, as stored; None where ``path`` is no link (no backend but a disk
        has them)."""
        return None

    @abc.abstractmethod
    def scandir(self, path: str) -> ContextManager[Iterator[Any]]:
        """The entries of folder ``path`` (``os.DirEntry``-like: ``name``, ``path``, ``is_dir``, ``is_file``,
        ``is_symlink``, ``stat``); FileNotFoundError when there is no such folder.

        ``is_dir()`` and ``is_file()`` say what an entry leads to, a link's target included: listings ask them
        so (never ``follow_symlinks=False``), so that a link inside a checkpoint reads as what it names and one
        leading out of it is refused when it is read, never skipped as neither file nor folder."""

    def listdir(self, path: str) -> list[str]:
        with self.scandir(path) as it:
            return sorted(e.name for e in it)

    def walk(self, top: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` top down (``dirs`` may be pruned) for any backend: a link to a folder is walked as the
        folder it leads to (``scandir``'s ``is_dir()``), never left out as neither file nor folder."""
        pending = [top]
        while pending:
            folder = pending.pop()
            try:
                with self.scandir(folder) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue
            dirs = sorted(e.name for e in entries if e.is_dir())
            yield folder, dirs, sorted(e.name for e in entries if not e.is_dir())
            pending.extend(join(folder, d) for d in reversed(dirs))

    def missing(self, path: str) -> Exception:
        """The error for a path with nothing at it."""
        return CheckpointNotFoundError(f"{path}: no such file or folder.")

    # -- reads

    @abc.abstractmethod
    def open(self, path: str, *, block_size: int = 64 * 2**10) -> Any:
        """A file opened for reading (binary, seekable). ``block_size``: how far ahead a bucket reads."""

    @abc.abstractmethod
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` (fewer at the end of the file)."""

    def read_into(self, path: str, view: memoryview, pos: int) -> int:
        """Read into ``view`` from byte ``pos``; the number of bytes read (short at the end of the file)."""
        data = self.read_range(path, pos, len(view))
        view[: len(data)] = data
        return len(data)

    # -- listings a backend may remember (a bucket); no-ops on a disk

    def forget(self, path: str) -> None:  # noqa: B027  (a no-op on a disk, on purpose: not abstract)
        """Drop remembered listings, so the next look at ``path`` asks afresh."""

    def prefetch(self, folder: str, *, tree: bool = False) -> bool:
        """List ``folder`` now where that answers the probes that follow (``tree``: everything below it at once,
        where that saves round trips); whether it was listed."""
        return False

    # -- writes (treetools convert, the one command that writes)

    @abc.abstractmethod
    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> Upload:
        """A file opened for writing (``Upload``), its folders made as needed: nothing at ``path`` reads as complete
        before ``commit``."""

    @abc.abstractmethod
    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        """Write ``dst`` (a file, or with ``folder`` a folder of files) so that nothing partial ever reads as it.

        ``write(path)`` writes the file (or the folder's files) at ``path`` with ``create`` (``fsync=False``) and
        returns the files it wrote; where ``path`` is, and how it becomes ``dst``, is the backend's: a temporary
        name renamed at the end on a disk (``fsync``: durably), ``dst`` itself in a bucket, whose objects appear
        whole when their upload completes (an old folder is removed first, so old shards never read beside new
        ones). A failed or interrupted write leaves nothing at the temporary name. Without ``overwrite``, a
        disk's final rename never replaces what appeared at ``dst`` meanwhile (a bucket has no such rename: the
        caller's check before writing is all there is).
        """

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove a file or a whole folder; nothing there is no error."""


def map_io(storage: Storage, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``[fn(x) for x in items]``; on a remote storage several at a time (each waits on the network).

    >>> from treetools.checkpoint_io.storage import LOCAL
    >>> map_io(LOCAL, abs, [-1, 2])
    [1, 2]
    """
    items = list(items)
    if not storage.remote or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(REMOTE_IO_THREADS, len(items)), thread_name_prefix="treetools-io") as pool:
        return list(pool.map(fn, items))


REMOTE_IO_THREADS = 16
"""Round trips one read of a remote storage keeps in flight at once (``map_io``: listings and small files of many
steps)."""


@contextlib.contextmanager
def entries(items: Iterable[Entry]) -> Iterator[Iterator[Entry]]:
    """``items`` as ``scandir`` yields them (a context manager around an iterator)."""
    yield iter(items)
