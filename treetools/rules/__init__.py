"""The rules engine (no jax): map a checkpoint's leaves onto the leaves a user wants, from metadata alone.

A ``Rules`` is data (a frozen dataclass, JSON or TOML in a file, or CLI
flags): rename, drop/keep, cast, transpose, unstack and stack, and the layout
rules split, concat, reshape, permute (rotary), slice, pad, tie and scale, each written
as Python regexes matched with ``re.search`` on the one path string
(``params/layers/3/attn/q``; a flat-key name such as
``model.layers.0.self_attn.q_proj.weight`` is matched as the string it is).
Restore, load, convert, diff and ``inspect --unstack`` all apply rules
through this one engine, in two steps:

1. ``Rules.plan(leaves)`` reads metadata only, ``(path, shape, dtype)`` per
   source leaf, and returns a ``RulesPlan``: one ``TargetLeaf`` per leaf the
   user gets (its path, shape, dtype and how it is made from the sources),
   or raises one ``RulesError`` listing every problem before any data is read.
2. The checkpoint layer's ``treetools.checkpoint_io.mapping.RuledReader`` reads any
   block of a target leaf by reading only the matching block of its source(s).

Modules: ``spec`` (``Rules``, its one field table, files and CLI strings),
``ops`` (the layout rules' values), ``plan`` (the plan types and the planner),
``stages`` (the planner's layout stages), ``blocks`` (how a target leaf is made
from its sources, read block by block), ``dtypes`` (dtype names and kinds).

Order of operations (each rule's patterns see the paths of its own stage)::

    keep / drop  ->  unstack  ->  rename  ->  stack  ->  transpose  ->  cast
    `-------- source paths ---------'  `- per-layer -'   `---- target paths ----'

with the layout rules between them (docs/rules.md, "Order of operations")::

    unstack -> split -> rename -> stack -> concat -> reshape -> permute -> transpose -> slice -> pad -> tie -> scale
            -> cast

* ``keep`` / ``drop``: matched against the checkpoint's own paths. A leaf is
  used when it matches some ``keep`` pattern (or there are none) and no
  ``drop`` pattern. Dropped leaves are listed in ``RulesPlan.dropped``.
* ``unstack``: matched against the checkpoint's paths (a stacked, scanned
  leaf only exists there). A leaf of shape ``(L, ...)`` becomes ``L`` leaves
  of shape ``(...)``; the layer index is a new path component inserted right
  after the component in which the pattern's (first) match ends:

  ==========================  ==================  ===========================
  path                        pattern             layer 3
  ==========================  ==================  ===========================
  ``params/layers/attn/q``    ``layers``          ``params/layers/3/attn/q``
  ``params/layers/attn/q``    ``params/lay``      ``params/layers/3/attn/q``  (match ends mid-component)
  ``params/layers/attn/q``    ``layers/``         ``params/layers/3/attn/q``  (a trailing ``/`` belongs to ``layers``)
  ``params/layers/attn/q``    ``^params/.*/q$``   ``params/layers/attn/q/3``  (the whole path: the index goes last)
  ``params/layers/attn/q``    ``(?=attn)``        ``params/layers/3/attn/q``  (an empty match ends after ``layers/``)
  ``model.layers.q.weight``   ``model\\.layers``   ``model.layers.3.q.weight`` (a flat name: components split on ``.``)
  ==========================  ==================  ===========================

  A path with a ``/`` splits on ``/``; a path without one splits on ``.``.
* ``rename``: ``re.sub(pattern, replacement, path)`` on the paths after
  unstack, so per-layer names are renamed one layer at a time
  (``(r"^params/layers/(\\d+)/attn/q$", r"model.layers.\\1.self_attn.q_proj.weight")``).
  For each path the first rule whose pattern matches wins (T5X's
  ``assignment_map``); every match of that pattern in the path is replaced,
  as ``re.sub`` does. Two leaves renamed onto one path is an error naming both.
* ``stack``: the inverse of unstack, matched against the paths after rename.
  The component right after the match must be a layer index; it is removed,
  and the leaves that then share a path are stacked along a new axis 0 in
  index order: ``layers/0/q``, ``layers/1/q`` -> ``layers/q`` of shape
  ``(2, ...)``. The indices must be ``0 .. L-1`` and the layers must agree
  in shape and dtype.
* ``transpose``: ``(pattern, axes)`` matched against the target paths (after
  rename and stack); the first matching rule wins. ``axes`` are
  ``numpy.transpose``'s: target axis ``j`` is axis ``axes[j]`` of the leaf as
  unstacked/stacked (a Flax ``kernel`` ``(in, out)`` -> a PyTorch ``weight``
  ``(out, in)`` is ``(1, 0)``; a stacked ``(L, in, out)`` is ``(0, 2, 1)``).
* ``cast`` / ``dtype``: ``{pattern: dtype}`` matched against the target paths,
  first match wins; ``dtype=`` applies to every other floating leaf (integer,
  bool and complex leaves keep their dtype). Names are numpy's plus
  ml_dtypes' (``bfloat16``, ``float8_e4m3fn``). A ``cast`` rule may change a
  leaf's kind (bool, integer, floating, complex: ``step`` int32 -> float32)
  only when every leaf that rule applies to has that kind: a rule written
  for those leaves. ``{".*": "bfloat16"}`` over float and integer leaves is
  refused for the integer ones; ``dtype="bfloat16"`` is what casts all
  floating leaves.

Every pattern must match at least one path at its stage, unless
``allow_unmatched=True``; the error names the pattern and nearby paths of
that stage. Non-array leaves (``shape`` None) pass through keep/drop and
rename; cast and ``dtype=`` leave them alone; unstack, stack and transpose
of one is an error.

Command-line strings (``Rules.from_cli``): ``--rename 'PATTERN=>REPLACEMENT'``
(exactly one ``=>``), ``--cast 'PATTERN=DTYPE'`` and
``--transpose 'PATTERN=AXES'`` with ``AXES`` comma-separated
(``'weight$=1,0'``; split at the last ``=``, so a pattern may hold ``=``),
``--drop``/``--keep``/``--unstack``/``--stack PATTERN``, ``--dtype DTYPE``.
With ``--rules FILE`` the flags come after the file's rules (``Rules.merge``).

>>> rules = Rules(unstack=["layers"], rename=[(r"^layers/(\\d+)/w$", r"h.\\1.weight")],
...               transpose=[(r"weight$", (1, 0))], dtype="bfloat16")
>>> plan = rules.plan([("layers/w", (2, 4, 8), "float32"), ("step", (), "int32")])
>>> [(t.path, t.shape, t.dtype.name) for t in plan]
[('h.0.weight', (8, 4), 'bfloat16'), ('h.1.weight', (8, 4), 'bfloat16'), ('step', (), 'int32')]
>>> print(plan)
source       -> target      shape                dtype                rules
layers/w[0]  -> h.0.weight  (2, 4, 8) -> (8, 4)  float32 -> bfloat16  unstack [0], transpose (1, 0), cast bfloat16
layers/w[1]  -> h.1.weight  (2, 4, 8) -> (8, 4)  float32 -> bfloat16  unstack [1], transpose (1, 0), cast bfloat16
step         -> step        ()                   int32
"""

from treetools.rules.spec import Rules  # noqa: F401  (`from treetools.rules import Rules`; tt.Rules is the public name)
