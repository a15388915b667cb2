"""The one home of item-name knowledge: which item holds the parameters, in which order items are shown, whose
counts are parameters, and where a train state keeps its parts.

Every command and the library ask this module (``choose_params_item``,
``params_from``, ``order_items``, ``counts_params``...), so none has its own
idea of where the params are. Pure functions over item names and items: a
``Source`` (``treetools.checkpoint_io.source``, the layer above) reads the
items and hands them down (``Source.params_item``, ``Source.find_params``);
nothing here calls back up into it. No jax.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from treetools.checkpoint_io.leaves import Item, Leaf, tree_leaves  # noqa: F401  (tree_leaves: the examples use it)
from treetools.shared.errors import CheckpointNotFoundError


ITEM_ORDER = ("params", "params_ema", "ema_params", "target", "model", "opt_state", "state")
"""Items shown first, in this order (params, EMA params, optimizer state); the rest follow as stored."""

MODEL_ITEMS = ("target", "model")
"""Items that hold the model's parameters where no ``params`` item is: T5X's ``target``, Levanter's and EasyDeL's ``model``."""

PARAM_ITEMS = ("params", "params_ema", "ema_params", "target", "model", "default")
"""Items whose element counts are parameters; other items (optimizer moments, state) count "elements"."""

STATE_ITEMS = ("state", "default", "train_state")
"""Items that hold a whole train state (Orbax's legacy and v1 training APIs, a single-item manager)."""

MODEL_FILES = ("config.json", "generation_config.json")
"""A Hugging Face model's files kept beside its weights: what ``convert --preset`` carries over (into an Orbax
save too, where the way back finds it: docs/presets.md), and what no check of a save counts as a stranger."""

PARAM_SUBTREES = {False: ("params", "target"), True: ("params_ema", "ema_params", "ema")}
"""Where real layouts keep the parameters inside one item holding a whole train state (T5X: ``target``)."""


def order_items(names: Sequence[str]) -> list[str]:
    """Params first, then EMA params, then optimizer state, then the rest in stored order.

    >>> order_items(["data_iter", "opt_state", "params_ema", "params"])
    ['params', 'params_ema', 'opt_state', 'data_iter']
    """
    first = [n for n in ITEM_ORDER if n in names]
    return first + [n for n in names if n not in first]


def non_param_leaves(leaves: Sequence["Leaf"]) -> dict[tuple[str, ...], str]:
    """The leaves of a parameter item that are no parameters, by path: what they are.

    A whole nnx ``State`` saved as one item holds more than ``nnx.Param``s:
    the RNG streams of ``nnx.Rngs`` (``rngs/<stream>/count`` and ``key``, or
    any leaf of a PRNG key dtype) and BatchNorm's running statistics (``mean``
    and ``var`` beside the module's ``scale`` or ``bias``; linen keeps them in
    ``batch_stats``, apart). The checkpoint does not store the variable types:
    these are told by their names, as flax writes them.

    >>> import numpy as np
    >>> tree = {"bn": {"scale": np.ones(2), "bias": np.ones(2), "mean": np.ones(2), "var": np.ones(2)},
    ...         "drop": {"rngs": {"count": np.uint32(0), "key": np.zeros(2, np.uint32)}}, "mean": np.ones(2)}
    >>> sorted(non_param_leaves(tree_leaves(tree, where="x")).items())
    [(('bn', 'mean'), 'batch statistics'), (('bn', 'var'), 'batch statistics'), (('drop', 'rngs', 'count'), 'RNG state'), (('drop', 'rngs', 'key'), 'RNG state')]
    """
    names = {leaf.path for leaf in leaves}
    out: dict[tuple[str, ...], str] = dict.fromkeys(keras_optimizer_paths(leaves), "optimizer state")
    for leaf in leaves:
        path = leaf.path
        if not path:
            continue
        dtype = str(leaf.row.dtype or "")
        if ("rngs" in path[:-1] and path[-1] in ("count", "key")) or dtype.startswith("key<"):
            out[path] = "RNG state"
        elif path[-1] in ("mean", "var") and len(path) > 1 and (
                (*path[:-1], "scale") in names or (*path[:-1], "bias") in names):
            out[path] = "batch statistics"
    return out


KERAS_OPTIMIZER = "optimizer"
"""Where Keras 3 saves a compiled model's optimizer variables (``optimizer/vars/N``, saving_lib's attribute path)."""


def keras_optimizer_paths(leaves: Sequence["Leaf"]) -> list[tuple[str, ...]]:
    """The paths of a Keras file's optimizer variables; none when the leaves are not laid out as Keras saves.

    Keras 3 (``model.save``, ``save_weights``) writes every variable as ``<attribute path>/vars/<i>``: the
    model's under its layers (``layers/dense``, a subclassed model's attribute names, its own ``vars``), the
    optimizer's under ``optimizer``. The model's parameters (``model.count_params()``, ``model.weights``) are
    every variable but the optimizer's.

    >>> import numpy as np
    >>> tree = {"layers": {"dense": {"vars": {"0": np.ones(2)}}}, "optimizer": {"vars": {"0": np.int64(3)}}}
    >>> keras_optimizer_paths(tree_leaves(tree, where="x"))
    [('optimizer', 'vars', '0')]
    """
    paths = [leaf.path for leaf in leaves]
    if not paths or not all(len(p) >= 2 and p[-2] == "vars" and p[-1].isdigit() for p in paths):
        return []
    return [p for p in paths if len(p) > 2 and p[0] == KERAS_OPTIMIZER]


def keras_model(item: Item) -> Item | None:
    """A Keras file's model variables (every leaf but the optimizer's, paths as stored); None when ``item`` is not
    a Keras file holding an optimizer's variables (``keras_optimizer_paths``)."""
    if any(leaf.row.sep != "/" for leaf in item.leaves):
        return None
    optimizer = set(keras_optimizer_paths(item.leaves))
    model = [leaf for leaf in item.leaves if leaf.path not in optimizer]
    return dataclasses.replace(item, leaves=model) if optimizer and model else None


def counts_params(item: str) -> bool:
    """Whether an item's element count is its parameter count (else its table says "elements").

    >>> counts_params("params"), counts_params("opt_state")
    (True, False)
    """
    return item in PARAM_ITEMS



def part_holder(present: Sequence[str], name: str) -> str | None:
    """The item that may hold ``name`` as a top-level key: the one item holding a whole train state (Orbax's
    ``default``/``state``/``train_state``), or the lone item of the step; None when there is no single one.

    >>> part_holder(["default"], "params"), part_holder(["params", "opt_state"], "mu")
    ('default', None)
    """
    holders = [n for n in present if n in STATE_ITEMS] or (list(present) if len(present) == 1 else [])
    return holders[0] if len(holders) == 1 and name not in present else None


def item_argument(present: Sequence[str], item: str) -> tuple[str, str | None]:
    """``--item`` as ``(item to read, path prefix inside it or None)``: any path a command prints works.

    An item name, a top-level key of an item holding a whole train state
    (``params`` of Orbax's ``default``), or ``item/path`` (a group or leaf of an item).
    An unknown name comes back as it is: the snapshot says what is missing, listing the items.

    >>> item_argument(["params", "opt_state"], "params/Dense_0"), item_argument(["default"], "params")
    (('params', 'Dense_0'), ('params', None))
    """
    if item in present or ("/" not in item and part_holder(present, item) is not None):
        return item, None
    head, _, rest = item.partition("/")
    if rest and (head in present or part_holder(present, head) is not None):
        return head, rest
    return item, None


def top_level_keys(item: Item) -> list[str]:
    """The first path parts of an item's leaves, in stored order."""
    return list(dict.fromkeys(leaf.path[0] for leaf in item.leaves if leaf.path))


def part_of(item: Item, key: str) -> Item | None:
    """The leaves below top-level key ``key`` of ``item`` as an item named ``key`` (paths below it); None if none.

    >>> import numpy as np
    >>> state = Item("default", "pytree", tree_leaves({"params": {"w": np.ones(2)}, "step": 3}, where="x"))
    >>> [leaf.name for leaf in part_of(state, "params").leaves], part_of(state, "opt") is None
    (['w'], True)
    """
    if any(leaf.row.sep != "/" for leaf in item.leaves):  # flat stored names (safetensors): no parts
        return None
    below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[1:]))
             for leaf in item.leaves if len(leaf.path) > 1 and leaf.path[0] == key]
    return dataclasses.replace(item, name=key, leaves=below) if below else None


