"""The presets shipped with treetools: one TOML rules file per family and direction (docs/presets.md).

Data only: ``treetools.rules.presets`` reads these files (``tt.presets()``, ``tt.preset(name, config=None)``).
"""
