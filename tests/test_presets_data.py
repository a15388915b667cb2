"""The preset files themselves (issue 46), without torch: the catalog, placeholders, the fit checks on
metadata, docs/presets.md's table, and the files shipping in the package.

tests/test_presets.py runs every preset on tiny models transformers builds (the ``test-hf`` extra).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import treetools as tt
from treetools.rules.presets import evaluate, fill, hf_sizes
from treetools.shared.errors import RulesError, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET_TESTS = os.path.join(ROOT, "tests", "test_presets.py")


def _doc_rows():
    with open(os.path.join(ROOT, "docs", "presets.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("<!-- presets table -->")[1].split("<!-- end presets table -->")[0]
    return [[c.strip().strip("`") for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]


def _preset_tests():
    """The test functions of tests/test_presets.py, and the case ids of its CASES and MAXTEXT, read from its
    source (it imports torch, which this file does without)."""
    with open(PRESET_TESTS, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    cases = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CASES")
    families = {k.value: v.elts[0].value for k, v in zip(cases.keys, cases.values)}
    return functions, families


def test_docs_table_lists_every_preset_and_the_test_that_runs_it():
    rows = _doc_rows()
    assert sorted(r[0] for r in rows) == tt.presets()
    functions, families = _preset_tests()
    for name, file, test, what in rows:
        assert tt.preset(name).spec.file == file and what
        function, _, case = test.partition("[")
        assert function in functions, test
        family, source, target = name.split(":")
        assert families[case.rstrip("]")] == family, test  # a case of the preset's family
        assert ("maxtext" in function) == ("maxtext" in (source, target)), test


def test_every_family_has_both_directions():
    names = set(tt.presets())
    for family in ("llama", "mistral", "qwen2", "gemma", "gpt2"):
        assert {f"{family}:hf:reference", f"{family}:reference:hf"} <= names
    for family in ("llama", "mistral"):
        assert {f"{family}:hf:maxtext", f"{family}:maxtext:hf"} <= names


def test_maxtext_presets_name_the_script_and_commit():
    for name in tt.presets():
        if "maxtext" not in name:
            continue
        with open(os.path.join(ROOT, "treetools", "presets", tt.preset(name).spec.file), encoding="utf-8") as f:
            text = f.read()
        assert "598dfbc62ec5100adcedc24279c223c6b1c4f0db" in text and "llama_or_mistral_ckpt.py" in text


def test_unknown_preset_lists_them():
    with pytest.raises(UsageError) as e:
        tt.preset("llama:hf:flax")
    assert all(name in str(e.value) for name in tt.presets())


def test_placeholders():
    assert evaluate("kv_heads * head_dim", {"kv_heads": 2, "head_dim": 16}) == 32
    assert evaluate("head_dim // 2", {}) is None
    assert fill({"a": ["{3 * hidden}", "x{2}", "{hidden}"]}, {"hidden": 5}) == {"a": [15, "x{2}", 5]}
    # inside a scale factor, the digits; nowhere else inside a string (a regex's `\d{2}` stays as it is)
    assert fill(["1/sqrt({head_dim})", "sqrt({heads * head_dim})", "2/sqrt({head_dim})", r"\d{2}"],
                {"head_dim": 8, "heads": 4}) == ["1/sqrt(8)", "sqrt(32)", "2/sqrt({head_dim})", r"\d{2}"]
    with pytest.raises(ValueError, match="unknown size"):
        evaluate("width", {})
    # transformers' defaults where save_pretrained leaves a key out (by hand: Mistral's 8 kv heads, Gemma's 256)
    assert hf_sizes({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 8})["kv_heads"] == 8
    assert hf_sizes({"model_type": "gemma", "hidden_size": 64, "num_attention_heads": 4})["head_dim"] == 256
    assert hf_sizes({"model_type": "gpt2", "n_embd": 48, "n_head": 4})["ffn"] == 192


def _llama_leaves(L=2, H=4, K=2, D=8, d=32, F=48, V=64, tied=False):
    leaves = [("model.embed_tokens.weight", (V, d), "float32"), ("model.norm.weight", (d,), "float32")]
    leaves += [] if tied else [("lm_head.weight", (V, d), "float32")]
    for i in range(L):
        p = f"model.layers.{i}."
        leaves += [(p + "input_layernorm.weight", (d,), "float32"), (p + "post_attention_layernorm.weight", (d,), "float32"),
                   (p + "self_attn.q_proj.weight", (H * D, d), "float32"), (p + "self_attn.k_proj.weight", (K * D, d), "float32"),
                   (p + "self_attn.v_proj.weight", (K * D, d), "float32"), (p + "self_attn.o_proj.weight", (d, H * D), "float32"),
                   (p + "mlp.gate_proj.weight", (F, d), "float32"), (p + "mlp.up_proj.weight", (F, d), "float32"),
                   (p + "mlp.down_proj.weight", (d, F), "float32")]
    return leaves


CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}


def test_maxtext_plan_shapes_from_metadata():
    """The MaxText layout's shapes, planned from metadata alone (hand-derived: docs/presets.md's table)."""
    plan = {t.path: t.shape for t in tt.preset("llama:hf:maxtext", config=CONFIG).plan(_llama_leaves())}
    assert plan == {
        "token_embedder/embedding": (64, 32), "decoder/decoder_norm/scale": (32,),
        "decoder/logits_dense/kernel": (32, 64),
        "decoder/layers/pre_self_attention_layer_norm/scale": (32, 2),
        "decoder/layers/post_self_attention_layer_norm/scale": (32, 2),
        "decoder/layers/self_attention/query/kernel": (32, 2, 4, 8),
        "decoder/layers/self_attention/key/kernel": (32, 2, 2, 8),
        "decoder/layers/self_attention/value/kernel": (32, 2, 2, 8),
        "decoder/layers/self_attention/out/kernel": (4, 2, 8, 32),
        "decoder/layers/mlp/wi_0/kernel": (32, 2, 48), "decoder/layers/mlp/wi_1/kernel": (32, 2, 48),
        "decoder/layers/mlp/wo/kernel": (48, 2, 32)}


def test_head_dim_needs_a_config_or_a_shape():
    with pytest.raises(RulesError, match="needs the model's head_dim"):
        tt.preset("llama:hf:maxtext").plan(_llama_leaves())
    back = tt.preset("llama:hf:maxtext", config=CONFIG).plan(_llama_leaves())
    # the way back reads head_dim off the query kernel: no config needed
    plan = tt.preset("llama:maxtext:hf").plan([(t.path, t.shape, "float32") for t in back])
    assert {t.path: t.shape for t in plan} == {p: s for p, s, _ in _llama_leaves()}


def test_the_way_back_reads_maxtexts_params_prefix_and_the_scanned_reference():
    maxtext = tt.preset("llama:hf:maxtext", config=CONFIG).plan(_llama_leaves())
    plan = tt.preset("llama:maxtext:hf").plan([("params/params/" + t.path, t.shape, "float32") for t in maxtext])
    assert {t.path: t.shape for t in plan} == {p: s for p, s, _ in _llama_leaves()}
    # the reference model scanned (nn.scan: `layers/...` with the layers on axis 0) back to Hugging Face
    per_layer = tt.preset("llama:hf:reference").plan(_llama_leaves())
    scanned = tt.Rules(stack=[r"^layers/"], rename=[(r"^layers_(\d+)/", r"layers/\1/")]).plan(
        [(t.path, t.shape, "float32") for t in per_layer])
    assert scanned["layers/q/kernel"].shape == (2, 32, 32)
    plan = tt.preset("llama:reference:hf").plan([(t.path, t.shape, "float32") for t in scanned])
    assert {t.path: t.shape for t in plan} == {p: s for p, s, _ in _llama_leaves()}


def test_the_first_leaf_that_does_not_fit_is_the_one_error():
    leaves = _llama_leaves()
    with pytest.raises(RulesError) as e:
        tt.preset("llama:hf:reference").plan([*leaves[:3], ("vision.patch_embed.weight", (8, 8), "float32"), *leaves[3:]])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("`vision.patch_embed.weight`: no leaf of a llama")
    with pytest.raises(RulesError) as e:  # the config says 4 heads of 8: q_proj would be [32, 32]
        tt.preset("llama:hf:reference", config=CONFIG).plan(_llama_leaves(H=2, D=8, K=2))
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("`model.layers.0.self_attn.q_proj.weight`: shape (16, 32), but a llama "
                                          "(hf layout) checkpoint has (heads * head_dim=32, hidden=32)")
    with pytest.raises(RulesError, match=re.escape("no leaf matching `^model\\.norm\\.weight$` (expected shape ({hidden},))")):
        tt.preset("llama:hf:reference").plan([x for x in leaves if x[0] != "model.norm.weight"])


def test_a_preset_with_rules_flags_after_it(tmp_path):
    """--preset ... --dtype bfloat16: the flags come after the preset's rules."""
    rules = tt.preset("llama:hf:reference", config=CONFIG).merge(tt.Rules(dtype="bfloat16"))
    plan = rules.plan(_llama_leaves())
    assert {str(t.dtype) for t in plan} == {"bfloat16"}
    assert plan["layers_0/q/kernel"].shape == (32, 32)


