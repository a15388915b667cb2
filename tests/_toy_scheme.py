"""Two storage schemes, each in this one module, as docs/formats.md ("Adding a storage scheme") writes one.

``toy://``: files live in a dict, ``{normalized URL: bytes}``; folders are key prefixes, as in a bucket. The class
implements the abstract methods of ``Storage`` (nothing else is needed) and the module registers it: importing
this module is all a program does to read and write ``toy://`` paths with every command. No TensorStore key-value
store is registered for it, so a format whose arrays TensorStore reads (Orbax, zarr) refuses it with one line.

``folder://``: a local folder under another name, registered with a TensorStore key-value store too
(``register_kvstore``): Orbax checkpoints read in it.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Callable

from treetools.checkpoint_io import register_kvstore
from treetools.checkpoint_io.formats._ts_kvstore import kvstore_spec, pin
from treetools.checkpoint_io.storage import (LOCAL, Entry, LocalStorage, Stat, Storage, Upload, entries, is_url, join,
                                             normalize, register_scheme, split_url)


class ToyUpload(Upload):
    """One object being written: it appears in the dict whole, at ``commit``."""

    def __init__(self, storage: "ToyStorage", path: str):
        self.path, self.written, self._storage = path, 0, storage
        self._parts: list[bytes] = []

    def write(self, data: Any) -> None:
        self._parts.append(bytes(data))
        self.written += len(self._parts[-1])

    def commit(self) -> None:
        with self._storage.lock:
            self._storage.files[self.path] = b"".join(self._parts)

    def abort(self) -> None:
        self._parts = []


class ToyStorage(Storage):
    scheme = "toy"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def confine(self, path: str, *, follow_links: bool = False) -> "ToyStorage":
        return self  # no links: no key under a folder leads out of it

    def _data(self, path: str) -> bytes:
        try:
            return self.files[normalize(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    def stat(self, path: str) -> Stat:
        key = normalize(path)
        if key in self.files:
            return Stat.of("file", len(self.files[key]))
        if any(k.startswith(key + "/") for k in list(self.files)):
            return Stat.of("directory", 0)
        raise FileNotFoundError(path)

    def scandir(self, path: str) -> Any:
        head = normalize(path) + "/"
        found: dict[str, Entry] = {}
        for key, data in list(self.files.items()):
            if key.startswith(head):
                name, below, _ = key[len(head):].partition("/")
                found[name] = Entry(name, head + name, "directory" if below else "file", 0 if below else len(data))
        if not found:
            raise FileNotFoundError(path)
        return entries(found[name] for name in sorted(found))

    def open(self, path: str, *, block_size: int = 64 * 2**10) -> io.BytesIO:
        return io.BytesIO(self._data(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self._data(path)[start:start + length]

    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> ToyUpload:
        return ToyUpload(self, normalize(path))

    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        dst = normalize(dst)
        tmp = dst + ".partial"
        try:
            write(tmp)
        except BaseException:
            self.remove(tmp)
            raise
        with self.lock:  # the renames: what was at dst goes, what was written appears there at once
            for key in [k for k in self.files if k == dst or k.startswith(dst + "/")]:
                del self.files[key]
            for key in [k for k in self.files if k == tmp or k.startswith(tmp + "/")]:
                self.files[dst + key[len(tmp):]] = self.files.pop(key)

    def remove(self, path: str) -> None:
        key = normalize(path)
        with self.lock:
            for k in [k for k in self.files if k == key or k.startswith(key + "/")]:
                del self.files[k]


TOY = ToyStorage()
register_scheme("toy", lambda url: TOY)


class FolderStorage(Storage):
    """``folder://NAME/KEY``: the local folder ``TOP/NAME/KEY`` under another name, read through the local disk's
    own storage (confinement included), and, registered with ``register_kvstore``, through TensorStore's ``file``
    store: Orbax and zarr checkpoints read in it as on the disk."""

    scheme = "folder"
    top = ""  # set by the test: where folder:// URLs lead

    def __init__(self, disk: LocalStorage = LOCAL):
        self.disk = disk

    def local(self, path: str) -> str:
        """The local path of a ``folder://`` URL; a local path as it is (TensorStore's adapter hands back the
        local folders it reads)."""
        if not is_url(path):
            return path
        _, name, key = split_url(path)
        return os.path.join(self.top, name, key)

    def confine(self, path: str, *, follow_links: bool = False) -> "FolderStorage":
        return FolderStorage(self.disk.confine(self.local(path), follow_links=follow_links))

    def stat(self, path: str) -> Any:
        return self.disk.stat(self.local(path))

    def link_target(self, path: str) -> str | None:
        return self.disk.link_target(self.local(path))

    def scandir(self, path: str) -> Any:
        with self.disk.scandir(self.local(path)) as it:
            found = [Entry(e.name, join(path, e.name), "directory" if e.is_dir() else "file",
                           e.stat().st_size if e.is_file() else 0) for e in it]
        return entries(found)

    def open(self, path: str, *, block_size: int = 64 * 2**10) -> Any:
        return self.disk.open(self.local(path))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self.disk.read_range(self.local(path), start, length)

    def create(self, path: str, *, size: int | None = None, fsync: bool = True) -> Upload:
        return self.disk.create(self.local(path), fsync=fsync)

    def write_atomically(self, dst: str, write: Callable[[str], list[str]], *, folder: bool,
                         fsync: bool = True, overwrite: bool = True) -> None:
        self.disk.write_atomically(self.local(dst), write, folder=folder, fsync=fsync, overwrite=overwrite)

    def remove(self, path: str) -> None:
        self.disk.remove(self.local(path))


register_scheme("folder", lambda url: FolderStorage())
register_kvstore("folder", lambda folder: kvstore_spec(LOCAL, FolderStorage().local(folder)),
                 pin=lambda storage, folder: pin(storage.disk, FolderStorage().local(folder)))
