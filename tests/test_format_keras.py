"""Keras 3 ``.weights.h5`` and ``.keras`` files (issue 29), written by keras itself (the ``test-formats`` extra).

Keras writes its variables into HDF5 (keras/src/saving/saving_lib.py at keras-team/keras commit
3422977a5e38fb2f7709aaa9a08e47f0c43d0f60, ``H5IOStore``): one group per saveable, named by its attribute
path (``layers/dense_1``; the layer's own name is the group's ``vars`` attribute ``name``), its variables as
datasets ``vars/0``, ``vars/1``, ... in the order of ``layer.weights``; bfloat16 as 2-byte opaque data with
the attribute ``dtype="bfloat16"``. ``model.save("m.keras")`` zips ``metadata.json``, ``config.json`` and
that HDF5 file (``model.weights.h5``, stored uncompressed). treetools reads both through h5py (the ``keras``
extra): one item, ``default``, whose leaf paths are the HDF5 dataset paths. Without h5py the file is refused
with one line saying what it is and how to read it. The truth is the model's own variables.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests._every_command import (check_convert, check_diff_names_the_changed_leaf, check_restore,
                                  check_single_file, run_fresh)

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                             keras.layers.LayerNormalization(name="norm"),
                             keras.layers.Dense(2, name="head", dtype="bfloat16")])


def _layer_truth(model, h5_file) -> dict[str, np.ndarray]:
    """``{h5 path: variable}``: each layer's group is found by the ``name`` keras writes on its ``vars``."""
    groups = {}

    def visit(name, obj):  # returns None: h5py's visititems stops at the first other value
        if isinstance(obj, h5py.Group) and name.endswith("/vars") and "name" in obj.attrs:
            groups[obj.attrs["name"]] = name

    with h5py.File(h5_file, "r") as f:
        f.visititems(visit)
    return {f"{groups[layer.name]}/{i}": np.asarray(keras.ops.convert_to_numpy(v.value))
            for layer in model.layers for i, v in enumerate(layer.weights)}


def write_weights_h5(path):
    """``model.save_weights(path)``; returns (path, model, truth)."""
    model = _model()
    model.save_weights(path)
    return path, model, _layer_truth(model, path)


def write_keras_file(folder):
    """A compiled, trained model saved whole (``model.save``): the layers and the optimizer's variables;
    returns (path, model, truth)."""
    import zipfile

    model = _model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), verbose=0, epochs=2)
    model.save(folder / "model.keras")
    with zipfile.ZipFile(folder / "model.keras") as z:
        (folder / "inner.weights.h5").write_bytes(z.read("model.weights.h5"))
    truth = _layer_truth(model, folder / "inner.weights.h5")
    truth.update({f"optimizer/vars/{i}": np.asarray(keras.ops.convert_to_numpy(v.value))
                  for i, v in enumerate(model.optimizer.variables)})
    return folder / "model.keras", model, truth


@pytest.fixture(scope="module")
def weights_h5(tmp_path_factory):
    return write_weights_h5(tmp_path_factory.mktemp("keras") / "model.weights.h5")


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    return write_keras_file(tmp_path_factory.mktemp("keras"))


def test_weights_h5_every_command(weights_h5, tmp_path):
    path, model, truth = weights_h5
    assert any(str(v.dtype) == "bfloat16" for v in truth.values())
    check_single_file(path, truth, tmp_path, "keras")


def test_keras_zip_every_command(keras_file, tmp_path):
    path, model, truth = keras_file
    assert int(truth["optimizer/vars/0"]) == 2  # iterations: one batch per epoch, two epochs
    check_single_file(path, truth, tmp_path, "keras", params=_model_part(truth))


def _model_part(truth):
    """The truth without the optimizer's variables: the model's, as ``load_parameters`` and ``convert`` take."""
    return {k: v for k, v in truth.items() if not k.startswith("optimizer/")}


@pytest.mark.parametrize("which", ["weights_h5", "keras_file"])
def test_convert(which, request, tmp_path):
    path, model, truth = request.getfixturevalue(which)
    check_convert(path, _model_part(truth), tmp_path)
    (tmp_path / "whole").mkdir()
    check_convert(path, truth, tmp_path / "whole", item="default")  # the whole file, asked for by name


