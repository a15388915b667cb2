"""treetools.rules (spec, plan, dtypes) and the block reader over it (treetools.checkpoint_io.mapping.RuledReader): the Rules
engine, checked against numpy doing the same mapping by hand."""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treetools.checkpoint_io.mapping import RuledReader
from treetools.checkpoint_io.readers import InMemoryReader
from treetools.rules.dtypes import resolve_dtype
from treetools.rules.plan import Piece, format_rows
from treetools.rules.spec import FIELDS, Rules, fields_markdown, parse_cast, parse_rename, parse_transpose
from treetools.shared.errors import PatternError, RulesError

BF16 = np.dtype(ml_dtypes.bfloat16)
Spec = namedtuple("Spec", "shape dtype")  # what a ShapeDtypeStruct looks like to the planner: no data


def plan_paths(rules, leaves, **kw):
    return [t.path for t in rules.plan(leaves, **kw)]


class Recording(InMemoryReader):
    """An in-memory source leaf that records every block asked of it, as ``(name, index)``."""

    def __init__(self, name, array, calls):
        super().__init__(array)
        self.name, self.calls = name, calls

    def read(self, index):
        self.calls.append((self.name, index))
        return super().read(index)


def reader(target, arrays):
    """The block reader of one target leaf over in-memory sources."""
    return RuledReader(target, {p.path: InMemoryReader(np.asarray(arrays[p.path])) for p in target.pieces})


def materialize(plan, arrays, *, block=None):
    """Every target leaf read through RuledReader, whole or tiled in blocks of shape ``block``."""
    out = {}
    for t in plan:
        if not t.is_array:
            out[t.path] = arrays[t.source]
            continue
        r = reader(t, arrays)
        if block is None:
            out[t.path] = r.read()
            continue
        result = np.empty(r.shape, r.dtype)
        for index in tiles(r.shape, block):
            result[index] = r.read(index)
        out[t.path] = result
    return out


def tiles(shape, block):
    """Index tuples of slices tiling ``shape`` in blocks of (at most) ``block`` along each axis."""
    block = tuple(block[: len(shape)]) + (None,) * (len(shape) - len(block))
    ranges = [
        [slice(None)] if b is None else [slice(i, min(i + b, n)) for i in range(0, max(n, 1), b)]
        for n, b in zip(shape, block)
    ]
    return list(itertools.product(*ranges))


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize("field", ["rename", "drop", "keep", "cast", "transpose", "unstack", "stack"])
def test_a_bad_regex_is_a_pattern_error_naming_the_field(field):
    value = {"rename": [("(", "x")], "cast": {"(": "float16"}, "transpose": [("(", (1, 0))]}.get(field, ["("])
    with pytest.raises(PatternError, match=rf"^`{field}` pattern '\(' is not a valid regex"):
        Rules(**{field: value})


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "float32", "int4"])
def test_ml_dtypes_names_resolve(name):
    assert resolve_dtype(name).name == name
    assert Rules(cast={"w": name}).cast == (("w", name),)


def test_bad_dtype_names_are_value_errors_naming_them():
    with pytest.raises(ValueError, match=r"`dtype` 'bfloat61' is not a numeric dtype"):
        Rules(dtype="bfloat61")
    with pytest.raises(ValueError, match=r"`cast\['kernel\$'\]` 'str' is not a numeric dtype"):
        Rules(cast={"kernel$": "str"})
    # A blanket dtype casts floating leaves only, so an integer one is refused at once.
    with pytest.raises(ValueError, match=r"`dtype` 'int8' is not a floating dtype.*cast=\{pattern: 'int8'\}"):
        Rules(dtype="int8")


def test_bad_shapes_of_values_are_type_errors():
    with pytest.raises(TypeError, match="`transpose` axes"):
        Rules(transpose=[("w", "1,0")])
    with pytest.raises(TypeError, match="`rename` takes"):
        Rules(rename=["a=>b"])
    with pytest.raises(TypeError, match="`rename` replacement"):
        Rules(rename=[("a", None)])
    with pytest.raises(ValueError, match="inline"):
        Rules(drop=[re.compile("a", re.IGNORECASE)])


def test_rules_written_differently_are_equal_and_hash_alike():
    a = Rules(rename={"^a/": "b/"}, drop="opt", cast={"w$": np.float16}, transpose={"k$": [1, 0]}, dtype=BF16)
    b = Rules(rename=[("^a/", "b/")], drop=["opt"], cast=[("w$", "float16")], transpose=[("k$", (1, 0))],
              dtype="bfloat16")
    assert a == b and hash(a) == hash(b)
    assert a.drop == ("opt",) and a.dtype == "bfloat16" and a.cast == (("w$", "float16"),)
    assert repr(a) == ("Rules(rename=(('^a/', 'b/'),), drop=('opt',), cast=(('w$', 'float16'),), "
                       "dtype='bfloat16', transpose=(('k$', (1, 0)),))")
    assert Rules().empty and not a.empty and Rules(allow_unmatched=True).empty


# ---------------------------------------------------------------------------------------------- as data


FULL = Rules(
    rename=[(r"^params/layers/(\d+)/(\w+)/kernel$", r"model.layers.\1.\2.weight"), (r"^params/(.*)$", r"\1")],
    drop=["^opt_state/"],
    keep=["^(params|step)"],
    cast={r"^step$": "float32", r"norm": "float32"},
    dtype="bfloat16",
    transpose=[(r"\.weight$", (1, 0))],
    unstack=["params/layers"],
    stack=["experts/"],
    split=[(r"c_attn\.weight$", {"names": ["q.weight", "k.weight", "v.weight"], "axis": 1})],
    concat=[(r"\.(?P<part>gate|up)_proj\.weight$", {"name": ".gate_up_proj.weight", "axis": 0,
                                                      "parts": ["gate", "up"]})],
    reshape=[(r"q_proj\.weight$", (-1, 64, 0))],
    permute=[(r"(q|k)_proj\.weight$", {"axis": 0, "head_dim": 64, "to": "interleaved"})],
    slice=[(r"^lm_head", {"axis": 0, "stop": 32000})],
    pad=[(r"embed_tokens\.weight$", {"axis": 0, "size": 32128, "init": "normal", "stddev": 0.02, "seed": 1})],
    tie=[(r"^embed/embedding$", {"name": "lm_head/kernel", "axes": [1, 0]})],
    scale=[(r"q_proj\.weight$", "1/sqrt(128)"), (r"^lm_head", 0.5)],
    allow_unmatched=True,
)

