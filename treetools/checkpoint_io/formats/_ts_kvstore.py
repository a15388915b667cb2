"""How TensorStore reaches the files of each storage scheme: the TensorStore adapter's part of a scheme.

``Storage`` is bytes and names only. TensorStore opens the files of a store
itself, by path or URL, through its own key-value store drivers; what it needs
of a scheme is kept here, by scheme (``register_kvstore``):

- ``spec(folder)``: the key-value store spec of a folder (``file``, ``gcs``, ``s3``);
- ``context``: the spec of one TensorStore context the readers of one item share,
  or None (each array opens with a fresh, cache-less context: locally, an open
  costs no round trip);
- ``pin(storage, folder)``: the folder opened once and checked (``Pinned``), to
  hand TensorStore; locally ``LocalPinned`` (``/proc/self/fd/N``, every entry
  below inside the checkpoint root), elsewhere the URL as it is (no links);
- ``folder_of(node)``: the folder URL a spec node of the scheme's driver names
  (so an OCDBT database in it is checked before TensorStore opens it).

The built-in schemes (``file``, ``gs``, ``s3``) are registered below. A new
scheme's module registers its ``Storage`` (``register_scheme``) and, for
TensorStore to read arrays in it, its key-value store here. A scheme without
one is refused by every format whose arrays TensorStore reads (Orbax, T5X,
zarr folders), with one line naming the folder and the scheme
(``kvstore_spec``, ``pin``): TensorStore cannot read a scheme it has no driver for, and
arrays are not copied into memory behind the user's back; the formats treetools
reads itself (safetensors, npz, msgpack, ...) read any scheme.
"""

from __future__ import annotations

import dataclasses
import os
import stat as stat_
import threading
import weakref
from typing import Any, Callable

