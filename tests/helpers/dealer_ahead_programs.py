"""Party programs for tests/mpc/test_dealer_ahead.py (module-level: the party processes import them)."""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from mpc.table_compare import negative_bounded
from protocols import backend as B


def mixed(party, x: np.ndarray, y: np.ndarray, plan=None, budget: int = 256 << 20):
    """Products, a sign test and a product by its bits (triples, tables, edabits, truncations),
    opened; with this call's recorded requests and how many corrections came from the
    background fetch of ``plan``."""
    prov = crypten.mpc.get_default_provider()
    first, served = len(prov.recorded), prov.served_ahead
    if plan is not None:
        party.fetch_ahead(plan, budget)
    X = crypten.cryptensor(torch.from_numpy(x), src=0)
    Y = crypten.cryptensor(torch.from_numpy(y), src=1)
    prod = X * Y
    bits = negative_bounded(X - Y)
    picked = bits * prod
    out = {"prod": B.reveal(prod).numpy(), "bits": B.reveal(bits).numpy(), "picked": B.reveal(picked).numpy()}
    return out, list(prov.recorded[first:]), prov.served_ahead - served


def close_while_fetching(party, x: np.ndarray, y: np.ndarray, plan: list):
    """Ask for a plan far longer than the program, compute, and let the session close while the
    background fetch is still on the dealer link (the close must wait for it, not race it)."""
    if plan:
        party.fetch_ahead(plan, 1 << 30)
    out, _, served = mixed(party, x, y)
    return out, served
