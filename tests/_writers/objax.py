"""objax's ``Checkpoint`` npz, written as objax writes it (objax does not install with the project's jax).

Follows google/objax at commit f288d5865d06cfadd0a93e5b178878bb585d7304, ``objax/io/ops.py``
``save_var_collection``: each distinct variable's value under the member name ``str(i)`` and the variables'
names (``(Sequential)[0](Linear).w``) as ``names=np.array(names)``, by ``np.savez``; ``objax.io.Checkpoint`` saves
one such file per step as ``<logdir>/ckpt/<step:010d>.npz``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def save_var_collection(file: Any, named_values: dict[str, Any]) -> None:
    """``save_var_collection(file, vc)`` for a collection whose variables are ``named_values`` (in order)."""
    data, names = {}, []
    for name, value in named_values.items():
        names.append(name)
        data[str(len(data))] = np.asarray(value)
    np.savez(os.fspath(file), names=np.array(names), **data)
