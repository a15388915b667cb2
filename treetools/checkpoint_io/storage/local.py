"""The local disk, and confinement: the reads of a checkpoint stay inside the folder it was opened at.

Checkpoints are untrusted input: a symlink inside one (a chunk file, an item
folder, a metadata file) may lead anywhere on the machine. ``confine(path)``
opens the checkpoint's folder once (a ``Root``, holding an open descriptor of
it) and returns a ``LocalStorage`` bound to it: every read through that
storage (``open``, ``read_range``, ``read_into``, the listings; and the folders
the TensorStore adapter opens through ``open_fd`` and checks against ``root``)
resolves inside the root, or is refused. The
storage holds the root; the readers a checkpoint hands out hold the storage;
nothing is registered by path, and nothing depends on which thread reads.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_
import weakref
from typing import Any, Callable, Iterable, Iterator

from treetools.checkpoint_io.storage.base import OutsideCheckpointError, SpecialFileError, Storage, Upload, kind_of_mode
from treetools.shared.errors import CheckpointError
from treetools.shared.files import create_new, fsync_dir, fsync_file, remove, swap_in, tmp_name

HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
"""Folder names of a Hugging Face hub cache repo, whose ``snapshots/<rev>/`` files link into its ``blobs/``."""

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def fd_path(fd: int) -> str | None:
    """The real path of an open descriptor (Linux: its /proc link), None where the OS does not say."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target[: -len(" (deleted)")] if target.endswith(" (deleted)") else target


class Root:
    """A checkpoint root: the folder a checkpoint was opened at, held open, and where reads under it may lead.

    Every local file read under ``path`` must resolve (symlinks followed)
    inside the real path of the folder that was opened, or be one of the files
    a user named (a checkpoint file given as PATH may itself be a link: the
    user chose it). One layout links out of its folder by design, the Hugging
    Face hub cache (``models--org--name/snapshots/<rev>/model.safetensors ->
    ../../blobs/<sha>``): a root inside a ``snapshots/`` folder of such a repo
    may also read anything inside that same repo folder, nothing beyond it.

    With ``follow_links`` (``ReadContext.follow_links``, ``--follow-links``)
    every path is allowed: links out of the root are followed, as a user who
    keeps step folders on other volumes asks; the folder is still held open.

    The folder's descriptor is opened once, here: the real path it is known by
    is the one of the folder opened, whatever is renamed or relinked at its
    name later. It is closed by ``close`` or when the root is collected.

    >>> import tempfile, os
    >>> repo = os.path.join(os.path.realpath(tempfile.mkdtemp()), "models--org--m")
    >>> os.makedirs(os.path.join(repo, "snapshots", "abc"))
    >>> root = Root(os.path.join(repo, "snapshots", "abc"))
    >>> root.allows(os.path.join(repo, "blobs", "f00")), root.allows(os.path.dirname(repo))
    (True, False)
    >>> root.close()
    """

    def __init__(self, path: str, *, named: str | None = None, follow_links: bool = False):
        self.path = path
        self.follow_links = follow_links
        self.fd: int | None = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        real = fd_path(self.fd) or os.path.realpath(path)
        self.allowed: tuple[str, ...] = ()
        self._allow(path, real)
        if named is not None:
            self._allow(named, os.path.realpath(named))

    def _allow(self, path: str, real: str) -> None:
        allowed = [*self.allowed, real]
        for candidate in (path, real):  # a snapshot file given as PATH is itself a link into blobs/
            parts = candidate.split(os.sep)
            for i in range(1, len(parts) - 1):
                if parts[i + 1] == "snapshots" and parts[i].startswith(HF_REPO_PREFIXES):
                    allowed.append(os.path.realpath(os.sep.join(parts[:i + 1])))
        self.allowed = tuple(dict.fromkeys(allowed))

    def allows(self, real: str) -> bool:
        """Whether the real path ``real`` lies inside this root (the folder opened, wherever it is now; or its
        Hugging Face repo folder, or the file the user named)."""
        if self.follow_links:  # the user's opt-in: every link is followed wherever it leads
            return True
        here = fd_path(self.fd) if self.fd is not None else None
        allowed = (*self.allowed, here) if here else self.allowed
        return any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in allowed)

    def relative(self, path: str) -> str | None:
        """``path`` relative to the root folder, when it lies under it by name; else None."""
        if path == self.path:
            return "."
        head = self.path.rstrip(os.sep) + os.sep
        return path[len(head):] if path.startswith(head) else None

    def outside(self, path: str) -> OutsideCheckpointError:
        return OutsideCheckpointError(
            f"{path}: resolves outside the checkpoint {self.path} (a symlink leading out of it?); refusing to read "
            "it (--follow-links, follow_links=True: if you trust it).")

    def check(self, path: str, real: str | None = None) -> None:
        """Refuse ``path``, when it lies under the root by name, unless its real path (``real``, else
        ``os.path.realpath``) lies inside the root too. A path outside the root by name is one a format asks for
        knowingly (the step folder above an item folder given as PATH), not one the checkpoint named."""
        if self.relative(path) is not None and not self.allows(real if real is not None else os.path.realpath(path)):
            raise self.outside(path)

    def close(self) -> None:
        self._finalizer()
        self.fd = None

    def __repr__(self) -> str:
        return f"Root({self.path!r})"


