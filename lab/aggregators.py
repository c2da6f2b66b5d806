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

from common.robust_rules import (BRACE_CLIENTS, BRACE_DECAY, BRACE_LAMBDA, BRACE_SCALE, FEDSECA_BETA,
                                 FEDSECA_GAMMA, brace_lambda, brace_step_scale)
from protocols.robust_aggregation import brace_sign, fedseca, momentum
from protocols.starfish.robust_replay import RoundRule, RuleCombine

from lab.fl import aggregate

__all__ = ["FedAvg", "FedSECA", "BraceSign", "AGGREGATORS", "build_aggregator",
           "FEDSECA_GAMMA", "FEDSECA_BETA", "BRACE_LAMBDA", "BRACE_CLIENTS", "BRACE_SCALE",
           "BRACE_DECAY", "replay_rule"]



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
        return brace_step_scale(t, self.scale, self.decay)

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor:
        g = _stack(updates)
        self._round += 1
        lam = brace_lambda(BRACE_LAMBDA, g.shape[0]) if self.lam is None else self.lam
        return self.step_scale(self._round) * brace_sign(g, lam=lam).to(g.dtype)

    def params(self) -> dict[str, Any]:
        return {"lam": self.lam, "scale": self.scale, "decay": self.decay}


AGGREGATORS = {"fedavg": FedAvg, "fedseca": FedSECA, "brace-sign": BraceSign}


def build_aggregator(name: str, **params: Any) -> FedAvg | FedSECA | BraceSign:
    """``AGGREGATORS[name](**params)`` with a clear error for an unknown name."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name](**params)


def replay_rule(aggregator: FedAvg | FedSECA | BraceSign | None) -> RuleCombine | None:
    """The rule a replay (Stage II's ``combine``) applies to round t's rows, or None for FedAvg.

    The same :class:`protocols.starfish.robust_replay.RuleCombine` the servers' 2PC job builds
    from its rounds' metadata, here with every round made by ``aggregator``: the replay feeds
    it the rows of the remaining clients of each replayed round, in order, from a fresh state
    (FedSECA's momentum starts at zero, and restarts at round 1 as it did in FL). BRACE's step
    is that of the FL round being replayed, scale / t**decay, not of the replay's own count, so
    a replayed round moves as far as it did in FL.
    """
    if aggregator is None or isinstance(aggregator, FedAvg):
        return None
    aggregator.reset()
    if isinstance(aggregator, BraceSign):
        def rule_of(t: int) -> RoundRule:
            return RoundRule("brace-sign", step=aggregator.step_scale(t), lam=aggregator.lam)
    elif isinstance(aggregator, FedSECA):
        def rule_of(t: int) -> RoundRule:
            return RoundRule("fedseca", gamma=aggregator.gamma, beta=aggregator.beta, restart=t == 1)
    else:
        raise TypeError(f"no replay rule for {aggregator!r}")
    return RuleCombine(rule_of)
