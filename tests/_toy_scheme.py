"""``toy://``: a storage scheme in one module, as docs/formats.md ("Adding a storage scheme") writes one.

Files live in a dict, ``{normalized URL: bytes}``; folders are key prefixes, as in a bucket. The class implements
the abstract methods of ``Storage`` (nothing else is needed) and the module registers it: importing this module is
all a program does to read and write ``toy://`` paths with every command. No TensorStore key-value store is
registered for it, so a format whose arrays TensorStore reads (Orbax, zarr) refuses it with one line.
"""

from __future__ import annotations

import io
import threading
from typing import Any, Callable

from treetools.checkpoint_io.storage import Entry, Stat, Storage, Upload, entries, normalize, register_scheme


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
