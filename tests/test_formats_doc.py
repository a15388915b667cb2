"""docs/formats.md's table is true: every row's layout is written by its real writer and every cell is checked.

The table is parsed from the markdown. For each row the layout's writer runs
(Orbax, flax, safetensors, numpy; the Orbax 0.6 / Flax 0.8 rows read the
fixtures those versions wrote), and each column's operation runs on it: a ✓
must work and give the writer's own arrays, a ✗ must be refused with an
error. A row without a writer here fails (add one to ``CASES``). T5X has no
installable writer without TensorFlow: its rows use tests/_t5x_writer.py,
which follows T5X's own save code; Levanter's and EasyDeL's use
tests/_writers/, AlphaFold 3's tests/test_format_af3.py. The Equinox and Keras rows skip when the
``test-formats`` extra is absent, AlphaFold 3's when the ``af3`` extra is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from safetensors.numpy import save_file as save_safetensors

import treetools as tt
from treetools.cli import main
from treetools.checkpoint_io.opening import open_source
from treetools.checkpoint_tools.diff import diff_paths
from treetools.checkpoint_tools.report import inspect_path
from treetools.checkpoint_tools.show import show_leaf
from treetools.pytree.paths import flatten
from tests._every_command import flat_arrays
from tests.test_checkpoint_layer import write_orbax_manager_linen
from tests.test_format_flax_legacy import write_flax_legacy
from tests.test_format_hf_flax import write_hf_flax
from tests.test_format_hf_sharded import _write as write_hf_sharded
from tests.test_format_transformer_vq import fixture_truth as transformer_vq_truth
from tests.test_format_xlstm_jax import fixture_truth as xlstm_jax_truth
from tests._t5x_writer import save_t5x

DOC = Path(__file__).parent.parent / "docs" / "formats.md"
FIXTURES = Path(__file__).parent / "fixtures"
COLUMNS = ("inspect", "stats", "show", "diff", "verify", "load_parameters", "restore_checkpoint")


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table whose header starts with ``| layout |``, as column -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layout |"))
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            if line.startswith("<!--"):
                continue
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"row has {len(cells)} cells, header {len(header)}: {line}"
        rows.append(dict(zip(header, cells)))
    return rows


@dataclasses.dataclass
class Case:
    path: Path
    truth: dict[str, np.ndarray]
    item: str | None = None
    """The item inspect/show/load_parameters are asked for (None: the only one)."""
    restore_item: str = "default"
    """The item name restore_checkpoint is asked for."""


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"Dense_0": {"kernel": rng.standard_normal((6, 4)).astype(np.float32),
                        "bias": np.arange(4, dtype=np.float32)},
            "embed": rng.standard_normal((5, 3)).astype(np.float32)}


def _manager(tmp, *below, item="params"):
    """The Orbax manager root that test_checkpoint_layer writes (step 7, item ``params``), or a folder below it."""
    root, name, truth = write_orbax_manager_linen(tmp)
    return Case(root.joinpath(*below), truth, item=item, restore_item=name)


def _checkpointer_save(tmp, handler, name):
    tree = _params()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp / name, args=ocp.args.PyTreeSave(tree) if isinstance(handler, ocp.PyTreeCheckpointHandler)
                   else ocp.args.StandardSave(tree))
    return Case(tmp / name, flat_arrays(tree))


def _truth_npz(prefix):
    with np.load(FIXTURES / "orbax_0_6_truth.npz") as z:
        return {k[len(prefix):]: z[k] for k in z.files if k.startswith(prefix)}


def _flax_legacy(tmp, orbax):
    truth = write_flax_legacy(tmp / "legacy", (1, 2), orbax=orbax)
    return Case(tmp / "legacy", flat_arrays(truth[2]), item="default")


def _single_file(tmp, name, save):
    tree = _params()
    save(tmp / name, tree)
    return Case(tmp / name, flat_arrays(tree))


def _t5x(tmp, *below):
    """A T5X model dir (steps 1 and 2, and an unfinished save) as T5X's Checkpointer writes it; truth: step 2's target."""
    from tests.test_format_t5x import _state

    states = {step: _state(step, step) for step in (1, 2)}
    for step, state in states.items():
        save_t5x(tmp / "model", step, state)
    save_t5x(tmp / "model", 3, _state(3, 3), finish=False)
    return Case((tmp / "model").joinpath(*below), flat_arrays(states[2]["target"]), item="target", restore_item="target")


def _orbax_fixture(version):
    """A CheckpointManager written by a real old Orbax (tests/fixtures/make_orbax_<version>.py); truth: step 2."""
    with np.load(FIXTURES / f"orbax_{version}_truth.npz") as z:
        truth = {k[2:]: z[k] for k in z.files if k.startswith("2/")}
    return Case(FIXTURES / f"orbax_{version}_manager", truth, item="params", restore_item="params")


def _orbax_v1_training(tmp):
    """Orbax's v1 API: ``training.Checkpointer.save(step, state)`` writes each step's state as the item `state`."""
    import jax.numpy as jnp
    from orbax.checkpoint.experimental.v1 import training

    # Keys with a `/` inside ("Dense_0/kernel"), as a flattened params dict has: Orbax stores them as
    # nested folders / OCDBT keys, which verify once took for arrays _METADATA does not list.
    params = _params()
    state = {"params": {k: jnp.asarray(v) for k, v in flatten(params).items()}, "opt_state": {"mu": jnp.zeros(3)}}
    with training.Checkpointer(str(tmp / "v1")) as ckptr:
        ckptr.save(3, state)
    return Case(tmp / "v1", flat_arrays(state), item="state",
                restore_item="state")


def _safetensors(tmp):
    tensors = {name.replace("/", "."): value for name, value in flat_arrays(_params()).items()}  # HF's dotted names
    save_safetensors(tensors, str(tmp / "model.safetensors"))
    return Case(tmp / "model.safetensors", tensors)


def _hf_model_folder(tmp, *, flax):
    """A `save_pretrained` folder that fits one shard (tests/test_format_hf_folder.py writes it)."""
    from tests.test_format_hf_folder import write_model_folder

    truth = write_model_folder(tmp / "model", flax=flax)
    return Case(tmp / "model", truth)


def _xlstm_jax(*below):
    """xlstm-jax's run, written by the Orbax it pins (tests/fixtures/make_xlstm_jax.py); truth: step 200's `rng`."""
    truth = xlstm_jax_truth()[200]["rng"]
    root = FIXTURES / "xlstm_jax_orbax_0_6"
    if below:
        return Case(root.joinpath(*below), truth, restore_item="rng")
    return Case(root, truth, item="rng", restore_item="rng")


def _transformer_vq():
    """transformer_vq's folder of two series, written by the flax it pins; truth: the `checkpoint_` series' step 6."""
    return Case(FIXTURES / "transformer_vq_flax_0_6", transformer_vq_truth()["checkpoint_"][6], item="default")


def _levanter(tmp, *below):
    """A Levanter run (tests/_writers/levanter.py: steps 10, 20 and a preempted 30); truth: step 20's `model`."""
    from tests.test_format_levanter import write_run

    base = tmp / "checkpoints" / "run-1"
    truth = write_run(base)[20]["model"]
    return Case(base.joinpath(*below), truth, item=None if below[1:] else "model", restore_item="model")


