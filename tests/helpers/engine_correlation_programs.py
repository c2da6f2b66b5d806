"""Programs for tests/mpc/test_engine_correlations.py (module-level: the party processes import them)."""

from __future__ import annotations

import numpy as np

from mpc.crypten_compat import crypten


def engine_matmuls(party, cases):
    """This party's shares of a @ b for each (a0, a1, b0, b1) (party r holds a_r, b_r), computed
    by the session's two-party engine (``SpuEngine.product``)."""
    eng = crypten.mpc.get_default_provider().engine
    return [eng.product("matmul", *((a0, b0) if party.rank == 0 else (a1, b1))) for a0, a1, b0, b1 in cases]


def engine_truncation_pairs(party, cases):
    """This party's (top, high) shares for each (r0, r1, d): the engine's half of a truncation pair."""
    eng = crypten.mpc.get_default_provider().engine
    return [eng.truncation_pairs(r0 if party.rank == 0 else r1, d) for r0, r1, d in cases]


def provider_pairs(party, requests):
    """Pairs taken from the two-party provider's stock, one request (n, d) after another."""
    provider = crypten.mpc.get_default_provider()
    return [tuple(t.numpy().copy() for t in provider.trunc_pairs((n,), d, d)) for n, d in requests]
