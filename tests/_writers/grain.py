"""Grain's Orbax checkpoint handler for data iterators, as Grain defines it (grain is not installed here).

Follows google/grain at commit 08f7cb175da8ae3c150027500a47797a8f9ddd6c,
``grain/_src/python/checkpoint_handlers.py`` ``PyGrainCheckpointHandler``: ``save`` writes the iterator's state
(``json.dumps(iterator.get_state(), indent=4)``) to ``process_<index>-of-<count>.json`` in the item folder;
``typestr()`` is its module and class name, which Orbax records in the step's ``_CHECKPOINT_METADATA``. The
class below keeps that name, so the step metadata reads as Grain's; the manager is real Orbax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orbax.checkpoint as ocp


class PyGrainCheckpointHandler(ocp.CheckpointHandler):
    """Grain's handler: one JSON state file per process."""

    def save(self, directory, item=None, args=None):
        item = item or args.item
        (directory / "process_0-of-1.json").write_text(json.dumps(item.get_state(), indent=4))

    def restore(self, directory, item=None, args=None):
        item = item or args.item
        item.set_state(json.loads((directory / "process_0-of-1.json").read_text()))
        return item

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass

    @classmethod
    def typestr(cls) -> str:
        return "grain._src.python.checkpoint_handlers.PyGrainCheckpointHandler"


@ocp.args.register_with_handler(PyGrainCheckpointHandler, for_save=True)
@dataclasses.dataclass
class PyGrainCheckpointSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(PyGrainCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class PyGrainCheckpointRestore(ocp.args.CheckpointArgs):
    item: Any


class DatasetIterator:
    """A data iterator with Grain's ``get_state``/``set_state`` (a ``grain.DatasetIterator``'s state dict)."""

    def __init__(self, state: dict):
        self._state = dict(state)

    def get_state(self) -> dict:
        return dict(self._state)

    def set_state(self, state: dict) -> None:
        self._state = dict(state)