def _easydel(tmp, trainer):
    """EasyDeL's save_pretrained folder, or a trainer's run-N folders (tests/_writers/easydel.py); truth: `model`."""
    from tests.test_format_easydel import _params, write_trainer_run
    from tests._writers.easydel import save_pretrained

    if trainer:
        return Case(tmp / "out", write_trainer_run(tmp / "out")[10]["model"], item="model", restore_item="model")
    save_pretrained(tmp / "llama", _params(1))
    return Case(tmp / "llama", flat_arrays(_params(1)), item="model", restore_item="model")


def _equinox(tmp):
    pytest.importorskip("equinox")
    from tests.test_format_equinox import write_eqx

    path, _, truth = write_eqx(tmp / "model.eqx")
    return Case(path, truth)


def _keras(tmp, whole):
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    pytest.importorskip("keras")
    pytest.importorskip("h5py")
    from tests.test_format_keras import write_keras_file, write_weights_h5

    path, _, truth = write_keras_file(tmp) if whole else write_weights_h5(tmp / "model.weights.h5")
    # a compiled model's file: item `default` is every variable, the optimizer's too (without it, the model's)
    return Case(path, truth, item="default" if whole else None)


def _orbax_every_handler(tmp):
    """A manager whose steps hold an item per Orbax handler (tests/test_format_orbax_items.py); truth: `params`."""
    from tests.test_format_orbax_items import write_manager

    truth = write_manager(tmp / "run", steps=(1,))
    return Case(tmp / "run", flat_arrays(truth[1]["params"]), item="params", restore_item="params")