FULL_TOML = r"""
drop = ['^opt_state/']
keep = ['^(params|step)']
dtype = "bfloat16"
unstack = ["params/layers"]
stack = ["experts/"]
allow_unmatched = true

[rename]
'^params/layers/(\d+)/(\w+)/kernel$' = 'model.layers.\1.\2.weight'
'^params/(.*)$' = '\1'

[cast]
'^step$' = "float32"
'norm' = "float32"

[transpose]
'\.weight$' = [1, 0]

[split]
'c_attn\.weight$' = {names = ['q.weight', 'k.weight', 'v.weight'], axis = 1}

[concat]
'\.(?P<part>gate|up)_proj\.weight$' = {name = '.gate_up_proj.weight', axis = 0, parts = ['gate', 'up']}

[reshape]
'q_proj\.weight$' = [-1, 64, 0]

[permute]
'(q|k)_proj\.weight$' = {axis = 0, head_dim = 64, to = 'interleaved'}

[slice]
'^lm_head' = {axis = 0, stop = 32000}

[pad]
'embed_tokens\.weight$' = {axis = 0, size = 32128, init = 'normal', stddev = 0.02, seed = 1}

[tie]
'^embed/embedding$' = {name = 'lm_head/kernel', axes = [1, 0]}

[scale]
'q_proj\.weight$' = '1/sqrt(128)'
'^lm_head' = 0.5
"""

FULL_FLAGS = dict(
    rename=[r"^params/layers/(\d+)/(\w+)/kernel$=>model.layers.\1.\2.weight", r"^params/(.*)$=>\1"],
    drop=["^opt_state/"],
    keep=["^(params|step)"],
    cast=["^step$=float32", "norm=float32"],
    dtype="bfloat16",
    transpose=[r"\.weight$=1,0"],
    unstack=["params/layers"],
    stack=["experts/"],
    split=[r"c_attn\.weight$=>names=q.weight,k.weight,v.weight axis=1"],
    concat=[r"\.(?P<part>gate|up)_proj\.weight$=>name=.gate_up_proj.weight axis=0 parts=gate,up"],
    reshape=[r"q_proj\.weight$=-1,64,0"],
    permute=[r"(q|k)_proj\.weight$=>axis=0 head_dim=64 to=interleaved"],
    slice=[r"^lm_head=>axis=0 stop=32000"],
    pad=[r"embed_tokens\.weight$=>axis=0 size=32128 init=normal stddev=0.02 seed=1"],
    tie=[r"^embed/embedding$=>name=lm_head/kernel axes=1,0"],
    scale=[r"q_proj\.weight$=1/sqrt(128)", "^lm_head=0.5"],
    allow_unmatched=True,
)


def test_json_toml_python_and_cli_strings_give_the_same_rules(tmp_path):
    assert all(getattr(FULL, name) for name in FIELDS)  # every field of the one table, so a new one is checked too
    (tmp_path / "r.json").write_text(json.dumps(FULL.to_dict()))
    (tmp_path / "r.toml").write_text(FULL_TOML)
    assert Rules.from_file(tmp_path / "r.json") == FULL
    assert Rules.from_file(str(tmp_path / "r.toml")) == FULL
    assert Rules.from_cli(**FULL_FLAGS) == FULL
    assert Rules.from_dict(FULL.to_dict()) == FULL
    # The JSON form is plain data: pairs as lists, cast as an object.
    assert FULL.to_dict()["transpose"] == [[r"\.weight$", [1, 0]]]
    assert FULL.to_dict()["cast"] == {"^step$": "float32", "norm": "float32"}
    assert Rules().to_dict() == {}


def test_from_cli_puts_the_flags_after_the_files_rules(tmp_path):
    (tmp_path / "r.toml").write_text(FULL_TOML)
    rules = Rules.from_cli(rules_file=tmp_path / "r.toml", rename=["^step$=>global_step"], drop=["^extra"],
                           cast=["norm=float16"], dtype="float16")
    assert rules.rename == FULL.rename + (("^step$", "global_step"),)
    assert rules.drop == ("^opt_state/", "^extra")
    assert rules.cast == (("^step$", "float32"), ("norm", "float16"))  # same pattern: the flag's value, in place
    assert rules.dtype == "float16" and rules.allow_unmatched
    assert Rules.from_cli() == Rules()


def test_rules_files_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("drop = [")
    with pytest.raises(ValueError, match=r"bad\.toml does not parse as TOML"):
        Rules.from_file(bad)
    typo = tmp_path / "typo.json"
    typo.write_text('{"renmae": []}')
    with pytest.raises(ValueError, match=r"typo\.json: unknown rules field\(s\) \['renmae'\]"):
        Rules.from_file(typo)
    with pytest.raises(ValueError, match=r"unknown suffix '\.yaml'"):
        Rules.from_file(tmp_path / "r.yaml")
    regex = tmp_path / "regex.json"
    regex.write_text('{"drop": ["("]}')
    with pytest.raises(PatternError, match=r"regex\.json: `drop` pattern"):
        Rules.from_file(regex)


def test_cli_string_parsers():
    assert parse_rename("a=>b") == ("a", "b")
    assert parse_rename(r"^(\w+)/x$=>\1.y") == (r"^(\w+)/x$", r"\1.y")
    assert parse_rename("^a=>") == ("^a", "")  # an empty replacement is a replacement
    for bad in ("a=b", "a=>b=>c"):
        with pytest.raises(ValueError, match="exactly one `=>`"):
            parse_rename(bad)
    assert parse_cast("x(?=y)=bfloat16") == ("x(?=y)", "bfloat16")  # split at the last `=`
    assert parse_transpose("w$=0, 2,1") == ("w$", (0, 2, 1))
    assert parse_transpose("w$=-1,-2") == ("w$", (-1, -2))
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_transpose("w$=a,b")
    with pytest.raises(ValueError, match=r"PATTERN=DTYPE"):
        parse_cast("bfloat16")


# ---------------------------------------------------------------------------------------------- planning


LEAVES = [
    ("params/layers/attn/q", (4, 3, 5), "float32"),
    ("params/layers/attn/k", (4, 3, 5), "float32"),
    ("params/embed", (10, 3), "float32"),
    ("step", (), "int32"),
    ("opt_state/0/mu/embed", (10, 3), "float32"),
    ("meta/name", None, None),
]


def test_no_rules_map_every_leaf_onto_itself():
    plan = Rules().plan(LEAVES)
    assert [(t.path, t.shape, t.source) for t in plan] == [(p, s, p) for p, s, _ in LEAVES]
    assert all(t.identity for t in plan) and plan.dropped == ()


