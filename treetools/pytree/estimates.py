"""Figures ``memory_plan`` gives beside the state's exact bytes, each an estimate with its formula.

* ``activation_estimate``: the activations a transformer's training step keeps for its backward pass, by the
  formula of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
  4.1) without dropout: per layer ``s*b*h*(16 + 2*a*s/h)`` elements of the activation dtype (``s`` sequence,
  ``b`` batch per device, ``h`` hidden size, ``a`` heads): attention 5 ``sbh`` (its input, Q, K, V and the
  projection's input) and 2 ``as^2b`` (the scores' softmax and its input), the MLP 9 ``sbh`` (its input, and the
  4h-wide pre- and post-activation), two layer norms 2 ``sbh``; with full rematerialisation only each layer's
  input, ``s*b*h``. Compilers fuse and reuse buffers: a guide within a factor of about two, not a bound.
* ``allocator_estimate``: the memory jax's GPU allocator reserves at its first use, ``XLA_PYTHON_CLIENT_MEM_FRACTION``
  (default 0.75) of each device's memory (none reserved up front with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``,
  the same cap), and what is left of it for the step once the state is in.
* ``host_estimates``: the host RAM a restore needs: ``restore_checkpoint`` one leaf at a time (its largest device
  block plus the stored chunk decoded for it), ``load_parameters`` the params whole.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

DEFAULT_MEM_FRACTION = 0.75
"""jax's default ``XLA_PYTHON_CLIENT_MEM_FRACTION``: the share of a GPU it preallocates."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A figure that is not counted from the state but estimated: ``bytes`` per device (or per host, as ``name``
    says), and the ``formula`` it came from, with its inputs."""

    name: str
    bytes: int
    formula: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "formula": self.formula}


ACTIVATION_KEYS = ("batch", "seq", "hidden", "layers", "heads")


def activation_estimate(spec: Mapping[str, Any], *, batch_shards: int = 1) -> Estimate:
    """The activations one device keeps for the backward pass of a transformer step (module doc's formula).

    ``spec``: ``batch`` (global), ``seq``, ``hidden``, ``layers``, ``heads``; optional ``itemsize`` (bytes of the
    activation dtype, default 2: bfloat16), ``remat`` (True: each layer's input only) and ``batch_shards`` (the
    devices the batch is split over, overriding the argument, which ``memory_plan`` sets to the mesh's size).

    >>> # GPT-2 small, batch 8 of 1024 tokens: sbh = 6,291,456; 16 sbh + 2 a s^2 b = 100,663,296 + 201,326,592
    >>> # per layer, times 12 layers, times 2 bytes
    >>> activation_estimate({"batch": 8, "seq": 1024, "hidden": 768, "layers": 12, "heads": 12}).bytes
    7247757312
    """
    missing = [k for k in ACTIVATION_KEYS if k not in spec]
    extra = sorted(set(spec) - {*ACTIVATION_KEYS, "itemsize", "remat", "batch_shards"})
    if missing or extra:
        raise ValueError(f"`activations` needs {', '.join(ACTIVATION_KEYS)} (and optionally itemsize, remat); "
                         f"missing {missing}, unknown {extra}.")
    b_global, s, h, layers, a = (int(spec[k]) for k in ACTIVATION_KEYS)
    itemsize, remat = int(spec.get("itemsize", 2)), bool(spec.get("remat", False))
    batch_shards = int(spec.get("batch_shards", batch_shards))
    b = -(-b_global // max(batch_shards, 1))
    if remat:
        per_layer, text = s * b * h, "s*b*h"
    else:
        per_layer, text = s * b * h * 16 + 2 * a * s * s * b, "s*b*h*16 + 2*a*s^2*b"
    total = per_layer * layers * itemsize
    return Estimate("activations", total, f"({text}) * layers * itemsize with s={s}, b={b} (batch {b_global} over "
                    f"{batch_shards} device(s)), h={h}, a={a}, layers={layers}, itemsize={itemsize}"
                    f"{', remat' if remat else ''} (Korthikanti et al. 2022, no dropout)")


def mem_fraction(environ: Mapping[str, str] | None = None) -> float:
    """``XLA_PYTHON_CLIENT_MEM_FRACTION`` as jax reads it, else its default 0.75."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    except ValueError:
        return DEFAULT_MEM_FRACTION
    return value if 0 < value <= 1 else DEFAULT_MEM_FRACTION


def allocator_estimate(device_memory: int, state_bytes: int, activations: int | None = None,
                       environ: Mapping[str, str] | None = None) -> list[Estimate]:
    """jax's GPU pool (``fraction * device_memory``) and what the step has left of it once the state (and the
    activation estimate, where given) is in."""
    fraction = mem_fraction(environ)
    pool = int(device_memory * fraction)
    used = state_bytes + (activations or 0)
    left = pool - used
    what = "state + activations" if activations is not None else "state"
    return [Estimate("allocator_pool", pool, f"XLA_PYTHON_CLIENT_MEM_FRACTION ({fraction:g}) * device memory: what "
                     "jax reserves per GPU (preallocated at first use unless XLA_PYTHON_CLIENT_PREALLOCATE=false)"),
            Estimate("allocator_headroom", left, f"allocator pool - ({what}): left for the step's other temporaries "
                     "(negative: short)")]


def host_estimates(restore_peak: int, params_global: int) -> list[Estimate]:
    """The host RAM a restore needs, per host, beyond the process itself."""
    return [Estimate("host_restore", restore_peak, "restore_checkpoint: the largest device block + the stored chunk "
                     "decoded for it (one leaf at a time)"),
            Estimate("host_load_parameters", params_global, "load_parameters: every param whole on the host (the "
                     "params' global bytes)")]