def train_state_parts(name: str, item: Item, present: Sequence[str]) -> list[str] | None:
    """The top-level keys of an item that holds a whole train state (``params`` or T5X's ``target`` beside
    other keys: ``opt_state``, ``step``...), else None. Shown part by part, each counted for what it is.

    >>> import numpy as np
    >>> tree = {"step": 3, "opt_state": {"mu": {"w": np.ones(2)}}, "params": {"w": np.ones(2)}}
    >>> train_state_parts("default", Item("default", "pytree", tree_leaves(tree, where="x")), ["default"])
    ['params', 'opt_state', 'step']
    """
    if part_holder(present, "\0") != name or item.kind != "pytree":
        return None
    keys = top_level_keys(item)
    if len(keys) < 2 or not set(keys) & set(PARAM_SUBTREES[False]):
        return None
    if any(leaf.row.sep != "/" for leaf in item.leaves):
        return None
    return order_items(keys)


def choose_params_item(names: Sequence[str], *, default: str | None = None, use_ema: bool = False,
                       where: str = "the checkpoint") -> str:
    """The item of a step (``names``) that holds the parameters.

    ``params`` (``params_ema`` with ``use_ema``); else the format's own choice
    (``default``: ``Source.default_item``); else T5X's ``target``, Levanter's and
    EasyDeL's ``model``; else the one item of a single-item step; else the one
    item holding a whole train state beside others (a ``best_fn`` manager's
    ``metrics`` item). ``Source.params_item`` asks it with the step's items.

    Raises:
      CheckpointNotFoundError: none of these (the message, starting with ``where``, lists the items).

    >>> choose_params_item(["opt_state", "params"]), choose_params_item(["target", "state"])
    ('params', 'target')
    """
    wanted = "params_ema" if use_ema else "params"
    if wanted in names:
        return wanted
    if default is not None and default in names:
        return default
    model = [n for n in MODEL_ITEMS if n in names]  # T5X: `target`; Levanter, EasyDeL: `model`
    if not use_ema and model:
        return model[0]
    if len(names) == 1:  # a single-tree file, or a standalone Orbax save (item `default`)
        return names[0]
    whole = [n for n in names if n in STATE_ITEMS]
    if len(whole) == 1:
        return whole[0]
    raise CheckpointNotFoundError(
        f"{where} has no item {wanted!r}; items present: {', '.join(names) or 'none'}; pass item=NAME."
    )


