"""One module per on-disk checkpoint format; each exposes ``FORMAT = Format(...)``.

``treetools.ckpt.source.registered_formats()`` imports every module here (names not
starting with ``_``) and registers its ``FORMAT``: adding a format is adding a
module (and its test file). Modules import nothing heavy at import time.
"""
