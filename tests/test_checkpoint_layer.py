"""The one checkpoint layer: every reader agrees on steps and on the path of every leaf.

For every checkpoint kind the tests can write (treetools saves, plain Orbax
saves of linen params, of nnx State, of an optax state, a JSON item, Flax
msgpack, safetensors, npz), the paths ``inspect --format json`` lists, the
keys of ``flatten(load_parameters(...))`` and the paths ``restore_checkpoint``
accepts are the same strings, and restoring into
``make_abstract(load_parameters(...))`` is bit-exact. Truth comes from the
writer's own arrays.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_tools.diff import diff_paths
from treetools.checkpoint_tools.report import inspect_path
from treetools.checkpoint_io.leaves import tree_leaves
from treetools.checkpoint_io.registry import claiming_format, register_format, registered_formats, unregister_format
from treetools.checkpoint_io.source import FileSource, Format
from treetools.pytree.paths import flatten

FIXTURE = Path(__file__).parent / "fixtures" / "treetools_v0_1"
FIXTURE_TRUTH = Path(__file__).parent / "fixtures" / "treetools_v0_1_truth.npz"


def _params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {"kernel": rng.standard_normal((8, 4)).astype(np.float32), "bias": np.arange(4, dtype=np.float32)},
        "layers": [{"w": rng.standard_normal((4, 4)).astype(np.float32)} for _ in range(2)],
        "scale": np.float32(rng.standard_normal((4,))),
    }


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 4, rngs=rngs)


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([_Block(rngs) for _ in range(2)])


def _host(tree) -> dict:
    return {p: np.asarray(jax.device_get(tt.unbox(x))) for p, x in flatten(tree).items()}


# ----------------------------------------------------------------------------- writers: (path, item) per kind


def write_treetools_boxed(tmp: Path):
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    host = _params()
    params = jax.tree.map(jnp.asarray, host)
    params["Dense_0"]["kernel"] = nn.Partitioned(
        jax.device_put(host["Dense_0"]["kernel"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))),
        names=("fsdp", None), mesh=mesh)
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp / "run", async_save=False)
    tt.save_checkpoint(mngr, 3, {"params": params, "data_iter": {"index": 3}})
    mngr.close()
    return tmp / "run", "params", _host(params)


def write_orbax_manager_linen(tmp: Path):
    model = nn.Dense(4)
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    with ocp.CheckpointManager(tmp / "plain") as mngr:
        mngr.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(variables["params"])))
        mngr.wait_until_finished()
    return tmp / "plain", "params", _host(variables["params"])


def write_orbax_nnx_state(tmp: Path):
    # The Flax NNX guide's way: split the module, save the State with a plain StandardCheckpointer.
    model = _Net(nnx.Rngs(0))
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / "nnx_state", state)
    return tmp / "nnx_state", "default", _host(state)


def write_orbax_optax_state(tmp: Path):
    params = jax.tree.map(jnp.asarray, _params())
    opt = optax.adamw(1e-3).init(params)
    with ocp.CheckpointManager(tmp / "opt") as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(opt)))
        mngr.wait_until_finished()
    return tmp / "opt", "opt_state", _host(opt)


def write_msgpack(tmp: Path):
    host = _params()
    (tmp / "state.msgpack").write_bytes(serialization.to_bytes(host))
    return tmp / "state.msgpack", None, {p: np.asarray(x) for p, x in flatten(host).items()}


def write_safetensors(tmp: Path):
    from safetensors.numpy import save_file

    tensors = {"model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32),
               "model.embed_tokens.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp / "model.safetensors", None, tensors


def write_npz(tmp: Path):
    flat = {p: np.asarray(x) for p, x in flatten(_params()).items()}
    np.savez(tmp / "weights.npz", **flat)
    return tmp / "weights.npz", None, flat


WRITERS = [write_treetools_boxed, write_orbax_manager_linen, write_orbax_nnx_state, write_orbax_optax_state,
           write_msgpack, write_safetensors, write_npz]
ORBAX = {write_treetools_boxed, write_orbax_manager_linen, write_orbax_nnx_state, write_orbax_optax_state}


def _json_paths(capsys, path, item) -> list[str]:
    argv = ["inspect", str(path), "--format", "json"] + (["--item", item] if item else [])
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == 2
    (name,) = report["checkpoints"][0]["items"]
    return [leaf["path"] for leaf in report["checkpoints"][0]["items"][name]["leaves"]]


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.__name__[len("write_"):])
def test_one_path_per_leaf_everywhere(tmp_path, capsys, writer):
    path, item, truth = writer(tmp_path)
    listed = _json_paths(capsys, path, item)
    loaded = tt.load_parameters(path, item=item)
    # The same strings (each side in its own order: stored order vs jax's sorted dict keys).
    assert sorted(listed) == sorted(flatten(loaded)), "inspect and load_parameters disagree on paths"
    assert sorted(listed) == sorted(truth), "paths differ from the writer's own"
    for p, want in truth.items():
        got = np.asarray(flatten(loaded)[p])
        assert got.dtype == np.asarray(want).dtype and np.array_equal(got, want), p
    if writer in ORBAX:
        # restore_checkpoint accepts exactly those paths, and the round trip is bit-exact.
        restored = tt.restore_checkpoint(path, "latest", {item: tt.make_abstract(loaded)})[item]
        assert sorted(flatten(restored)) == sorted(listed)
        for p, want in truth.items():
            np.testing.assert_array_equal(np.asarray(flatten(restored)[p]), want, err_msg=p)


def test_json_item_reads_the_same_everywhere(tmp_path, capsys):
    path, _, _ = write_treetools_boxed(tmp_path)
    assert main(["inspect", str(path), "--format", "json"]) == 0
    items = json.loads(capsys.readouterr().out)["checkpoints"][0]["items"]
    assert items["data_iter"]["value"] == {"index": 3}
    assert [leaf["path"] for leaf in items["data_iter"]["leaves"]] == ["index"]
    assert tt.restore_checkpoint(path, None, {"data_iter": None})["data_iter"] == {"index": 3}


def test_boxed_demo_save_restores_into_make_abstract_of_load_parameters(tmp_path):
    # Bug 1 of the issue: load_parameters then restore_checkpoint into its abstract tree.
    path, item, truth = write_treetools_boxed(tmp_path)
    assert not any(p.endswith("/value") for p in flatten(tt.load_parameters(path)))
    meta = json.loads((path / "3" / "params" / "_METADATA").read_text())
    assert not any("value" == e["key_metadata"][-1]["key"] for e in meta["tree_metadata"].values()), \
        "a box was written to disk"
    mngr = tt.get_checkpoint_manager(100, checkpoint_dir=path)
    p = tt.load_parameters(path)
    out = tt.restore_checkpoint(mngr, "latest", {"params": tt.make_abstract(p)})["params"]
    got = _host(out)
    assert sorted(got) == sorted(truth)
    for k in truth:
        np.testing.assert_array_equal(got[k], truth[k], err_msg=k)
    mngr.close()


def test_relative_and_home_paths(tmp_path, monkeypatch):
    # Bug 2: a relative checkpoint_dir reached Orbax, which needs absolute paths.
    monkeypatch.chdir(tmp_path)
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir="runs/demo/checkpoints")
    params = {"w": jnp.arange(4.0)}
    tt.save_checkpoint(mngr, 1, {"params": params}, wait=True)
    out = tt.restore_checkpoint(mngr, "latest", {"params": tt.make_abstract(params)})
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.arange(4.0))
    mngr.close()
    np.testing.assert_array_equal(tt.load_parameters("runs/demo/checkpoints")["w"], np.arange(4.0))
    out = tt.restore_checkpoint("runs/demo/checkpoints", 1, {"params": tt.make_abstract(params)})
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.arange(4.0))
    monkeypatch.setenv("HOME", str(tmp_path))
    np.testing.assert_array_equal(tt.load_parameters("~/runs/demo/checkpoints")["w"], np.arange(4.0))
    assert tt.list_steps("~/runs/demo/checkpoints") == [1]


def test_nnx_state_saved_by_plain_orbax_agrees_with_treetools_save(tmp_path):
    # Bug 3: three functions gave three answers on `kernel/value` leaves.
    path, item, truth = write_orbax_nnx_state(tmp_path)
    loaded = tt.load_parameters(path)
    assert isinstance(loaded["blocks"][0]["fc1"]["kernel"], np.ndarray)
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "ours", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": nnx.state(_Net(nnx.Rngs(0)))})
    mngr.close()
    report = diff_paths(str(path), str(tmp_path / "ours"), item="params", values=True)
    assert not report.added and not report.removed
    assert report.counts()["bit_identical"] == len(truth) and report.identical


def test_checkpoint_written_by_treetools_0_1_still_reads(capsys):
    # A fixture written by the code before this layer (boxes stored as `.../value` nodes).
    truth = dict(np.load(FIXTURE_TRUTH))
    loaded = flatten(tt.load_parameters(FIXTURE))
    assert sorted(loaded) == sorted(truth)
    for p in truth:
        np.testing.assert_array_equal(loaded[p], truth[p])
    assert sorted(_json_paths(capsys, FIXTURE, "params")) == sorted(loaded)
    out = tt.restore_checkpoint(FIXTURE, None, {"params": tt.make_abstract(tt.load_parameters(FIXTURE)),
                                                "data_iter": None})
    assert out["data_iter"] == {"index": 7, "seed": 3}
    for p in truth:
        np.testing.assert_array_equal(np.asarray(flatten(out["params"])[p]), truth[p])
    # Restoring into boxed targets gives boxes back.
    boxed = {"Dense_0": {"kernel": nn.Partitioned(jnp.zeros((8, 4)), names=("fsdp", None)), "bias": jnp.zeros(4)},
             "embed": nn.Partitioned(jnp.zeros((4, 8)), names=(None, "fsdp"))}
    out = tt.restore_checkpoint(FIXTURE, None, {"params": boxed})["params"]
    assert isinstance(out["embed"], nn.Partitioned)
    np.testing.assert_array_equal(np.asarray(out["embed"].value), truth["embed"])


# ----------------------------------------------------------------------------- metadata read once, only what is asked


class _Opens:
    """Counts the files Python opens (an audit hook; TensorStore's own reads are not seen)."""

    installed = False
    active: list | None = None

    def __init__(self):
        if not _Opens.installed:
            sys.addaudithook(lambda event, args: _Opens.active.append(os.fspath(args[0]))
                             if event == "open" and _Opens.active is not None and isinstance(args[0], (str, bytes, os.PathLike))
                             else None)
            _Opens.installed = True

    def __enter__(self):
        _Opens.active = self.paths = []
        return self

    def __exit__(self, *exc):
        _Opens.active = None

    def count(self, suffix: str) -> int:
        # A file under a checkpoint is opened relative to its root's open folder (``dir_fd``): the hook then sees
        # the path below the root (``1/params/_METADATA``), else the absolute one.
        return sum(1 for p in self.paths if str(p).endswith(suffix) or str(p) == suffix.lstrip("/"))


def _three_items(tmp_path: Path) -> Path:
    params = {"w": jnp.arange(8.0).reshape(2, 4), "b": jnp.ones(4)}
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run", async_save=False)
    tt.save_checkpoint(mngr, 1, {"params": params, "params_ema": params,
                                 "opt_state": optax.adam(1e-3).init(params), "data_iter": {"i": 1}})
    mngr.close()
    return tmp_path / "run"


def test_restore_reads_each_requested_items_metadata_once(tmp_path):
    root = _three_items(tmp_path)
    targets = {"params": {"w": jnp.zeros((2, 4)), "b": jnp.zeros(4)}}
    targets["params_ema"] = targets["params"]
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root)
    with _Opens() as opens:
        out = tt.restore_checkpoint(mngr, "latest", targets)
    np.testing.assert_array_equal(np.asarray(out["params_ema"]["w"]), np.arange(8.0).reshape(2, 4))
    for name in ("params", "params_ema"):
        assert opens.count(f"/1/{name}/_METADATA") == 1, opens.paths
    assert not any("/opt_state/" in p or "/data_iter/" in p for p in opens.paths), opens.paths
    mngr.close()


