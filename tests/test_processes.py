"""Several processes on one checkpoint (``--processes N``, ``--distributed``): each reads a share of the leaves
by bytes, and the report is the one a single process prints, byte for byte.

Real processes: ``--processes N`` starts N - 1 copies of the command, joined by ``jax.distributed`` on
127.0.0.1 (gloo collectives); the ``--distributed`` runs are started by hand, as a cluster's scheduler starts
one process per host, with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.test_inspect import write_run

rng = np.random.default_rng(0)


def _treetools(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "treetools", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("processes")
    tensors = {f"model.layers.{i}.w": rng.standard_normal((37 * (i + 1), 64)).astype(np.float32) for i in range(9)}
    tensors["model.embed"] = rng.standard_normal((3000, 64)).astype(np.float32)
    tensors["model.bad"] = np.array([1.0, np.nan, np.inf, -0.0], np.float32)
    save_file(tensors, str(folder / "a.safetensors"))
    tensors["model.layers.3.w"] = tensors["model.layers.3.w"] + np.float32(1e-3)
    save_file(tensors, str(folder / "b.safetensors"))
    run = write_run(folder / "run")  # an Orbax manager root of two steps (test_inspect's)
    return folder, run


@pytest.mark.parametrize("processes", [2, 4])
def test_stats_verify_and_diff_are_the_same_with_several_processes(checkpoints, processes):
    folder, run = checkpoints
    commands = [
        ("inspect", folder / "a.safetensors", "--stats", "--leaves", "--format", "json"),
        ("inspect", run, "--stats", "--step", "all", "--format", "json"),
        ("verify", folder / "a.safetensors", "--format", "json"),
        ("verify", run, "--format", "json"),
        ("diff", folder / "a.safetensors", folder / "b.safetensors", "--values", "--format", "json"),
    ]
    # Two processes: each command once; four: the Orbax root's steps (verify and inspect read alike).
    for argv in [commands[0], commands[3], commands[4]] if processes == 2 else [commands[1]]:
        alone = _treetools(*argv)
        several = _treetools(*argv, "--processes", processes)
        assert several.returncode == alone.returncode, (argv, several.stderr[-3000:])
        assert several.stdout == alone.stdout, argv  # byte for byte, one report
        assert json.loads(several.stdout)  # and a report it is, not empty
    diff = json.loads(_treetools(*commands[-1], "--processes", processes).stdout)
    assert diff["schema"] and _treetools(*commands[-1]).returncode == 1  # the changed layer is found


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_started_by_hand_join_with_the_environment(checkpoints):
    # As a scheduler starts them: one process per host, each told the coordinator, the count and its index.
    folder, _ = checkpoints
    argv = [sys.executable, "-m", "treetools", "inspect", str(folder / "a.safetensors"), "--stats", "--leaves",
            "--format", "json", "--distributed"]
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": address,
                                   "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": str(i)}) for i in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    alone = _treetools("inspect", folder / "a.safetensors", "--stats", "--leaves", "--format", "json")
    assert outs[0][0] == alone.stdout  # process 0 prints the report
    assert outs[1][0] == outs[2][0] == ""  # the others print nothing on stdout


def test_a_run_that_cannot_be_joined_is_one_line():
    proc = _treetools("verify", ".", "--distributed",
                      env={"JAX_COORDINATOR_ADDRESS": "", "JAX_NUM_PROCESSES": "x", "JAX_PROCESS_ID": "0"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "treetools: error: `JAX_NUM_PROCESSES` must be an integer, got 'x'."


def test_each_process_reads_only_its_share(checkpoints, tmp_path):
    # Counted, not timed: each process's read bytes (/proc/self/io rchar, printed at exit by a wrapper) add up to
    # about one read of the data, where each process reading everything would be `processes` times it.
    folder, _ = checkpoints
    wrapper = tmp_path / "wrap.py"
    wrapper.write_text(
        "import atexit, sys\n"
        "def rchar():\n"
        "    return int(next(l for l in open('/proc/self/io') if l.startswith('rchar')).split()[1])\n"
        "atexit.register(lambda: print('RCHAR', rchar(), file=sys.stderr))\n"
        "sys.argv = ['treetools', *sys.argv[1:]]\n"
        "from treetools.cli import run\n"
        "run()\n")
    big, tiny = folder / "big.safetensors", folder / "tiny.safetensors"
    save_file({f"w{i}": rng.standard_normal(2**20).astype(np.float32) for i in range(8)}, str(big))
    save_file({f"w{i}": np.ones(4, np.float32) for i in range(8)}, str(tiny))
    data = 8 * 4 * 2**20

    def rchar_of_two(path):
        address = f"127.0.0.1:{_free_port()}"
        procs = [subprocess.Popen([sys.executable, str(wrapper), "verify", str(path), "--distributed"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": address,
                                       "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}) for i in range(2)]
        errs = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs
        return [int(next(line for line in e.splitlines() if line.startswith("RCHAR")).split()[1]) for e in errs]

    # Beyond the same run on a file of the same names and no data (Python, jax's libraries, the header).
    read = [b - t for b, t in zip(rchar_of_two(big), rchar_of_two(tiny))]
    assert all(r < 0.75 * data for r in read), (read, data)  # each its share (half), not the whole
    assert sum(read) > 0.9 * data, (read, data)  # and every byte by someone


def test_convert_with_several_processes_writes_the_same_files(checkpoints, tmp_path):
    # Each process writes the shards it owns into process 0's temporary folder; process 0 writes the index and
    # renames the folder: the files are the one process's, byte for byte, and --verify (itself shared) passes.
    folder, _ = checkpoints
    src = folder / "a.safetensors"
    alone = _treetools("convert", src, tmp_path / "one", "--shard-size", "200KB")
    assert alone.returncode == 0, alone.stderr
    several = _treetools("convert", src, tmp_path / "two", "--shard-size", "200KB", "--processes", "2", "--verify")
    assert several.returncode == 0, several.stderr[-3000:]
    assert "verify: ok" in several.stdout and several.stdout.count("wrote ") == 1  # one report, process 0's
    names = sorted(os.listdir(tmp_path / "one"))
    assert len(names) > 3 and sorted(os.listdir(tmp_path / "two")) == names  # no temporary left beside either
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]
    # An existing destination: every process refuses it, one line, nothing written.
    again = _treetools("convert", src, tmp_path / "two", "--processes", "2")
    assert again.returncode == 1 and again.stderr.strip().splitlines()[-1].endswith(
        "exists; pass --overwrite (overwrite=True) to replace it.")
    # One file: process 0 writes it, the same bytes as one process writes.
    assert _treetools("convert", src, tmp_path / "m1.safetensors").returncode == 0
    one_file = _treetools("convert", src, tmp_path / "m2.safetensors", "--processes", "2")
    assert one_file.returncode == 0, one_file.stderr[-2000:]
    assert (tmp_path / "m1.safetensors").read_bytes() == (tmp_path / "m2.safetensors").read_bytes()
    # --to orbax with several processes: tests/test_processes_orbax.py.
