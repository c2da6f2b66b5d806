"""Threshold checking (SecTC, Starfish Alg. 3): which clients must send exact updates.

Client j is flagged when some coordinate k of its estimated update satisfies
g_hat^j(k)^2 >= (delta^j)^2. Comparing squares avoids a secure absolute value or square
root; both sides are non-negative, so the test equals |g_hat^j(k)| >= delta^j. Only the
one flag bit per client is revealed (the paper reveals f_{t_i}), never which coordinate.
"""

from __future__ import annotations

from typing import Any

import torch

from mpc import table_compare
from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.sharded import is_sharded
from protocols.threshold import any_exceeds

__all__ = ["check_thresholds", "session_engine", "ENGINE_DROP"]

#: the fractional bits the engine's SecTC may drop locally (``SpuEngine.rows_exceed``)
ENGINE_DROP = 30


def session_engine() -> Any:
    """The two-party engine of the session in use (``SpuEngine``); None in any other mode."""
    return getattr(crypten.mpc.get_default_provider(), "engine", None)


def check_thresholds(estimates: Any, thresholds: Any) -> torch.Tensor:
    """Public 0/1 flags, one per row of ``estimates`` (clients x m); ``thresholds`` is (clients,).

    Delegates to ``protocols.threshold.any_exceeds``, which compares x^2 with d^2
    coordinate-wise and reveals only the per-row OR.
    """
    if is_sharded(estimates):     # on coordinate shards: counts per shard, the OR here
        return estimates.exceeds(thresholds)
    if len(estimates.shape) != 2 or len(thresholds.shape) != 1:
        raise ValueError("estimates must be (clients, m) and thresholds (clients,)")
    direct = _two_party_check(estimates, thresholds)
    if direct is None:
        direct = _table_check(estimates, thresholds)
    if direct is not None:
        return direct
    flags = any_exceeds(B.rescale(estimates), thresholds)  # estimates may carry raw bits (SecUE)
    return torch.as_tensor(flags).reshape(-1).to(torch.int64)


def _two_party_check(estimates: Any, thresholds: Any) -> torch.Tensor | None:
    """Two-party mode: the whole check (rescale, |x| >= |d|, per-row OR) in the engine's 32-bit
    ring (``mpc.spu_engine.SpuEngine.rows_exceed``); the same flags as ``any_exceeds`` on the
    rescaled estimates, revealing the same one bit per row. None in any other mode."""
    if not B.is_shared(estimates):
        return None
    engine = session_engine()
    drop = B.bits_of(estimates) - B.frac_bits()
    if engine is None or not 0 <= drop <= ENGINE_DROP:
        return None
    if B.is_shared(thresholds):
        d = B.rescale(thresholds).share.numpy()
    else:   # a public threshold is party 0's share; party 1 holds 0
        enc = B.encode_public(torch.as_tensor(thresholds, dtype=torch.float64))
        d = (enc if engine.rank == 0 else torch.zeros_like(enc)).numpy()
    flags = engine.rows_exceed(estimates.share.numpy(), drop, d)
    return torch.as_tensor(flags).to(torch.int64)


def _table_check(estimates: Any, thresholds: Any) -> torch.Tensor | None:
    """Dealer mode: the check in a 32-bit ring with table-driven sign tests
    (``mpc.table_compare.rows_exceed``, about 24 bytes per coordinate instead of about 91); the
    same one bit per row is opened. None where the provider has no tables or the values do not
    have the raw bits it truncates locally."""
    if not B.is_shared(estimates) or not table_compare.supported():
        return None
    drop = B.bits_of(estimates) - B.frac_bits()
    if not 0 <= drop <= table_compare.MAX_DROP:
        return None
    if B.is_shared(thresholds):
        d, shared = B.rescale(thresholds).share.numpy(), True
    else:
        d, shared = B.encode_public(torch.as_tensor(thresholds, dtype=torch.float64)).numpy(), False
    flags = table_compare.rows_exceed(estimates.share.numpy(), drop, d, d_shared=shared)
    return torch.as_tensor(flags).to(torch.int64)
