"""Local files written so that a link planted where they go is never written through, and nothing partial shows.

Every file treetools writes on the local disk (``plot``'s images, ``train``'s
``metrics.jsonl``, ``convert``'s output, the step ``convert --to orbax
--dst-step`` writes) goes through here:

* a new file is made under a temporary name beside its destination, created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a name planted there, link or file,
  makes the create fail instead of being written through), written whole,
  flushed, then renamed onto the destination: the rename replaces whatever
  entry is at the destination (a planted symlink is replaced as a link; what it
  pointed to is untouched), and a reader sees the old file or the new one,
  never part of either (``replace_file``);
* appending to a file opens it ``O_NOFOLLOW``: a link at its name is refused,
  never appended through (``open_append``);
* a finished folder or file is placed at its destination either replacing what
  is there only once the new one is complete (``swap_in``), or, without
  overwrite, never replacing anything: the rename itself refuses an entry that
  appeared meanwhile (``place_new``: ``renameat2(RENAME_NOREPLACE)`` on Linux,
  else a hard link for a file and an exclusive ``mkdir`` for a folder).

The folder a write goes into is the one the user named (a path's parent
folders are theirs to link); only the entry written is guarded.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from typing import IO, Any, Callable, Iterator

from treetools.shared.errors import TreetoolsError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


NAME_MAX = 255
"""The longest name of one file or folder, in bytes, on the file systems treetools writes to (Linux, macOS)."""

TMP_SUFFIX_ROOM = 32
"""Bytes a temporary name leaves free for what a writer appends to it (Orbax's ``.orbax-checkpoint-tmp``: 21)."""


class LinkRefusedError(TreetoolsError, PermissionError):
    """A write refused because its destination is a symbolic link (never written through): ``filename`` is the
    link, ``strerror`` says why (one line: ``PATH: reason.``)."""


def tmp_name(dst: str, what: str) -> str:
    """A hidden name beside ``dst`` for a file or folder being written (``what``: ``tmp``, ``old``).

    >>> os.path.basename(tmp_name("/run/norms.png", "tmp")).startswith(".norms.png.treetools-tmp-")
    True
    """
    head, name = os.path.split(dst)
    tail = f".treetools-{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # A name is at most NAME_MAX (255) bytes: a long destination's own name is cut (both ends kept) to leave room
    # for the tail, and for what a writer appends to the temporary (Orbax: `.orbax-checkpoint-tmp`), so a
    # 230-character DST can be written (its temporary name was 264: ENAMETOOLONG).
    room = NAME_MAX - TMP_SUFFIX_ROOM - 1 - len(tail.encode())
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > room:
        half = room // 2
        name = (raw[:half] + b"~" + raw[len(raw) - (room - half - 1):]).decode("utf-8", "ignore")
    return os.path.join(head, f".{name}{tail}")


WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG",
                                                            "EIO", "EEXIST", "ENOTDIR", "EISDIR", "ENAMETOOLONG")
                          if hasattr(errno, name))
"""The errors of a write the user's place causes (read-only, no permission, full, over a quota): reported as one
``PATH: reason.`` line, never a traceback."""

_TMP = re.compile(r"^\.(.+?)\.treetools-(?:tmp|old|probe)-\d+-[0-9a-f]{8}")


def user_path(path: str) -> str:
    """The destination a temporary name (``tmp_name``) stands for; any other path as it is.

    >>> (user_path("/out/.model.safetensors.treetools-tmp-12-0123abcd"),
    ...  user_path("/out/.x.treetools-tmp-1-0123abcd.orbax-checkpoint-tmp/d/f"))
    ('/out/model.safetensors', '/out/x')
    >>> user_path("/out/model.safetensors")
    '/out/model.safetensors'
    """
    head = path
    while True:
        head, name = os.path.split(head)
        if not name:
            return path
        m = _TMP.match(name)
        if m:
            return os.path.join(head, m.group(1))
        if not head or head == os.sep:
            return path


def existing_folder(path: str) -> str:
    """The folder that holds ``path``'s first part still to be made: its parent, or the nearest one above it
    that exists (a write makes the folders between)."""
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def check_writable(path: str) -> None:
    """Fail at once, before any work, when ``path`` cannot be written: a file is created and removed in the
    folder that would hold it (``existing_folder``), which is the one test that holds for root, a read-only mount
    and access control lists alike.

    Raises:
      OSError: its errno, ``filename`` the folder, ``strerror`` ``cannot write there (REASON)``.

    >>> import tempfile; check_writable(os.path.join(tempfile.mkdtemp(), "new", "out.png"))
    """
    folder = existing_folder(path)
    probe = tmp_name(os.path.join(folder, "write-check"), "probe")
    try:
        os.close(create_new(probe))
    except OSError as e:
        raise OSError(e.errno, f"cannot write there ({e.strerror or e})", folder) from None
    with contextlib.suppress(OSError):
        os.unlink(probe)