def test_keep_and_drop_match_source_paths():
    plan = Rules(keep=["^params/", "^step$"], drop=["attn/k$"]).plan(LEAVES)
    assert [t.path for t in plan] == ["params/layers/attn/q", "params/embed", "step"]
    assert plan.dropped == ("params/layers/attn/k", "opt_state/0/mu/embed", "meta/name")


@pytest.mark.parametrize(
    "path, pattern, expected, inverse",
    [
        ("params/layers/attn/q", "layers", "params/layers/3/attn/q", "layers"),
        ("params/layers/attn/q", "params/lay", "params/layers/3/attn/q", "params/lay"),  # ends mid-component
        ("params/layers/attn/q", "layers/", "params/layers/3/attn/q", "layers/"),  # `/` belongs to `layers`
        ("params/layers/attn/q", "^params/.*/q$", "params/layers/attn/q/3", "^params/layers/attn/q"),  # index last
        ("params/layers/attn/q", "(?=attn)", "params/layers/3/attn/q", r"(?=\d+/attn)"),  # empty match
        ("params/layers/attn/q", "^", "3/params/layers/attn/q", "^"),  # empty match at 0: index first
        ("params/layers/attn/q", "a", "params/3/layers/attn/q", "a"),  # the first match counts
        ("model.layers.q.weight", r"model\.layers", "model.layers.3.q.weight", r"model\.layers"),  # `.` splits
        ("model.layers.q.weight", r"layers\.", "model.layers.3.q.weight", r"layers\."),
        ("embed", "embed", "embed/3", "embed"),
    ],
)
def test_unstack_puts_the_index_after_the_component_where_the_match_ends(path, pattern, expected, inverse):
    plan = Rules(unstack=[pattern]).plan([(path, (4, 2), "float32")])
    assert [t.path for t in plan][3] == expected
    assert plan[expected].pieces == (Piece(path, 3),) and plan[expected].shape == (2,)
    # stack is the inverse: the component after the match is the index, removed
    back = Rules(stack=[inverse]).plan([(t.path, t.shape, t.dtype) for t in plan])
    assert [(t.path, t.shape) for t in back] == [(path, (4, 2))]


def test_rename_runs_after_unstack_first_match_wins_and_transpose_cast_see_target_names():
    rules = Rules(
        unstack=["params/layers"],
        rename=[
            (r"^params/layers/(\d+)/attn/(\w)$", r"model.layers.\1.self_attn.\2_proj.weight"),
            (r"^params/", "model."),  # not reached by the layers: the first rule took them
            (r"^step$", "global_step"),
        ],
        transpose=[(r"_proj\.weight$", (1, 0))],
        cast={r"^model\.layers\.0\.": "float16"},
        dtype="bfloat16",
        drop=["^opt_state", "^meta"],
    )
    plan = rules.plan(LEAVES)
    got = [(t.path, t.shape, t.dtype.name, str(t.pieces[0]), t.axes) for t in plan]
    assert got == [
        ("model.layers.0.self_attn.q_proj.weight", (5, 3), "float16", "params/layers/attn/q[0]", (1, 0)),
        ("model.layers.1.self_attn.q_proj.weight", (5, 3), "bfloat16", "params/layers/attn/q[1]", (1, 0)),
        ("model.layers.2.self_attn.q_proj.weight", (5, 3), "bfloat16", "params/layers/attn/q[2]", (1, 0)),
        ("model.layers.3.self_attn.q_proj.weight", (5, 3), "bfloat16", "params/layers/attn/q[3]", (1, 0)),
        ("model.layers.0.self_attn.k_proj.weight", (5, 3), "float16", "params/layers/attn/k[0]", (1, 0)),
        ("model.layers.1.self_attn.k_proj.weight", (5, 3), "bfloat16", "params/layers/attn/k[1]", (1, 0)),
        ("model.layers.2.self_attn.k_proj.weight", (5, 3), "bfloat16", "params/layers/attn/k[2]", (1, 0)),
        ("model.layers.3.self_attn.k_proj.weight", (5, 3), "bfloat16", "params/layers/attn/k[3]", (1, 0)),
        ("model.embed", (10, 3), "bfloat16", "params/embed", None),
        ("global_step", (), "int32", "step", None),  # dtype= casts floating leaves only
    ]
    assert plan.dropped == ("opt_state/0/mu/embed", "meta/name")


def test_rename_replaces_every_match_as_re_sub_does():
    assert plan_paths(Rules(rename=[("/", ".")]), [("a/b/c", (1,), "f4")]) == ["a.b.c"]


def test_stack_gathers_layers_in_index_order_where_layer_0_was():
    leaves = [("x", (1,), "f4")] + [(f"blocks/{i}/w", (2, 3), "float16") for i in (2, 0, 1)]
    plan = Rules(stack=["blocks/"]).plan(leaves)
    assert [(t.path, t.shape, t.stacked) for t in plan] == [("x", (1,), False), ("blocks/w", (3, 2, 3), True)]
    assert [p.path for p in plan["blocks/w"].pieces] == ["blocks/0/w", "blocks/1/w", "blocks/2/w"]
    # transpose after stack sees the stacked leaf: (L, in, out) -> (L, out, in) is (0, 2, 1)
    plan = Rules(stack=["blocks/"], transpose={"w$": (0, 2, 1)}).plan(leaves)
    assert plan["blocks/w"].shape == (3, 3, 2)


def test_flat_dotted_names_are_matched_as_they_are():
    leaves = [(f"model.layers.{i}.mlp.up_proj.weight", (6, 4), "bfloat16") for i in range(3)]
    leaves.append(("model.norm.weight", (4,), "bfloat16"))
    rules = Rules(
        stack=[r"model\.layers"],
        rename=[(r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"params/layers/\1/mlp/wi/kernel"),
                (r"^model\.norm\.weight$", "params/final_norm/scale")],
        transpose=[("kernel$", (0, 2, 1))],
        dtype="float32",
    )
    with pytest.raises(RulesError, match=r"`stack` pattern 'model\\\\.layers' matches no leaf \(paths after rename\)"):
        rules.plan(leaves)  # stack sees the renamed paths
    plan = rules.merge(Rules(stack=["params/layers"])).merge(Rules(allow_unmatched=True)).plan(leaves)
    assert [(t.path, t.shape, t.dtype.name) for t in plan] == [
        ("params/layers/mlp/wi/kernel", (3, 4, 6), "float32"),
        ("params/final_norm/scale", (4,), "float32"),
    ]