def _orbax_v1_partial(tmp):
    """``ocp.v1.partial.save`` twice, then ``finalize``: one item `state` (StatefulCheckpointableHandler)."""
    import jax.numpy as jnp
    from orbax.checkpoint.experimental.v1 import partial

    import jax

    first, second = {"params": _params()}, {"opt_state": {"mu": np.ones(3, np.float32)}}
    partial.save(str(tmp / "p"), jax.tree.map(jnp.asarray, first))
    partial.save(str(tmp / "p"), jax.tree.map(jnp.asarray, second))
    partial.finalize(str(tmp / "p"))
    return Case(tmp / "p", {**flat_arrays(first), **flat_arrays(second)}, item="state", restore_item="state")


def _jax_pytree(tmp):
    pytest.importorskip("flatbuffers")
    from tests.test_format_jax_pytree import _state, save

    save(tmp / "jp", _state())
    return Case(tmp / "jp", flat_arrays(_state()), item="default")


def _big_vision(tmp):
    from tests.test_format_zarr_tree import write_big_vision

    truth = write_big_vision(tmp / "bv")
    return Case(tmp / "bv", flat_arrays(truth[300]), item="default")


def _async_serialize(tmp):
    from tests.test_format_zarr_tree import _async_serialize as write

    state = {"target": _params(), "state": {"step": np.asarray(3, np.int32)}}
    for name, value in flatten(state).items():
        write(str(tmp / "m" / "checkpoint_3" / name.replace("/", ".")), value)
    return Case(tmp / "m", flat_arrays(state), item="default")


def _levanter_export(tmp):
    from tests._writers.levanter import save_export

    state = {"model": _params(), "step": np.asarray(4, np.int32)}
    return Case(Path(save_export(tmp / "export", state)), flat_arrays(state), item="default")


def _easylm(tmp, whole):
    from tests._writers.easylm import save_all

    state = {"params": {"params": _params()}, "opt_state": {"0": {"mu": _params(1)}}}
    path = save_all(tmp, state, save_optimizer_state=whole)
    return Case(Path(path), flat_arrays(state if whole else state["params"]), item="default")


def _objax(tmp):
    from tests._writers.objax import save_var_collection

    named = {"(Sequential)[0](Linear).w": np.ones((2, 3), np.float32), "(Sequential)[0](Linear).b": np.zeros(3, np.float32)}
    save_var_collection(tmp / "0000000010.npz", named)
    return Case(tmp / "0000000010.npz", named)


def _diffusers(tmp, *below):
    from tests._writers.diffusers import save_pipeline

    params = {"unet": _params(), "vae": _params(1), "text_encoder": _params(2)}
    save_pipeline(tmp / "sd", params)
    if below:
        return Case((tmp / "sd").joinpath(*below), flat_arrays(params[below[0]]))
    return Case(tmp / "sd", flat_arrays(params["unet"]), item="unet", restore_item="unet")


