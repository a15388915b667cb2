"""Shared modules, the bottom layer (standard library only): errors, type aliases, the Row type and number formats,
path patterns, rendering and safe text.
"""