def test_non_array_leaves_pass_through_rename_cast_and_dtype():
    plan = Rules(rename={"^meta/": "info/"}, cast={".": "float16"}, dtype="bfloat16").plan(
        [("meta/name", None, None), ("w", (2,), "float32")])
    assert [(t.path, t.shape, t.dtype) for t in plan] == [("info/name", None, None), ("w", (2,), np.float16)]
    with pytest.raises(TypeError, match="not an array"):
        RuledReader(plan["info/name"], {})


def test_leaves_may_be_a_mapping_of_arrays_or_shape_dtype_structs():
    flat = {"a/w": Spec((2, 3), np.dtype("float32")), "a/n": 3, "a/s": np.float32(1.0)}
    plan = Rules().plan(flat)
    assert [(t.path, t.shape, t.dtype) for t in plan] == [
        ("a/w", (2, 3), np.float32), ("a/n", None, None), ("a/s", (), np.float32)]
    with pytest.raises(ValueError, match="share the path 'a'"):
        Rules().plan([("a", (1,), "f4"), ("a", (1,), "f4")])


def test_dtype_of_a_leaf_numpy_does_not_know_is_kept_and_never_cast():
    plan = Rules(dtype="bfloat16").plan([("key", (2,), "key<fry>")])
    assert plan["key"].dtype == "key<fry>" and plan["key"].cast is None
    with pytest.raises(RulesError, match=r"matches `key` of dtype key<fry>, which does not cast"):
        Rules(cast={"key": "float32"}).plan([("key", (2,), "key<fry>")])


# ---------------------------------------------------------------------------------------------- errors


def test_a_pattern_matching_nothing_names_the_pattern_the_stage_and_nearby_paths():
    with pytest.raises(RulesError) as e:
        Rules(drop=["^opt_stat$"]).plan(LEAVES)
    assert isinstance(e.value, PatternError)
    assert str(e.value).startswith("`drop` pattern '^opt_stat$' matches no leaf (checkpoint paths); nearby paths: [")
    assert "opt_state/0/mu/embed" in str(e.value) and "allow_unmatched=True" in str(e.value)
    # transpose and cast name target paths: nearby paths are the renamed ones
    with pytest.raises(RulesError, match=r"`transpose` pattern 'kernel\.T' matches no leaf \(target paths.*'w\.kernel'"):
        Rules(rename={"^w$": "w.kernel"}, transpose={"kernel.T": (0,)}).plan([("w", (2,), "f4")])
    # every unmatched pattern of the stage, one line each
    with pytest.raises(RulesError) as e:
        Rules(keep=["nope"], drop=["nada"]).plan(LEAVES)
    assert len(e.value.problems) == 2 and str(e.value).count("\n") == 2
    # allow_unmatched=True: silent
    assert plan_paths(Rules(drop=["nope"], rename={"x": "y"}, allow_unmatched=True), LEAVES[:1]) == [LEAVES[0][0]]


def test_a_rename_rule_matching_only_leaves_an_earlier_rule_took_is_not_unmatched():
    assert plan_paths(Rules(rename=[("^a", "b"), ("^a/x", "c")]), [("a/x", (1,), "f4")]) == ["b/x"]


def test_two_leaves_renamed_onto_one_path_names_both():
    with pytest.raises(RulesError, match=r"^`params/layers/attn/q` and `params/layers/attn/k` both become "
                                         r"`params/layers/attn/x` after rename"):
        Rules(rename=[("attn/.$", "attn/x")]).plan(LEAVES)
    # a renamed leaf onto one that keeps its name, and unstacked layers name their layer
    with pytest.raises(RulesError, match=r"`a\[1\]` and `b/1` both become `b/1`"):
        Rules(unstack=["^a$"], rename={r"^a/(\d)$": r"b/\1"}).plan([("a", (2,), "f4"), ("b/1", (), "f4")])


    with pytest.raises(RulesError, match=r"^`a/x`, `a/y` and `a/z` all become `b`"):
        Rules(rename={"^a/.$": "b"}).plan([("a/x", (1,), "f4"), ("a/y", (1,), "f4"), ("a/z", (1,), "f4")])


def test_a_bad_replacement_is_said_once():
    with pytest.raises(RulesError) as e:
        Rules(rename=[(r"attn/(.)$", r"attn/\2")]).plan(LEAVES)
    assert len(e.value.problems) == 1 and "invalid group reference 2" in str(e.value)
    # the target layer check renames too, and leaves the bad replacement to the rename stage
    with pytest.raises(RulesError, match="invalid group reference 2"):
        Rules(unstack=["layers"], rename=[(r"attn/(.)$", r"attn/\2")]).plan(LEAVES, targets={"x"})


def test_unstack_errors_name_the_leaf_and_its_shape():
    with pytest.raises(RulesError, match=r"`unstack` pattern 'step' matches `step`, which has shape \(\), no leading"):
        Rules(unstack=["step"]).plan(LEAVES)
    with pytest.raises(RulesError, match=r"matches `meta/name`, which is not an array"):
        Rules(unstack=["meta"]).plan(LEAVES)
    with pytest.raises(RulesError, match=r"`params/embed` has shape \(10, 3\), whose leading axis is not the 4 layers"):
        Rules(unstack=["layers", "embed"]).plan(LEAVES, num_layers=4)
    assert len(plan_paths(Rules(unstack=["layers"]), LEAVES, num_layers=4)) == 12
    # against a target path set: the layers the target names must be the leaf's
    targets = {f"params/layers/{i}/attn/{n}" for i in range(2) for n in "qk"}
    with pytest.raises(RulesError) as e:
        Rules(unstack=["layers"]).plan(LEAVES, targets=targets)
    assert e.value.problems[0] == (
        "`unstack`: `params/layers/attn/q` has shape (4, 3, 5), 4 layers, but the target has 2 "
        "(`params/layers/0/attn/q` .. `params/layers/1/attn/q`); restore a checkpoint with as many layers "
        "or fix the target's layer count.")
    targets = {f"params/layers/{i}/attn/{n}" for i in range(4) for n in "qk"}
    assert len(Rules(unstack=["layers"]).plan(LEAVES, targets=targets)) == 12
    assert len(Rules(unstack=["layers"]).plan(LEAVES, targets={"elsewhere"})) == 12  # not named: not checked


def test_the_target_layer_check_follows_rename():
    rules = Rules(unstack=["layers"], rename={r"^params/layers/(\d+)/attn/(\w)$": r"h.\1.\2"})
    with pytest.raises(RulesError, match=r"but the target has 3 \(`h\.0\.q` \.\. `h\.2\.q`\)"):
        rules.plan(LEAVES[:1], targets={"h.0.q", "h.1.q", "h.2.q"})


