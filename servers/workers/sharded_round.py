"""An FL round's 2PC on coordinate shards, as a coordinator drives it (issue 30).

Why here and not in the round's leader or follower: both servers run the same two steps on
their workers, and the daemon, the benchmark and the tests all drive them the same way. The
range check: each worker pair computes its shard's parts (``shard_programs.range_partials``),
the coordinator adds its workers' shares of them (local: additive shares add) and the two
coordinators decide in their own small session (``protocols.upload_range.verdict_from_partials``:
one opened bit per client). The aggregate: each pair opens its shard of the exact weighted ring
sum (``shard_programs.open_weighted_sum``) and the coordinator puts the shards side by side. A
BRACE round's vote: each pair votes on its shard's coordinates and opens them
(``protocols.starfish.shard_steps.brace_program``, the vote Stage II's replay runs on shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.encoding import DEFAULT_PRECISION
from protocols.starfish.shard_steps import brace_program
from protocols.upload_range import DEFAULT_BOUND_BITS, shard_chunks, verdict_from_partials

from .shard_programs import open_weighted_sum, range_partials
from .shards import join
from .worker_group import WorkerGroup

__all__ = ["check_on_shards", "aggregate_on_shards", "vote_on_shards"]


def _ring_sum(parts: Sequence[np.ndarray]) -> torch.Tensor:
    with np.errstate(over="ignore"):   # int64 wraps: the ring
        return torch.from_numpy(np.sum(np.stack(parts), axis=0, dtype=np.int64))


def check_on_shards(group: WorkerGroup, party: Any, names: Sequence[str], norms: np.ndarray,
                    deltas: np.ndarray, *, bound_bits: int = DEFAULT_BOUND_BITS,
                    precision: int = DEFAULT_PRECISION) -> list[bool]:
    """Per client (``names``: the workers' shares of its update), True iff its upload is in range;
    ``norms``, ``deltas``: this server's shares of the reported values; ``party``: the
    coordinators' session. What crosses shards: two shares per client per shard."""
    _, t = shard_chunks([hi - lo for lo, hi in group.bounds], bound_bits)
    parts = group.run(range_partials, list(names), t, bound_bits, precision)
    return verdict_from_partials(party, _ring_sum([c for c, _ in parts]), _ring_sum([s for _, s in parts]), t,
                                 party.wrap_share(norms, precision=precision),
                                 party.wrap_share(deltas, precision=precision), bound_bits=bound_bits,
                                 precision=precision)


def aggregate_on_shards(group: WorkerGroup, names: Sequence[str], counts: Sequence[int]) -> np.ndarray:
    """sum_j n_j enc(g_j) over every coordinate, opened shard by shard (both servers get it)."""
    return join(group.run(open_weighted_sum, list(names), [int(c) for c in counts]))


def vote_on_shards(group: WorkerGroup, names: Sequence[str], lam: float,
                   precision: int = DEFAULT_PRECISION) -> np.ndarray:
    """BRACE's vote (+1 where sum_j sgn(g_j) > lam, else -1) over the updates ``names`` (the
    workers' shares, at ``precision`` bits), opened shard by shard (both servers get it)."""
    return join(group.run(brace_program, [(n, None) for n in names], [precision] * len(names), float(lam)))