def _diffusers_sharded(tmp):
    import json

    from tests.test_format_diffusers import _save_sharded

    transformer = {k.replace("/", "."): v for k, v in flat_arrays(_params()).items()}
    encoder = {k.replace("/", "."): v for k, v in flat_arrays(_params(2)).items()}
    _save_sharded(tmp / "pipe" / "transformer", transformer, "diffusion_pytorch_model")
    _save_sharded(tmp / "pipe" / "text_encoder_2", encoder, "model")
    (tmp / "pipe" / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "text_encoder_2": ["transformers", "T5EncoderModel"],
        "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    return Case(tmp / "pipe", transformer, item="transformer", restore_item="transformer")


def _flax_metric_named(tmp):
    from flax.training import checkpoints

    states = {}
    for acc in (0.5, 0.625):
        states[acc] = {"params": _params(int(acc * 8))}
        checkpoints.save_checkpoint(tmp / "best", states[acc], step=acc, prefix="best_acc_", keep=5, overwrite=True)
    return Case(tmp / "best", flat_arrays(states[0.625]), item="default")


def _levanter_bare_export(tmp, *below):
    """Levanter's ``save_checkpoint({"model": model}, 0, "export/step-0")`` (tests/_writers/levanter.py)."""
    from tests._writers.levanter import save_levanter

    save_levanter(tmp / "export", 0, {"model": _params()})
    return Case((tmp / "export").joinpath(*below), flat_arrays(_params()), item="model", restore_item="model")


def _easydel_nnx_optimizer(tmp):
    """An EasyDeL trainer save whose `tx` is optax's state of an nnx model (moments stored at `.../value`)."""
    import optax
    from flax import nnx

    from tests._writers.easydel import save_run

    state = nnx.state(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Param)
    opt_state = optax.adam(1e-3).init(state)
    folder = save_run(tmp / "out", 7, {k: np.asarray(v) for k, v in flatten(state.to_pure_dict()).items()}, opt_state)
    truth = {k.removesuffix("/value"): np.asarray(v) for k, v in flatten(opt_state).items()}
    return Case(Path(folder), truth, item="tx", restore_item="tx")


def _easydel_index_file(tmp):
    from tests._writers.easydel import save_pretrained
    from tests.test_format_easydel import _params as easydel_params

    save_pretrained(tmp / "llama", easydel_params(1))
    return Case(tmp / "llama" / "tensorstore_index.json", flat_arrays(easydel_params(1)), item="model",
                restore_item="model")


def _paxml(tmp):
    from tests.test_params_finding import _pax_names, write_pax_run

    truth = write_pax_run(tmp / "pax", steps=(100,))
    return Case(tmp / "pax", {k.replace(".", "/"): v for k, v in _pax_names(truth[100]).items()}, item="default")


def _af3(tmp):
    pytest.importorskip("zstandard")
    from tests.test_format_af3 import _flat, _params, write_af3

    return Case(Path(write_af3(tmp / "af3.bin.zst", _params())), _flat(_params()))


def _af3_parts(tmp):
    pytest.importorskip("zstandard")
    from tests.test_format_af3 import _flat, _params, _split, write_af3

    data = Path(write_af3(tmp / "whole.bin.zst", _params())).read_bytes()
    (tmp / "models").mkdir()
    for k, part in enumerate(_split(data, 2)):
        (tmp / "models" / f"af3.{k}.bin.zst").write_bytes(part)
    return Case(tmp / "models", _flat(_params()))


def _maxtext_aqt(tmp):
    import jax
    import jax.numpy as jnp

    from tests.test_params_finding import _maxtext_quantized

    tree = {"params": _maxtext_quantized()}
    with ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=True) as ckptr:
        ckptr.save(tmp / "quantized", jax.tree.map(jnp.asarray, tree))
    return Case(tmp / "quantized", flat_arrays(tree), item="default")


