"""Orbax folder layout, read with the standard library only.

A CheckpointManager root holds one folder per step, named ``N`` or
``<prefix>_N`` with optional zero padding. A save in progress (or one that
died) is a ``<name>.orbax-checkpoint-tmp-<timestamp>`` folder; a finished step
holds ``commit_success.txt`` (or a committed ``_CHECKPOINT_METADATA``). Step
listing and the commit rule come from ``treetools.checkpoint`` (pure Python).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Orbax's on-disk names come from the one module whose tests check them against Orbax.
from treetools.checkpoint import COMMIT_SUCCESS_FILE as COMMIT_FILE
from treetools.checkpoint import PYTREE_METADATA_FILE as PYTREE_METADATA
from treetools.checkpoint import STEP_METADATA_FILE as STEP_METADATA
from treetools.checkpoint import TMP_DIR_SUFFIX as TMP_MARKER
from treetools.checkpoint import is_committed_step_dir, parse_step_name, scan_steps
from treetools.inspect._base import CheckpointError, require_file

JSON_ITEM_FILE = "metadata"
ARRAY_DATA_NAMES = ("manifest.ocdbt", "_sharding", "array_metadatas")


def step_of(name: str) -> int | None:
    """The step number in a step folder name (``100``, ``ckpt_0100``), tmp suffix dropped.

    >>> step_of("ckpt_0100"), step_of("300.orbax-checkpoint-tmp-1700000000"), step_of("logs")
    (100, 300, None)
    """
    return parse_step_name(name.split(TMP_MARKER, 1)[0])


def is_tmp(name: str) -> bool:
    return TMP_MARKER in name


def read_json(path: str, *, what: str) -> Any:
    """Parse a small JSON metadata file; a missing, unreadable or broken one is a ``CheckpointError``."""
    require_file(path, what=what)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated {what} ({e}).") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e}).") from None


def is_committed(step_dir: str) -> bool:
    """Whether a step folder is a finished save (``treetools.checkpoint``'s rule, shared)."""
    return is_committed_step_dir(step_dir)


@dataclasses.dataclass
class RootListing:
    """The steps of a CheckpointManager root."""

    steps: dict[int, str]
    """Committed step -> folder path, ascending."""
    incomplete: list[str]
    """Folder names of unfinished saves, never read."""


def _subdirs(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return sorted((e for e in it if e.is_dir()), key=lambda e: e.name)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list folder ({e.strerror or e}).") from None


def has_entry(folder: str, name: str) -> bool:
    """Whether ``folder/name`` exists as anything (a FIFO or folder in place of a file still counts)."""
    return os.path.lexists(os.path.join(folder, name))


def looks_like_item(path: str) -> bool:
    return has_entry(path, PYTREE_METADATA) or has_entry(path, JSON_ITEM_FILE) or has_array_data(path)


def has_array_data(path: str) -> bool:
    """Whether ``path`` holds what Orbax writes next to an item's ``_METADATA`` (OCDBT files, ``_sharding``)."""
    try:
        with os.scandir(path) as it:
            return any(e.name in ARRAY_DATA_NAMES or e.name.startswith("ocdbt.process_") for e in it)
    except OSError:
        return False


def looks_like_step(path: str) -> bool:
    if has_entry(path, STEP_METADATA):
        return True
    return any(looks_like_item(e.path) for e in _subdirs(path) if not is_tmp(e.name))


def scan_root(path: str) -> RootListing:
    """Committed and incomplete step folders directly under ``path``.

    Delegates to ``treetools.checkpoint.scan_steps`` (pure Python), so the
    inspector and the trainer agree on which steps exist; folders whose name
    carries no step number are ignored.
    """
    try:
        committed, incomplete = scan_steps(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list folder ({e.strerror or e}).") from None
    return RootListing({step: str(folder) for step, folder in committed.items()}, list(incomplete))
