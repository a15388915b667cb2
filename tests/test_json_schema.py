"""docs/json-schema.md is the contract of `inspect --format json`: real output validates against it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main

DOC = Path(__file__).parent.parent / "docs" / "json-schema.md"


def _schema() -> dict:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    return json.loads(blocks[-1])  # the JSON Schema is the last block; the first is the example


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema") / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, async_save=False)
    for step in (1, 2):
        params = {"Dense_0": {"kernel": jnp.full((4, 2), float(step)), "bias": jnp.array([np.nan, 1.0])}}
        tt.save_checkpoint(mngr, step, {"params": params, "data_iter": {"index": step}}, metrics={"loss": 1.0 / step})
    mngr.close()
    return root


@pytest.mark.parametrize("extra", [[], ["--step", "all"], ["--stats"], ["--depth", "1"], ["--item", "params"]])
def test_real_output_validates(root, capsys, extra):
    assert main(["inspect", str(root), "--format", "json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, _schema())
    assert out["schema"] == 2 and out["steps"] == [1, 2]
    shown = [c["step"] for c in out["checkpoints"]]
    assert shown == ([1, 2] if "all" in extra else [2])
    last = out["checkpoints"][-1]
    assert last["metadata"]["metrics"] == {"loss": 0.5}
    if "--item" not in extra:
        assert last["items"]["data_iter"]["value"] == {"index": 2}


def test_example_in_the_doc_validates_too():
    example = json.loads(re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)[0])
    jsonschema.validate(example, _schema())


def test_single_file_has_null_steps(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    assert main(["inspect", str(tmp_path / "w.npz"), "--format", "json", "--stats"]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, _schema())
    assert out["steps"] is None and out["checkpoints"][0]["step"] is None