CASES: dict[str, Callable[[Path], Case]] = {
    "Orbax CheckpointManager root": _manager,
    "Orbax step folder": lambda t: _manager(t, "7"),
    "Orbax single item folder": lambda t: _manager(t, "7", "params", item=None),
    "Orbax StandardCheckpointer save": lambda t: _checkpointer_save(t, ocp.StandardCheckpointHandler(), "std"),
    "Orbax PyTreeCheckpointer save": lambda t: _checkpointer_save(t, ocp.PyTreeCheckpointHandler(), "pytree"),
    "Orbax zarr3 (`use_zarr3=True`)": lambda t: _checkpointer_save(t, ocp.PyTreeCheckpointHandler(use_zarr3=True),
                                                                    "zarr3"),
    "Orbax without OCDBT (`use_ocdbt=False`)": lambda t: _checkpointer_save(
        t, ocp.PyTreeCheckpointHandler(use_ocdbt=False), "plain"),
    "Orbax v1 training Checkpointer (`ocp.experimental.v1.training`)": _orbax_v1_training,
    "Orbax 0.6.x CheckpointManager": lambda t: Case(FIXTURES / "orbax_0_6_manager", _truth_npz("manager/2/"),
                                                    item="params", restore_item="params"),
    "nnx State, Flax 0.8 (`.../raw_value` on disk)": lambda t: Case(FIXTURES / "orbax_0_6_nnx", _truth_npz("nnx/")),
    "Flax msgpack file": lambda t: _single_file(t, "state.msgpack",
                                                lambda p, tree: p.write_bytes(serialization.to_bytes(tree))),
    "Flax legacy `checkpoint_<N>` msgpack files": lambda t: _flax_legacy(t, orbax=False),
    "Flax legacy Orbax mode `checkpoint_<N>/`": lambda t: _flax_legacy(t, orbax=True),
    "Hugging Face safetensors file": _safetensors,
    "Hugging Face model folder, one `model.safetensors` (`save_pretrained`, fits one shard)":
        lambda t: _hf_model_folder(t, flax=False),
    "Hugging Face Flax model folder, one `flax_model.msgpack` (`FlaxPreTrainedModel.save_pretrained`)":
        lambda t: _hf_model_folder(t, flax=True),
    "Hugging Face sharded safetensors": lambda t: Case(t, write_hf_sharded(t, [
        {"model.embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4)},
        {"model.layers.0.q.weight": np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)}])),
    "Hugging Face Flax sharded msgpack": lambda t: Case(t, write_hf_flax(t, _params(), max_shard_size=100)),
    "numpy npz": lambda t: _single_file(t, "weights.npz", lambda p, tree: np.savez(p, **flat_arrays(tree))),
    "T5X model dir": _t5x,
    "T5X step folder": lambda t: _t5x(t, "checkpoint_2"),
    "T5X `checkpoint` file": lambda t: _t5x(t, "checkpoint_2", "checkpoint"),
    "Orbax before 0.5 CheckpointManager (`checkpoint` msgpack + zarr folders, no `_METADATA`)":
        lambda t: _orbax_fixture("0_3"),
    "Orbax 0.4.x CheckpointManager": lambda t: _orbax_fixture("0_4"),
    "xlstm-jax run (Orbax 0.6 CheckpointManager; items `step`, `rng` by `ArrayCheckpointHandler`)":
        lambda t: _xlstm_jax(),
    "Orbax `ArrayCheckpointHandler` item folder": lambda t: _xlstm_jax("checkpoint_200", "rng"),
    "transformer_vq run (flax `save_checkpoint_multiprocess`, prefixes `checkpoint_` and "
    "`validation_loss_lm_per_token_`)": lambda t: _transformer_vq(),
    "Levanter run folder": _levanter,
    "Levanter step folder": lambda t: _levanter(t, "step-20"),
    "Levanter item folder": lambda t: _levanter(t, "step-20", "model"),
    "EasyDeL `save_pretrained` folder": lambda t: _easydel(t, trainer=False),
    "EasyDeL trainer save folder": lambda t: _easydel(t, trainer=True),
    "Equinox `eqx.tree_serialise_leaves` file": _equinox,
    "Keras 3 weights file (`model.save_weights`)": lambda t: _keras(t, whole=False),
    "Keras 3 model file (`model.save`)": lambda t: _keras(t, whole=True),
    "Orbax step with an item per handler (`JaxRandomKeySave`, `NumpyRandomKeySave`, `ArraySave`, `ProtoSave`, "
    "`JsonSave`, Grain's `PyGrainCheckpointHandler`)": _orbax_every_handler,
    "Orbax v1 `partial.save` + `partial.finalize`": _orbax_v1_partial,
    "jax pytree serialization (`pytree_serialization.save`)": _jax_pytree,
    "big_vision `save_checkpoint_ts` workdir": _big_vision,
    "jax `async_serialize` per-leaf folders in `checkpoint_<N>/`": _async_serialize,
    "Levanter export without `metadata.json` (`tree_serialize_leaves_tensorstore`)": _levanter_export,
    "EasyLM `streaming_params`": lambda t: _easylm(t, whole=False),
    "EasyLM `streaming_train_state`": lambda t: _easylm(t, whole=True),
    "objax `Checkpoint` npz (a `names` array)": _objax,
    "diffusers Flax pipeline": _diffusers,
    "diffusers Flax model folder": lambda t: _diffusers(t, "unet"),
    "diffusers PyTorch pipeline, sharded components": _diffusers_sharded,
    "Flax checkpoints named by a metric (`best_acc_0.625`)": _flax_metric_named,
    "Levanter bare `save_checkpoint` export root": _levanter_bare_export,
    "Levanter bare `save_checkpoint` export step folder": lambda t: _levanter_bare_export(t, "step-0"),
    "EasyDeL trainer save of an nnx optimizer state (`tx/0/mu/.../kernel/value` on disk)": _easydel_nnx_optimizer,
    "EasyDeL `tensorstore_index.json` given as PATH": _easydel_index_file,
    "Hugging Face `model.safetensors.index.json` given as PATH": lambda t: Case(
        t / "model.safetensors.index.json", write_hf_sharded(t, [
            {"model.embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4)},
            {"model.layers.0.q.weight": np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)}])),
    "paxml GDA checkpoints (`TrainState(step, mdl_vars, opt_states)`, one folder per leaf)": _paxml,
    "MaxText AQT-quantized params (`save_params_to_path`: collections `params` and `aqt`)": _maxtext_aqt,
    "AlphaFold 3 parameter file (`af3.bin.zst`)": _af3,
    "AlphaFold 3 model in parts": _af3_parts,
}


