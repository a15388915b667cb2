"""transformer_vq runs (issue 29): one flax checkpoint folder holding two series, read one series at a time.

transformer_vq saves with ``flax.training.checkpoints.save_checkpoint_multiprocess`` (src/transformer_vq/utils/
io.py at transformer-vq/transformer_vq commit 21943e4eea124fa1eec0939a24f36cfa6fe9c499) into one folder under
two prefixes: ``checkpoint_<N>`` (the train state) and ``validation_loss_lm_per_token_<N>`` (eval metrics, the
same steps); flax reads it with ``restore_checkpoint(dir, prefix="checkpoint_")``. treetools reads the
``checkpoint_`` series by default, names the other series, and reads one when asked (``--prefix`` in the CLI,
``prefix=`` in the library).

Writers: tests/fixtures/transformer_vq_flax_0_6/ (flax 0.6.11, the version transformer_vq pins, Orbax mode
with Orbax 0.2.3: every array aggregated in each folder's ``checkpoint`` msgpack; make_transformer_vq.py),
and the project's flax 0.12.8 running the same call, in both of its modes. Each step of a series is one
item, ``default`` (the whole saved target), as for every Flax legacy folder; ``load_parameters`` returns its
``params``. The truth is the writer's own arrays.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import serialization
from flax.training import checkpoints

import treetools as tt
from tests._every_command import (check_convert, check_diff_names_the_changed_leaf,
                                  check_inspect, check_load_parameters, check_restore, check_show, check_stats,
                                  check_verify, inspect_json, run, run_fresh)
from tests.test_format_flax_legacy import _orbax_backend

FIXTURES = Path(__file__).parent / "fixtures"
EVAL = "validation_loss_lm_per_token_"


def fixture_truth() -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """{prefix: {step: {path: array}}} from transformer_vq_truth.npz."""
    truth: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    with np.load(FIXTURES / "transformer_vq_truth.npz") as z:
        for key in z.files:
            folder, path = key.split("/", 1)
            prefix, step = folder.rsplit("_", 1)
            truth.setdefault(prefix + "_", {}).setdefault(int(step), {})[path] = z[key]
    return truth


def _state(step: int):
    """A flax TrainState as transformer_vq's get_train_state builds it (adam under clip and schedule)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    rng = np.random.default_rng(step)
    params = {"token_embedder": {"embedding": rng.standard_normal((11, 4)).astype(np.float32)},
              "transformer_layer_0": {"attn": {"w_q": rng.standard_normal((4, 4)).astype(np.float32),
                                               "b_q": (np.arange(4) + step).astype(np.float32)}}}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3), optax.scale_by_schedule(lambda s: 1.0))
    state = TrainState.create(apply_fn=None, params=jax.tree.map(jnp.asarray, params), tx=tx)
    return state.replace(step=jnp.asarray(step, jnp.int32),
                         opt_state=jax.tree.map(lambda x: x + step, state.opt_state))


def write_run(folder: Path, *, orbax: bool, steps=(4, 6)) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """transformer_vq's two series, saved by the project's flax (Orbax mode or msgpack mode)."""
    import jax.numpy as jnp

    truth: dict[str, dict[int, dict[str, np.ndarray]]] = {"checkpoint_": {}, EVAL: {}}
    with _orbax_backend(orbax):
        for step in steps:
            metrics = {"loss_lm_per_token": jnp.asarray(3.0 - step / 10, jnp.float32),
                       "total_tokens": jnp.asarray(4096.0 * step, jnp.float32)}
            for prefix, target in (("checkpoint_", _state(step)), (EVAL, metrics)):
                checkpoints.save_checkpoint_multiprocess(str(folder), target=target, step=step, prefix=prefix,
                                                         keep=5, overwrite=False, keep_every_n_steps=None,
                                                         async_manager=None, orbax_checkpointer=None)
                flat = tt.flatten(serialization.to_state_dict(target))
                truth[prefix][step] = {k: np.asarray(v) for k, v in flat.items()}
    return truth


@pytest.fixture(scope="module", params=["flax-0.6.11", "flax-0.12.8-orbax", "flax-0.12.8-msgpack"])
def run_dir(request, tmp_path_factory):
    if request.param == "flax-0.6.11":
        return FIXTURES / "transformer_vq_flax_0_6", fixture_truth(), request.param
    folder = tmp_path_factory.mktemp("tvq") / "ckpt"
    folder.mkdir()
    return folder, write_run(folder, orbax=request.param.endswith("orbax")), request.param


def _params(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len("params/"):]: v for k, v in state.items() if k.startswith("params/")}


def test_the_checkpoint_series_is_read_by_default_and_the_other_series_is_named(run_dir):
    folder, truth, _ = run_dir
    rc, out, err = run("inspect", folder)
    assert rc == 0, err
    assert "two committed" not in err
    assert EVAL in out + err and "--prefix" in out + err  # the other series, and how to read it
    report = check_inspect(folder, truth["checkpoint_"][6], item="default")
    assert report["steps"] == [4, 6]
    assert report["checkpoints"][0]["step"] == 6
    check_inspect(folder, truth["checkpoint_"][4], item="default", args=("--step", 4))