def _special(path: str, mode: int) -> SpecialFileError:
    """The refusal of ``path``, which is no regular file (``mode``: what it is), before it is ever opened."""
    kind = kind_of_mode(mode)
    return SpecialFileError(f"{path}: not a regular file ({kind}); refusing to read it.", path=path, kind=kind)


def _kind(mode: int) -> str:
    return "directory" if stat_.S_ISDIR(mode) else "file" if stat_.S_ISREG(mode) else "other"


class LocalEntry:
    """One entry of a local folder, as ``os.DirEntry`` answers (``name``, ``path``, ``is_dir``, ``is_file``,
    ``is_symlink``, ``stat``), its kinds found while the folder was held open.

    ``is_dir()`` and ``is_file()`` (``follow_symlinks=True``, the default) say
    what the entry leads to: for a link, the kind of its target, asked through
    the folder's descriptor. A link to a folder or a file is listed as that
    folder or file, never as something else to skip; reading it is what
    confinement checks. A broken or looping link leads to nothing: neither.
    """

    __slots__ = ("name", "path", "_own", "_target", "_storage")

    def __init__(self, name: str, path: str, own: str, target: str | None, storage: "LocalStorage"):
        self.name, self.path, self._own, self._target, self._storage = name, path, own, target, storage

    @classmethod
    def of(cls, entry: os.DirEntry, folder: str, fd: int, storage: "LocalStorage") -> "LocalEntry":
        """``entry`` of ``os.scandir(fd)`` (``fd``: folder ``folder``, still open)."""
        target: str | None
        if entry.is_symlink():
            own = "symlink"
            try:
                target = _kind(os.stat(entry.name, dir_fd=fd).st_mode)
            except OSError:  # broken, a loop
                target = None
        else:
            own = ("directory" if entry.is_dir(follow_symlinks=False)
                   else "file" if entry.is_file(follow_symlinks=False) else "other")
            target = own
        return cls(entry.name, os.path.join(folder, entry.name), own, target, storage)

    def _is(self, kind: str, follow_symlinks: bool) -> bool:
        return (self._target if follow_symlinks else self._own) == kind

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return self._is("directory", follow_symlinks)

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return self._is("file", follow_symlinks)

    def is_symlink(self) -> bool:
        return self._own == "symlink"

    def stat(self, follow_symlinks: bool = True) -> Any:
        return self._storage.stat(self.path) if follow_symlinks else self._storage.lstat(self.path)

    def __repr__(self) -> str:
        return f"<LocalEntry {self.name!r}>"


