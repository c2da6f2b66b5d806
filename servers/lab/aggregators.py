"""The lab's server aggregation rules behind one shape: FedAvg, FedSECA, BRACE's sign vote.

Why objects: ``run_federated`` steps M_i = M_{i-1} - server_lr * direction for every rule; what
differs is how the round's updates become the direction and whether the rule remembers
anything between rounds (FedSECA's server momentum). An aggregator is named (the lab records
the name in its JSON config), ``reset()`` at the start of every run, and asked for
``direction(updates, weights)`` once per round. The rules themselves live in
``protocols.robust_aggregation`` (plaintext tensors and shares); this module only adapts them
to the lab's round loop.

FedSECA and BRACE are unweighted (every client one vote, as in both papers); they ignore the
FedAvg weights. The history still records those weights, so the recovery methods that replay a
history (FedEraser, FedRecover, Starfish, Crab, FedADP) keep assuming a FedAvg step even when
the history was made by another rule; only Retrain re-runs FL with the same aggregator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from protocols.robust_aggregation import brace_sign, fedseca, momentum

from .fl import aggregate

__all__ = ["FedAvg", "FedSECA", "BraceSign", "AGGREGATORS", "build_aggregator",
           "FEDSECA_GAMMA", "FEDSECA_BETA", "BRACE_LAMBDA", "BRACE_SCALE"]

#: FedSECA sec. 5: sparsification factor gamma = 0.9 and server momentum beta_ra = 0.5,
#: the same for all three of its datasets.
FEDSECA_GAMMA = 0.9
FEDSECA_BETA = 0.5
#: BRACE sec. 5 uses lambda = 5 with n = 100 clients (5% of n); the lab's default federation
#: has 20, and 5% of 20 is 1. With 20 clients and no zero updates the vote sum is even, so
#: lambda = 1 means "+1 iff at least 11 of 20 clients vote +1".
BRACE_LAMBDA = 1.0
#: BRACE's step is eta * sign-vote, magnitude eta in every coordinate. In the lab's step
#: M_i = M_{i-1} - server_lr * direction the direction is scale * vote, so every coordinate
#: moves server_lr * scale per round. The paper's eta belongs to its CNNs and 300-500
#: rounds; on the digits (logreg, server_lr 0.3, 40 rounds) scale 0.01 (a move of 0.003 per
#: coordinate and round) converges to within ~1 point of FedAvg's test error: scale 0.1
#: oscillates at a visibly higher error, 0.001 has not converged after 40 rounds
#: (docs/lab.md, "Attacks and robust aggregators").
BRACE_SCALE = 0.01


def _stack(updates: Mapping[int, torch.Tensor]) -> torch.Tensor:
    if not updates:
        raise ValueError("no updates to aggregate")
    return torch.stack([updates[j].reshape(-1) for j in sorted(updates)])


class FedAvg:
    """sum_j w_j g_j: exactly what ``run_federated`` does without an aggregator."""

    name = "fedavg"

    def reset(self) -> None:
        """Stateless."""

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor:
        return aggregate(dict(updates), dict(weights))

    def params(self) -> dict[str, Any]:
        return {}


class FedSECA:
    """FedSECA's aggregate g_tilde (CRISE sign election + RoCA), then server momentum.

    direction_t = beta * direction_{t-1} + (1 - beta) * g_tilde_t with direction_0 = 0
    (FedSECA eq. 11; the buffer starts empty like an optimiser's momentum, so round 1 moves
    half of g_tilde_1). ``beta = 0`` steps with g_tilde itself.
    """

    name = "fedseca"

    def __init__(self, gamma: float = FEDSECA_GAMMA, beta: float = FEDSECA_BETA) -> None:
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"FedSECA gamma must be in [0, 1), got {gamma}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"FedSECA momentum beta must be in [0, 1), got {beta}")
        self.gamma = float(gamma)
        self.beta = float(beta)
        self._buffer: torch.Tensor | None = None

    def reset(self) -> None:
        self._buffer = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The momentum after the last round (None before the first)."""
        return self._buffer

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor:
        g = _stack(updates)
        agg = fedseca(g, gamma=self.gamma).to(g.dtype)
        prev = torch.zeros_like(agg) if self._buffer is None else self._buffer
        self._buffer = momentum(prev, agg, beta=self.beta).to(g.dtype)
        return self._buffer

    def params(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "beta": self.beta}


class BraceSign:
    """BRACE's GAR: +1 where more than ``lam`` net client signs are positive, else -1.

    The direction is ``scale`` times that vote (see :data:`BRACE_SCALE` for the choice).
    """

    name = "brace-sign"

    def __init__(self, lam: float = BRACE_LAMBDA, scale: float = BRACE_SCALE) -> None:
        if not scale > 0.0:
            raise ValueError(f"BRACE step scale must be positive, got {scale}")
        self.lam = float(lam)
        self.scale = float(scale)

    def reset(self) -> None:
        """Stateless."""

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor:
        g = _stack(updates)
        return self.scale * brace_sign(g, lam=self.lam).to(g.dtype)

    def params(self) -> dict[str, Any]:
        return {"lam": self.lam, "scale": self.scale}


AGGREGATORS = {"fedavg": FedAvg, "fedseca": FedSECA, "brace-sign": BraceSign}


def build_aggregator(name: str, **params: Any) -> FedAvg | FedSECA | BraceSign:
    """``AGGREGATORS[name](**params)`` with a clear error for an unknown name."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name](**params)