def test_inspect_item_reads_only_that_item(tmp_path, capsys):
    root = _three_items(tmp_path)
    with _Opens() as opens:
        assert main(["inspect", str(root), "--item", "params", "--format", "json"]) == 0
    capsys.readouterr()
    assert opens.count("/1/params/_METADATA") == 1
    assert not any(f"/1/{other}/" in p for p in opens.paths for other in ("params_ema", "opt_state", "data_iter"))


# ----------------------------------------------------------------------------- a new format is one module


def _read_tiny(path: str) -> list:
    data = json.loads(Path(path).read_text())
    return tree_leaves({k: np.asarray(v, np.float32) for k, v in data["tensors"].items()}, where=path)


TINY = Format(
    name="tiny",
    priority=100,
    claims=lambda p, context: p.endswith(".tiny") and context.storage.isfile(p),
    open=lambda local, display, context: FileSource(display, context, "tiny", _read_tiny(local)),
    description="a test-only JSON file of tensors",
)


@pytest.fixture
def tiny_format():
    register_format(TINY)
    yield
    unregister_format("tiny")


def test_a_format_registered_from_outside_reaches_every_reader(tmp_path, capsys, tiny_format):
    a, b = tmp_path / "a.tiny", tmp_path / "b.tiny"
    a.write_text(json.dumps({"tensors": {"w": [1.0, 2.0, float("nan")], "v": [3.0]}}))
    b.write_text(json.dumps({"tensors": {"w": [1.0, 2.5, float("nan")], "v": [3.0]}}))
    assert main(["inspect", str(a), "--format", "json", "--stats"]) == 0
    leaves = json.loads(capsys.readouterr().out)["checkpoints"][0]["items"]["default"]["leaves"]
    assert {leaf["path"]: leaf["stats"]["nan"] for leaf in leaves} == {"w": 1, "v": 0}
    assert main(["inspect", str(a), "--fail-on-nonfinite"]) == 3
    capsys.readouterr()
    np.testing.assert_array_equal(tt.load_parameters(a)["w"], np.array([1.0, 2.0, np.nan], np.float32))
    report = diff_paths(str(a), str(b), values=True)
    assert report.counts()["outside_tolerance"] == 1 and report.counts()["bit_identical"] == 1
    assert main(["diff", str(a), str(b), "--values"]) == 1
    assert main(["diff", str(a), str(a), "--values"]) == 0
    capsys.readouterr()


