"""Make docs/health_spike.png: the reference trainer fed a bad batch, and `treetools plot` of its health dump.

Run from the repository root (about a minute on CPU)::

    .venv/bin/python docs/health_spike.py

It trains the reference model for 40 steps on 4 CPU devices with ``--inject-spike 30`` (a batch of padding:
every token 0) in a temporary folder, then draws the dump the trainer wrote 4 steps after the flagged step.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    treetools = [sys.executable, "-m", "treetools"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = os.path.join(tmp, "spike")
        subprocess.run([*treetools, "train", "--workdir", workdir, "--steps", "40", "--inject-spike", "30",
                        "--cpu-devices", "4", "--log-every", "10"], check=True)
        (dump,) = glob.glob(os.path.join(workdir, "health", "health_*.json"))
        subprocess.run([*treetools, "plot", dump, "-o", os.path.join(HERE, "health_spike.png")], check=True)


if __name__ == "__main__":
    main()