def params_from(found: Item, *, chosen_by_format: bool = False, use_ema: bool = False,
                where: str = "the checkpoint") -> tuple[Item, str | None]:
    """The parameters in the item ``choose_params_item`` picked (``found``, read), and a note saying which path
    they were taken from (None when the item is the parameters): the item itself, its Keras model variables, or
    its ``params_path``. ``chosen_by_format``: the format's own ``default_item`` picked it among several items
    (the note says so). ``Source.find_params`` reads the item and asks this.

    Raises:
      CheckpointNotFoundError: the item holds a train state whose parameters are none of the known places (the
        message lists the candidates with their sizes: pass item=).

    >>> import numpy as np
    >>> state = Item("default", "pytree", tree_leaves({"params": {"w": np.ones(2)}, "step": 3}, where="x"))
    >>> found, note = params_from(state, where="ckpt")
    >>> [leaf.name for leaf in found.leaves], note.split(";")[0]
    (['w'], 'ckpt: parameters taken from `params` of item `default`')
    """
    name = found.name
    if chosen_by_format:
        below, path = params_path(found, use_ema=use_ema)
        at = f"`{'/'.join(path)}` of " if path is not None else ""
        return below, (f"{where}: parameters taken from {at}item `{name}`, as its format reads them; item= (--item) "
                       "chooses another item.")
    if name in ("params", "params_ema", "model"):
        return found, None
    model = None if use_ema else keras_model(found)
    if model is not None:
        return model, (f"{where}: parameters taken from item `{name}` without `{KERAS_OPTIMIZER}/` (the Keras "
                       "optimizer's variables), as keras' count_params counts them; item= (--item) chooses another "
                       "item or path.")
    below, path = params_path(found, use_ema=use_ema)
    if path is None:
        return found, None
    return below, (f"{where}: parameters taken from `{'/'.join(path)}` of item `{name}`; item= (--item) chooses "
                   "another item, top-level key or path.")


