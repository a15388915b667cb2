import csv
import dataclasses
import io
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import treetools as tt
from tests import _models
from treetools.pytree.table import rows_from_tree


def _parse_tsv(text):
    body = text.split("\n\n")[0]
    rows = list(csv.reader(io.StringIO(body), delimiter="\t"))
    header = [h.strip() for h in rows[0]]
    return [dict(zip(header, [c.strip() for c in r])) for r in rows[1:]]


def _blocks_params(n=12):
    # A list of blocks: tree order is 0,1,...,11, string order would be 0,1,10,11,2,...
    return {"blocks": [{"kernel": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32)} for _ in range(n)],
            "head": {"kernel": np.ones((2, 3), np.float32)}}


def test_weight_decay_column_agrees_with_mask_leaf_by_leaf():
    params = _blocks_params()
    exclude = [r"bias$", r"^blocks/(9|10)/"]
    text = tt.tabulate_params(params, show_weight_decay=True, weight_decay_exclude=exclude, tablefmt="tsv")
    rows = _parse_tsv(text)
    mask = tt.flatten(tt.get_param_mask_fn(exclude)(params))
    assert [r["path"] for r in rows] == list(mask)  # tree order, blocks/9 before blocks/10
    assert [r["path"] for r in rows].index("blocks/9/kernel") < [r["path"] for r in rows].index("blocks/10/kernel")
    assert {r["path"]: r["weight_decay"] == "True" for r in rows} == mask
    assert sum(mask.values()) == 10 + 1  # kernels of blocks 0-8 and 11, plus the head kernel
    # Sorting by path must not unglue flags from their rows.
    sorted_rows = _parse_tsv(tt.tabulate_params(params, True, exclude, sort="path", tablefmt="tsv"))
    assert {r["path"]: r["weight_decay"] == "True" for r in sorted_rows} == mask


def test_columns_and_totals_for_flax_model():
    variables = _models.init_net()
    text = tt.tabulate_params(variables, tablefmt="tsv")
    rows = _parse_tsv(text)
    flat = tt.flatten(variables)
    assert len(rows) == len(flat)
    for r in rows:
        leaf = flat[r["path"]]
        assert int(r["params"].replace(",", "")) == leaf.size
        assert r["dtype"] == "float32"
    net_bytes = 4 * _models.NET_PARAMS
    assert net_bytes >= 1024  # the human size is shown in parentheses from 1 KiB
    footer = text.split("\n\n", 1)[1].splitlines()
    # One dtype: the total line alone, no per-dtype breakdown.
    assert footer == [f"Total: {_models.NET_PARAMS:,} params, {net_bytes:,} bytes ({net_bytes / 1024:.2f} KiB)"]
    stacked = [r for r in rows if r["path"] == "params/blocks/up/kernel"][0]
    assert stacked["shape"] == f"({_models.LAYERS}, {_models.D}, {_models.HIDDEN})"


def test_depth_sums_per_module_and_keeps_totals():
    variables = _models.init_net()
    rows = _parse_tsv(tt.tabulate_params(variables, depth=2, tablefmt="tsv"))
    by_path = {r["path"]: int(r["params"].replace(",", "")) for r in rows}
    assert by_path == {
        "params/blocks": _models.LAYERS * _models.BLOCK_PARAMS,
        "params/embed": _models.VOCAB * _models.D,
        "params/head": _models.D * _models.OUT + _models.OUT,
        "params/ln_f": 2 * _models.D,
    }


def test_per_dtype_breakdown_and_sharding_column():
    # numpy: an unplaced box shows its names (a jnp array sits whole on device 0 and says so: issue 39, point 7)
    tree = {"emb": nn.Partitioned(np.ones((8, 4), jnp.bfloat16), names=("fsdp", None)),
            "w": jnp.ones((3,), jnp.float32), "step": 7}
    text = tt.tabulate_params(tree, tablefmt="tsv")
    rows = {r["path"]: r for r in _parse_tsv(text)}
    assert rows["emb"]["sharding"] == "P('fsdp')"  # trailing Nones dropped
    assert rows["step"]["params"] == "0" and rows["step"]["shape"] == ""
    footer = text.split("\n\n", 1)[1].splitlines()
    assert footer == ["Total: 35 params, 76 bytes", "  bfloat16: 32 params, 64 B", "  float32: 3 params, 12 B"]