def test_stack_errors_name_the_layers():
    def leaves(*indices, shape=(2,), odd=None):
        return [(f"l/{i}/w", (3,) if i == odd else shape, "f4") for i in indices]

    with pytest.raises(RulesError, match=r"`stack` into `l/w`: layers \[0, 1, 3\] from `l/0/w`, `l/1/w`, `l/3/w` "
                                         r"are not 0 \.\. 2 \(missing \[2\]\)"):
        Rules(stack=["l/"]).plan(leaves(0, 1, 3))
    with pytest.raises(RulesError, match=r"are not 0 \.\. 1 \(missing \[0\]\)"):
        Rules(stack=["l/"]).plan(leaves(1, 2))
    with pytest.raises(RulesError, match=r"the layers differ in shape or dtype \(`l/0/w` \(2,\) float32; "
                                         r"`l/1/w` \(3,\) float32\)"):
        Rules(stack=["l/"]).plan(leaves(0, 1, 2, odd=1))
    with pytest.raises(RulesError, match=r"`stack` into `l/w`: 2 layers \(`l/0/w`, `l/1/w`\), not the 3 expected"):
        Rules(stack=["l/"]).plan(leaves(0, 1), num_layers=3)
    with pytest.raises(RulesError, match=r"matches `l/x/w`, but `x` follows the match where a layer index belongs"):
        Rules(stack=["l/"]).plan([("l/x/w", (1,), "f4")])
    with pytest.raises(RulesError, match=r"matches `l/0`, but nothing follows the match"):
        Rules(stack=[r"l/\d"]).plan([("l/0", (1,), "f4")])
    with pytest.raises(RulesError, match=r"`l/0/w \.\. l/1/w \(2\)` and `l/w` both become `l/w` after stack"):
        Rules(stack=[r"l/(?=\d)"]).plan(leaves(0, 1) + [("l/w", (2,), "f4")])
    with pytest.raises(RulesError, match=r"matches `l/0/w`, which is not an array"):
        Rules(stack=["l/"]).plan([("l/0/w", None, None)])


def test_a_transpose_that_does_not_fit_the_rank_names_the_leaf():
    with pytest.raises(RulesError) as e:
        Rules(transpose={"attn": (1, 0)}).plan(LEAVES)
    assert e.value.problems == [
        f"`transpose` rule ('attn', (1, 0)) does not fit `params/layers/attn/{n}` (shape (4, 3, 5), rank 3); "
        "give a permutation of 0 .. rank-1, or narrow the pattern." for n in "qk"]
    for axes in [(0, 0), (0, 2), (0, 1, 2)]:
        with pytest.raises(RulesError, match="does not fit"):
            Rules(transpose={"w": axes}).plan([("w", (2, 3), "f4")])
    with pytest.raises(RulesError, match=r"does not fit `meta/name` \(not an array\)"):
        Rules(transpose={"meta": (0,)}).plan(LEAVES)
    plan = Rules(transpose={"w": (-1, -2)}).plan([("w", (2, 3), "f4")])
    assert plan["w"].axes == (1, 0) and plan["w"].shape == (3, 2)
    assert Rules(transpose={"w": (0, 1)}).plan([("w", (2, 3), "f4")])["w"].axes is None  # identity: nothing to do


def test_int_float_casts_only_for_a_rule_that_asks_for_that_kind():
    with pytest.raises(RulesError) as e:
        Rules(cast={".*": "bfloat16"}).plan(LEAVES)
    assert e.value.problems == [
        "`cast` rule '.*' -> bfloat16 would turn integer `step` (int32) into floating, but the rule also applies "
        "to floating `params/layers/attn/q`; a kind change needs a rule for leaves of that kind only: narrow the "
        "pattern or put a rule for this leaf first (`dtype=` casts floating leaves only)."]
    # a rule written for the integer leaf casts it; the broad rule after it then meets floats only
    plan = Rules(cast={"^step$": "float32", ".*": "bfloat16"}).plan(LEAVES)
    assert plan["step"].cast == np.float32 and plan["params/embed"].cast == BF16
    # float -> int for a rule over float leaves only; int -> int and float -> float always
    plan = Rules(cast={"embed": "int8", "step": "int64"}).plan(LEAVES)
    assert plan["params/embed"].dtype == np.int8 and plan["step"].dtype == np.int64
    # dtype= never touches integer, bool or complex leaves
    plan = Rules(dtype="float16").plan([("i", (1,), "int32"), ("b", (1,), "bool"), ("c", (1,), "complex64"),
                                        ("h", (1,), BF16)])
    assert [t.cast for t in plan] == [None, None, None, np.float16]
    assert Rules(dtype="float32").plan([("w", (1,), "float32")])["w"].cast is None  # already that dtype


def test_a_later_stage_is_not_checked_while_an_earlier_one_has_problems():
    # the unmatched unstack pattern is reported alone: later stages would see the wrong paths
    with pytest.raises(RulesError) as e:
        Rules(unstack=["nope"], transpose={"nope": (0,)}).plan(LEAVES)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("`unstack`")


# ---------------------------------------------------------------------------------------------- blocks


def test_unstack_rename_transpose_cast_read_in_blocks_is_numpy_bit_exact():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 5, 7)).astype(np.float32)
    bias = rng.standard_normal((3, 7)).astype(np.float32)
    arrays = {"params/layers/q/kernel": q, "params/layers/q/bias": bias, "step": np.array(9, np.int32)}
    rules = Rules(
        unstack=["params/layers"],
        rename=[(r"^params/layers/(\d+)/q/kernel$", r"h.\1.q.weight"), (r"^params/layers/(\d+)/q/bias$", r"h.\1.q.bias")],
        transpose=[(r"weight$", (1, 0))],
        cast={r"^h\.1\.": "float16"},
        dtype="bfloat16",
    )
    # the same mapping, by hand
    truth = {"step": arrays["step"]}
    for i in range(3):
        dt = np.float16 if i == 1 else BF16
        truth[f"h.{i}.q.weight"] = q[i].T.astype(dt)
        truth[f"h.{i}.q.bias"] = bias[i].astype(dt)
    plan = rules.plan({p: Spec(a.shape, a.dtype) for p, a in arrays.items()})
    for block in [None, (1, 1), (2, 3), (3, 2), (7, 5), (100, 100)]:
        got = materialize(plan, arrays, block=block)
        assert list(got) == [f"h.{i}.q.weight" for i in range(3)] + [f"h.{i}.q.bias" for i in range(3)] + ["step"]
        for path, value in truth.items():
            assert bits_equal(got[path], value), (path, block)