def leaves_below(item: Item, under: str) -> Item | None:
    """The leaves of ``item`` below the path ``under`` (``a/b``), named from there; None when none is.

    >>> import numpy as np
    >>> item = Item("params", "pytree", tree_leaves({"dense": {"w": np.ones(2)}, "b": np.ones(1)}, where="x"))
    >>> [leaf.name for leaf in leaves_below(item, "dense").leaves], leaves_below(item, "conv")
    (['w'], None)
    """
    parts = tuple(under.split("/"))
    n = len(parts)
    below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[n:]))
             for leaf in item.leaves if len(leaf.path) > n and leaf.path[:n] == parts]
    return dataclasses.replace(item, leaves=below) if below else None


def params_within(found: Item, *, use_ema: bool = False) -> Item:
    """The parameters in the item ``choose_params_item`` picked: the item itself when it is a params (or model) item,
    else its ``params_subtree`` (an item holding a whole train state)."""
    if found.name in ("params", "params_ema", "model"):
        return found
    model = None if use_ema else keras_model(found)
    return model if model is not None else params_subtree(found, use_ema=use_ema)


def params_subtree(item: Item, *, use_ema: bool = False) -> Item:
    """The parameters inside an item holding a whole train state (see ``params_path``); the item itself when
    they are not found below it.

    Leaves keep their ``key`` (the format's own name), so a format's hooks
    still find them; their paths lose the subtree's name.

    Raises:
      CheckpointNotFoundError: ``use_ema`` and the item holds no EMA parameters; or the item is a train state
        whose parameters are in none of the known places (the candidates are listed with their sizes).

    >>> import numpy as np
    >>> state = tree_leaves({"params": {"w": np.ones(2)}, "step": 3}, where="x")
    >>> [leaf.name for leaf in params_subtree(Item("default", "pytree", state)).leaves]
    ['w']
    """
    return params_path(item, use_ema=use_ema)[0]


PARAM_PATHS = {
    False: (("params", "params"), ("params",), ("target",), ("model", "params"), ("state", "params"), ("train_state", "params"),
            ("mdl_vars",), ("0", "params"), ("0",), ("model",)),
    True: (("params_ema",), ("ema_params",), ("ema",), ("model", "params_ema"), ("state", "params_ema"),
           ("state", "ema_params")),
}
"""Where trainers keep the parameters inside one item holding a whole train state, in the order they are looked
for: ``params/params`` (a Flax ``TrainState`` whose params are the variables dict, EasyLM's train state; where
that dict holds other collections beside ``params``, as MaxText's AQT-quantized ``{"params", "aqt"}`` does, the
whole dict: values and scales as stored),
``params`` (Flax ``TrainState``, big_vision), T5X's ``target``, the Flax guide's ``{"model": {"params"}}``,
a state under ``state``, praxis's ``mdl_vars`` (a paxml ``TrainState(step, mdl_vars, opt_states)``: the variables
its model applies), the first element of a tuple (vit_jax's ``(params, opt_state, step)``: key ``0``),
Levanter's ``model``."""

