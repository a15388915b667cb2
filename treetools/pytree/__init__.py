"""The jax pytree toolkit: flax boxes and their specs, path strings, counting, tables, masks and labels, abstract
trees, stacked layers, norms and the metrics log. Imports nothing of the checkpoint layers or the commands.
"""