def test_stack_and_transpose_read_in_blocks_is_numpy_bit_exact():
    rng = np.random.default_rng(1)
    arrays = {f"model.layers.{i}.w": rng.standard_normal((4, 6)).astype(np.float16) for i in range(5)}
    plan = Rules(stack=[r"layers\."], transpose={"w": (2, 0, 1)}, cast={"w": "float32"}).plan(arrays)
    truth = np.stack([arrays[f"model.layers.{i}.w"] for i in range(5)]).transpose(2, 0, 1).astype(np.float32)
    assert plan["model.layers.w"].shape == truth.shape == (6, 5, 4)
    for block in [None, (1, 1, 1), (2, 2, 3), (6, 1, 4), (4, 3, 2)]:
        assert bits_equal(materialize(plan, arrays, block=block)["model.layers.w"], truth)
    stacked = reader(plan["model.layers.w"], arrays)
    # stepped and empty slices, and a short index (missing trailing axes are whole)
    for index in [(slice(None, None, 2), slice(4, 0, -2)), (slice(1, 1),), (slice(0, 6), slice(5, 9)), ()]:
        assert bits_equal(stacked.read(index), truth[index]), index
    with pytest.raises(TypeError, match="tuple of at most 3 slices"):
        stacked.read((0,))


def test_reads_take_only_the_blocks_asked_for():
    src = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    calls = []
    plan = Rules(unstack=["^w$"], transpose={r"w/\d": (1, 0)}).plan({"w": src})
    block = RuledReader(plan["w/2"], {"w": Recording("w", src, calls)}).read((slice(1, 3), slice(4, 6)))
    assert calls == [("w", (slice(2, 3), slice(4, 6), slice(1, 3)))]  # layer 2, the permuted block only
    assert bits_equal(block, src[2].T[1:3, 4:6])

    layers = {f"l/{i}/w": src[i] for i in range(4)}
    calls.clear()
    plan = Rules(stack=["l/"]).plan(layers)
    block = RuledReader(plan["l/w"], {p: Recording(p, x, calls) for p, x in layers.items()}).read(
        (slice(1, 3), slice(0, 2)))
    assert calls == [("l/1/w", (slice(0, 2), slice(0, 8))), ("l/2/w", (slice(0, 2), slice(0, 8)))]  # whole: 0..8
    assert bits_equal(block, src[1:3, 0:2])


def test_narrowing_casts_round_as_numpy_and_ml_dtypes_do():
    x = np.array([1.0, 1 + 2**-9, 1 + 3 * 2**-9, 65504.0, 70000.0, 1e-8, -0.0, np.inf, np.nan], np.float32)
    for name in ["bfloat16", "float16", "float8_e4m3fn"]:
        plan = Rules(dtype=name).plan({"x": x})
        with np.errstate(over="ignore"):  # 70000 overflows float16: numpy warns, as it would for astype
            got = reader(plan["x"], {"x": x}).read()
            assert bits_equal(got, x.astype(resolve_dtype(name))), name
    # widening is exact: bf16 -> f32 -> bf16 gives the same bits
    h = x.astype(BF16)
    wide = reader(Rules(dtype="float32").plan({"h": h})["h"], {"h": h}).read()
    assert bits_equal(wide.astype(BF16), h) and wide.dtype == np.float32
    c = np.array([1 + 2j], np.complex64)
    real = reader(Rules(cast={"c": "float32"}).plan({"c": c})["c"], {"c": c}).read()
    assert bits_equal(real, np.array([1.0], np.float32))


# ---------------------------------------------------------------------------------------------- GPT-2


def flax_gpt2(n_layer=2, d=8, vocab=11, n_pos=6, scanned=False, seed=0):
    """HF FlaxGPT2LMHeadModel-style params: FlaxConv1D kernels are stored (out, in) = (features, d_in)."""
    rng = np.random.default_rng(seed)

    def block():
        return {
            "ln_1": {"scale": rng.standard_normal(d), "bias": rng.standard_normal(d)},
            "attn": {"c_attn": {"kernel": rng.standard_normal((3 * d, d)), "bias": rng.standard_normal(3 * d)},
                     "c_proj": {"kernel": rng.standard_normal((d, d)), "bias": rng.standard_normal(d)}},
            "ln_2": {"scale": rng.standard_normal(d), "bias": rng.standard_normal(d)},
            "mlp": {"c_fc": {"kernel": rng.standard_normal((4 * d, d)), "bias": rng.standard_normal(4 * d)},
                    "c_proj": {"kernel": rng.standard_normal((d, 4 * d)), "bias": rng.standard_normal(d)}},
        }

    def flat(tree, prefix=""):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v.astype(np.float32)})
        return out

    blocks = [flat(block()) for _ in range(n_layer)]
    params = {"transformer/wte/embedding": rng.standard_normal((vocab, d)).astype(np.float32),
              "transformer/wpe/embedding": rng.standard_normal((n_pos, d)).astype(np.float32)}
    if scanned:
        params.update({f"transformer/h/{k}": np.stack([b[k] for b in blocks]) for k in blocks[0]})
    else:
        params.update({f"transformer/h/{i}/{k}": v for i, b in enumerate(blocks) for k, v in b.items()})
    params["transformer/ln_f/scale"] = np.ones(d, np.float32)
    params["transformer/ln_f/bias"] = np.zeros(d, np.float32)
    return params, blocks


GPT2_TO_PYTORCH = Rules(
    rename=[
        (r"^transformer/h/(\d+)/(\w+)/(\w+)/kernel$", r"transformer.h.\1.\2.\3.weight"),
        (r"^transformer/h/(\d+)/(\w+)/(\w+)/bias$", r"transformer.h.\1.\2.\3.bias"),
        (r"^transformer/h/(\d+)/(\w+)/scale$", r"transformer.h.\1.\2.weight"),
        (r"^transformer/h/(\d+)/(\w+)/bias$", r"transformer.h.\1.\2.bias"),
        (r"^transformer/(\w+)/(?:embedding|scale)$", r"transformer.\1.weight"),
        (r"^transformer/(\w+)/bias$", r"transformer.\1.bias"),
    ],
    # PyTorch's GPT-2 Conv1D weight is (in, out): the transpose of Flax's (out, in) kernel
    transpose=[(r"\.(c_attn|c_proj|c_fc)\.weight$", (1, 0))],
)