STATE_KEYS = frozenset(("opt_state", "opt_states", "opt", "optimizer", "tx", "step", "rng", "rngs", "training_key",
                        "config", "data", "metrics", "epoch", "model_averaging"))
"""Top-level keys of a train state's parts other than the parameters."""

STATE_MARKERS = frozenset(("opt_state", "opt_states", "opt", "tx", "step", "training_key", "rng", "rngs", "epoch"))
"""Top-level keys that say an item holds a whole train state (not a model file that also keeps its optimizer's
variables, as Keras's ``optimizer/vars``): there, the parameters must be found, or the candidates listed."""


def _size(leaves: Sequence[Leaf]) -> str:
    count = sum(leaf.row.params for leaf in leaves)
    nbytes = sum(leaf.row.bytes for leaf in leaves)
    return f"{count:,} elements, {nbytes:,} bytes"


def params_path(item: Item, *, use_ema: bool = False) -> tuple[Item, tuple[str, ...] | None]:
    """The parameters inside ``item`` and the path they were found at (``PARAM_PATHS``), or ``(item, None)``
    when the item is the parameters itself.

    >>> import numpy as np
    >>> tree = {"model": {"params": {"w": np.ones(2)}}, "config": {"lr": 0.1}}
    >>> found, path = params_path(Item("default", "pytree", tree_leaves(tree, where="x")))
    >>> path, [leaf.name for leaf in found.leaves]
    (('model', 'params'), ['w'])
    """
    if item.positional or any(leaf.row.sep != "/" for leaf in item.leaves):  # leaves by index, flat stored names
        return item, None
    tops = list(dict.fromkeys(leaf.path[0] for leaf in item.leaves if leaf.path))
    for path in PARAM_PATHS[use_ema]:
        if path == ("0",) and not (tops and all(t.isdigit() for t in tops)):
            continue  # a tuple's first element only where the item is a tuple
        if path == ("model",) and not set(tops) & STATE_KEYS:
            continue  # `model` beside state keys (Levanter's export), not a module named `model`
        if path == ("params", "params") and any(leaf.path[:1] == ("params",) and len(leaf.path) > 2
                                                and leaf.path[1] != "params" for leaf in item.leaves):
            continue  # a variables dict of several collections (MaxText's quantized `params` and `aqt`): whole
        n = len(path)
        below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[n:]))
                 for leaf in item.leaves if len(leaf.path) > n and leaf.path[:n] == path]
        if below:
            return dataclasses.replace(item, leaves=below), path
    if use_ema:
        raise CheckpointNotFoundError(
            f"item `{item.name}` holds no EMA parameters (looked for {', '.join('/'.join(p) for p in PARAM_PATHS[True])}); "
            f"its top-level keys: {', '.join(tops)}."
        )
    markers = set(tops) & STATE_MARKERS
    others = [t for t in tops if t not in STATE_KEYS]
    if markers and len(others) == 1:  # one subtree beside the state's bookkeeping: the parameters
        n = 1
        below = [dataclasses.replace(leaf, row=dataclasses.replace(leaf.row, path=leaf.path[n:]))
                 for leaf in item.leaves if len(leaf.path) > n and leaf.path[0] == others[0]]
        if below:
            return dataclasses.replace(item, leaves=below), (others[0],)
    if markers and len(tops) > 1:
        candidates = "; ".join(f"`{item.name}/{t}` ({_size([leaf for leaf in item.leaves if leaf.path[:1] == (t,)])})"
                               for t in tops[:12])
        raise CheckpointNotFoundError(
            f"item `{item.name}` holds a train state whose parameters are in none of the known places "
            f"({', '.join('/'.join(p) for p in PARAM_PATHS[False])}); candidates: {candidates}; "
            f"pass item=\"{item.name}/<key>\" (--item) to choose."
        )
    return item, None
