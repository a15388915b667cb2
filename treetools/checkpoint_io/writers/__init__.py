"""Checkpoint writers: safetensors (one file, or a Hugging Face folder of shards with its index) and Orbax.

``treetools convert`` is their one caller. The safetensors writer streams
any array reader (``shape``, ``dtype``, ``read(index)``: a checkpoint leaf's
``ArrayReader`` or a rules ``RuledReader``) block by block, to a local path
or a ``gs://``/``s3://`` bucket; the Orbax writer hands a tree held in host
memory to Orbax's own ``StandardCheckpointer`` or ``CheckpointManager``.
Both are atomic (see each module). Importing this package imports no jax.
"""