PYTORCH_GPT2_KEYS = ["transformer.wte.weight", "transformer.wpe.weight"] + [
    f"transformer.h.{i}.{name}"
    for i in range(2)
    for name in ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]
] + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


@pytest.mark.parametrize("scanned", [False, True])
def test_flax_gpt2_to_pytorch_names_with_conv1d_transposes(scanned):
    params, blocks = flax_gpt2(scanned=scanned)
    rules = GPT2_TO_PYTORCH.merge(Rules(unstack=["^transformer/h/"], dtype="float16")) if scanned else \
        GPT2_TO_PYTORCH.merge(Rules(dtype="float16"))
    plan = rules.plan({p: Spec(a.shape, a.dtype) for p, a in params.items()})
    assert sorted(t.path for t in plan) == sorted(PYTORCH_GPT2_KEYS)
    d = 8
    assert plan["transformer.h.1.attn.c_attn.weight"].shape == (d, 3 * d)  # PyTorch Conv1D: (in, out)
    assert plan["transformer.h.1.mlp.c_proj.weight"].shape == (4 * d, d)
    assert plan["transformer.wte.weight"].axes is None and plan["transformer.h.0.ln_1.weight"].axes is None
    got = materialize(plan, params, block=(5, 3))
    for i, b in enumerate(blocks):
        for mod in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            name = mod.replace("/", ".")
            assert bits_equal(got[f"transformer.h.{i}.{name}.weight"], b[f"{mod}/kernel"].T.astype(np.float16))
            assert bits_equal(got[f"transformer.h.{i}.{name}.bias"], b[f"{mod}/bias"].astype(np.float16))
        assert bits_equal(got[f"transformer.h.{i}.ln_2.weight"], b["ln_2/scale"].astype(np.float16))
    assert bits_equal(got["transformer.wpe.weight"], params["transformer/wpe/embedding"].astype(np.float16))
    text = str(plan)
    if scanned:
        assert "transformer/h/attn/c_attn/kernel[1]  -> transformer.h.1.attn.c_attn.weight  (2, 24, 8) -> (8, 24)" \
            "  float32 -> float16" in text


def test_describe_rows_and_text():
    rules = Rules(unstack=["layers"], drop=["^opt"], stack=[r"^x/"], dtype="bfloat16",
                  transpose={r"layers/\d+/attn/q": (1, 0)})
    leaves = LEAVES + [("x/0/b", (2,), "float32"), ("x/1/b", (2,), "float32")]
    rows = rules.describe(leaves)
    assert [(r.source, r.target, r.ops) for r in rows[:2]] == [
        ("params/layers/attn/q[0]", "params/layers/0/attn/q", ("unstack [0]", "transpose (1, 0)", "cast bfloat16")),
        ("params/layers/attn/q[1]", "params/layers/1/attn/q", ("unstack [1]", "transpose (1, 0)", "cast bfloat16")),
    ]
    assert [(r.source, r.target, r.shape, r.ops) for r in rows[-3:]] == [
        ("meta/name", "meta/name", None, ()),
        ("x/0/b .. x/1/b (2)", "x/b", (2, 2), ("stack 2", "cast bfloat16")),
        ("opt_state/0/mu/embed", None, None, ("drop",)),  # dropped leaves come last
    ]
    text = format_rows(rows).splitlines()
    assert text[0].split() == ["source", "->", "target", "shape", "dtype", "rules"]
    assert text[1].split() == ["params/layers/attn/q[0]", "->", "params/layers/0/attn/q", "(4,", "3,", "5)", "->",
                               "(5,", "3)", "float32", "->", "bfloat16", "unstack", "[0],", "transpose", "(1,",
                               "0),", "cast", "bfloat16"]
    assert text[-1].split() == ["opt_state/0/mu/embed", "(dropped)"]
    assert str(rules.plan(leaves)) == format_rows(rows)


def test_describe_takes_path_strings_shapes_and_dtypes_optional():
    # DESIGN.md: `rules.describe(paths)` shows the mapping before anything is read; paths alone are arrays whose
    # shape and dtype are not known (blank in the rows), mixed freely with (path, shape, dtype) triples.
    rules = Rules(rename=[(r"^params/(\w+)/kernel$", r"\1.weight")], drop=["^opt"], transpose={"weight$": (1, 0)},
                  cast={"^step$": "float32"}, dtype="bfloat16")
    paths = ["params/dense/kernel", "opt_state/mu", "step"]
    rows = rules.describe(paths)
    assert [(r.source, r.target, r.shape, r.ops) for r in rows] == [
        ("params/dense/kernel", "dense.weight", None, ("transpose (1, 0)", "cast bfloat16")),
        ("step", "step", None, ("cast float32",)),
        ("opt_state/mu", None, None, ("drop",)),
    ]
    assert format_rows(rows).splitlines() == [
        "source               -> target        shape  dtype          rules",
        "params/dense/kernel  -> dense.weight         ? -> bfloat16  transpose (1, 0), cast bfloat16",
        "step                 -> step                 ? -> float32   cast float32",
        "opt_state/mu         (dropped)",
    ]
    # known metadata where given: the triples' rows are what describe(triples) gives
    mixed = rules.describe(["params/dense/kernel", ("step", (), "int32"), "opt_state/mu"])
    known = rules.describe([("params/dense/kernel", (2, 3), "float32"), ("step", (), "int32"), ("opt_state/mu", (1,), "f4")])
    assert mixed[1] == known[1] and mixed[1].dtype == "float32" and mixed[0].shape is None and known[0].shape == (3, 2)
    # a generator of paths, and the errors of paths: a pattern that matches none of them names them
    assert [r.target for r in Rules(rename={"^a": "b"}).describe(p for p in ["a/x", "c"])] == ["b/x", "c"]
    with pytest.raises(RulesError, match=r"`drop` pattern 'nope' matches no leaf \(checkpoint paths\); nearby"):
        Rules(drop=["nope"]).describe(["a", "b"])
    # unstack needs the layer count: from the shape, or num_layers when only paths are given
    with pytest.raises(RulesError, match=r"`unstack` pattern 'layers' matches `layers/w`, whose shape is not given; "
                                         r"pass its shape \(a \(path, shape, dtype\) triple\) or num_layers="):
        Rules(unstack=["layers"]).describe(["layers/w"])
    rows = Rules(unstack=["layers"], rename={r"^layers/(\d+)/w$": r"h.\1.w"}, stack=[r"^h\."]).describe(
        ["layers/w"], num_layers=3)
    assert [(r.source, r.target, r.ops) for r in rows] == [("layers/w[0..2]", "h.w", ("stack 3",))]
    rows = Rules(unstack=["layers"]).describe(["layers/w", "emb"], num_layers=2)
    assert [(r.source, r.target) for r in rows] == [("layers/w[0]", "layers/0/w"), ("layers/w[1]", "layers/1/w"),
                                                    ("emb", "emb")]
    # a transpose of an unknown shape is checked against its own axes: a permutation of 0 .. len(axes)-1
    assert Rules(transpose={"w": (-1, -2)}).plan(["w"])["w"].axes == (1, 0)
    with pytest.raises(RulesError, match=r"does not fit `w` \(shape not given\)"):
        Rules(transpose={"w": (0, 0)}).describe(["w"])


