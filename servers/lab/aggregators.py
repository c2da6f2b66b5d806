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

import math
from collections.abc import Mapping
from typing import Any

import torch

from protocols.robust_aggregation import (BRACE_LAMBDA, FEDSECA_BETA, FEDSECA_GAMMA, brace_sign, fedseca,
                                          momentum)

from .fl import aggregate

__all__ = ["FedAvg", "FedSECA", "BraceSign", "AGGREGATORS", "build_aggregator",
           "FEDSECA_GAMMA", "FEDSECA_BETA", "BRACE_LAMBDA", "BRACE_CLIENTS", "BRACE_SCALE",
           "BRACE_DECAY", "replay_rule"]

#: FedSECA's gamma = 0.9 and beta_ra = 0.5 and BRACE's lambda = 5 are the paper values kept in
#: ``protocols.robust_aggregation``. BRACE's lambda = 5 goes with its n = 100 clients; by
#: default the lab keeps that share of the round's clients, lambda = 5 K / 100 (K = 20: 1, so
#: with no zero updates "+1 iff at least 11 of 20 clients vote +1").
BRACE_CLIENTS = 100
#: BRACE's step is eta * sign-vote, magnitude eta in every coordinate. In the lab's step
#: M_i = M_{i-1} - server_lr * direction the direction is scale_t * vote, so every coordinate
#: moves server_lr * scale_t in round t. The paper's fixed eta belongs to its CNNs and 300-500
#: rounds. On the digits (logreg, server_lr 0.3, 40 rounds, no attack) a fixed scale cannot
#: match FedAvg's 5.8% test error: 0.01 has not converged (20%), 0.03 gives 11%, 0.07-0.15
#: plateau at 7.3-8.2% (the sign step keeps jumping around the optimum by server_lr * scale),
#: 0.3 gives 14%. The usual remedy for sign descent is a step that shrinks like 1/sqrt(t)
#: (the O(1/sqrt T) rates of signSGD and BRACE's bound (10), which trades 1/(eta T) against
#: L eta / 2): scale_t = 0.5 / sqrt(t) reaches 5.8% (0.3 / sqrt(t): 6.9%, 1 / sqrt(t): 8.7%).
#: ``decay = 0`` is the paper's fixed step.
BRACE_SCALE = 0.5
BRACE_DECAY = 0.5


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
    (FedSECA eq. 11; ``protocols.robust_aggregation.momentum`` starts from a zero buffer, so
    round 1 moves (1 - beta) g_tilde_1). ``beta = 0`` steps with g_tilde itself.
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
        # the buffer stays in the rules' float64; the step uses the updates' dtype
        self._buffer = momentum(self._buffer, fedseca(g, gamma=self.gamma), beta=self.beta)
        return self._buffer.to(g.dtype)

    def params(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "beta": self.beta}


class BraceSign:
    """BRACE's GAR: +1 where the net client sign exceeds ``lam``, else -1.

    ``lam`` None: BRACE's 5 of 100 as a share of the round's K clients, 5 K / 100. The
    direction of round t (1-based within a run) is ``scale / t**decay`` times that vote (see
    :data:`BRACE_SCALE` for the choice); the round counter is the rule's only state.
    """

    name = "brace-sign"

    def __init__(self, lam: float | None = None, scale: float = BRACE_SCALE,
                 decay: float = BRACE_DECAY) -> None:
        if lam is not None and not math.isfinite(lam):
            raise ValueError(f"BRACE lambda must be finite, got {lam}")
        if not scale > 0.0:
            raise ValueError(f"BRACE step scale must be positive, got {scale}")
        if not decay >= 0.0:
            raise ValueError(f"BRACE step decay must be >= 0, got {decay}")
        self.lam = None if lam is None else float(lam)
        self.scale = float(scale)
        self.decay = float(decay)
        self._round = 0

    def reset(self) -> None:
        self._round = 0

    def step_scale(self, t: int) -> float:
        """The factor of the vote in round ``t``."""
        return self.scale / t ** self.decay

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor:
        g = _stack(updates)
        self._round += 1
        lam = BRACE_LAMBDA * g.shape[0] / BRACE_CLIENTS if self.lam is None else self.lam
        return self.step_scale(self._round) * brace_sign(g, lam=lam).to(g.dtype)

    def params(self) -> dict[str, Any]:
        return {"lam": self.lam, "scale": self.scale, "decay": self.decay}


AGGREGATORS = {"fedavg": FedAvg, "fedseca": FedSECA, "brace-sign": BraceSign}


def build_aggregator(name: str, **params: Any) -> FedAvg | FedSECA | BraceSign:
    """``AGGREGATORS[name](**params)`` with a clear error for an unknown name."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name](**params)


def replay_rule(aggregator: FedAvg | FedSECA | BraceSign | None):
    """The rule a replay (Stage II's ``combine``) applies to round t's rows, or None for FedAvg.

    The replay feeds the rule the rows of the remaining clients of each replayed round, in
    order, from a fresh state (FedSECA's momentum starts at zero, as in FL). BRACE's step is that
    of the FL round being replayed, scale / t**decay, not of the replay's own count, so a
    replayed round moves as far as it did in FL.
    """
    if aggregator is None or isinstance(aggregator, FedAvg):
        return None
    aggregator.reset()
    if isinstance(aggregator, BraceSign):
        def brace(rows, weights, present, t):
            g = torch.stack([torch.as_tensor(r).reshape(-1) for r in rows])
            lam = (BRACE_LAMBDA * g.shape[0] / BRACE_CLIENTS if aggregator.lam is None
                   else aggregator.lam)
            return aggregator.step_scale(t) * brace_sign(g, lam=lam).to(g.dtype)
        return brace

    def rule(rows, weights, present, t):
        return aggregator.direction({j: torch.as_tensor(r) for j, r in zip(present, rows)},
                                    dict(zip(present, weights)))
    return rule