from treetools.checkpoint_io.storage import (
    LocalStorage,
    SpecialFileError,
    Storage,
    kind_of_mode,
    split_url,
)
from treetools.checkpoint_io.storage.local import Root, fd_path
from treetools.shared.errors import CheckpointError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Pinned:
    """A folder opened once and checked, for TensorStore, which opens the files in it by path.

    ``path`` is what to hand TensorStore. This one (a bucket: no links to
    follow) is the folder's URL itself, with nothing to check; ``LocalPinned``
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


def special_file(path: str, mode: int) -> SpecialFileError:
    """The refusal of ``path``, which is no regular file (``mode``: what it is), before it is ever opened."""
    kind = kind_of_mode(mode)
    return SpecialFileError(f"{path}: not a regular file ({kind}); refusing to read it.", path=path, kind=kind)


_WALKS: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
"""Folders already walked and found clean, by the identity of every folder gone through (a memo, not a registry
of roots: a changed folder changes its identity)."""
_WALKS_LOCK = threading.Lock()


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


class LocalPinned(Pinned):
    """A local folder opened once and checked, for a library that opens the files in it by path (TensorStore).

    ``path`` is what to hand the library: ``/proc/self/fd/N`` on Linux, so the
    folder read is the one checked even if a link is swapped in for it later
    (elsewhere its real path). ``identity`` changes when entries of the folder
    are added, removed or renamed. Close it when the library is done.
    """

    def __init__(self, storage: LocalStorage, folder: str, fd: int):
        self._storage, self.folder, self.fd = storage, folder, fd
        self.path = f"/proc/self/fd/{fd}" if fd_path(fd) is not None else os.path.realpath(folder)
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        self._finalizer = weakref.finalize(self, os.close, fd)

    def real(self, name: str = "") -> str:
        """The real path of ``name`` inside the folder (symlinks resolved)."""
        return os.path.realpath(os.path.join(self.path, name) if name else self.path)

    def check_file(self, name: str) -> None:
        root = self._storage.root
        if root is None:
            return
        real = self.real(name)
        root.check(os.path.join(self.folder, name), real)
        try:
            mode = os.stat(real).st_mode
        except OSError:
            return  # missing: the library's own error names it
        if not (stat_.S_ISREG(mode) or stat_.S_ISDIR(mode)):
            raise special_file(os.path.join(self.folder, name), mode)

    def check_tree(self) -> None:
        """Refuse the folder unless every entry below it resolves inside the checkpoint root (links followed) and
        is a regular file or folder (no FIFO, socket or device).

        A walk that found nothing wrong is remembered by the identity of every
        folder it went through (inode, modification and change times): while none
        of them has changed (an entry added, removed, renamed or relinked changes
        its folder's times), the next check of the same folder is those stats only.
        """
        root = self._storage.root
        if root is None:
            return
        key = (self.identity, root.allowed)
        with _WALKS_LOCK:
            dirs = _WALKS.get(key)
        if dirs is not None and all(_identity(os.path.join(self.path, rel)) == ident for rel, ident in dirs):
            return
        dirs = self._walk(root)
        with _WALKS_LOCK:
            _WALKS[key] = dirs
            while len(_WALKS) > 4096:
                _WALKS.pop(next(iter(_WALKS)))

    def unchanged(self) -> bool:
        """Whether the folder's path still leads to this folder as pinned (same inode, same times) and, when
        ``check_tree`` walked it, no folder below it has changed since (that walk's memo): a few stats. False
        sends the caller back to ``pin``, which checks afresh."""
        if _identity(self.folder) != self.identity:  # renamed, replaced, or a link swapped in on its path
            return False
        root = self._storage.root
        if root is None:
            return True
        with _WALKS_LOCK:
            dirs = _WALKS.get((self.identity, root.allowed))
        held = self.fd
        if dirs is None or held is None:  # never walked, or closed
            return False
        for rel, ident in dirs:  # relative to the held descriptor (no lookup through /proc for each)
            try:
                st = os.stat(rel, dir_fd=held) if rel else os.fstat(held)
            except (OSError, TypeError):
                return False
            if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != ident:
                return False
        return True

    def _walk(self, root: Root) -> list[tuple[str, tuple[int, ...]]]:
        """Every entry below the folder checked; ``(relative folder, identity)`` of each folder gone through."""
        seen: set[tuple[int, int]] = set()
        dirs: list[tuple[str, tuple[int, ...]]] = []
        if self.fd is None:
            raise CheckpointError(f"{self.folder}: checked after it was let go of.")
        stack = [(os.dup(self.fd), self.real(), self.folder, "")]
        nofollow = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC
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
                            root.check(name, target)
                            if os.path.isdir(target):
                                stack.append((self._storage.open_fd(target, _DIRECTORY), target, name, sub))
                            elif os.path.exists(target) and not os.path.isfile(target):
                                raise special_file(name, os.stat(target).st_mode)
                        elif e.is_dir(follow_symlinks=False):
                            stack.append((os.open(e.name, nofollow, dir_fd=fd), os.path.join(real, e.name), name, sub))
                        elif not e.is_file(follow_symlinks=False):
                            raise special_file(name, e.stat(follow_symlinks=False).st_mode)
            except BaseException:
                for other, *_ in stack:
                    os.close(other)
                raise
            finally:
                os.close(fd)
        return dirs

    def close(self) -> None:
        self._finalizer()
        self.fd = None


def pin_local(storage: Storage, folder: str) -> LocalPinned:
    """A local ``folder`` opened through ``storage`` (as every read is: inside its root) and pinned.

    Raises:
      CheckpointError: the folder resolves outside the root.
      OSError: it cannot be opened (missing, not a folder).
    """
    if not isinstance(storage, LocalStorage):
        raise TypeError(f"{folder}: a local folder is pinned through a LocalStorage, not {type(storage).__name__}.")
    return LocalPinned(storage, folder, storage.open_fd(folder, _DIRECTORY))


# ---------------------------------------------------------------------------- the registry


@dataclasses.dataclass(frozen=True)
class KvStore:
    """What TensorStore needs of one storage scheme (see the module's docstring)."""

    spec: Callable[[str], dict[str, Any]]
    context: dict[str, Any] | None = None
    pin: Callable[[Storage, str], Pinned] = lambda storage, folder: Pinned(folder)
    folder_of: Callable[[dict[str, Any]], str | None] = lambda node: None


_KVSTORES: dict[str, KvStore] = {}


def register_kvstore(scheme: str, spec: Callable[[str], dict[str, Any]], *,
                     context: dict[str, Any] | None = None,
                     pin: Callable[[Storage, str], Pinned] | None = None,
                     folder_of: Callable[[dict[str, Any]], str | None] | None = None) -> None:
    """Let TensorStore read arrays in ``scheme://`` storage: ``spec(folder)`` is the key-value store spec of a
    folder; ``context``, ``pin`` and ``folder_of`` as the module's docstring says (defaults: no shared context,
    a folder handed over as its URL, no OCDBT check of a remote database before TensorStore opens it)."""
    defaults = KvStore(spec)
    _KVSTORES[scheme.lower()] = KvStore(spec, context, pin or defaults.pin, folder_of or defaults.folder_of)


def _kvstore(storage: Storage, folder: str) -> KvStore:
    found = _KVSTORES.get(storage.scheme)
    if found is None:
        raise CheckpointError(
            f"{folder}: TensorStore cannot read {storage.scheme}:// storage (no key-value store is registered for "
            "the scheme: treetools.checkpoint_io.register_kvstore); copy the checkpoint to a local folder "
            "to read its arrays.")
    return found


def kvstore_spec(storage: Storage, folder: str) -> dict[str, Any]:
    """TensorStore's key-value store of ``folder`` in ``storage``.

    >>> from treetools.checkpoint_io.storage import LOCAL
    >>> kvstore_spec(LOCAL, "/data/run/7/params")
    {'driver': 'file', 'path': '/data/run/7/params/'}

    Raises:
      CheckpointError: TensorStore has no key-value store for the storage's scheme (one line naming it).
    """
    return _kvstore(storage, folder).spec(folder)


def tensorstore_context(storage: Storage) -> dict[str, Any] | None:
    """The spec of one TensorStore context the readers of one item share, or None (see ``KvStore.context``)."""
    found = _KVSTORES.get(storage.scheme)
    return found.context if found is not None else None


def pin(storage: Storage, folder: str) -> Pinned:
    """``folder`` opened and checked, to hand TensorStore (``Pinned``).

    Raises:
      CheckpointError: TensorStore has no key-value store for the storage's scheme (one line naming it).
    """
    return _kvstore(storage, folder).pin(storage, folder)


def folder_of(node: dict[str, Any]) -> str | None:
    """The folder URL a remote key-value store spec node names (a ``gcs`` or ``s3`` one), None for any other."""
    for kv in _KVSTORES.values():
        found = kv.folder_of(node)
        if found is not None:
            return found
    return None


def _file_spec(folder: str) -> dict[str, Any]:
    return {"driver": "file", "path": os.path.abspath(folder) + "/"}


def _bucket_spec(driver: str) -> Callable[[str], dict[str, Any]]:
    def spec(folder: str) -> dict[str, Any]:
        _, bucket, key = split_url(folder)
        return {"driver": driver, "bucket": bucket, "path": key + "/" if key else ""}

    return spec


def _s3_spec(folder: str) -> dict[str, Any]:
    """TensorStore's ``s3`` driver. The endpoint comes from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    (TensorStore does not read them itself) and the region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``;
    without either, TensorStore asks AWS for the bucket's region."""
    spec = _bucket_spec("s3")(folder)
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


def _bucket_folder(driver: str, scheme: str) -> Callable[[dict[str, Any]], str | None]:
    def folder(node: dict[str, Any]) -> str | None:
        if node.get("driver") != driver or not isinstance(node.get("bucket"), str):
            return None
        return f"{scheme}://{node['bucket']}/{str(node.get('path') or '').strip('/')}".rstrip("/")

    return folder


BUCKET_CONTEXT = {"cache_pool": {"total_bytes_limit": 64 * 2**20}}
"""A bucket item's shared context: every open costs round trips (an OCDBT manifest and b-tree nodes, the
credentials); sharing one context shares those and the connections, and its small cache keeps the b-tree nodes
every array looks up."""

register_kvstore("file", _file_spec, pin=pin_local)
register_kvstore("gs", _bucket_spec("gcs"), context=BUCKET_CONTEXT, folder_of=_bucket_folder("gcs", "gs"))
register_kvstore("s3", _s3_spec, context=BUCKET_CONTEXT, folder_of=_bucket_folder("s3", "s3"))
