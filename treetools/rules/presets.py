"""Presets: ``tt.Rules`` for whole model families, shipped as data (``treetools/presets/*.toml``), not code.

A preset is named ``FAMILY:SOURCE:TARGET`` (``llama:hf:maxtext``). Its file
holds three tables (docs/presets.md):

* ``[preset]``: the names it serves, what it does, and ``infer``: sizes read
  off the source's own shapes (``head_dim = ['query[./]kernel$', -1]``: the
  last axis of the leaf that pattern matches).
* ``[expect]``: what every source leaf must be, ``pattern = [shape]``, or
  ``pattern = {shape = [...], optional = true}``; a dimension is a number, a
  size (``"{hidden}"``) or a product of sizes (``"{heads * head_dim}"``).
* ``[rules]``: the ``Rules`` fields (``Rules.from_dict``), where a value that is
  exactly ``"{size}"`` (or a product) is that size of the model, and a
  ``scale`` factor may hold one, ``"1/sqrt({head_dim})"``.
* ``[options.NAME]``: a switch, ``default`` true or false, whose ``rules``
  (filled the same way) come after ``[rules]`` when it is on; set with
  ``preset(name, NAME=False)`` or ``--preset FAMILY:SOURCE:TARGET,NAME=false``.

The sizes (``vocab``, ``hidden``, ``layers``, ``heads``, ``kv_heads``,
``head_dim``, ``ffn``, ``positions``) come from the model's Hugging Face
``config.json`` (``hf_sizes``: a path, the folder holding it, or its dict),
and where no config gives one, from the source leaves: the first leaf whose
expected dimension is that bare size sets it, and ``infer`` reads the others.

``preset(name, config=None)`` returns a ``Preset``, a ``Rules`` whose
``plan`` first checks the source leaves against ``[expect]`` (the first
leaf that does not fit is one ``RulesError`` naming it and what was
expected, before anything is read) and then plans the filled rules, so
every caller of ``Rules.plan`` (convert, restore, load) applies it as any
rules. Standard library only (``tomllib``); the package's ``presets`` folder
is read with ``importlib.resources``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.resources
import json
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from treetools.rules.spec import Rules
from treetools.shared.errors import RulesError, UsageError

if TYPE_CHECKING:
    from treetools.rules.plan import RulesPlan

SIZES = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "positions")
"""The sizes a preset's placeholders may name."""

_PLACEHOLDER = re.compile(r"^\{([a-z0-9_][a-z0-9_ *+\-/]*)\}$")
_IN_FACTOR = re.compile(r"^((?:1/)?sqrt\()\{([a-z0-9_][a-z0-9_ *+\-/]*)\}(\))$")
"""A placeholder inside a ``scale`` factor, ``'1/sqrt({head_dim})'``: filled as ``'1/sqrt(128)'``."""

# transformers' config-class defaults of the keys ``hf_sizes`` reads, where a family's differ from
# "as many kv heads as heads" and "head_dim = hidden / heads" (``save_pretrained`` leaves defaults out).
_HF_DEFAULTS: dict[str, dict[str, int]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
              "max_position_embeddings": 8192},
    "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
}


# ---------------------------------------------------------------------------------------------- sizes


def read_hf_config(config: Any) -> dict[str, Any]:
    """An HF ``config.json`` as a dict: the dict itself, the file, the folder holding it, or a transformers
    ``PretrainedConfig``.

    Raises:
      UsageError: the file is missing or is not a JSON object (the message names it).
    """
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict") and not isinstance(config, (str, os.PathLike)):
        return dict(config.to_dict())  # a transformers PretrainedConfig
    path = os.path.expanduser(os.fspath(config))
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read a Hugging Face config.json ({getattr(e, 'strerror', None) or e}); "
                         "pass the model folder, its config.json, or the dict.") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: holds a JSON {type(data).__name__}, not a Hugging Face config object.")
    return data