def test_accepts_train_state_nnx_module_and_state():
    variables = _models.init_net()
    ts = train_state.TrainState.create(apply_fn=None, params=variables["params"], tx=optax.sgd(0.1))
    assert f"Total: {_models.NET_PARAMS:,} params" in tt.tabulate_params(ts)
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    assert "Total: 16 params" in tt.tabulate_params(model)  # 3*4 + 4
    assert "Total: 16 params" in tt.tabulate_params(nnx.state(model))


def test_tablefmt_passes_through_and_errors():
    params = {"w": np.ones((2, 2), np.float32)}
    assert tt.tabulate_params(params, tablefmt="github").startswith("| path")
    assert "┌" in tt.tabulate_params(params, tablefmt="simple_grid")
    with pytest.raises(ValueError, match="`sort` must be one of"):
        tt.tabulate_params(params, sort="size")
    with pytest.raises(ValueError, match="matches no leaf"):
        tt.tabulate_params(params, show_weight_decay=True, weight_decay_exclude=["bias$"])


def test_empty_tree():
    assert "Total: 0 params" in tt.tabulate_params({})


def test_json_and_tree_renderers_share_rows():
    from treetools.shared.render import render_rows
    from treetools.pytree.table import rows_from_tree

    rows = rows_from_tree({"a": {"b": np.ones((2, 3), np.float32)}, "c": np.zeros(4, np.int8)})
    import json

    data = json.loads(render_rows(rows, fmt="json"))
    assert data["total_params"] == 10 and data["total_bytes"] == 28
    assert data["leaves"][0] == {"path": "a/b", "shape": [2, 3], "dtype": "float32", "params": 6, "bytes": 24,
                                 "sharding": None}
    tree_text = render_rows(rows, fmt="tree")
    assert tree_text.splitlines()[:3] == ["a/  6 params", "  b (2, 3) float32  6 params", "c (4,) int8  4 params"]


def test_markdown_footer_lists_dtypes():
    from treetools.shared.render import render_rows
    from treetools.pytree.table import rows_from_tree

    text = render_rows(rows_from_tree({"a": np.ones(2, np.float32), "b": np.ones(3, np.int8)}), fmt="markdown")
    footer = text.split("\n\n", 1)[1].splitlines()
    # "Total" paragraph, a blank line, then one list item per dtype.
    assert footer[0] == "Total: 5 params, 11 bytes" and footer[1] == ""
    assert footer[2:] == ["- float32: 2 params, 8 B", "- int8: 3 params, 3 B"]


def test_float0_leaf_is_shown_as_float0_with_zero_bytes():
    # Gradients of integer inputs under allow_int have jax's float0 dtype: the shape is kept, no data is stored.
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * jnp.sum(p["ids"]), allow_int=True)(
        {"w": jnp.ones((2, 3), jnp.float32), "ids": jnp.arange(5)})
    abstract = jax.eval_shape(lambda: grads["ids"])  # a ShapeDtypeStruct of dtype float0
    assert grads["ids"].dtype == jax.dtypes.float0 and abstract.dtype == jax.dtypes.float0
    ids_bytes = grads["ids"].nbytes  # jax's own count: 0, float0 carries no data
    assert ids_bytes == 0 and np.dtype(jax.dtypes.float0).itemsize == 0
    tree = {"grads": grads, "abstract": abstract}
    rows = {r.name: r for r in rows_from_tree(tree)}
    for path in ("grads/ids", "abstract"):
        assert (rows[path].dtype, rows[path].shape, rows[path].params, rows[path].bytes) == ("float0", (5,), 5, ids_bytes)
    assert rows["grads/w"].dtype == "float32"
    text = tt.tabulate_params(tree, tablefmt="tsv")
    table = {r["path"]: r for r in _parse_tsv(text)}
    assert table["grads/ids"]["dtype"] == table["abstract"]["dtype"] == "float0"
    assert table["grads/ids"]["bytes"] == "0 B" and table["grads/ids"]["params"] == "5"
    assert "V'" not in text  # numpy's own spelling of float0 is "[('float0', 'V')]"
    # Totals: 2*3 float32 (24 bytes) plus two float0 leaves of 5 elements and 0 bytes.
    assert "Total: 16 params, 24 bytes" in text.splitlines()
    assert "  float0: 10 params, 0 B" in text.splitlines()
    assert "  float32: 6 params, 24 B" in text.splitlines()


