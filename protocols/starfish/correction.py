"""The correction step: exact updates from the remaining clients replace estimates.

Why a step of its own: in the warm-up and whenever a threshold check flags a client, Stage II
(and FedRecover) ask clients for their exact update gbar^j on the recovered model M_hat. That
exact update does two things: it replaces the estimate in this round's aggregate, and it
offers the client's L-BFGS buffer the pair (s, gbar^j - g^j), where g^j is the stored update of
the round being replayed (the buffer keeps it if it passes the curvature test, ``pair_buffers``). The clients are reached through the
:class:`~protocols.starfish.ports.CorrectionClients` port (plain tensors in the lab, this
party's shares on a server); s is public, y stays shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from protocols.backend import to_compute
from .ports import CorrectionClients

__all__ = ["apply_corrections"]


def apply_corrections(clients: CorrectionClients, round_index: int, model: torch.Tensor,
                      ids: Sequence[int], rest: Sequence[int], stored: Sequence[Any],
                      rows: list[Any]) -> dict[int, Any]:
    """Fetch the exact updates of ``ids`` on ``model``, put them into ``rows`` (in place; ``rest``
    orders ``stored`` and ``rows``) and return the secants y_j = gbar_j - g_j for the buffers.

    A client the port left out (no answer in time, or an answer the servers refused) gets no
    secant and its row stays as it was: its estimate, or None in a warm-up step (the replay then
    treats it as absent from the round)."""
    wanted = set(ids)
    fresh = clients.exact_updates(round_index, model, list(ids))
    secants = {}
    for r, j in enumerate(rest):
        if j in wanted and j in fresh:
            gbar = to_compute(fresh[j])
            secants[j] = gbar - stored[r]
            rows[r] = gbar
    return secants
