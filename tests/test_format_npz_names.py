"""npz naming conventions (issue 37): objax's ``names`` array is applied, haiku's keys stay as they are.

objax's ``save_var_collection`` (tests/_writers/objax.py names the file and commit) stores each variable as member
``0``..``N-1`` and their names apart in ``names``; haiku's ``np.savez(**params)`` of a flattened ``hk.Params``
keys members ``mlp/~/linear_0//w`` (module path, ``//``, parameter). The truth is the writer's arrays.
"""

from __future__ import annotations

import numpy as np

import treetools as tt

from tests._every_command import (check_convert, check_inspect, check_load_parameters, check_restore, check_show,
                                  check_stats, check_verify, run)
from tests._writers.objax import save_var_collection

OBJAX = {"(Sequential)[0](Linear).b": np.zeros(3, np.float32),
         "(Sequential)[0](Linear).w": np.arange(6, dtype=np.float32).reshape(2, 3),
         "(Sequential)[2](BatchNorm0D).running_mean": np.full(3, 0.5, np.float32)}
HAIKU = {"mlp/~/linear_0//w": np.arange(6, dtype=np.float32).reshape(3, 2),
         "mlp/~/linear_0//b": np.ones(2, np.float32)}


def test_objax_names_are_applied_and_names_is_no_leaf(tmp_path):
    path = tmp_path / "0000000010.npz"
    save_var_collection(path, OBJAX)
    report = check_inspect(path, OBJAX)  # exactly the variables: no `names`, no `0`
    assert report["format"] == "npz"
    rc, _, err = run("inspect", path)
    assert rc == 0 and "objax" in err  # a note says the names were applied
    check_show(path, OBJAX)
    check_stats(path, OBJAX)
    check_verify(path)
    check_convert(path, OBJAX, tmp_path)
    loaded = tt.load_parameters(path)  # nested on the names' dots, flattened back to them
    assert sorted(tt.flatten(loaded)) == sorted(OBJAX)
    got = np.load(path)  # the writer's own layout, read by numpy: the names array lists the members in order
    assert [str(n) for n in got["names"]] == list(OBJAX)


def test_haiku_keys_stay_as_stored(tmp_path):
    path = tmp_path / "params.npz"
    np.savez(path, **HAIKU)
    check_inspect(path, HAIKU)
    check_show(path, HAIKU)
    check_load_parameters(path, HAIKU)  # flatten() of the result gives back the stored keys
    check_restore(path, HAIKU, item="default")
    rc, out, err = run("inspect", path, "--leaves")
    assert rc == 0 and "mlp/~/linear_0//w" in out and "objax" not in err


def test_an_npz_with_names_that_do_not_match_its_members_is_left_as_stored(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, names=np.array(["a", "b"]), **{"0": np.ones(2)})  # two names, one member: not objax's layout
    rc, out, err = run("inspect", path, "--leaves")
    assert rc == 0 and "objax" not in err
    assert sorted(tt.flatten(tt.load_parameters(path))) == ["0", "names"]