def test_not_a_checkpoint_lists_the_registered_formats(tmp_path, capsys, tiny_format):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    assert main(["inspect", str(tmp_path / "notes")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Readable formats:" in err
    for name in ("orbax", "safetensors", "npz", "msgpack", "tiny"):
        assert name in err


def write_train_workdir(workdir: Path) -> Path:
    """A `treetools train` workdir as the trainer lays it out: `checkpoints/` (an Orbax manager: items `params` and
    `data_iter` at step 3) and `metrics.jsonl` beside it. Returns the checkpoints folder."""
    params = {"Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}
    with ocp.CheckpointManager(workdir / "checkpoints") as mngr:
        mngr.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                             data_iter=ocp.args.JsonSave({"index": 3})))
        mngr.wait_until_finished()
    (workdir / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    return workdir / "checkpoints"


def test_near_misses_name_the_checkpoint_that_works(tmp_path, capsys, monkeypatch):
    # Issue 24.5: the run folder and files inside a step got one 818-character line listing every format. Now one
    # short line naming the path to pass, which works.
    monkeypatch.chdir(tmp_path)
    write_train_workdir(tmp_path / "runs" / "demo")  # Orbax writes to absolute paths only
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "notes.txt").write_text("hello")
    cases = {
        "runs/demo": "runs/demo: not a checkpoint but a folder holding checkpoints; did you mean "
                     "runs/demo/checkpoints (orbax)?",
        "runs/demo/metrics.jsonl": "runs/demo/metrics.jsonl: not a checkpoint but a file beside checkpoints; did "
                                   "you mean runs/demo/checkpoints (orbax)?",
    }
    inside = {"runs/demo/checkpoints/3/_CHECKPOINT_METADATA": "runs/demo/checkpoints/3",
              "runs/demo/checkpoints/3/params/manifest.ocdbt": "runs/demo/checkpoints/3/params",
              "runs/demo/checkpoints/3/params/_METADATA": "runs/demo/checkpoints/3/params",
              "runs/demo/checkpoints/3/params/ocdbt.process_0": "runs/demo/checkpoints/3/params",
              "runs/demo/checkpoints/3/data_iter/metadata": "runs/demo/checkpoints/3/data_iter"}
    chunk = next(p for p in sorted(Path("runs/demo/checkpoints/3/params").rglob("*"))
                 if p.is_file() and p.parent.name == "d")
    inside[str(chunk)] = "runs/demo/checkpoints/3/params"
    if Path("runs/demo/checkpoints/3/commit_success.txt").exists():
        inside["runs/demo/checkpoints/3/commit_success.txt"] = "runs/demo/checkpoints/3"
    for path, checkpoint in inside.items():
        kind = "folder" if Path(path).is_dir() else "file"
        cases[path] = f"{path}: not a checkpoint but a {kind} inside the checkpoint {checkpoint} (orbax); pass that instead."
    for path, want in cases.items():
        assert main(["inspect", path]) == 1
        err = capsys.readouterr().err
        assert err == f"treetools: error: {want}\n", path
        fix = want.split(" the checkpoint ")[-1].split(" (")[0] if "inside" in want else "runs/demo/checkpoints"
        assert main(["inspect", fix]) == 0, fix  # the path named works
        capsys.readouterr()
    # A stranger: the format names only (not their descriptions); a folder beside a root's steps is no part of it.
    (tmp_path / "runs" / "demo" / "checkpoints" / "notes").mkdir()
    (tmp_path / "runs" / "demo" / "checkpoints" / "notes" / "a.txt").write_text("x")
    for path in ("logs/notes.txt", "runs/demo/checkpoints/notes/a.txt"):
        assert main(["inspect", path]) == 1
        err = capsys.readouterr().err.strip()
        names = ", ".join(f.name for f in tt.ckpt.registered_formats())
        assert err.startswith(f"treetools: error: {path}: not a checkpoint that treetools can read. Readable "
                              f"formats: {names} ("), err
        assert len(err) < 360  # was 818 (issue 37 added four formats to the list)


class _OpensAFileWhenUnpickled:
    """A hostile pickle's payload: unpickling it creates ``path`` (as a pickle can run any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _torch_zip(path: Path, payload: bytes) -> None:
    """What ``torch.save`` writes since PyTorch 1.6 (torch is not installed here): a stored zip holding
    ``archive/data.pkl`` (the pickled state dict), ``archive/data/0`` (a storage) and ``archive/version``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/data/0", np.ones(4, np.float32).tobytes())
        z.writestr("archive/version", "3\n")


def test_pytorch_pickles_are_named_and_never_unpickled(tmp_path, capsys):
    from safetensors.numpy import save_file

    # A Hugging Face folder saved by PyTorch (`pytorch_model.bin`, a torch.save zip) and a pre-1.6 torch.save file
    # (a bare pickle) got "not a checkpoint" (or an npz error); now one line that names the pickle and the fix.
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _OpensAFileWhenUnpickled(marker)}, protocol=2)
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}')
    _torch_zip(hf / "pytorch_model.bin", payload)
    (tmp_path / "old.pt").write_bytes(payload)
    assert payload[:2] == b"\x80\x02"  # a pickle opens like an empty msgpack map: no longer claimed as msgpack
    fix = ("treetools reads no pickles (loading one can run code). Save the weights as safetensors "
           "(`save_pretrained(DIR, safe_serialization=True)`, or `safetensors.torch.save_file(model.state_dict(), "
           "PATH)`) and pass that.")
    cases = {hf: f"{hf}: holds pytorch_model.bin, a PyTorch pickle; {fix}",
             hf / "pytorch_model.bin": f"{hf / 'pytorch_model.bin'}: a PyTorch pickle (torch.save); {fix}",
             tmp_path / "old.pt": f"{tmp_path / 'old.pt'}: a PyTorch pickle (torch.save); {fix}"}
    for path, want in cases.items():
        assert main(["inspect", str(path)]) == 1
        assert capsys.readouterr().err == f"treetools: error: {want}\n"
        with pytest.raises(tt.CheckpointError, match="reads no pickles"):
            tt.load_parameters(str(path))
    assert not marker.exists()
    # An index of torch shards is named as such; shards without their index are named too.
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    _torch_zip(shards / "pytorch_model-00001-of-00002.bin", payload)
    assert main(["inspect", str(shards)]) == 1
    assert capsys.readouterr().err == (f"treetools: error: {shards}: holds pytorch_model.bin.index.json, an index of "
                                       f"PyTorch pickles; {fix}\n")
    (shards / "pytorch_model.bin.index.json").unlink()
    assert main(["inspect", str(shards)]) == 1
    assert "holds pytorch_model-00001-of-00002.bin, a PyTorch pickle;" in capsys.readouterr().err
    # A Hugging Face Trainer's output_dir: a stray pickle beside a checkpoint folder points at the checkpoint.
    trainer = tmp_path / "trainer"
    (trainer / "checkpoint-500").mkdir(parents=True)
    _torch_zip(trainer / "pytorch_model.bin", payload)
    save_file({"w": np.ones(2, np.float32)}, str(trainer / "checkpoint-500" / "model.safetensors"))
    assert main(["inspect", str(trainer)]) == 1
    assert capsys.readouterr().err == (f"treetools: error: {trainer}: not a checkpoint but a folder holding "
                                       f"checkpoints; did you mean {trainer / 'checkpoint-500'} (safetensors)?\n")
    # An npz saved under a torch-like name (np.savez to a file object adds no suffix) is still an npz.
    for name in ("weights.bin", "weights.pt"):
        with open(tmp_path / name, "wb") as fh:
            np.savez(fh, w=np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(tt.load_parameters(str(tmp_path / name))["w"], np.arange(3, dtype=np.float32))
    assert not marker.exists()
    # Beside safetensors the pickle is ignored: the folder is the safetensors format's.
    save_file({"w": np.ones(2, np.float32)}, str(hf / "model.safetensors"))
    assert main(["inspect", str(hf), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "safetensors"


def test_every_pickle_is_named_and_never_unpickled(tmp_path, capsys):
    # Issue 47 (4): Haiku's `params.pkl` (and any pickle.dump) got "not a checkpoint but a file beside checkpoints;
    # did you mean ...?" where `pytorch_model.bin` got the clear line. Every pickle gets it now: by its name
    # (.pkl/.pickle, whatever the protocol: protocols 0 and 1 have no magic bytes) or by its magic bytes (any name).
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "other.npz", w=np.ones(2, np.float32))  # a checkpoint beside: the "did you mean" of before
    cases = {"params.pkl": 4, "state.pickle": 5, "old.pkl": 0, "params": 2, "weights.ckpt": 3}
    for name, protocol in cases.items():
        (tmp_path / name).write_bytes(pickle.dumps({"w": _OpensAFileWhenUnpickled(marker)}, protocol=protocol))
    fix = ("treetools reads no pickles (loading one can run code). Where you trust it, load it yourself and save the "
           "arrays as safetensors (`safetensors.numpy.save_file(tt.flatten(params), PATH)`) or an Orbax checkpoint, "
           "and pass that.")
    for name in cases:
        path = tmp_path / name
        assert main(["inspect", str(path)]) == 1
        assert capsys.readouterr().err == (f"treetools: error: {path}: a Python pickle (pickle.dump: Haiku's "
                                           f"params.pkl and others); {fix}\n"), name
        with pytest.raises(tt.CheckpointError, match="reads no pickles"):
            tt.load_parameters(str(path))
    assert not marker.exists()
    # A file that is no pickle, under no pickle's name, still gets the "did you mean".
    (tmp_path / "notes").write_bytes(b"\x80\x09 not a pickle")
    assert main(["inspect", str(tmp_path / "notes")]) == 1
    assert f"did you mean {tmp_path / 'other.npz'} (npz)?" in capsys.readouterr().err


def test_files_that_merely_start_like_a_msgpack_map_are_not_claimed(tmp_path):
    # The msgpack format sniffs a map of string keys (flax's state dicts), not any byte 0x80-0x8f: a PNG (0x89 'P':
    # a map whose first key would be the integer 80) was claimed as msgpack, and offered as "did you mean".
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (tmp_path / "int_keys.bin").write_bytes(b"\x81\x01\xc0")  # {1: None}
    (tmp_path / "state").write_bytes(serialization.to_bytes({"params": {"w": np.ones(2, np.float32)}}))
    (tmp_path / "empty").write_bytes(serialization.to_bytes({}))
    big = {f"k{i}": np.float32(i) for i in range(20)}  # more than 15 keys: a map16 header
    (tmp_path / "map16").write_bytes(serialization.to_bytes(big))
    claimed = {name: claiming_format(str(tmp_path / name), registered_formats())
               for name in ("plot.png", "int_keys.bin", "state", "empty", "map16")}
    assert {k: (f.name if f else None) for k, f in claimed.items()} == {
        "plot.png": None, "int_keys.bin": None, "state": "msgpack", "empty": "msgpack", "map16": "msgpack"}


def test_a_plain_npy_reads_as_npy_and_is_never_a_did_you_mean(tmp_path, capsys, monkeypatch):
    # Issue 39, point 15: a plain .npy showed as "(equinox)", and "did you mean" named an unrelated .npy array or a
    # 0-byte file as the checkpoint the user meant.
    import shutil

    from treetools.checkpoint_io.opening import open_source

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    assert main(["inspect", str(tmp_path / "x.npy")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"{tmp_path / 'x.npy'} (npy)"
    assert open_source(str(tmp_path / "x.npy")).format == "npy"
    np.testing.assert_array_equal(flatten(tt.load_parameters(str(tmp_path / "x.npy")))["0"], x)
    with open(tmp_path / "m.eqx", "wb") as f:  # arrays back to back: an Equinox file, under any name
        np.save(f, x)
        np.save(f, np.int32(7))
    shutil.copy(tmp_path / "m.eqx", tmp_path / "two.npy")
    assert [open_source(str(tmp_path / n)).format for n in ("m.eqx", "two.npy")] == ["equinox", "equinox"]
    # Beside a stray array and an empty file, no "did you mean"; beside a real checkpoint, that one alone.
    # (Looked for one folder up only: other tests' folders in pytest's base folder can read as a run of steps.)
    import treetools.checkpoint_io.diagnose as source_module

    monkeypatch.setattr(source_module, "NEAR_LEVELS", {False: 1, True: 1})
    folder = tmp_path / "f"
    folder.mkdir()
    np.save(folder / "embeddings.npy", x)
    (folder / "empty.safetensors").write_bytes(b"")
    (folder / "notes.md").write_text("notes")
    for path in (folder, folder / "notes.md"):
        assert main(["inspect", str(path)]) == 1
        err = capsys.readouterr().err
        assert "did you mean" not in err and "Readable formats:" in err, err
    np.savez(folder / "weights.npz", w=x)
    assert main(["inspect", str(folder / "notes.md")]) == 1
    assert capsys.readouterr().err == (f"treetools: error: {folder / 'notes.md'}: not a checkpoint but a file beside "
                                       f"checkpoints; did you mean {folder / 'weights.npz'} (npz)?\n")


def test_t5x_style_folder_is_not_claimed_as_orbax(tmp_path, capsys):
    # `checkpoint_100/checkpoint` (T5X) has no Orbax evidence: the T5X format reads it, Orbax never claims it.
    step = tmp_path / "model" / "checkpoint_100"
    step.mkdir(parents=True)
    (step / "checkpoint").write_bytes(b"\x81\xa6target\x80")
    assert main(["inspect", str(tmp_path / "model"), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["format"] == "t5x" and json.loads(out)["steps"] == [100]
    assert "step folder holds no Orbax item" not in err


def test_unexpected_exception_keeps_its_traceback(tmp_path, monkeypatch):
    # A bug is not a known error: the CLI lets it through instead of a one-line "internal error".
    path, _, _ = write_npz(tmp_path)
    import treetools.checkpoint_tools.report as report

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(report, "open_source", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["inspect", str(path)])


def test_orbax_metadata_inspection_imports_neither_jax_nor_orbax(tmp_path):
    root = _three_items(tmp_path)
    code = ("import sys\n"
            "from treetools.cli import main\n"
            f"assert main(['inspect', {str(root)!r}]) == 0\n"
            f"assert main(['inspect', {str(root)!r}, '--format', 'json', '--item', 'opt_state']) == 0\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'orbax', 'flax'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[params]" in proc.stdout and "Grand total (4 items)" in proc.stdout


def test_orbax_metadata_without_orbax_matches_orbax_own_metadata_api(tmp_path):
    # The jax-free reader against Orbax's metadata API, on OCDBT, non-OCDBT and zarr3 layouts.
    params = {"a": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)}, "n": jnp.int32(3)}
    for name, kwargs in {"ocdbt": {}, "plain": {"use_ocdbt": False}, "zarr3": {"use_zarr3": True}}.items():
        folder = tmp_path / name
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kwargs)) as ckptr:
            ckptr.save(folder, args=ocp.args.PyTreeSave(params))
        ours = {leaf.name: (leaf.reader.shape, leaf.reader.dtype) for leaf in
                tt.open_source(folder).snapshot().items["default"].leaves}
        theirs = ocp.PyTreeCheckpointHandler().metadata(folder).tree
        want = {p: (tuple(m.shape), np.dtype(m.dtype)) for p, m in flatten(theirs).items()}
        assert ours == want, name


def test_restore_through_a_plain_orbax_manager_logs_no_warnings(tmp_path, caplog):
    path, item, truth = write_orbax_manager_linen(tmp_path)
    import logging

    with ocp.CheckpointManager(path) as mngr, caplog.at_level(logging.WARNING):
        target = tt.make_abstract(tt.load_parameters(path))
        out = tt.restore_checkpoint(mngr, "latest", {"params": target})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    for p, want in truth.items():
        np.testing.assert_array_equal(np.asarray(flatten(out["params"])[p]), want)


def test_save_checkpoint_stores_metrics_and_says_when_a_step_exists(tmp_path):
    mngr = tt.get_checkpoint_manager(100, checkpoint_dir=tmp_path, async_save=False)
    params = {"w": jnp.ones(2)}
    assert tt.save_checkpoint(mngr, 100, {"params": params}, metrics={"loss": np.float32(1.5)}) is True
    assert tt.save_checkpoint(mngr, 150, {"params": params}) is False  # not a save step: the policy's silence
    with pytest.warns(UserWarning, match="step 100 is already saved"):
        assert tt.save_checkpoint(mngr, 100, {"params": params}) is False
    assert tt.save_checkpoint(mngr, 150, {"params": params}, force=True) is True
    mngr.close()
    report = inspect_path(str(tmp_path), step=100)
    assert report.by_step[0].metadata["metrics"] == {"loss": 1.5}
    assert tt.list_steps(tmp_path) == [100, 150]


def test_load_parameters_finds_params_inside_a_single_train_state_item(tmp_path):
    # Orbax's basic example: one unnamed `default` item holding the whole train state.
    params = jax.tree.map(jnp.asarray, _params())
    state = {"step": jnp.int32(5), "params": params, "opt_state": optax.adam(1e-3).init(params)}
    with ocp.CheckpointManager(tmp_path / "basic") as mngr:
        mngr.save(5, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    loaded = tt.load_parameters(tmp_path / "basic")
    assert sorted(flatten(loaded)) == sorted(flatten(params))
    for p, x in flatten(params).items():
        np.testing.assert_array_equal(flatten(loaded)[p], np.asarray(x))
    restored = tt.load_parameters(tmp_path / "basic", target=tt.make_abstract(loaded))
    np.testing.assert_array_equal(np.asarray(restored["Dense_0"]["kernel"]), np.asarray(params["Dense_0"]["kernel"]))
    with pytest.raises(FileNotFoundError, match="holds no EMA parameters.*top-level keys: "):
        tt.load_parameters(tmp_path / "basic", use_ema_params=True)
    # The whole item stays reachable by name.
    assert "opt_state" in tt.load_parameters(tmp_path / "basic", item="default")
    # A Flax msgpack of a whole state: the same rule.
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes({"params": _params(), "step": 3}))
    assert sorted(flatten(tt.load_parameters(tmp_path / "state.msgpack"))) == sorted(flatten(_params()))


def test_typed_prng_keys_restore_as_keys(tmp_path):
    # nnx State with Dropout holds a typed key; Orbax stores its key data. Truth: Orbax's own restore.
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    state = nnx.state(M(nnx.Rngs(0, dropout=1)))
    abstract = nnx.state(nnx.eval_shape(lambda: M(nnx.Rngs(0, dropout=1))))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", state)
        theirs = ckptr.restore(tmp_path / "orbax", abstract)
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=tmp_path / "run")
    tt.save_checkpoint(mngr, 1, {"params": state, "rng": {"k": jax.random.key(7)}}, wait=True)
    ours = tt.restore_checkpoint(mngr, "latest", {"params": tt.make_abstract(abstract),
                                                  "rng": {"k": jax.eval_shape(lambda: jax.random.key(0))}})
    key = ours["params"]["drop"]["rngs"]["key"].get_value()
    want = theirs["drop"]["rngs"]["key"].get_value()
    assert key.dtype == want.dtype and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want))
    np.testing.assert_array_equal(jax.random.key_data(ours["rng"]["k"]), jax.random.key_data(jax.random.key(7)))


