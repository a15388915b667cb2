"""What the `treetools` program sets for its own process (treetools/cli/_process.py), and only there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from treetools.cli import _process

BLAS_FREE = {k: v for k, v in os.environ.items() if k not in _process.BLAS_THREAD_VARIABLES}
MALLOC_FREE = {k: v for k, v in BLAS_FREE.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")}


def test_one_openblas_thread_unless_the_user_chose():
    env: dict[str, str] = {}
    assert "OPENBLAS_NUM_THREADS=1" in _process.tune(env, mallopt=lambda option, value: 1)
    assert env == {"OPENBLAS_NUM_THREADS": "1"}
    for name in _process.BLAS_THREAD_VARIABLES:
        env = {name: "4"}
        assert not any("OPENBLAS" in s for s in _process.tune(env, mallopt=lambda option, value: 1))
        assert env == {name: "4"}


def test_malloc_thresholds_unless_the_user_tunes_malloc():
    calls: list[tuple[int, int]] = []
    mallopt = lambda option, value: calls.append((option, value)) or 1  # noqa: E731
    _process.tune({}, mallopt=mallopt)
    # glibc's malloc.h: M_MMAP_THRESHOLD is -3, M_TRIM_THRESHOLD -1, M_ARENA_MAX -8
    assert calls == [(-3, 32 * 2**20), (-1, 32 * 2**20), (-8, 2)]  # 4 blocks of the default 8 MiB kept free
    # A user who shrinks the blocks (to hold memory down) is kept 4 of them free, not 32 MiB; a bad value is the
    # command's to report: the process keeps the default.
    for chunk, kept in (("2097152", 8 * 2**20), ("1e9", 64 * 2**20), ("1.5", 32 * 2**20)):
        calls.clear()
        _process.tune({"TREETOOLS_CHUNK_BYTES": chunk}, mallopt=mallopt)
        assert calls[1] == (-1, kept), chunk
    for env in ({"MALLOC_ARENA_MAX": "2"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                {"GLIBC_TUNABLES": "glibc.rtld.nns=4:glibc.malloc.mmap_threshold=65536"}):
        calls.clear()
        assert not any("malloc" in s for s in _process.tune(dict(env), mallopt=mallopt)) and calls == []
    # Another C library's mallopt refusing an option (it returns 0): nothing is said to be set.
    assert not any("malloc" in s for s in _process.tune({}, mallopt=lambda option, value: 0))


# A fresh process: how many more blocks malloc has mapped by mmap (mallinfo2's hblks) after one 8 MiB malloc.
_HBLKS = """
import ctypes, sys
from treetools.cli import _process
if sys.argv[1] == "tuned":
    _process.tune()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.mallinfo2.restype = ctypes.c_void_p, Info
before = libc.mallinfo2().hblks
block = libc.malloc(8 * 2**20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(_process.glibc_mallopt() is None, reason="glibc's malloc")
def test_a_tuned_process_takes_8_mib_blocks_from_the_heap():
    def hblks(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _HBLKS, mode], capture_output=True, text=True, timeout=60,
                              env=MALLOC_FREE)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    # Untuned, glibc maps a fresh process's first 8 MiB block by itself (and unmaps it when it is freed).
    assert hblks("default") == 1
    assert hblks("tuned") == 0


# A fresh process: how many malloc arenas (malloc_info's <heap nr=...>) after 8 threads each hold an 8 MiB block
# at once (a thread takes an arena of its own while glibc's limit allows).
_ARENAS = """
import ctypes, sys, threading
from treetools.cli import _process
if sys.argv[1] == "tuned":
    _process.tune()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.open_memstream.restype = ctypes.c_void_p, ctypes.c_void_p
libc.free.argtypes, libc.fclose.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
held, all_in = [], threading.Barrier(9)
def hold():
    held.append(libc.malloc(8 * 2**20))
    all_in.wait()
    all_in.wait()
threads = [threading.Thread(target=hold) for _ in range(8)]
for t in threads:
    t.start()
all_in.wait()
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
libc.malloc_info(0, stream)
libc.fclose(stream)
all_in.wait()
for t in threads:
    t.join()
for p in held:
    libc.free(p)
print(buf.value.decode().count("<heap nr="))
"""


@pytest.mark.skipif(_process.glibc_mallopt() is None, reason="glibc's malloc")
def test_a_tuned_process_shares_two_malloc_arenas():
    def arenas(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, env=MALLOC_FREE)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    assert arenas("default") > 2  # each thread an arena of its own (glibc allows eight per core)
    assert arenas("tuned") <= _process.ARENA_MAX == 2


_SEEN = ("import atexit, os, sys\n"
         "atexit.register(lambda: print('blas', os.environ.get('OPENBLAS_NUM_THREADS')))\n"
         "from treetools.cli import main, run\n"
         "if sys.argv[1] == 'run':\n"
         "    sys.argv = ['treetools', '--version']\n"
         "    run()\n"
         "main(['--version'])\n")


def test_the_program_tunes_its_process_and_main_leaves_the_callers_alone():
    def seen(mode: str) -> str:
        proc = subprocess.run([sys.executable, "-c", _SEEN, mode], capture_output=True, text=True, timeout=60,
                              env=BLAS_FREE)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("treetools ")  # the command ran
        return proc.stdout.splitlines()[-1]

    assert seen("run") == "blas 1"
    assert seen("main") == "blas None"