def test_docs_rules_md_fields_table_is_the_field_table():
    # docs/rules.md shows the one field table of Rules; regenerate it with
    # python -c "from treetools.rules.spec import fields_markdown; print(fields_markdown())"
    doc = (Path(__file__).parent.parent / "docs" / "rules.md").read_text()
    table = fields_markdown()
    assert table in doc
    rows = table.splitlines()[2:]
    assert [row.split("`")[1].split("=")[0] for row in rows] == list(FIELDS)
    assert "`--rename 'RE=>REPL'`, repeatable" in table and "| `dtype=DTYPE` |" in table
    assert "`--allow-unmatched` |" in table and "`cast={pattern: dtype}`" in table


def test_docs_rules_md_python_toml_json_and_flags_are_the_same_rules(tmp_path):
    import treetools as tt

    doc = (Path(__file__).parent.parent / "docs" / "rules.md").read_text()
    doc = doc[:doc.index("## Restoring with rules")]  # the reference part; the restore examples have their own test
    blocks = re.findall(r"```(\w*)\n(.*?)```", doc, flags=re.S)
    python, = [b for lang, b in blocks if lang == "python" and "tt.Rules(" in b]
    toml, = [b for lang, b in blocks if lang == "toml"]
    json_text, = [b for lang, b in blocks if lang == "json"]
    flags, = [b for lang, b in blocks if lang == "" and b.startswith("--rename")]
    namespace = {"tt": tt}
    exec(python, namespace)
    (tmp_path / "r.toml").write_text(toml)
    (tmp_path / "r.json").write_text(json_text)
    words = shlex.split(flags)
    kwargs = {"rename": [], "transpose": []}
    for flag, value in zip(words[::2], words[1::2]):
        name = flag.removeprefix("--")
        kwargs[name] = value if name == "dtype" else kwargs[name] + [value]
    expected = GPT2_TO_PYTORCH.merge(Rules(dtype="float16"))
    assert namespace["rules"] == expected
    assert Rules.from_file(tmp_path / "r.toml") == expected
    assert Rules.from_file(tmp_path / "r.json") == expected
    assert Rules.from_cli(**kwargs) == expected
    # the printed plan on the page is what str(plan) prints
    printed, = [b for lang, b in blocks if lang == "" and b.startswith("source")]
    plan = Rules(unstack=["layers"], rename=[(r"^layers/(\d+)/w$", r"h.\1.weight")], drop=["^opt"],
                 transpose=[(r"weight$", (1, 0))], dtype="bfloat16").plan(
        [("layers/w", (2, 4, 8), "float32"), ("step", (), "int32"), ("opt/mu", (3,), "float32")])
    assert str(plan) == printed.rstrip("\n")


# ---------------------------------------------------------------------------------------------- properties


components = st.sampled_from(["a", "b", "enc", "dec", "mlp", "w", "kernel", "q"])


@st.composite
def stacked_trees(draw):
    sep = draw(st.sampled_from(["/", "."]))
    n_layers = draw(st.integers(1, 4))
    names = draw(st.lists(st.lists(components, min_size=1, max_size=3).map(sep.join), min_size=1, max_size=4,
                          unique=True))
    prefix = draw(st.lists(components, max_size=2))
    shapes = [draw(st.lists(st.integers(0, 3), max_size=3).map(tuple)) for _ in names]
    stacked = {sep.join([*prefix, "layers", n]): (n_layers, *s) for n, s in zip(names, shapes)}
    others = {sep.join(["other", n]): s for n, s in zip(names, shapes)}
    return sep, stacked, others


@settings(max_examples=60, deadline=None)
@given(stacked_trees(), st.integers(0, 2**31 - 1))
def test_unstack_then_stack_gives_the_original(tree, seed):
    sep, stacked, others = tree
    rng = np.random.default_rng(seed)
    arrays = {p: rng.standard_normal(s).astype(np.float32) for p, s in {**stacked, **others}.items()}
    pattern = f"layers{re.escape(sep)}"
    unstacked_plan = Rules(unstack=[pattern]).plan(arrays)
    n_layers = next(iter(stacked.values()))[0]
    assert len(unstacked_plan) == len(others) + n_layers * len(stacked)
    unstacked = materialize(unstacked_plan, arrays)
    back = Rules(stack=[pattern]).plan(unstacked)
    assert sorted((t.path, t.shape) for t in back) == sorted((p, a.shape) for p, a in arrays.items())
    restored = materialize(back, unstacked, block=(1, 2, 1, 2))
    assert all(bits_equal(restored[p], a) for p, a in arrays.items())
    # in one plan the two cancel out
    both = Rules(unstack=[pattern], stack=[pattern]).plan(arrays)
    assert [(t.path, t.shape) for t in both] == [(p, a.shape) for p, a in arrays.items()]
    assert all(bits_equal(v, arrays[p]) for p, v in materialize(both, arrays, block=(2, 1, 3, 1)).items())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(components, min_size=1, max_size=4).map("/".join), min_size=1, max_size=8, unique=True))
def test_rename_and_its_inverse_give_the_original_paths(paths):
    leaves = [(p, (1,), "float32") for p in paths]
    there = Rules(rename=[(r"^(\w+)/", r"X_\1."), (r"^(\w+)$", r"Y_\1")], allow_unmatched=True)
    renamed = there.plan(leaves)
    assert all(t.path.startswith(("X_", "Y_")) for t in renamed)
    back = Rules(rename=[(r"^X_(\w+)\.", r"\1/"), (r"^Y_(\w+)$", r"\1")], allow_unmatched=True).plan(
        [(t.path, t.shape, t.dtype) for t in renamed])
    assert [t.path for t in back] == paths
    assert [t.source for t in back] == [t.path for t in renamed]


# ---------------------------------------------------------------------------------------------- layering


def test_importing_rules_imports_no_jax():
    code = ("import sys, treetools.rules.spec, treetools.rules.plan; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
