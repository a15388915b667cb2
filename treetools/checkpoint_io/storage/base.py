"""The storage interface: what every backend (the local disk, a bucket) answers, with the same methods.

Readers of checkpoints (the step rule, the formats, the array readers) ask a
``Storage`` instead of ``os``, so one code path reads a local folder and the
same folder in a bucket, and no caller branches on the scheme. A backend is
one class (``treetools.checkpoint_io.storage.local.LocalStorage``,
``treetools.checkpoint_io.storage.bucket.GcsStorage`` / ``S3Storage``); a new scheme is
one more, registered with ``register_scheme``.

Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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


class Upload:
    """One file being written: ``write`` bytes, then ``commit`` (the file exists, whole) or ``abort`` (it does not).

    Used as a context manager, an exception aborts. ``written`` counts the bytes written so far.
    """

    path: str
    written: int = 0

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Pinned:
    """A folder opened once and checked, for a library that opens the files in it by path (TensorStore).

    ``path`` is what to hand the library. The default (a bucket: no links to
    follow) is the folder's URL itself, with nothing to check; the local backend
    hands out a descriptor's path instead.
    """

    fd: int | None = None
    identity: tuple[int, ...] = ()

    def __init__(self, folder: str):
        self.folder = self.path = folder

    def check_file(self, name: str) -> None:
        """Refuse ``name`` (relative) unless it may be read (inside the checkpoint, a regular file)."""

    def check_tree(self) -> None:
        """Refuse the folder unless everything below it may be read."""

    def unchanged(self) -> bool:
        """Whether the folder is still the one pinned and checked (a bucket's URL always is)."""
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Storage:
    """Where a checkpoint's files live, with the same methods for every backend.

    Paths are strings: absolute local paths, or URLs of the backend's scheme
    (``normalize`` makes either). An instance may be *confined* to a checkpoint
    root (``confine``): every read through it must resolve inside the root, or
    is refused with a ``CheckpointError``; the unconfined instance of a scheme
    (``treetools.checkpoint_io.storage.backend``) reads anything, and serves probes that
    look around a checkpoint (the "did you mean" diagnostics) and writes.

    Implementation hint: a backend implements the probes (``info``-like
    ``exists``/``isdir``/``isfile``/``getsize``/``stat``), ``scandir``,
    ``open``, ``read_range``, ``kvstore_spec`` and the writes; the rest have
    defaults written in terms of those.
    """

    scheme: str = ""
    remote: bool = False
    """True when every read is a network round trip (more threads than cores help, ranged reads are GETs)."""

    # -- confinement

    def confine(self, path: str, *, follow_links: bool = False) -> "Storage":
        """A storage whose reads must stay inside ``path`` (a folder; for a file, its folder and the file itself);
        with ``follow_links``, one that follows links out of it (held open all the same). The default (no
        symlinks, as in a bucket) is this storage itself."""
        return self

    def close(self) -> None:
        """Release what ``confine`` holds (an open folder); reads after it are refused."""

    # -- names

    def join(self, folder: str, name: str) -> str:
        return os.path.join(folder, name)

    def parent(self, path: str) -> str | None:
        """The folder holding ``path``; None at the top (``/``, a bucket)."""
        parent = os.path.dirname(path)
        return None if parent == path else parent

    def realpath(self, path: str) -> str:
        return normalize(path)

    # -- probes (follow symlinks, like os.path)

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def lexists(self, path: str) -> bool:
        return self.exists(path)

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def isfile(self, path: str) -> bool:
        raise NotImplementedError

    def islink(self, path: str) -> bool:
        return False

    def readlink(self, path: str) -> str:
        """Where the link ``path`` points, as stored; OSError where it is no link (no backend but a disk has them)."""
        raise OSError(errno.EINVAL, "not a symlink", path)

    def lstat(self, path: str) -> Any:
        """``stat`` of ``path`` itself, a link not followed (the same as ``stat`` where there are no links)."""
        return self.stat(path)

    def getsize(self, path: str) -> int:
        return self.stat(path).st_size

    def stat(self, path: str) -> Any:
        raise NotImplementedError

    def scandir(self, path: str) -> ContextManager[Iterator[Any]]:
        """The entries of folder ``path`` (``os.DirEntry``-like: ``name``, ``path``, ``is_dir``, ``is_file``,
        ``is_symlink``, ``stat``); FileNotFoundError when there is no such folder.

        ``is_dir()`` and ``is_file()`` say what an entry leads to, a link's target included: listings ask them
        so (never ``follow_symlinks=False``), so that a link inside a checkpoint reads as what it names and one
        leading out of it is refused when it is read, never skipped as neither file nor folder."""
        raise NotImplementedError

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
            pending.extend(self.join(folder, d) for d in reversed(dirs))

    # -- reads

    def open(self, path: str, *, block_size: int = 64 * 2**10) -> Any:
        """A file opened for reading (binary, seekable). ``block_size``: how far ahead a bucket reads."""
        raise NotImplementedError

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` (fewer at the end of the file)."""
        raise NotImplementedError

    def read_into(self, path: str, view: memoryview, pos: int) -> int:
        """Read into ``view`` from byte ``pos``; the number of bytes read (short at the end of the file)."""
        data = self.read_range(path, pos, len(view))
        view[: len(data)] = data
        return len(data)

    def kvstore_spec(self, folder: str) -> dict[str, Any]:
        """The TensorStore key-value store of a folder."""
        raise NotImplementedError

    def tensorstore_context(self) -> dict[str, Any] | None:
        """The spec of one TensorStore context the readers of one item share, or None: each array opens with a
        fresh, cache-less context (locally, where an open costs no round trip)."""
        return None

    def pin(self, folder: str) -> Pinned:
        """``folder`` opened and checked, to hand a library that opens the files in it by path."""
        return Pinned(folder)

    def missing(self, path: str) -> Exception:
        """The error for a path with nothing at it."""
        return CheckpointNotFoundError(f"{path}: no such file or folder.")

    # -- listings a backend may remember (a bucket); no-ops on a disk

    def forget(self, path: str) -> None:
        """Drop remembered listings, so the next look at ``path`` asks afresh."""

    def prefetch_tree(self, folder: str) -> bool:
        """List everything below ``folder`` at once where that saves round trips; whether it was listed."""
        return False

    def prefetch(self, folder: str) -> None:
        """List ``folder`` now where that answers the probes that follow."""

    def map_io(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(x) for x in items]``; a remote backend runs them several at a time (each waits on the network)."""
        return [fn(x) for x in items]

    # -- writes (treetools convert, the one command that writes)

    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> Upload:
        """A file opened for writing (``Upload``): nothing at ``path`` reads as complete before ``commit``."""
        raise NotImplementedError

    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        """Write ``dst`` (a file, or with ``folder`` a folder of files) so that nothing partial ever reads as it.

        ``write(path)`` writes the file (or the folder's files, after ``makedirs(path)``) at ``path`` with
        ``create`` (``fsync=False``) and returns the files it wrote; where ``path`` is, and how it becomes
        ``dst``, is the backend's: a temporary name renamed at the end on a disk (``fsync``: durably), ``dst``
        itself in a bucket, whose objects appear whole when their upload completes (an old folder is removed
        first, so old shards never read beside new ones). A failed or interrupted write leaves nothing at the
        temporary name. Without ``overwrite``, a disk's final rename never replaces what appeared at ``dst``
        meanwhile (a bucket has no such rename: the caller's check before writing is all there is).
        """
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        """``os.makedirs(path, exist_ok=True)``; nothing where folders are key prefixes."""

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, replacing what is there (durably); a backend without rename refuses."""
        raise ValueError(f"{self.scheme}:// has no rename; writers upload to the final name instead.")

    def remove(self, path: str) -> None:
        """Remove a file or a whole folder; nothing there is no error."""
        raise NotImplementedError

    def fsync_dir(self, path: str) -> None:
        """Make a rename in folder ``path`` durable (no-op where that means nothing)."""


@contextlib.contextmanager
def entries(items: Iterable[Entry]) -> Iterator[Iterator[Entry]]:
    """``items`` as ``scandir`` yields them (a context manager around an iterator)."""
    yield iter(items)