ROWS = parse_table(DOC.read_text())


def test_table_has_every_column_and_a_row_per_writer():
    assert ROWS and all(set(COLUMNS) <= set(row) for row in ROWS)
    documented = {row["layout"] for row in ROWS}
    assert set(CASES) <= documented, f"writers without a row: {set(CASES) - documented}"
    for row in ROWS:
        for col in COLUMNS:
            assert row[col] in ("✓", "✗"), f"{row['layout']} / {col}: {row[col]!r} is neither ✓ nor ✗"


def _leaves(report, item):
    items = report["checkpoints"][0]["items"]
    chosen = items[item] if item is not None else next(iter(items.values()))
    return {leaf["path"]: leaf for leaf in chosen["leaves"]}


def check_inspect(case, tmp):
    leaves = _leaves(inspect_path(str(case.path), item=case.item).to_json(), case.item)
    assert sorted(leaves) == sorted(case.truth)
    for p, want in case.truth.items():
        assert leaves[p]["shape"] == list(want.shape) and leaves[p]["dtype"] == str(want.dtype), p


def check_stats(case, tmp):
    leaves = _leaves(inspect_path(str(case.path), item=case.item, stats=True).to_json(), case.item)
    for p, want in case.truth.items():
        assert leaves[p]["stats"]["max"] == pytest.approx(float(want.max())), p
        assert leaves[p]["stats"]["mean"] == pytest.approx(float(want.astype(np.float64).mean()), abs=1e-6), p