def test_weight_decay_column_with_allow_unmatched_for_a_model_without_biases():
    # One optimizer config for model families with and without biases prints too.
    import treetools as tt

    params = {"proj": {"kernel": jnp.ones((4, 4))}, "norm": {"scale": jnp.ones(4)}}
    with pytest.raises(ValueError, match="bias"):
        tt.tabulate_params(params, show_weight_decay=True, weight_decay_exclude=[r"bias$", r"scale$"])
    table = tt.tabulate_params(params, show_weight_decay=True, weight_decay_exclude=[r"bias$", r"scale$"],
                               allow_unmatched=True, tablefmt="tsv")
    rows = {line.split("\t")[0].strip(): line for line in table.splitlines()}
    want = tt.get_param_mask_fn(exclude=[r"bias$", r"scale$"], allow_unmatched=True)(params)
    assert want == {"proj": {"kernel": True}, "norm": {"scale": False}}
    assert rows["proj/kernel"].rstrip().endswith("True") and rows["norm/scale"].rstrip().endswith("False"), table


def test_stacked_leaves_show_their_layer_count():
    # nn.scan with the `layers` partition name: every leaf of the scanned module holds 4 layers, the unboxed biases too.
    params = _models.ScannedLM().init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
    rows = {r["path"]: r for r in _parse_tsv(tt.tabulate_params(params, tablefmt="tsv"))}
    layers = {p: r["layers"] for p, r in rows.items()}
    assert layers == {"decoder/layers/down/bias": "4", "decoder/layers/down/kernel": "4",
                      "decoder/layers/up/bias": "4", "decoder/layers/up/kernel": "4",
                      "decoder/norm/bias": "", "decoder/norm/scale": "", "embed/embedding": ""}
    d, L = _models.SCAN_D, _models.SCAN_LAYERS
    assert rows["decoder/layers/up/kernel"]["shape"] == f"({L}, {d}, {2 * d})"  # the shape keeps the layer axis
    assert rows["decoder/layers/up/kernel"]["params"] == f"{L * d * 2 * d:,}"
    header = tt.tabulate_params(params, tablefmt="tsv").splitlines()[0].split("\t")
    assert [h.strip() for h in header][:4] == ["path", "shape", "layers", "dtype"]
    # Per module: a module whose leaves all hold 4 layers says 4; a mixed one says nothing.
    by_module = {r["path"]: r for r in _parse_tsv(tt.tabulate_params(params, depth=2, tablefmt="tsv"))}
    assert by_module["decoder/layers"]["layers"] == "4" and by_module["decoder/norm"]["layers"] == ""
    # At depth 1 no module holds only stacked leaves: no column.
    assert "layers" not in tt.tabulate_params(params, depth=1).splitlines()[0]
    assert f"Total: {_models.SCAN_PARAMS:,} params" in tt.tabulate_params(params)
    # Unboxed trees by pattern; stacked=False or a tree without stacks: no column, the table as before.
    by_pattern = _parse_tsv(tt.tabulate_params({"blocks": {"w": np.ones((3, 2), np.float32)}}, stacked={"blocks": 0},
                                               tablefmt="tsv"))
    assert by_pattern == [{"path": "blocks/w", "shape": "(3, 2)", "layers": "3", "dtype": "float32", "params": "6",
                           "bytes": "24 B"}]  # (tsv drops the empty sharding cell)
    assert "layers" not in tt.tabulate_params(params, stacked=False).splitlines()[0]
    plain = tt.tabulate_params(_models.init_net())  # nn.scan without the partition name: no `layers` axis name
    assert plain.splitlines()[0].split() == ["path", "shape", "dtype", "params", "bytes", "sharding"]


