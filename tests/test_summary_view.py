"""The default `treetools inspect` view fits a screen; --leaves shows every leaf (issue 13)."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import treetools as tt
from treetools.cli import main

LAYERS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # linen-style names (layers_0 .. layers_23): 24 rows at any depth unless numbered siblings are merged.
    params = {f"layers_{i}": {"attn": {"q": jnp.ones((8, 8)), "k": jnp.ones((8, 8)), "v": jnp.ones((8, 8))},
                              "mlp": {"up": jnp.ones((8, 16)), "down": jnp.ones((16, 8))},
                              "ln": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}} for i in range(LAYERS)}
    params["embed"] = jnp.ones((32, 8))
    root = tmp_path_factory.mktemp("summary") / "run"
    mngr = tt.get_checkpoint_manager(1, checkpoint_dir=root, async_save=False)
    opt = optax.adamw(1e-3).init(params)
    tt.save_checkpoint(mngr, 1, {"opt_state": opt, "params_ema": params, "params": params, "data_iter": {"i": 1}})
    mngr.close()
    return root, params, opt


def test_default_view_is_one_screen_with_a_grand_total(run, capsys):
    root, params, opt = run
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 80, len(lines)
    sections = [line for line in lines if line.startswith("[")]
    assert [s.split("]")[0] + "]" for s in sections] == ["[params]", "[params_ema]", "[opt_state]", "[data_iter]"]
    total = 2 * tt.get_num_params(params) + tt.get_num_params(opt)
    assert any(line.startswith("Grand total (4 items): ") and f"{total:,}" in line for line in lines)
    assert "layers_0..23/attn" in out  # 24 numbered layers merged into one row per module kind
    assert "--leaves shows every leaf" in out
    # Columns named for what they count: optimizer moments are elements, not parameters.
    tables = out.split("[opt_state]")
    assert " params " in tables[0] and " elements " in tables[1].split("[data_iter]")[0]


def test_leaves_lists_every_leaf(run, capsys):
    root, params, _ = run
    assert main(["inspect", str(root), "--item", "params", "--leaves"]) == 0
    out = capsys.readouterr().out
    n = len(tt.flatten(params))  # 24 * 7 + 1
    assert sum(1 for line in out.splitlines() if "float32" in line and ("layers_" in line or "embed" in line)) == n


def test_depth_counts_from_the_items_shared_prefix(run, capsys):
    root, _, _ = run
    # opt_state paths share `0/` (adamw's first state): depth 1 is mu / nu / count, not one useless `0` row;
    # each row names its whole path (issue 24: pasteable into --show/--include/--item).
    assert main(["inspect", str(root), "--item", "opt_state", "--depth", "1"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:3] in ("0/c", "0/m", "0/n")]
    assert rows == ["0/count", "0/mu", "0/nu"]
