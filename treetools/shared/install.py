"""The name treetools is installed by, and the one install hint every message about a missing extra gives.

``treetools`` on the package index is an unrelated project ("Tools for processing treebank trees", with its own
``treetools/cli.py``), so this project is distributed as ``jax-treetools``: ``pip install 'jax-treetools[plot]'``.
The import name (``import treetools as tt``) and the ``treetools`` command are unchanged (README.md, "Installing",
also says how to install a clone into one's own environment).
"""

from __future__ import annotations

DISTRIBUTION = "jax-treetools"
"""The distribution name (``[project] name`` in pyproject.toml): what ``pip install`` takes."""


def install_hint(extra: str) -> str:
    """The command that installs treetools with ``extra`` (``plot``, ``remote``, ``keras``, ...).

    >>> install_hint("plot")
    "pip install 'jax-treetools[plot]'"
    """
    return f"pip install '{DISTRIBUTION}[{extra}]'"