class LocalUpload(Upload):
    """A local file written at ``path`` (the caller picks a temporary name and renames it), created new (never
    through a name planted there: ``create_new``); ``commit`` flushes and fsyncs it, ``abort`` removes it."""

    def __init__(self, path: str, *, fsync: bool = True):
        self.path, self._fsync, self.written = path, fsync, 0
        self._file = os.fdopen(create_new(path), "wb")

    def write(self, data: Any) -> None:
        with self._named():
            self._file.write(data)
        self.written += memoryview(data).nbytes

    def write_runs(self, runs: Iterable[tuple[memoryview, int]]) -> None:
        """Write each ``(view, pos)`` of ``runs`` at byte ``pos`` (one ``pwrite`` each): a block of a leaf written
        out of C order (``treetools.checkpoint_io.writers.safetensors``); ``written`` grows by their bytes, and
        ``write`` appends after the furthest byte written. A local fast path, not part of the ``Upload``
        interface (a bucket's upload is appended in order)."""
        with self._named():
            self._file.flush()
            fd, end = self._file.fileno(), self._file.tell()
            for view, pos in runs:
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], pos + done)
                self.written += len(view)
                end = max(end, pos + len(view))
            self._file.seek(end)

    def commit(self) -> None:
        with self._named():
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
            self._file.close()

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """An OS error of the write (a full disk) naming the file, as ``open`` names it."""
        try:
            yield
        except OSError as e:
            if e.filename is not None or not e.strerror:
                raise
            raise type(e)(e.errno, e.strerror, self.path) from None

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the close's flush too: the file goes all the same
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LocalStorage(Storage):
    """The local file system through ``os``: same semantics (symlinks and FIFOs included), no import cost.

    ``root``: the checkpoint root reads are confined to (``confine``); None reads anything.
    """

    scheme = "file"

    def __init__(self, root: Root | None = None):
        self.root = root

    def confine(self, path: str, *, follow_links: bool = False) -> "LocalStorage":
        """A storage whose reads stay inside ``path``: a folder is its own root; a file's root is its folder (a
        T5X ``checkpoint`` file names the zarr folders beside it), which may also read the file itself wherever
        it links. ``follow_links``: links out of the root are followed (``Root``)."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return LocalStorage(Root(path, follow_links=follow_links))
        return LocalStorage(Root(os.path.dirname(path), named=path, follow_links=follow_links))

    def close(self) -> None:
        """Release the root's open folder (reads after it are refused); nothing for the unconfined disk."""
        if self.root is not None:
            self.root.close()

    def _at(self, path: str) -> tuple[str, int | None]:
        """Where ``path`` is reached: ``(path relative to the root's open folder, its descriptor)`` when it lies
        under the root by name, else ``(path, None)`` (``os`` calls take both: ``dir_fd=None`` goes by name).

        Every probe and listing under the root goes through the folder that was
        opened, as every read does: renaming the checkpoint and planting a link
        at its name changes nothing that is probed, listed or read.
        """
        root = self.root
        fd = root.fd if root is not None else None
        rel = root.relative(path) if root is not None and fd is not None else None
        return (path, None) if rel is None else (rel, fd)

    # -- probes (symlinks followed, as os.path does; what a link out of the root leads to is a kind and a size,
    #    never read: reads and listings through it are refused)

    def stat(self, path: str) -> Any:
        return self._os(os.stat, path)

    def lstat(self, path: str) -> Any:
        return self._os(os.stat, path, follow_symlinks=False)

    def _os(self, call: Callable[..., Any], path: str, **kwargs: Any) -> Any:
        """``call(path)`` reached through ``_at``; an ``OSError`` names ``path`` as the checkpoint names it."""
        rel, fd = self._at(path)
        try:
            return call(rel, dir_fd=fd, **kwargs)
        except OSError as e:
            if fd is None:
                raise
            raise type(e)(e.errno, e.strerror, path) from None

    def _mode(self, path: str, *, follow: bool = True) -> int | None:
        try:
            return (self.stat(path) if follow else self.lstat(path)).st_mode
        except (OSError, ValueError):  # ValueError: a NUL byte, as os.path answers
            return None

    def exists(self, path: str) -> bool:
        return self._mode(path) is not None

    def lexists(self, path: str) -> bool:
        return self._mode(path, follow=False) is not None

    def isdir(self, path: str) -> bool:
        return stat_.S_ISDIR(self._mode(path) or 0)

    def isfile(self, path: str) -> bool:
        return stat_.S_ISREG(self._mode(path) or 0)

    def link_target(self, path: str) -> str | None:
        try:
            return self._os(os.readlink, path)
        except (OSError, ValueError):  # no link there (or nothing at all)
            return None

    def getsize(self, path: str) -> int:
        return self.stat(path).st_size

    def _entries(self, path: str) -> tuple[list["LocalEntry"], tuple[int, int]]:
        """The entries of folder ``path`` (opened as every read is: under the root, relative to its descriptor
        and checked inside it), each with its kind and, for a link, the kind of what it leads to; and the
        folder's ``(device, inode)``."""
        fd = self.open_fd(path, _DIRECTORY)
        try:
            st = os.fstat(fd)
            with os.scandir(fd) as it:
                found = [LocalEntry.of(e, path, fd, self) for e in it]
        finally:
            os.close(fd)
        return found, (st.st_dev, st.st_ino)

    @contextlib.contextmanager
    def scandir(self, path: str) -> Iterator[Any]:
        """``os.scandir`` of a folder, read through its own descriptor: ``LocalEntry``s, whose ``is_dir()`` and
        ``is_file()`` say what a link leads to (a link inside the checkpoint is what it names; a folder reached
        through a link out of it is refused when it is listed or read, never skipped in silence)."""
        found, _ = self._entries(path)
        yield iter(found)

    def listdir(self, path: str) -> list[str]:
        fd = self.open_fd(path, _DIRECTORY)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def walk(self, top: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` top down (``dirs`` may be pruned), a link to a folder walked as that folder (listed
        through ``scandir``: inside the root, or refused); a link back to a folder above it is refused, not
        walked round for ever.

        Raises:
          CheckpointError: a folder resolves outside the root, or links back to a folder above it.
        """
        pending: list[tuple[str, tuple[tuple[int, int], ...]]] = [(top, ())]
        while pending:
            folder, above = pending.pop()
            try:
                found, ident = self._entries(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if ident in above:
                raise CheckpointError(f"{folder}: a symlink back to a folder above it (a loop); refusing to walk it.")
            dirs = sorted(e.name for e in found if e.is_dir())
            yield folder, dirs, sorted(e.name for e in found if not e.is_dir())
            pending.extend((os.path.join(folder, d), (*above, ident)) for d in reversed(dirs))

    # -- reads

    def open_fd(self, path: str, flags: int = 0) -> int:
        """A regular file (or, with ``os.O_DIRECTORY``, folder) opened read-only, after checking what was opened.

        Under the root, the path is opened relative to the root's own
        descriptor; the check is of the descriptor itself (its real path
        through /proc, else its inode against ``realpath``), so a link swapped
        in between a check and the open cannot redirect the read.

        What stands there is looked at first (through the same descriptor): a
        FIFO, a socket or a device is refused without ever being opened.

        Raises:
          OutsideCheckpointError: it resolves outside the root.
          SpecialFileError: it is not a regular file (a FIFO, a device).
          CheckpointError: ``path`` holds a NUL byte.
          OSError: it cannot be opened (``NotADirectoryError``: a folder was asked for), naming ``path``.
        """
        if "\0" in path:
            raise CheckpointError(f"{path!r}: a NUL byte in a path; the checkpoint names a file that cannot exist.")
        want = stat_.S_ISDIR if flags & _DIRECTORY else stat_.S_ISREG
        # O_NONBLOCK: a FIFO swapped in for a file after the stat opens at once (and is refused below) instead of
        # hanging the open; the stat first means a FIFO standing there is never opened at all.
        flags |= os.O_RDONLY | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
        root = self.root
        rel, dir_fd = self._at(path)
        try:
            mode = os.stat(rel, dir_fd=dir_fd).st_mode
            if want(mode):
                fd = os.open(rel, flags, dir_fd=dir_fd)
        except OSError as e:  # named as the checkpoint names it, not relative to the root's descriptor
            raise type(e)(e.errno, e.strerror, path) from None
        if not want(mode):
            if flags & _DIRECTORY:  # as os.open(O_DIRECTORY) says it
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            raise _special(path, mode)
        try:
            opened = os.fstat(fd).st_mode
            if not want(opened):  # swapped in between the stat and the open
                raise _special(path, opened)
            if root is not None:
                real = fd_path(fd)
                if real is None:  # no /proc: the real path, proven to be the file opened
                    real = os.path.realpath(path)
                    st, fst = os.stat(real), os.fstat(fd)
                    if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
                        raise CheckpointError(f"{path}: changed while it was opened; refusing to read it.")
                root.check(path, real)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open(self, path: str, *, block_size: int = 64 * 2**10) -> Any:
        return os.fdopen(self.open_fd(path), "rb")

    def read_range(self, path: str, start: int, length: int) -> bytes:
        fd = self.open_fd(path)
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

    def read_into(self, path: str, view: memoryview, pos: int) -> int:
        try:
            fd = self.open_fd(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
        try:
            return _pread(fd, view, pos)
        finally:
            os.close(fd)

    def read_runs(self, path: str, runs: Iterable[tuple[memoryview, int]]) -> int:
        """Read each ``(view, pos)`` of ``runs`` in order, the file opened once for all (one ``preadv`` each); how
        many were read whole (fewer: the file ended inside the next one). A strided block's rows (``FileReader``);
        a local fast path, not part of the ``Storage`` interface (a bucket reads a strided block in slabs)."""
        try:
            fd = self.open_fd(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e}).") from None
        try:
            done = 0
            for view, pos in runs:
                if _pread(fd, view, pos) < len(view):
                    break
                done += 1
            return done
        finally:
            os.close(fd)

    # -- writes

    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> LocalUpload:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return LocalUpload(path, fsync=fsync)

    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        """Written under a temporary name beside ``dst`` (files fsynced once all are written: the kernel writes
        the first back meanwhile), then renamed onto it (``treetools.shared.files.swap_in``: without
        ``overwrite``, the rename itself refuses anything that appeared at ``dst`` meanwhile); removed on any
        failure."""
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        tmp = tmp_name(dst, "tmp")
        try:
            written = write(tmp)
            if fsync:
                for path in written:
                    fsync_file(path)
                if folder:
                    fsync_dir(tmp)
            swap_in(tmp, dst, overwrite=overwrite)
        except BaseException:
            self.remove(tmp)
            raise

    def remove(self, path: str) -> None:
        remove(path)


def _pread(fd: int, view: memoryview, pos: int) -> int:
    """Read into ``view`` from byte ``pos`` of ``fd``; the bytes read (short at the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], pos + got)
        if n <= 0:
            break
        got += n
    return got
