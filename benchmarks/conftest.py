"""Benchmarks run on 8 fake CPU devices; sizes scale with TREETOOLS_BENCH_SCALE.

``TREETOOLS_BENCH_SCALE`` is a float fraction of the full sizes named in each
suite (default 1.0; the smoke run in ``make test`` uses a tiny value).
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

SCALE = float(os.environ.get("TREETOOLS_BENCH_SCALE", "1.0"))


@pytest.fixture(scope="session")
def scale() -> float:
    return SCALE


def report(
    name: str, ours: float, anchor: float, anchor_name: str, *, target: str = "", ratio: float | None = None, spread=None
) -> float:
    """Print one benchmark line: our time, the anchor's, and the ratio.

    ``ratio`` defaults to ``ours / anchor``; pass a paired statistic instead
    (and its interquartile ``spread``) when the rounds were timed in pairs.
    """
    if ratio is None:
        ratio = ours / anchor if anchor > 0 else float("inf")
    line = f"[bench] {name}: ours {ours * 1e3:.2f} ms, {anchor_name} {anchor * 1e3:.2f} ms, ratio {ratio:.3f}"
    if spread is not None:
        line += f" (IQR {spread[0]:.3f}-{spread[1]:.3f})"
    print(line + (f" (target {target})" if target else ""), flush=True)
    return ratio


def best(fn, repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn`` (seconds)."""
    import math
    import time

    fastest = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest
