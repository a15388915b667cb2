"""docs/json-schema.md is the contract of every command's `--format json`: real output validates against it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import treetools as tt
from treetools.cli import main

DOC = Path(__file__).parent.parent / "docs" / "json-schema.md"


def _schema(command: str = "inspect") -> dict:
    """The JSON Schema of ``command``: the JSON block under the heading ``### JSON Schema: COMMAND``."""
    text = DOC.read_text()
    section = text.split(f"### JSON Schema: {command}\n", 1)[1]
    return json.loads(re.search(r"```json\n(.*?)```", section, flags=re.S).group(1))


def _example(command: str) -> dict:
    """The example object of ``command``'s section (its first JSON block)."""
    section = re.split(r"^## ", DOC.read_text(), flags=re.M)
    (body,) = [s for s in section if s.startswith(f"`treetools {command} --format json`")]
    return json.loads(re.search(r"```json\n(.*?)```", body, flags=re.S).group(1))


def _json(capsys, *argv, rc: int = 0) -> dict:
    got = main([str(a) for a in argv] + ["--format", "json"])
    out = capsys.readouterr().out
    assert got == rc, out
    return json.loads(out)


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


@pytest.mark.parametrize("command", ["inspect", "diff", "verify", "plan"])
def test_example_in_the_doc_validates_too(command):
    jsonschema.validate(_example(command), _schema(command))


def test_single_file_has_null_steps(tmp_path, capsys):
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    assert main(["inspect", str(tmp_path / "w.npz"), "--format", "json", "--stats"]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, _schema())
    assert out["steps"] is None and out["checkpoints"][0]["step"] is None


# Issue 24, point 13: `diff` and `verify` JSON had no `schema` key, and `verify --step all` printed an array.


@pytest.mark.parametrize("extra", [[], ["--values"], ["--values", "--depth", "1"], ["--values", "--sort", "rel_l2"]])
def test_diff_output_validates(root, capsys, extra):
    out = _json(capsys, "diff", root, "--step", "1", "--step", "2", *extra, rc=1)
    jsonschema.validate(out, _schema("diff"))
    assert list(out)[0] == "schema" and out["schema"] == 1
    assert (out["a"]["step"], out["b"]["step"]) == (1, 2)
    if "--values" in extra:
        # Leaves: params/Dense_0/{kernel,bias} (kernel changed 1 -> 2 everywhere, bias the same) and data_iter/index.
        assert out["counts"]["bit_identical"] + out["counts"]["within_tolerance"] + \
            out["counts"]["outside_tolerance"] == sum(v.get("num_leaves", 1) for v in out["values"])
        assert out["counts"]["outside_tolerance"] == 1


@pytest.mark.parametrize("extra", [[], ["--step", "all"], ["--step", "1"]])
def test_verify_output_is_one_object_for_one_step_or_many(root, capsys, extra):
    out = _json(capsys, "verify", root, *extra)
    jsonschema.validate(out, _schema("verify"))
    assert list(out)[0] == "schema" and out["schema"] == 1 and out["ok"] is True
    (entry,) = out["paths"]
    assert entry["path"] == str(root) and entry["steps"] == [1, 2] and entry["incomplete"] == []
    want = {"--step all": [1, 2], "--step 1": [1]}.get(" ".join(extra), [2])
    assert [c["step"] for c in entry["checkpoints"]] == want
    assert all(c["ok"] and c["problems"] == [] for c in entry["checkpoints"])


def test_verify_output_of_several_paths_and_a_missing_one_validates(root, tmp_path, capsys):
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    out = _json(capsys, "verify", root, tmp_path / "w.npz", tmp_path / "missing.npz", rc=1)
    jsonschema.validate(out, _schema("verify"))
    assert [p["path"] for p in out["paths"]] == [str(root), str(tmp_path / "w.npz"), str(tmp_path / "missing.npz")]
    assert [p["ok"] for p in out["paths"]] == [True, True, False] and out["ok"] is False
    assert "missing.npz" in out["paths"][2]["error"] and out["paths"][1]["checkpoints"][0]["bytes"] == 12


def test_convert_output_has_its_schema_first(root, tmp_path, capsys):
    out = _json(capsys, "convert", root, tmp_path / "m.safetensors")
    assert list(out)[0] == "schema" and out["schema"] == 1 and out["ok"] is True


# Issue 39.14: a command asked for --format json printed nothing on stdout when it failed.
@pytest.mark.parametrize("argv, code, usage", [
    (["inspect", "{missing}"], 1, False),
    (["inspect", "{npz}", "--show", "w[9]"], 2, True),  # the library's UsageError
    (["inspect", "{npz}", "--depth", "0"], 2, True),  # argparse's own usage error
    (["inspect", "{npz}", "--include", "nomatch"], 1, False),
    (["diff", "{npz}", "{missing}"], 2, False),
    (["diff", "{npz}", "{npz}", "--sort", "rel_l2"], 2, True),
    (["diff", "{npz}", "--bogus"], 2, True),
    (["verify", "{missing}"], 1, False),
    (["convert", "{npz}", "{out}", "--step", "all"], 2, True),
    (["convert", "{pairs}", "{out}", "--rename", r"^[ab]_(\d+)/w=>\1/w"], 1, False),
])
@pytest.mark.parametrize("spelling", [["--format", "json"], ["--format=json"], ["--form", "json"]])
def test_a_failed_command_asked_for_json_prints_one_error_object(tmp_path, capsys, argv, code, usage, spelling):
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    np.savez(tmp_path / "pairs.npz", **{f"{side}_{i}/w": np.ones(2, np.float32) for i in range(2) for side in "ab"})
    names = {"missing": tmp_path / "missing.npz", "npz": tmp_path / "w.npz", "out": tmp_path / "o.safetensors",
             "pairs": tmp_path / "pairs.npz"}
    argv = [a.format(**names) for a in argv]
    assert main(argv + spelling) == code
    cap = capsys.readouterr()
    out = json.loads(cap.out)  # one object, nothing else on stdout
    jsonschema.validate(out, _schema("error"))
    assert (out["exit_code"], out["usage"]) == (code, usage)
    header = [line for line in cap.err.splitlines() if ": error: " in line][0]
    assert header.split(": error: ", 1)[1] == out["error"]  # the stderr line's message, whole
    if "pairs" in argv[1]:
        assert len(out["problems"]) == 2 and all("both become" in p for p in out["problems"])
    assert main(argv) == code and capsys.readouterr().out == ""  # without --format json: nothing on stdout