def free_bytes(folder: str) -> int | None:
    """Bytes this process may still write in ``folder``'s file system (None where the system does not say)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def create_new(path: str, mode: int = 0o666) -> int:
    """A file descriptor of a new file at ``path``, opened for writing; fails (``FileExistsError``) if anything,
    a symlink included, is at ``path``."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def fsync_dir(path: str) -> None:
    """Make a rename in folder ``path`` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a local file's data to disk (durable before a rename makes it visible)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, content: bytes | Callable[[IO[bytes]], Any], *, fsync: bool = True) -> None:
    """Write the file ``path`` whole, then make it appear at once (see the module): ``content`` is its bytes, or a
    function writing them to the binary file it is given (``fig.savefig(f, format="png")``).

    A symlink at ``path`` is replaced by the new file; the file it pointed to is not touched. On any failure the
    temporary file is removed and ``path`` is left as it was.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); os.symlink(os.path.join(d, "elsewhere"), os.path.join(d, "out.txt"))
    >>> replace_file(os.path.join(d, "out.txt"), b"new")
    >>> os.path.islink(os.path.join(d, "out.txt")), os.path.exists(os.path.join(d, "elsewhere"))
    (False, False)
    """
    tmp = tmp_name(path, "tmp")
    fd = create_new(tmp)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:  # name `path`, not the temporary (a full disk's write names no file at all)
            if not e.strerror:
                raise
            raise type(e)(e.errno, e.strerror, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path))


@contextlib.contextmanager
def open_append(path: str) -> Iterator[IO[str]]:
    """``path`` opened to append text (created if absent), never through a link at its name.

    Raises:
      LinkRefusedError: ``path`` is a symbolic link.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkRefusedError(errno.ELOOP, "a symbolic link; treetools never writes through a link (remove it, or "
                                           "write elsewhere)", path) from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        yield f


def refuse_link_out(path: str, folder: str) -> None:
    """Refuse to write at ``path`` (inside ``folder``) when it is a symlink leading out of ``folder``.

    Raises:
      LinkRefusedError: naming the link and where it leads.
    """
    if not os.path.islink(path):
        return
    real, top = os.path.realpath(path), os.path.realpath(folder)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise LinkRefusedError(errno.ELOOP, f"a symbolic link leading out of {folder} (to {real}); treetools never "
                                       "writes through such a link (remove it, or pick another folder)", path)


_RENAMEAT2: Any = False  # looked up at the first use


def renameat2_available() -> bool:
    """Whether this process can call ``renameat2`` (Linux, glibc 2.28 or later): the running process's own
    symbols, looked up once, with no search and no subprocess."""
    global _RENAMEAT2
    if _RENAMEAT2 is False:
        import ctypes  # here: only a write that places a file needs it

        try:
            _RENAMEAT2 = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            _RENAMEAT2 = None
    return _RENAMEAT2 is not None


def _renameat2(src: str, dst: str, flags: int) -> int | None:
    """``renameat2(AT_FDCWD, src, AT_FDCWD, dst, flags)``: 0, an errno, or None where the call does not exist."""
    if not renameat2_available():
        return None
    import ctypes

    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def place_new(src: str, dst: str) -> None:
    """Rename the finished ``src`` to ``dst``, which must not exist: an entry that appeared at ``dst`` meanwhile
    (a file, a folder, a dangling symlink) makes it fail with ``FileExistsError`` and is left as it is.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); open(os.path.join(d, "a"), "w").close(); open(os.path.join(d, "b"), "w").close()
    >>> place_new(os.path.join(d, "a"), os.path.join(d, "b"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists: ...
    """
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        fsync_dir(os.path.dirname(dst))
        return
    if err == errno.EEXIST:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    if err is not None and err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), dst)
    # No RENAME_NOREPLACE here (an old kernel, a file system without it).
    if os.path.isdir(src) and not os.path.islink(src):
        os.mkdir(dst)  # exclusive: fails if anything is there; the rename then replaces only this empty folder
        try:
            os.rename(src, dst)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(dst)
            raise
    else:
        os.link(src, dst, follow_symlinks=False)  # fails if anything is at dst
        os.unlink(src)
    fsync_dir(os.path.dirname(dst))


def remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a whole folder; nothing there is no error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def swap_in(tmp: str, dst: str, *, overwrite: bool = True) -> None:
    """Put the finished ``tmp`` at ``dst``. With ``overwrite``, an existing ``dst`` is replaced only now that the
    new one is complete: a file replaces a file in one rename; a folder (or a link) is exchanged with ``tmp`` in
    one step (Linux ``RENAME_EXCHANGE``) and the old one removed (a link as a link, never what it points to);
    where that is not available, ``dst`` is moved aside and ``tmp`` renamed onto it, so ``dst`` is absent for
    the moment between two renames, never partial. Without ``overwrite``, nothing at ``dst`` is ever replaced
    (``place_new``).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "new", "x")); os.makedirs(os.path.join(d, "old", "y"))
    >>> swap_in(os.path.join(d, "new"), os.path.join(d, "old"))
    >>> sorted(os.listdir(d)), os.listdir(os.path.join(d, "old"))
    (['old'], ['x'])
    """
    if not overwrite:
        place_new(tmp, dst)
        return
    if not os.path.lexists(dst) or (os.path.isfile(tmp) and os.path.isfile(dst) and not os.path.islink(dst)):
        os.replace(tmp, dst)
        fsync_dir(os.path.dirname(dst))
        return
    if _exchange(tmp, dst):  # the new one at dst and the old one at tmp, in one step: dst is never absent
        fsync_dir(os.path.dirname(dst))
        remove(tmp)
        return
    aside = tmp_name(dst, "old")
    os.rename(dst, aside)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    fsync_dir(os.path.dirname(dst))
    remove(aside)


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); False where that is not
    available (another OS, an old kernel, a file system without it)."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err == 0:
        return True
    if err is None or err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)
