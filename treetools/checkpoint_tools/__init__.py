"""The commands over checkpoints: inspect, show, stats, diff, verify; each data in, a report out.

Each command takes an options object (``treetools.checkpoint_tools.options``) and
returns a report that ``treetools.checkpoint_tools.text`` renders; every checkpoint is
read through the checkpoint layer (``treetools.checkpoint_io``), and nothing below this
package imports it. The public names are ``treetools.inspect_path`` and
``treetools.diff_paths``; the rest is private to treetools. No jax is imported.
"""