def check_show(case, tmp):
    for p, want in case.truth.items():
        _, value = show_leaf(str(case.path), p, item=case.item)
        np.testing.assert_array_equal(value, want, err_msg=p)


def check_diff(case, tmp):
    other = tmp / "truth.npz"
    # The npz holds the truth as the item asked for (`--item` of a single-tree file is a top-level key): so a tree
    # whose own top-level key is the item's name (EasyDeL's `model/...` params in the item `model`) pairs whole.
    nest = case.item not in (None, "default")
    np.savez(other, **{f"{case.item}/{k}" if nest else k: v for k, v in case.truth.items()})
    report = diff_paths(str(case.path), str(other), item=case.item, values=True)
    assert not report.added and not report.removed and report.identical


def check_verify(case, tmp):
    rc = main(["verify", str(case.path)])
    if rc != 0:  # a refusal, as the CLI reports it
        raise tt.CheckpointError(f"treetools verify {case.path} exited {rc}")


def check_load_parameters(case, tmp):
    loaded = flat_arrays(tt.load_parameters(case.path, item=case.item))
    assert sorted(loaded) == sorted(case.truth)
    for p, want in case.truth.items():
        assert loaded[p].dtype == want.dtype, p
        np.testing.assert_array_equal(loaded[p], want, err_msg=p)


def check_restore_checkpoint(case, tmp):
    target = tt.make_abstract(tt.load_parameters(case.path, item=case.item))
    restored = flat_arrays(tt.restore_checkpoint(str(case.path), None, {case.restore_item: target})[case.restore_item])
    assert sorted(restored) == sorted(case.truth)
    for p, want in case.truth.items():
        np.testing.assert_array_equal(restored[p], want, err_msg=p)


CHECKS = {col: globals()[f"check_{col}"] for col in COLUMNS}


@pytest.mark.parametrize("row", ROWS, ids=[row["layout"] for row in ROWS])
def test_row_is_true(row, tmp_path, capsys):
    if row["layout"] not in CASES:
        pytest.fail(f"no writer for the documented layout {row['layout']!r}: add one to CASES")
    case = CASES[row["layout"]](tmp_path)
    assert open_source(str(case.path)).format == row["format"]
    for col in COLUMNS:
        work = tmp_path / f"_{col}"
        work.mkdir()
        if row[col] == "✓":
            CHECKS[col](case, work)
        else:
            # Refused: a treetools error (CheckpointError, FileNotFoundError, ValueError), not a wrong answer.
            with pytest.raises((tt.CheckpointError, FileNotFoundError, ValueError)) as refused:
                CHECKS[col](case, work)
            assert not isinstance(refused.value, AssertionError), refused.value


def test_writing_a_format_example_runs(tmp_path):
    # docs/formats.md "Writing a format": the worked examples (a single file; a format with steps) run as written,
    # each in a fresh namespace.
    import re

    from treetools.checkpoint_io.registry import registered_formats, unregister_format

    text = DOC.read_text()
    section = text[text.index("## Writing a format"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)
    assert len(blocks) == 2, len(blocks)
    spaces = []
    try:
        for i, code in enumerate(blocks):
            spaces.append({"workdir": str(tmp_path)})
            exec(compile(code, f"docs/formats.md (Writing a format, block {i + 1})", "exec"), spaces[-1])
    finally:
        for name in ("rawbin", "rawbin-run"):
            unregister_format(name)
    assert spaces[0]["params"]["dense"]["b"].tolist() == [1.0, 1.0, 1.0]
    assert spaces[1]["source"].steps == [100, 200]
    assert not {"rawbin", "rawbin-run"} & {f.name for f in registered_formats()}
