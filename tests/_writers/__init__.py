"""Test writers that follow a trainer's own saving code where that code does not install in the test environment.

Each module's docstring names the repository, file and commit it follows. The arrays themselves are always
written by the library the trainer calls (jax's ``GlobalAsyncCheckpointManager`` over TensorStore), never by
treetools.
"""
