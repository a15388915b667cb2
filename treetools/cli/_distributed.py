"""``--processes N`` and ``--distributed``: a command run by several processes, each reading a share.

``--processes N`` starts N - 1 copies of the same command on this machine, each told its place by
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (coordinator on 127.0.0.1), and is
process 0 itself. ``--distributed`` joins a run started elsewhere (one process per host under SLURM, say).
Either way the command's options get this process's share (``treetools.checkpoint_jax.distributed.connect_processes``),
the block engine reads that share and pools the results, and only process 0 writes to stdout: one report,
the same as one process's. Standard library only at import: jax is imported when a run is joined.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from typing import Sequence

from treetools.cli import _output


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _without_processes(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--processes N`` (either spelling), plus ``--distributed``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            out.append(a)
    return [*out, "--distributed"]


class Run:
    """The processes of one command: the local copies this process started, if any."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.joined = False

    def join(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        """Start the local copies (``--processes N``), join the run, set ``args.share``; quiet stdout unless
        this is process 0."""
        processes = getattr(args, "processes", None) or 1
        if processes <= 1 and not getattr(args, "distributed", False):
            return
        # Here, not at the top: a command run by one process never loads jax.
        from treetools.checkpoint_jax.distributed import connect_processes

        if processes > 1:
            address = f"127.0.0.1:{_free_port()}"
            child_argv = _without_processes(argv)
            for i in range(1, processes):
                env = {**os.environ, "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(processes),
                       "JAX_PROCESS_ID": str(i)}
                self.children.append(subprocess.Popen([sys.executable, "-m", "treetools", *child_argv], env=env,
                                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE))
            share = connect_processes(address, processes, 0)
        else:
            share = connect_processes()
        args.share = share
        self.joined = True
        if share.index != 0:
            _output.current.left.add("stdout")  # one report: process 0's

    def finish(self, code: int) -> int:
        """Leave the run and wait for the local copies (``close``); a copy that failed where this process did
        not fails the command."""
        failed = self.close()
        if code == 0 and failed:
            number, returncode, tail = failed[0]
            _output.error(f"process {number} of the run failed (exit {returncode}): {tail}")
            return returncode
        return code

    def close(self) -> list[tuple[int, int, str]]:
        """Leave the run (every process meets at jax's shutdown barrier, on an error too: a process that left
        without it would keep the others there), then wait for the local copies; the ones that failed, as
        ``(process number, exit code, last line of stderr)``."""
        if self.joined:
            import jax

            self.joined = False
            jax.distributed.shutdown()
        failed = []
        for number, child in enumerate(self.children, start=1):
            _, err = child.communicate()
            if child.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no message)"]
                failed.append((number, child.returncode, tail[0]))
        self.children = []
        return failed