def hf_sizes(config: Any) -> dict[str, int]:
    """The sizes presets name, from an HF ``config.json`` (a path, its folder, or its dict).

    A key the file leaves out takes transformers' default for its ``model_type``.

    >>> hf_sizes({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_attention_heads": 8,
    ...           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96})["head_dim"]
    8
    """
    hf = read_hf_config(config)
    family = hf.get("model_type")
    defaults = _HF_DEFAULTS.get(str(family), {})

    def get(*keys: str) -> Any:
        for key in keys:
            if hf.get(key) is not None:
                return hf[key]
        return next((defaults[k] for k in keys if k in defaults), None)

    if family == "gpt2":
        hidden, heads = get("n_embd", "hidden_size"), get("n_head", "num_attention_heads")
        sizes = {"vocab": get("vocab_size"), "hidden": hidden, "layers": get("n_layer", "num_hidden_layers"),
                 "heads": heads, "kv_heads": heads, "ffn": get("n_inner") or (4 * hidden if hidden else None),
                 "positions": get("n_positions", "max_position_embeddings")}
    else:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        sizes = {"vocab": get("vocab_size"), "hidden": hidden, "layers": get("num_hidden_layers"), "heads": heads,
                 "kv_heads": get("num_key_value_heads") or heads, "ffn": get("intermediate_size"),
                 "positions": get("max_position_embeddings")}
    sizes["head_dim"] = get("head_dim") or (hidden // heads if hidden and heads else None)
    return {k: int(v) for k, v in sizes.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b}


@functools.cache
def _expression(text: str) -> ast.expr:
    node = ast.parse(text.strip(), mode="eval").body
    for sub in ast.walk(node):
        if not isinstance(sub, (ast.BinOp, ast.Name, ast.Constant, ast.Load, *_OPS)):
            raise ValueError(f"placeholder {{{text}}}: only sizes, numbers and + - * // are allowed.")
        if isinstance(sub, ast.Name) and sub.id not in SIZES:
            raise ValueError(f"placeholder {{{text}}}: unknown size {sub.id!r}; the sizes are {', '.join(SIZES)}.")
    return node


def evaluate(text: str, sizes: Mapping[str, int]) -> int | None:
    """A placeholder's value (``"heads * head_dim"``), or None while a size it names is not known.

    >>> evaluate("heads * head_dim", {"heads": 4, "head_dim": 16}), evaluate("vocab", {})
    (64, None)
    """

    def value(node: ast.expr) -> int | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return sizes.get(node.id)
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            return None if a is None or b is None else _OPS[type(node.op)](a, b)
        raise ValueError(f"placeholder {{{text}}}: not a size expression.")

    return value(_expression(text))


def _match(text: str) -> tuple[str, str, str] | None:
    """``(before, size expression, after)`` of a placeholder string: ``"{head_dim}"`` (nothing around it), or one
    inside a ``scale`` factor, ``"1/sqrt({head_dim})"``; None for any other string."""
    m = _PLACEHOLDER.match(text)
    if m:
        return "", m.group(1), ""
    m = _IN_FACTOR.match(text)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def placeholders(data: Any) -> set[str]:
    """The sizes the placeholders in ``data`` (nested lists and dicts) name."""
    if isinstance(data, str):
        m = _match(data)
        return {n.id for n in ast.walk(_expression(m[1])) if isinstance(n, ast.Name)} if m else set()
    if isinstance(data, Mapping):
        return set().union(*(placeholders(v) for v in data.values()))
    if isinstance(data, (list, tuple)):
        return set().union(*(placeholders(v) for v in data))
    return set()


def fill(data: Any, sizes: Mapping[str, int]) -> Any:
    """``data`` with every placeholder string (``"{head_dim}"``) replaced by its value, and a placeholder inside a
    ``scale`` factor by its digits (``"1/sqrt({head_dim})"`` -> ``"1/sqrt(8)"``).

    Raises:
      KeyError: a placeholder names a size ``sizes`` lacks.

    >>> fill({"permute": {"k$": {"axis": 1, "head_dim": "{head_dim}"}}, "scale": [["q$", "1/sqrt({head_dim})"]]},
    ...      {"head_dim": 8})
    {'permute': {'k$': {'axis': 1, 'head_dim': 8}}, 'scale': [['q$', '1/sqrt(8)']]}
    """
    if isinstance(data, str):
        m = _match(data)
        if not m:
            return data
        value = evaluate(m[1], sizes)
        if value is None:
            raise KeyError(m[1])
        return value if not (m[0] or m[2]) else f"{m[0]}{value}{m[2]}"
    if isinstance(data, Mapping):
        return {k: fill(v, sizes) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [fill(v, sizes) for v in data]
    return data


# ---------------------------------------------------------------------------------------------- the files


@dataclasses.dataclass(frozen=True)
class Expect:
    """One ``[expect]`` row: source leaves ``pattern`` matches have ``shape`` (numbers and placeholders)."""

    pattern: str
    shape: tuple[int | str, ...] | None  # None: any shape
    optional: bool = False

    def dims(self) -> str:
        if self.shape is None:
            return "(any)"
        return "(" + ", ".join(str(d) for d in self.shape) + ("," if len(self.shape) == 1 else "") + ")"


@dataclasses.dataclass(frozen=True)
class Option:
    """One ``[options.NAME]`` table: a switch, on or off by ``default``, that adds its ``rules`` after the preset's
    own (filled like them) when on."""

    name: str
    default: bool
    description: str
    rules: str  # JSON of its rules table, placeholders unfilled

    @property
    def rules_data(self) -> dict[str, Any]:
        return json.loads(self.rules)


@dataclasses.dataclass(frozen=True)
class PresetSpec:
    """A preset file as read: its names, text, size inference, expected leaves, rules with placeholders, and
    options."""

    names: tuple[str, ...]
    description: str
    file: str
    infer: tuple[tuple[str, str, int], ...]
    expect: tuple[Expect, ...]
    rules: str  # JSON of the rules table, placeholders unfilled (hashable)
    options: tuple[Option, ...] = ()

    @property
    def rules_data(self) -> dict[str, Any]:
        return json.loads(self.rules)

    @property
    def needs(self) -> set[str]:
        """The sizes the rules' placeholders name (the options' rules too)."""
        return placeholders(self.rules_data).union(*(placeholders(o.rules_data) for o in self.options))

    def filled(self, sizes: Mapping[str, int], options: Mapping[str, bool]) -> Rules:
        """The rules with ``sizes`` filled in: ``[rules]``, then the rules of each option that is on."""
        out = Rules.from_dict(fill(self.rules_data, sizes))
        for option in self.options:
            if options.get(option.name, option.default):
                out = out.merge(Rules.from_dict(fill(option.rules_data, sizes)))
        return out


def _folder() -> Any:
    return importlib.resources.files("treetools").joinpath("presets")


def _options(name: str, data: Mapping[str, Any]) -> tuple[Option, ...]:
    out = []
    for key, table in dict(data.get("options", {})).items():
        if not isinstance(table, Mapping) or not isinstance(table.get("default"), bool) or \
                sorted(set(table) - {"default", "description", "rules"}) or not re.fullmatch(r"[a-z][a-z0-9_]*", key):
            raise ValueError(f"preset file {name}: option {key!r} is a table of default (true or false), "
                             "description and rules, named in lower case.")
        out.append(Option(key, table["default"], str(table.get("description", "")),
                          json.dumps(dict(table.get("rules", {})))))
    return tuple(out)


def _spec(name: str, data: Mapping[str, Any]) -> PresetSpec:
    head = dict(data.get("preset", {}))
    unknown = (sorted(set(data) - {"preset", "expect", "rules", "options"})
               + sorted(set(head) - {"names", "description", "infer"}))
    if unknown:
        raise ValueError(f"preset file {name}: unknown keys {unknown}.")
    expect = []
    for pattern, value in dict(data.get("expect", {})).items():
        row = value if isinstance(value, Mapping) else {"shape": value}
        re.compile(pattern)
        shape = tuple(row["shape"]) if row.get("shape") is not None else None
        for dim in shape or ():
            if not isinstance(dim, int) and not (isinstance(dim, str) and _PLACEHOLDER.match(dim)):
                raise ValueError(f"preset file {name}: expected shape of {pattern!r}: {dim!r} is neither a number "
                                 "nor a placeholder such as '{hidden}'.")
            placeholders(dim)  # an unknown size or operator is an error now
        expect.append(Expect(pattern, shape, bool(row.get("optional", False))))
    infer = tuple((size, str(p), int(axis)) for size, (p, axis) in dict(head.get("infer", {})).items())
    rules = dict(data.get("rules", {}))
    spec = PresetSpec(tuple(head.get("names", ())), str(head.get("description", "")), name, infer, tuple(expect),
                      json.dumps(rules), _options(name, data))
    try:  # keys, patterns and values checked now, with stand-in sizes (2: a head_dim must be even), options all on
        spec.filled(dict.fromkeys(SIZES, 2), {o.name: True for o in spec.options})
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"preset file {name}: {e}") from None
    return spec


@functools.lru_cache(maxsize=1)
def _catalog() -> dict[str, PresetSpec]:
    import tomllib

    out: dict[str, PresetSpec] = {}
    for entry in sorted(_folder().iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        spec = _spec(entry.name, tomllib.loads(entry.read_text(encoding="utf-8")))
        for name in spec.names:
            if name in out:
                raise ValueError(f"preset {name} is in both {out[name].file} and {entry.name}.")
            out[name] = spec
    return out


def presets() -> list[str]:
    """The names of the presets shipped with treetools, ``FAMILY:SOURCE:TARGET``, sorted.

    >>> "llama:hf:maxtext" in presets()
    True
    """
    return sorted(_catalog())


def split_name(text: str) -> tuple[str, dict[str, bool]]:
    """A preset as ``--preset`` names it, ``FAMILY:SOURCE:TARGET[,OPTION=true|false ...]``: its name and options.

    Raises:
      UsageError: an option not written ``OPTION=true`` or ``OPTION=false``.

    >>> split_name("llama:hf:maxtext,scale_query=false")
    ('llama:hf:maxtext', {'scale_query': False})
    """
    name, *given = str(text).split(",")
    options: dict[str, bool] = {}
    for item in given:
        key, eq, value = item.strip().partition("=")
        if not eq or value.strip().lower() not in ("true", "false") or key.strip() in options:
            raise UsageError(f"--preset {text}: {item!r} is not OPTION=true or OPTION=false (once each); write "
                             "FAMILY:SOURCE:TARGET,OPTION=false, e.g. llama:hf:maxtext,scale_query=false.")
        options[key.strip()] = value.strip().lower() == "true"
    return name.strip(), options


def preset_spec(name: str) -> PresetSpec:
    """The file behind preset ``name`` (options after it, ``,scale_query=false``, are left out).

    Raises:
      UsageError: an unknown name (the message lists the presets).
    """
    name = split_name(name)[0]
    catalog = _catalog()
    if name not in catalog:
        raise UsageError(f"--preset {name}: no such preset; the presets are {', '.join(sorted(catalog))} "
                         "(FAMILY:SOURCE:TARGET).")
    return catalog[name]


def preset(name: str, config: Any = None, **options: bool) -> Preset:
    """The ``tt.Rules`` of preset ``name`` (``tt.presets()`` lists them), for the model ``config`` describes.

    Args:
      name: ``FAMILY:SOURCE:TARGET``, e.g. ``"llama:hf:reference"``; options may follow as ``--preset`` writes
        them, ``"llama:hf:maxtext,scale_query=false"``.
      config: the model's Hugging Face ``config.json``: its path, the folder holding it, its dict, or a
        transformers ``PretrainedConfig``. It gives
        the sizes the preset's placeholders name (and checks the checkpoint's shapes against them); without
        it, sizes are read off the checkpoint's own shapes where they can be.
      **options: the preset's options (its file's ``[options.NAME]`` tables, docs/presets.md), True or False:
        ``scale_query=False`` for the ``maxtext`` presets' layout-only conversion.

    Raises:
      UsageError: an unknown name (the message lists the presets), an option the preset does not have (the
        message lists its options) or not True/False, or a config that cannot be read.
    """
    name, given = split_name(name)
    spec = preset_spec(name)
    given.update(options)
    known = {o.name: o.default for o in spec.options}
    for key, value in given.items():
        if key not in known:
            have = ", ".join(f"{k} (default {str(v).lower()})" for k, v in known.items()) or "none"
            raise UsageError(f"preset {name} has no option {key!r}; its options: {have} (docs/presets.md).")
        if not isinstance(value, bool):
            raise UsageError(f"preset {name}: option {key}={value!r}: give True or False.")
    sizes = hf_sizes(config) if config is not None else {}
    return Preset.build(name, spec, sizes, {**known, **given})


# ---------------------------------------------------------------------------------------------- Preset


@dataclasses.dataclass(frozen=True, repr=False, kw_only=True)
class Preset(Rules):
    """A ``Rules`` read from a preset file: ``plan`` checks the source leaves against the preset's expected
    leaves, fills the sizes the config did not give from their shapes, then plans the filled rules.

    The ``Rules`` fields hold the filled rules when the config gave every size they need, else they are
    empty until ``plan`` (``filled(leaves)`` gives them for a set of leaves).
    """

    preset: str = ""
    spec: PresetSpec | None = dataclasses.field(default=None, compare=False)
    sizes: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, bool], ...] = ()
    """Every option of the preset, on or off."""

    @classmethod
    def build(cls, name: str, spec: PresetSpec, sizes: Mapping[str, int], options: Mapping[str, bool]) -> Preset:
        known = dict(sizes)
        fields = Rules.to_dict(spec.filled(known, options)) if spec.needs <= set(known) else {}
        return cls(preset=name, spec=spec, sizes=tuple(sorted(known.items())), options=tuple(sorted(options.items())),
                   **fields)

    def __repr__(self) -> str:
        options = f", options={dict(self.options)}" if self.options else ""
        return f"Preset({self.preset!r}, sizes={dict(self.sizes)}{options})"

    @property
    def empty(self) -> bool:
        return False

    def merge(self, later: Rules) -> Preset:
        """The preset's rules (filled now: every size it needs must be known) followed by ``later``'s."""
        if self.spec is not None and not self.spec.needs <= {k for k, _ in self.sizes}:
            missing = sorted(self.spec.needs - {k for k, _ in self.sizes})
            raise UsageError(f"preset {self.preset}: other rules are merged after it only once its sizes are known "
                             f"({', '.join(missing)}): pass its config (--config).")
        return dataclasses.replace(self, **{k: v for k, v in Rules.merge(self, later).__dict__.items()
                                            if not k.startswith("_")})

    def check(self, leaves: Sequence[tuple[str, Any, Any]]) -> dict[str, int]:
        """The sizes, once every source leaf fits the preset's expected leaves.

        Raises:
          RulesError: one problem: the first leaf no expected row matches, or whose shape is not the expected
            one, or the first expected leaf missing, or a size the rules need that nothing gives.
        """
        assert self.spec is not None
        sizes = dict(self.sizes)
        seen: set[int] = set()
        for path, shape, _ in leaves:
            row = next((i for i, e in enumerate(self.spec.expect) if re.search(e.pattern, path)), None)
            if row is None:
                raise RulesError([self._unknown(path)])
            seen.add(row)
            if shape is not None and self.spec.expect[row].shape is not None:
                self._fit(path, tuple(shape), self.spec.expect[row], sizes)
        missing = [e for i, e in enumerate(self.spec.expect) if i not in seen and not e.optional]
        if missing:
            raise RulesError([(f"preset {self.preset}: the checkpoint has no leaf matching `{missing[0].pattern}` "
                               f"(expected shape {missing[0].dims()}); it is not a {self._what()} checkpoint.")])
        self._infer(leaves, sizes)
        lacking = sorted(self.spec.needs - set(sizes))
        if lacking:
            raise RulesError([(f"preset {self.preset} needs the model's {', '.join(lacking)}, which the "
                               "checkpoint's shapes do not give: pass its Hugging Face config.json "
                               "(tt.preset(name, config=...), --config FILE).")])
        return sizes

    def _what(self) -> str:
        family, source, _ = (self.preset.split(":") + ["", "", ""])[:3]
        return f"{family} ({source} layout)"

    def _unknown(self, path: str) -> str:
        assert self.spec is not None
        some = ", ".join(f"`{e.pattern}`" for e in self.spec.expect[:4])
        return (f"`{path}`: no leaf of a {self._what()} checkpoint is named so (preset {self.preset} expects "
                f"{len(self.spec.expect)} kinds of leaves: {some}, ...; docs/presets.md lists them); pick the preset "
                "of this checkpoint's family and layout.")

    def _fit(self, path: str, shape: tuple[int, ...], row: Expect, sizes: dict[str, int]) -> None:
        want = [d if isinstance(d, int) else _PLACEHOLDER.fullmatch(str(d)) for d in row.shape or ()]
        if len(want) != len(shape):
            raise RulesError([self._mismatch(path, shape, row, sizes)])
        for dim, w in zip(shape, want):
            if isinstance(w, int):
                ok = dim == w
            else:
                assert w is not None  # the file's shapes were checked when it was read
                name = w.group(1).strip()
                if name in SIZES and name not in sizes:
                    sizes[name] = dim  # the first leaf that shows a size sets it
                value = evaluate(name, sizes)
                ok = value is None or value == dim
            if not ok:
                raise RulesError([self._mismatch(path, shape, row, sizes)])

    def _mismatch(self, path: str, shape: tuple[int, ...], row: Expect, sizes: Mapping[str, int]) -> str:
        def show(d: Any) -> str:
            m = _PLACEHOLDER.match(d) if isinstance(d, str) else None
            value = evaluate(m.group(1), sizes) if m else d
            return f"{m.group(1).strip()}={value}" if m and value is not None else str(d)

        given = ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
        dims = ", ".join(show(d) for d in row.shape or ())
        return (f"`{path}`: shape {tuple(shape)}, but a {self._what()} checkpoint has ({dims}) "
                f"there (preset {self.preset}; sizes {given or 'none known'}); is it another family, or another "
                "model's config?")

    def _infer(self, leaves: Sequence[tuple[str, Any, Any]], sizes: dict[str, int]) -> None:
        assert self.spec is not None
        for size, pattern, axis in self.spec.infer:
            if size in sizes:
                continue
            shape = next((s for p, s, _ in leaves if s is not None and re.search(pattern, p)), None)
            if shape is not None and -len(shape) <= axis < len(shape):
                sizes[size] = int(shape[axis])

    def filled(self, leaves: Sequence[tuple[str, Any, Any]]) -> Rules:
        """The plain ``Rules`` for these source leaves (checked against the preset, sizes filled)."""
        assert self.spec is not None
        sizes = self.check(leaves)
        if Rules.to_dict(self):
            return Rules.from_dict(Rules.to_dict(self))
        return self.spec.filled(sizes, dict(self.options))

    def plan(
        self,
        leaves: Mapping[str, Any] | Iterable[str | tuple[str, Sequence[int] | None, Any]],
        *,
        num_layers: int | None = None,
        targets: Collection[str] | None = None,
    ) -> RulesPlan:
        triples = _triples(leaves)
        return self.filled(triples).plan(triples, num_layers=num_layers, targets=targets)


def _triples(leaves: Any) -> list[tuple[str, Any, Any]]:
    """``Rules.plan``'s leaves as ``(path, shape, dtype)``."""
    if isinstance(leaves, Mapping):
        return [(str(p), getattr(v, "shape", None), getattr(v, "dtype", None)) for p, v in leaves.items()]
    out = []
    for leaf in leaves:
        if isinstance(leaf, str):
            out.append((leaf, None, None))
        else:
            path, shape, *rest = leaf
            out.append((path, shape, rest[0] if rest else None))
    return out
