"""Shared by the ``gpu_*.py`` scripts: timing, compiled-program structure, the header and the JSON dump.

The scripts run on whatever backend jax picks (a GPU when there is one, else
the CPU), import treetools from this checkout, and never force a platform or
a device count (unlike the pytest suites, whose conftest.py forces 8 CPU
devices). Nothing here is collected by pytest.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # treetools from this checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

SCALE = float(os.environ.get("TREETOOLS_BENCH_SCALE", "1.0"))
ROUNDS = int(os.environ.get("ROUNDS", "15"))


def header(title: str) -> dict:
    """Print and return what was measured on: device kind, backend, versions, scale."""
    import flax
    import optax

    dev = jax.devices()[0]
    info = {
        "title": title,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "scale": SCALE,
        "rounds": ROUNDS,
    }
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if info["backend"] == "cpu":
        print("note: no accelerator; these numbers say the script runs, not what a GPU does", flush=True)
    return info


def time_rounds(fns: dict[str, tuple], rounds: int = ROUNDS, *, queued: int = 10, calls: int = 1) -> dict[str, dict]:
    """Per ``name: (fn, *args)``: latency and throughput per call, in interleaved shuffled rounds.

    Latency: ``calls`` calls then a block, divided by ``calls``. Throughput:
    ``queued`` calls enqueued, then one block, divided by ``queued`` (what a
    step loop that does not wait on its metrics sees). Every round runs every
    function, in a fresh random order; ratios are taken within a round.
    """
    for fn, *args in fns.values():  # compile and warm up
        jax.block_until_ready(fn(*args))
    lat = {k: [] for k in fns}
    thr = {k: [] for k in fns}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for key in rng.permutation(list(fns)):
            fn, *args = fns[key]
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            lat[key].append((time.perf_counter() - start) / calls)
            start = time.perf_counter()
            outs = [fn(*args) for _ in range(queued)]
            jax.block_until_ready(outs)
            thr[key].append((time.perf_counter() - start) / queued)
    return {k: {"latency": lat[k], "throughput": thr[k]} for k in fns}


def paired(times: dict[str, dict], who: str, against: str, kind: str = "throughput") -> tuple[float, float, float]:
    """Median and interquartile range over rounds of ``who / against``."""
    ratios = [a / b for a, b in zip(times[who][kind], times[against][kind])]
    q1, q3 = np.percentile(ratios, [25, 75])
    return statistics.median(ratios), float(q1), float(q3)


def median_ms(times: dict[str, dict], key: str, kind: str = "throughput") -> float:
    return statistics.median(times[key][kind]) * 1e3


def structure(fn, *args) -> dict:
    """What the compiled program looks like: kernels launched, conditionals, reductions.

    Counted in the entry computation of the optimized HLO: ``fusion`` and
    other top-level instructions that become kernels on a GPU, ``conditional``
    (on a GPU its predicate is read on the host), and ``reduce`` roots.
    """
    try:
        text = jax.jit(fn).lower(*args).compile().as_text()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return {"error": str(e)[:200]}
    return structure_of(text)


def structure_of(text: str) -> dict:
    """``structure`` of an already compiled program's text (``compiled.as_text()``)."""
    entry = text[text.find("\nENTRY") :]
    body = [line for line in entry.splitlines()[1:] if " = " in line]
    ops = [re.search(r"= (?:\([^)]*\)|\S+) ([a-z][\w\-]*)\(", line) for line in body]  # the type may be a tuple
    ops = [m.group(1) for m in ops if m]
    return {
        "fusions": sum(op == "fusion" for op in ops),
        "conditionals": text.count(" conditional("),
        "custom_calls": sum(op == "custom-call" for op in ops),
        "entry_ops": len(ops),
    }


def dump(name: str, payload: dict) -> None:
    """Write ``payload`` as JSON under ``$OUT`` (if set)."""
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {os.path.join(out, name)}", flush=True)
