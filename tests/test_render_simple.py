"""The fast ``simple`` table (issue 48: tabulate's per-cell type detection was most of ``tabulate_params`` at
100,000 leaves) is byte for byte tabulate's own ``simple`` format of the same cells."""

from __future__ import annotations

import random
import string

import numpy as np
from tabulate import tabulate

import treetools as tt
from treetools.shared.render import _simple_table


def test_simple_table_is_tabulates_simple_format_byte_for_byte():
    rng = random.Random(0)
    alphabet = string.ascii_letters + " ()/,._-0123456789"
    for _ in range(2000):
        ncols, nrows = rng.randint(1, 7), rng.randint(0, 6)

        def cell():
            return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 0, 1, 3, 8, 15])))

        headers = [cell() or "h" for _ in range(ncols)]
        data = [[cell() for _ in range(ncols)] for _ in range(nrows)]
        assert _simple_table(headers, data) == tabulate(data, headers=headers, tablefmt="simple",
                                                        disable_numparse=True), (headers, data)


def test_tabulate_params_prints_what_tabulate_prints():
    tree = {"enc": {"w": np.ones((3, 4), np.float32), "b": np.ones(4, np.float32)}, "step": 3, "é": np.ones(2)}
    from treetools.pytree.table import rows_from_tree
    from treetools.shared.render import row_cells

    columns = ["path", "shape", "dtype", "count", "bytes", "sharding"]
    headers, cells = row_cells(rows_from_tree({"enc": tree["enc"], "step": 3}), columns)
    want = tabulate(cells, headers=headers, tablefmt="simple", disable_numparse=True)
    assert tt.tabulate_params({"enc": tree["enc"], "step": 3}).startswith(want + "\n\n")
    assert "é" in tt.tabulate_params(tree)  # not plain ASCII: tabulate itself renders it