def test_convert_with_a_preset_object_keeps_the_rules_merged_after_it(tmp_path):
    """rules=tt.preset(...).merge(...) in convert: the source's config.json gives the sizes, the merged rules stay."""
    import json

    from safetensors.numpy import load_file, save_file

    src = tmp_path / "hf"
    src.mkdir()
    rng = np.random.default_rng(0)
    tensors = {p: rng.standard_normal(s).astype(np.float32) for p, s, _ in _llama_leaves()}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(CONFIG))
    rules = tt.preset("llama:hf:reference").merge(tt.Rules(dtype="float16"))
    tt.convert(str(src), str(tmp_path / "ref"), rules=rules, to="safetensors")
    out = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert out["layers_1.q.kernel"].dtype == np.float16
    assert np.array_equal(out["layers_1.q.kernel"], tensors["model.layers.1.self_attn.q_proj.weight"].T.astype(np.float16))
    assert json.loads((tmp_path / "ref" / "config.json").read_text()) == CONFIG


def test_the_presets_ship_in_the_package(tmp_path):
    # setuptools' build_py lays out exactly the files a wheel holds (as tests/test_package.py does for py.typed)
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "treetools"), src / "treetools", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    build = tmp_path / "build"
    proc = subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
                           "--build-lib", str(build)], cwd=src, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shipped = sorted(p.name for p in (build / "treetools" / "presets").glob("*.toml"))
    assert shipped == sorted(p for p in os.listdir(os.path.join(ROOT, "treetools", "presets")) if p.endswith(".toml"))
    listed = subprocess.run([sys.executable, "-c", "import treetools as tt; print(' '.join(tt.presets()))"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(build)}, capture_output=True, text=True,
                            timeout=300, check=False)
    assert listed.stdout.split() == tt.presets(), listed.stderr[-2000:]
    assert np.all([name.count(":") == 2 for name in tt.presets()])