def test_manager_with_best_fn_stores_a_metrics_item_that_every_reader_reads(tmp_path, capsys):
    # Orbax writes a best_fn manager's metrics as the item `metrics` in the file `metrics/metrics`.
    root = tmp_path / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, best_fn=lambda m: m["loss"], best_mode="min")
    tt.save_checkpoint(mngr, 1, {"params": {"w": jnp.ones(4)}}, metrics={"loss": 1.5}, wait=True)
    mngr.close()
    assert (root / "1" / "metrics" / "metrics").is_file()
    assert main(["inspect", str(root), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checkpoints"][0]["items"]["metrics"]["value"] == {"loss": 1.5}
    assert main(["verify", str(root)]) == 0
    assert main(["diff", str(root), str(root)]) == 0


def test_load_parameters_finds_the_state_item_beside_a_metrics_item(tmp_path):
    # A manager with best_fn saving one `state` item: the step holds `state` and Orbax's `metrics`.
    root = tmp_path / "run"
    params = {"Dense_0": {"kernel": np.arange(6.0, dtype=np.float32).reshape(2, 3)}}
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, best_fn=lambda m: m["loss"], best_mode="min")
    tt.save_checkpoint(mngr, 1, {"state": {"params": params, "step": np.int32(1)}}, metrics={"loss": 0.5}, wait=True)
    mngr.close()
    assert sorted(tt.open_source(root).snapshot().items) == ["metrics", "state"]
    got = tt.load_parameters(root)
    np.testing.assert_array_equal(got["Dense_0"]["kernel"], params["Dense_0"]["kernel"])


def test_flat_stored_names_are_never_split_into_a_params_subtree(tmp_path):
    # safetensors names starting with `params.` stay as stored: load_parameters' keys are inspect's paths.
    from safetensors.numpy import save_file

    tensors = {"params.w": np.ones(2, np.float32), "params.b": np.zeros(2, np.float32),
               "lm_head.weight": np.full((2, 2), 3.0, np.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    got = tt.load_parameters(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(tensors)
    np.testing.assert_array_equal(got["lm_head.weight"], tensors["lm_head.weight"])


def test_a_folder_named_like_a_step_of_a_series_with_no_committed_step_is_no_part_of_a_checkpoint(tmp_path):
    # pytest's `test_name_0` folders beside an unfinished Orbax save (`other_1.orbax-checkpoint-tmp`): the folder
    # holding them reads as a root (the unfinished save is Orbax's), but a run folder in `test_name_0/` is inside
    # no checkpoint; a step of a series that has a committed step still is.
    from treetools.checkpoint_io.diagnose import enclosing_checkpoints

    (tmp_path / "other_1.orbax-checkpoint-tmp-1700000000").mkdir()
    (tmp_path / "test_name_0").mkdir()
    assert enclosing_checkpoints(tmp_path / "test_name_0" / "run", include_self=True) == []
    inside_save = enclosing_checkpoints(tmp_path / "other_1.orbax-checkpoint-tmp-1700000000" / "x")
    assert str(tmp_path) in [str(p) for p, _ in inside_save]  # inside the unfinished save: part of the root still
    root = tmp_path / "committed"
    with ocp.CheckpointManager(str(root), options=ocp.CheckpointManagerOptions(step_prefix="ckpt")) as mgr:
        mgr.save(1, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
        mgr.wait_until_finished()
    assert [str(p) for p, _ in enclosing_checkpoints(root / "ckpt_2" / "run")] == [str(root)]  # a step to come