def test_prefix_picks_the_eval_series(run_dir):
    folder, truth, _ = run_dir
    report = check_inspect(folder, truth[EVAL][6], item="default", args=("--prefix", EVAL))
    assert report["steps"] == [4, 6]
    check_show(folder, truth[EVAL][4], item="default", args=("--prefix", EVAL, "--step", 4))
    check_stats(folder, truth[EVAL][6], item="default", args=("--prefix", EVAL))
    check_load_parameters(folder, truth[EVAL][4], prefix=EVAL, step=4)
    check_load_parameters(folder, truth[EVAL][6], prefix=EVAL)


def test_every_command_on_the_train_state_series(run_dir, tmp_path):
    folder, truth, _ = run_dir
    check_show(folder, truth["checkpoint_"][6], item="default")
    check_stats(folder, truth["checkpoint_"][4], item="default", args=("--step", 4))
    check_load_parameters(folder, _params(truth["checkpoint_"][6]))
    check_load_parameters(folder, _params(truth["checkpoint_"][4]), step=4, prefix="checkpoint_")
    out = check_verify(folder, "--step", "all")
    assert out.count("ok:") == 2, out
    out = check_verify(folder, "--step", "all", "--prefix", EVAL)
    assert out.count("ok:") == 2, out
    # diff of the two steps: the eval series' total_tokens differs by 4096 * (6 - 4)
    rc, out, err = run("diff", folder, "--step", 4, "--step", 6, "--values", "--prefix", EVAL, "--format", "json")
    assert rc == 1, out + err
    values = {row["path"]: row for row in json.loads(out)["values"]}
    assert sorted(values) == ["loss_lm_per_token", "total_tokens"]
    assert values["total_tokens"]["max_abs_diff"] == pytest.approx(4096.0 * 2)


def test_diff_names_the_leaf_the_writer_changed(run_dir, tmp_path):
    folder, truth, kind = run_dir
    if kind == "flax-0.6.11":
        pytest.skip("the fixture's writer is not installed here; the flax 0.12.8 runs cover diff")
    other = tmp_path / "other"
    other.mkdir()
    write_run(other, orbax=kind.endswith("orbax"), steps=(4,))  # the same writer, the same step 4 ...
    import jax.numpy as jnp

    # the same types as write_run's (jax arrays: Orbax stores a numpy scalar as a Python scalar, not an array)
    metrics = {"loss_lm_per_token": jnp.asarray(3.0 - 4 / 10, jnp.float32),
               "total_tokens": jnp.asarray(4096.0 * 4 + 5, jnp.float32)}
    with _orbax_backend(kind.endswith("orbax")):  # ... but for one eval value, 5 more tokens
        checkpoints.save_checkpoint_multiprocess(str(other), target=metrics, step=4, prefix=EVAL, overwrite=True)
    check_diff_names_the_changed_leaf(folder, other, "total_tokens", 5.0, args=("--step", 4, "--prefix", EVAL))


def test_an_unknown_prefix_is_one_error_listing_the_series(run_dir):
    folder, truth, _ = run_dir
    rc, out, err = run("inspect", folder, "--prefix", "nope_")
    assert rc == 1
    line = err.strip()
    assert "\n" not in line and line.startswith("treetools: error:") and "nope_" in line
    assert "checkpoint_" in line and EVAL in line
    with pytest.raises(tt.CheckpointError, match=EVAL):
        tt.load_parameters(folder, prefix="nope_")


def test_one_step_folder_of_either_series_is_read_directly(run_dir):
    folder, truth, kind = run_dir
    for prefix in ("checkpoint_", EVAL):
        one = folder / f"{prefix}6"
        check_inspect(one, truth[prefix][6], item="default")
        check_show(one, truth[prefix][6], item="default")


def test_restore_checkpoint_per_series(run_dir):
    folder, truth, kind = run_dir
    check_restore(folder, truth["checkpoint_"][6], item="default", step=6)
    import jax

    target = tt.make_abstract({k: np.asarray(v) for k, v in truth[EVAL][4].items()})
    assert tt.plan_restore(str(folder), 4, {"default": target}, prefix=EVAL).ok
    restored = tt.restore_checkpoint(str(folder), 4, {"default": target}, prefix=EVAL)["default"]
    assert isinstance(restored["total_tokens"], jax.Array)
    assert float(restored["total_tokens"]) == float(truth[EVAL][4]["total_tokens"])


def test_convert_each_series(run_dir, tmp_path):
    folder, truth, _ = run_dir
    check_convert(folder, _params(truth["checkpoint_"][6]), tmp_path)
    check_convert(folder, truth[EVAL][6], tmp_path / "eval", args=("--prefix", EVAL))


def test_load_parameters_with_rules(run_dir):
    folder, truth, _ = run_dir
    rules = tt.Rules(rename=[(r"^token_embedder/", "embed/")])
    want = {k.replace("token_embedder/", "embed/", 1): v for k, v in _params(truth["checkpoint_"][6]).items()}
    check_load_parameters(folder, want, rules=rules)


def test_jax_is_not_imported_for_metadata(run_dir):
    folder, _, kind = run_dir  # flax msgpack files too: they are walked without flax (issue 26)
    done = run_fresh("inspect", folder, "--prefix", EVAL, forbid=["jax"])
    assert done.returncode == 0, done.stderr
