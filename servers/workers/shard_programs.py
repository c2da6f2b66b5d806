"""What a worker pair computes on its coordinate shard (run by ``ShardWorker.run`` on both sides).

Each program is ``program(party, worker, *args)``: ``party`` the pair's 2PC session, ``worker``
this side's ``ShardWorker`` (its shares by name). Only elementwise work lives here; whatever needs
every coordinate (a norm, an inner product) is returned as this server's *share* of the shard's
part, and the coordinator adds the parts of its shards locally (additive shares add without
communication) before the small 2PC that decides (issue 30: only small values cross shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.encoding import DEFAULT_PRECISION
from mpc.crypten_compat import crypten
from protocols.backend import stack
from protocols.upload_range import DEFAULT_BOUND_BITS, shard_partials
from servers.secure.ring_aggregation import weighted_share_sum

__all__ = ["open_weighted_sum", "range_partials"]


def open_weighted_sum(party, worker, names: Sequence[str], counts: Sequence[int]) -> np.ndarray:
    """sum_j n_j enc(g_j) on this shard, opened (``servers.secure.ring_aggregation``: exact on the
    ring, public weights, the local sums exchanged once); what it opens is the shard of the
    round's aggregate, which the round publishes anyway."""
    shares = [worker.share(n) for n in names]
    dim = shares[0].shape[-1]
    local = weighted_share_sum(zip(counts, shares), dim)
    with party.meter("aggregate"):
        opened = crypten.mpc.MPCTensor.from_shares(torch.from_numpy(local), precision=0).reveal()
    return opened.numpy().astype(np.int64)


def range_partials(party, worker, names: Sequence[str], trunc_bits: int, bound_bits: int = DEFAULT_BOUND_BITS,
                   precision: int = DEFAULT_PRECISION) -> tuple[np.ndarray, np.ndarray]:
    """The range check's part on this shard (``protocols.upload_range.shard_partials``): this
    server's shares of each client's window violations and truncated sum of squares. Nothing is
    opened here; the coordinators add the shards' parts and decide together."""
    x = stack([party.wrap_share(worker.share(n), precision=precision) for n in names])
    with party.meter("range"):
        counts, squares = shard_partials(x, trunc_bits, bound_bits=bound_bits)
    return counts.numpy().copy(), squares.numpy().copy()