def test_layer_count_in_json_rows():
    from treetools.pytree.table import render_rows

    rows = [dataclasses.replace(r, layers=4) if r.name == "w" else r for r in rows_from_tree({"w": np.ones((4, 2)), "b": np.ones(2)})]
    data = {r["path"]: r for r in json.loads(render_rows(rows, fmt="json"))["leaves"]}
    assert data["w"]["layers"] == 4 and "layers" not in data["b"]  # absent where there is none: the schema as before


def test_a_box_placed_on_one_device_shows_where_it_is_not_its_names(devices):
    # Issue 39, point 7: params initialized without out_shardings sit whole on device 0, but the sharding column
    # showed their boxes' P('data', 'model') while get_num_params(per_device=True) counted them whole. A placed
    # array shows where it is (as the count has it); the box's spec is shown only for unplaced leaves.
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treetools.pytree.partitioning import unbox

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    names = ("data", "model")
    tree = {
        "on_0": nn.Partitioned(jnp.ones((8, 4), jnp.float32), names=names),  # no out_shardings: device 0
        "on_3": nnx.Param(jax.device_put(np.ones((8, 4), np.float32), devices[3]), out_sharding=names,
                          eager_sharding=False),
        "placed": nn.Partitioned(jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P(*names))),
                                 names=names),
        "unplaced": nn.Partitioned(np.ones((8, 4), np.float32), names=names),  # numpy: the plan, from the names
    }
    rows = {r["path"]: r["sharding"] for r in _parse_tsv(tt.tabulate_params(tree, mesh=mesh, tablefmt="tsv"))}
    (dev0,) = unbox(tree["on_0"]).devices()
    assert rows == {"on_0": f"whole on {dev0}", "on_3": f"whole on {devices[3]}", "placed": "P('data', 'model')",
                    "unplaced": "P('data', 'model')"}
    assert tt.leaf_sharding(tree["on_0"]).to_json() == {"mesh": None, "spec": [], "device": str(dev0)}
    # One truth with the count: devices 0 and 3 each hold a whole (8, 4) leaf (32) and a quarter-by-half shard of
    # `placed` (4); the unplaced box counts its largest shard (4) on top: 36 + 4.
    held = {d.id: 0 for d in devices}
    for x in (unbox(tree["on_0"]), unbox(tree["on_3"]), unbox(tree["placed"])):
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.size
    assert max(held.values()) == 36
    assert tt.get_num_params(tree, per_device=True, mesh=mesh) == 36 + 4
def test_one_renderer_of_rows_for_tabulate_params_inspect_and_diff(tmp_path, capsys):
    # Issue 36: shared/render.py and commands/text.py each had their own footer, tree and row cells.
    import pathlib

    from treetools.cli import main
    from treetools.shared.render import footer, render_tree
    from treetools.shared.rows import Row, totals

    package = pathlib.Path(tt.__file__).parent
    sources = {p.relative_to(package).as_posix(): p.read_text() for p in package.rglob("*.py")}
    assert [name for name, text in sources.items() if '"Total: ' in text or "f\"Total: " in text] == ["shared/render.py"]
    for name, text in sources.items():
        for own in ("def _footer", "def _render_tree", "def _shape_cell", "def _table_data"):
            assert own not in text, (name, own)
    # The same rows print the same lines in inspect's tree (which adds the bytes) and tabulate_params' renderer.
    np.savez(tmp_path / "w.npz", **{"enc/w": np.ones((2, 3), np.float32), "enc/b": np.zeros(3, np.float32),
                                    "head": np.ones(4, np.int8)})
    assert main(["inspect", str(tmp_path / "w.npz"), "--format", "tree"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [Row(("enc", "w"), (2, 3), "float32", 6, 24), Row(("enc", "b"), (3,), "float32", 3, 12),
            Row(("head",), (4,), "int8", 4, 4)]
    section = out[out.index("[default]") + 1:]
    want = render_tree(rows, label="params", sizes=True).splitlines() + \
        footer(totals(rows), label="params").splitlines()
    assert section == want
    assert section[:2] == ["enc/  9 params, 36 B", "  w (2, 3) float32  6 params, 24 B"]
