"""The reference trainer: a small sharded decoder-only Transformer trained with
Optax on a synthetic task, using treetools' public API end to end.

Run it with ``treetools train`` (see ``treetools.reference.train``).
"""