class _Subclassed(keras.Model):
    """Variables saved under attribute names (``enc/vars/0``), ``layers/``, and the model's own ``vars/0``."""

    def __init__(self):
        super().__init__()
        self.enc = keras.layers.Dense(4)
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(2)
        self.scale = self.add_weight(shape=(2,), initializer="ones", name="scale")

    def call(self, x):
        return self.out(self.norm(self.enc(x))) * self.scale


def _trained(model):
    """Compiled with Adam and trained one step: the optimizer's variables exist and are saved with the model."""
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), verbose=0, batch_size=4, epochs=1)
    return model


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
@pytest.mark.parametrize("saved", ["m.keras", "m.weights.h5"])
def test_params_are_the_models_variables_not_the_optimizers(kind, saved, tmp_path):
    # Issue 47 point 17: load_parameters, convert and inspect's params count held the optimizer's variables.
    import json

    import treetools as tt
    from tests._every_command import run

    keras.utils.set_random_seed(0)
    model = _trained(_Subclassed() if kind == "subclassed" else keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="enc"), keras.layers.BatchNormalization(name="bn"),
         keras.layers.Dense(2)]))
    path = tmp_path / saved
    model.save(path) if saved.endswith(".keras") else model.save_weights(path)
    weights = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in model.weights]
    opt_sizes = sum(int(np.size(keras.ops.convert_to_numpy(v.value))) for v in model.optimizer.variables)
    assert opt_sizes > 0 and any(not w.trainable for w in model.weights)  # BatchNorm's moving statistics count

    got = tt.flatten(tt.load_parameters(path))
    assert not [k for k in got if k.startswith("optimizer/")], sorted(got)
    assert sum(v.size for v in got.values()) == model.count_params()
    # The same variables, whatever their paths: each value's bytes, dtype and shape as the model holds it.
    key = lambda a: (str(a.dtype), a.shape, a.tobytes())  # noqa: E731
    assert sorted(map(key, got.values())) == sorted(map(key, weights))

    rc, out, err = run("inspect", path, "--format", "json")
    assert rc == 0, err
    item = json.loads(out)["checkpoints"][0]["items"]["default"]
    assert item["total_params"] == model.count_params() + opt_sizes  # inspect shows every stored variable
    assert item["not_params"] == {"optimizer state": opt_sizes}
    rc, out, err = run("inspect", path)
    assert f"({model.count_params():,} params, {opt_sizes:,} optimizer state)" in out, out

    dst = tmp_path / "converted.safetensors"
    rc, out, err = run("convert", path, dst)
    assert rc == 0, out + err
    from safetensors.numpy import load_file

    assert sorted(map(key, load_file(dst).values())) == sorted(map(key, weights))


def test_diff_of_two_weight_files_names_the_changed_variable(weights_h5, tmp_path):
    path, model, truth = weights_h5
    other = tmp_path / "other.weights.h5"
    changed = _model()
    kernel = changed.get_layer("dense").kernel
    kernel.assign(keras.ops.convert_to_numpy(kernel.value) + 0.5)
    changed.save_weights(other)
    name = next(k for k in _layer_truth(changed, other) if k.endswith("/0") and truth[k].shape == (3, 4))
    check_diff_names_the_changed_leaf(path, other, name, 0.5)


def test_without_h5py_the_file_is_named_and_the_fix_given(weights_h5):
    path, _, _ = weights_h5
    done = run_fresh("inspect", path, blocked=["h5py"])
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treetools: error:"), done.stderr
    assert "Keras" in lines[0] and "h5py" in lines[0] and path.name in lines[0], lines[0]
    assert "msgpack" not in lines[0] and "npz" not in lines[0]


def test_restore_with_rules(keras_file):
    # Keras's attribute paths onto shorter names: layers/<name>/vars/<i> -> <name>/<i>; the optimizer left out.
    path, model, truth = keras_file
    import treetools as tt

    rules = tt.Rules(rename=[(r"^layers/(\w+)/vars/", r"\1/")], drop=[r"^optimizer/"])
    renamed = {k.replace("layers/", "", 1).replace("/vars/", "/"): v for k, v in truth.items()
               if not k.startswith("optimizer/")}
    check_restore(path, truth, item="default", rules=rules, expect=renamed)