# ---------------------------------------------------------------------------------------------- options


def test_maxtext_presets_scale_the_query_by_default_and_scale_query_false_leaves_it_out():
    maxtext = tt.preset("llama:hf:maxtext", config=CONFIG).plan(_llama_leaves())
    ops = {t.path: t.row().ops for t in maxtext}
    assert ops["decoder/layers/self_attention/query/kernel"][-1] == "scale 1/sqrt(8)"  # head_dim 32 / 4
    assert not any("scale" in op for path, row in ops.items() if "query" not in path for op in row)
    back = tt.preset("llama:maxtext:hf").plan([(t.path, t.shape, "float32") for t in maxtext])
    assert back["model.layers.1.self_attn.q_proj.weight"].row().ops[-1] == "scale sqrt(8)"  # head_dim off the shape
    assert not any("scale" in op for t in back if "q_proj" not in t.path for op in t.row().ops)
    # off: the same plan without the scale, from tt.preset's keyword or from the name as --preset writes it
    for off in (tt.preset("llama:hf:maxtext", config=CONFIG, scale_query=False),
                tt.preset("llama:hf:maxtext,scale_query=false", config=CONFIG),
                tt.preset("llama:hf:maxtext, scale_query = False", config=CONFIG)):
        assert off.options == (("scale_query", False),) and not off.scale
        plan = off.plan(_llama_leaves())
        assert [t.row().ops for t in plan] == [tuple(o for o in ops[t.path] if not o.startswith("scale"))
                                               for t in plan]
    assert tt.preset("mistral:maxtext:hf", scale_query=False) != tt.preset("mistral:maxtext:hf")
    assert tt.preset("llama:hf:maxtext,scale_query=true") == tt.preset("llama:hf:maxtext")
    merged = tt.preset("llama:hf:maxtext", config=CONFIG, scale_query=False).merge(tt.Rules(dtype="bfloat16"))
    assert merged.options == (("scale_query", False),) and not merged.scale


