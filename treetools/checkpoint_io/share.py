"""One process's share of a run of several: which jobs it reads, and how the processes pool what they found.

A command run by several processes (``treetools inspect --stats --processes 4``, or one process per host
under ``jax.distributed``) reads every leaf exactly once in all: the block engine
(``treetools.checkpoint_io.stream.reduce_blocks``) gives each job to one process by bytes (``owners``), each process
reads its jobs as it would alone, and the results are pooled (``Share.allgather``) so that every process ends
with every job's result, the same objects one process would have computed: the report is identical.

This module is the contract only (no jax): ``treetools.checkpoint_jax.distributed`` implements it on
``jax.distributed`` (gloo collectives on CPU), and a test may implement it with threads.
"""

from __future__ import annotations

import heapq
import pickle
from typing import Any, Protocol, Sequence


class Share(Protocol):
    """This process's place in a run of ``count`` processes.

    Implementation hint: ``allgather`` is a collective: every process calls it, in the same order, with its
    own payload, and every process gets the list of all payloads by process index. Payloads come from the
    run's own processes (one user's job), never from a checkpoint.
    """

    index: int
    count: int

    def allgather(self, payload: bytes) -> list[bytes]: ...


def owners(sizes: Sequence[int], count: int) -> list[int]:
    """The process that reads each job: the largest job first, to the process with the fewest bytes so far
    (ties: the lowest index). Every process computes the same list from the same sizes.

    >>> owners([10, 40, 30, 20], 2)
    [0, 0, 1, 1]
    """
    out = [0] * len(sizes)
    heap = [(0, p) for p in range(max(1, count))]
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        load, p = heapq.heappop(heap)
        out[j] = p
        heapq.heappush(heap, (load + sizes[j], p))
    return out


def pool(share: Share, value: Any) -> list[Any]:
    """Every process's ``value``, by process index: each pickled and passed through ``share.allgather`` (a
    collective: every process calls it in turn). The pickles come from the run's own processes, never from a
    checkpoint's bytes; an exception that does not pickle travels as a ``RuntimeError`` of its type and text.

    >>> class Alone:
    ...     index, count = 0, 1
    ...     def allgather(self, payload): return [payload]
    >>> pool(Alone(), {"job": 3})
    [{'job': 3}]
    """
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        payload = pickle.dumps(RuntimeError(f"{type(value).__name__}: {value}"), protocol=pickle.HIGHEST_PROTOCOL)
    return [pickle.loads(part) for part in share.allgather(payload)]