def test_the_error_example_in_the_doc_validates():
    section = DOC.read_text().split("## Errors: the error object, schema 1\n", 1)[1]
    example = json.loads(re.search(r"```json\n(.*?)```", section, flags=re.S).group(1))
    jsonschema.validate(example, _schema("error"))


def test_a_command_without_json_output_prints_no_error_object(tmp_path, capsys):
    # `plot` has no --format: asking for it is argparse's usage error, on stderr only.
    assert main(["plot", str(tmp_path / "m.jsonl"), "--format", "json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "unrecognized arguments: --format json" in cap.err
# Issue 41: `treetools plan --format json` is `tt.memory_plan(...).to_json()`, documented with the others.


@pytest.mark.parametrize("extra", [[], ["--mesh", "data=4,fsdp=2", "--optimizer", "adamw", "--device-memory", "100"]])
def test_plan_output_validates(root, capsys, extra):
    out = _json(capsys, "plan", root, *extra, rc=1 if "--device-memory" in extra else 0)
    jsonschema.validate(out, _schema("plan"))
    assert list(out)[0] == "schema" and out["schema"] == 1
    assert out["per_device_bytes"] == sum(out["by_part"].values())
    assert out["fits"] is (False if extra else None)


def test_memory_plan_json_with_every_section_filled_validates(devices):
    import optax

    mesh = jax.make_mesh((8,), ("fsdp",))
    params = {"embed": jax.ShapeDtypeStruct((8000, 64), jnp.float32),  # replicated, 2 MiB: listed as shardable
              "w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=jax.sharding.NamedSharding(
                  mesh, jax.sharding.PartitionSpec("fsdp")))}
    batch = jax.ShapeDtypeStruct((8, 64), jnp.float32)

    def step(state, x):
        return jax.tree.map(lambda p: p * 2, state), (x @ state["params"]["w"]).sum()

    plan = tt.memory_plan(params, optimizer=optax.sgd(0.1, momentum=0.9), step_fn=step, step_args=(batch,),
                          device_memory="1GiB", memory_budget=2**20)
    out = plan.to_json()
    jsonschema.validate(out, _schema("plan"))
    assert out["compiled"]["platform"] == "cpu" and out["replicated"][0]["path"] == "params/embed"
    assert out["host"]["over_budget"] == ["params/embed", "opt_state/0/trace/embed"]


# Issue 49: scalar and string leaves show their values; an item not read is listed, in every command's JSON.


def test_values_and_unread_items_validate(tmp_path, capsys):
    import os

    import orbax.checkpoint as ocp

    state = np.random.RandomState(7).get_state()  # ('MT19937', key[624], pos, has_gauss, cached_gaussian)
    run = tmp_path / "run"
    with ocp.CheckpointManager(run) as manager:
        manager.save(3, args=ocp.args.Composite(
            params=ocp.args.StandardSave({"w": jnp.ones(2)}),
            extra=ocp.args.PyTreeSave({"step": 3, "lr": 0.25, "rng": state}),
            meta=ocp.args.JsonSave({"k": 1})))
        manager.wait_until_finished()
    os.unlink(run / "3" / "meta" / "metadata")
    os.mkfifo(run / "3" / "meta" / "metadata")  # never opened: listed as not read
    out = _json(capsys, "inspect", run, rc=1)
    jsonschema.validate(out, _schema())
    (checkpoint,) = out["checkpoints"]
    assert [u["item"] for u in checkpoint["unreadable"]] == ["meta"]
    want = {"step": 3, "lr": 0.25, "rng/0": "MT19937", "rng/2": int(state[2]), "rng/3": int(state[3]),
            "rng/4": float(state[4])}
    assert checkpoint["items"]["extra"]["values"] == want
    assert _json(capsys, "inspect", run, "--allow-unread", "--depth", "1")["checkpoints"][0]["items"]["extra"]["values"] == want
    out = _json(capsys, "diff", run, run, rc=1)  # the same, but `meta` not read on either side
    jsonschema.validate(out, _schema("diff"))
    assert [u["item"] for u in out["unreadable"]["a"]] == ["meta"] and out["identical"] is False
    assert out["counts"]["added"] == out["counts"]["removed"] == out["counts"]["changed_metadata"] == 0
    out = _json(capsys, "verify", run, "--allow-unread")
    jsonschema.validate(out, _schema("verify"))
    (entry,) = out["paths"][0]["checkpoints"]
    assert entry["problems"] == [] and len(entry["unread"]) == 1 and "a FIFO" in entry["unread"][0]
