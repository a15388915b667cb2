"""``python -m treetools``: the same as the ``treetools`` command."""

from treetools.cli import run

run()