@pytest.mark.parametrize("call, message", [
    (lambda: tt.preset("llama:hf:maxtext", scale=False), r"preset llama:hf:maxtext has no option 'scale'; its "
                                                         r"options: scale_query \(default true\)"),
    (lambda: tt.preset("llama:hf:reference,scale_query=false"), r"has no option 'scale_query'; its options: none"),
    (lambda: tt.preset("llama:hf:maxtext", scale_query="no"),  # type: ignore[arg-type]
     r"option scale_query='no': give True or False"),
    (lambda: tt.preset("llama:hf:maxtext,scale_query"), r"'scale_query' is not OPTION=true or OPTION=false"),
    (lambda: tt.preset("llama:hf:maxtext,scale_query=0"), r"'scale_query=0' is not OPTION=true or OPTION=false"),
])
def test_an_option_that_is_not_there_or_not_true_or_false_is_a_usage_error(call, message):
    with pytest.raises(UsageError, match=message):
        call()


def test_an_option_table_is_checked_when_the_file_is_read():
    from treetools.rules.presets import _spec

    good = {"preset": {"names": ["x:a:b"]}, "rules": {"drop": ["^opt"]},
            "options": {"half": {"default": False, "rules": {"scale": [["w$", 0.5]]}}}}
    spec = _spec("x.toml", good)
    assert spec.filled({}, {"half": True}).to_dict() == {"drop": ["^opt"], "scale": [["w$", 0.5]]}
    assert spec.filled({}, {}).to_dict() == {"drop": ["^opt"]}
    for bad, message in (({"half": {"rules": {}}}, "default \\(true or false\\)"),
                         ({"half": {"default": True, "when": 1}}, "option 'half' is a table"),
                         ({"half": {"default": True, "rules": {"scale": [["w$", "2*sqrt(2)"]]}}}, "factor '2\\*sqrt")):
        with pytest.raises(ValueError, match=message):
            _spec("x.toml", {**good, "options": bad})


@pytest.mark.parametrize("head_dim", [8, 12, 64, 128])
def test_the_query_scale_of_a_bfloat16_model_is_within_one_ulp_of_maxtexts_own_bfloat16_arithmetic(head_dim):
    """A bfloat16 checkpoint (Llama 3's): the preset divides by sqrt(head_dim) in float64 and rounds once; the
    script (llama_or_mistral_ckpt.py) computes `kernel / np.sqrt(head_dim).astype(bfloat16)` in ml_dtypes'
    bfloat16 (sqrt(128) is 11.3125 there). They agree exactly when sqrt(head_dim) is a power of 2, else within one
    bfloat16 step."""
    import ml_dtypes

    from treetools.checkpoint_io.mapping import RuledReader
    from treetools.checkpoint_io.readers import InMemoryReader

    bf16 = ml_dtypes.bfloat16
    config = {**CONFIG, "head_dim": head_dim}
    rng = np.random.default_rng(head_dim)
    arrays = {p: (rng.standard_normal(s) * 0.05).astype(bf16) for p, s, _ in _llama_leaves(D=head_dim)}
    plan = tt.preset("llama:hf:maxtext", config=config).plan(arrays)
    query = plan["decoder/layers/self_attention/query/kernel"]
    got = RuledReader(query, {p: InMemoryReader(a) for p, a in arrays.items()}).read()
    assert got.dtype == bf16
    unscaled = tt.preset("llama:hf:maxtext", config=config, scale_query=False).plan(arrays)
    layout = RuledReader(unscaled[query.path], {p: InMemoryReader(a) for p, a in arrays.items()}).read()
    script = layout / np.sqrt(head_dim).astype(bf16)  # the script's own expression, in bfloat16
    assert script.dtype == bf16
    steps = np.abs(got.view(np.int16).astype(np.int64) - script.view(np.int16).astype(np.int64))
    assert steps.max() <= (0 if head_dim == 64 else 1), steps.max()
