"""Starfish's parameters, their paper defaults, and the two formulas built on them.

Why one home: the selection rate sigma, the tolerance rate alpha, the interval rate beta,
the buffer size B and the round-selection method are read by the lab, the servers, the
benchmarks, the CLI, the deployment config (``[unlearning]``) and the clients (alpha); each
used to spell its own defaults and its own ceil(). Here they are written once (paper Sec.
VI-A: sigma 0.6, alpha 0.4, beta 0.1, B 2), in ``common`` because the config and the clients
read them and import nothing above it (``protocols.starfish.params`` re-exports them), with

    T'  = ceil(sigma T)   rounds replayed (at least 1, at most T),
    T_c = ceil(beta T)    replayed rounds between two threshold checks (at least 1).

alpha acts in Stage I (each client's delta_i^j is the value a fraction alpha of its
|g_i^j| coordinates exceed); it is carried here so that one object describes a run.

Stage II passes |C| for T, the number of candidate rounds (rounds in which a remaining client
took part, ``ports.candidate_rounds``); with full participation |C| = T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["StarfishParams", "PAPER", "GUARD", "Method", "ceil_rate"]

Method = Literal["ratio", "divide", "auto"]


def ceil_rate(rate: float, num_rounds: int) -> int:
    """ceil(rate * T), rounded to 9 decimals first so that 0.6 * 40 = 24.000000000000004 is 24."""
    return math.ceil(round(rate * num_rounds, 9))


#: Default divergence guard ratio (docs/unlearning.md, "Divergence guard").
GUARD = 3.0


@dataclass(frozen=True)
class StarfishParams:
    """Parameters of one Stage II run.

    ``t_delta``: Method 1 (ratio) while T < t_delta under ``method="auto"``; None takes the
    measured default (``round_selection.default_t_delta``). ``server_lr``: the unlearning step
    size eta_u; None takes the history's eta.
    """

    sigma: float = 0.6
    alpha: float = 0.4
    beta: float = 0.1
    buffer: int = 2
    method: Method = "auto"
    t_delta: int | None = None
    server_lr: float | None = None
    #: the replay's divergence guard (``protocols.starfish.replay``): an estimated round whose
    #: opened step is longer than ``guard`` x the longest step of the history is redone with exact
    #: updates; 0 turns it off (the paper's Alg. 4 as written)
    guard: float = GUARD

    def __post_init__(self) -> None:
        if not 0.0 < self.sigma <= 1.0:
            raise ValueError("sigma must be in (0, 1]")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("alpha must be in [0, 1]")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError("beta must be in (0, 1]")
        if self.buffer < 1:
            raise ValueError("buffer size B must be >= 1")
        if self.method not in ("ratio", "divide", "auto"):
            raise ValueError(f"unknown round-selection method {self.method!r}")
        if self.t_delta is not None and self.t_delta < 0:
            raise ValueError("t_delta must be >= 0")
        if not (self.guard == 0.0 or self.guard >= 1.0):
            raise ValueError(f"guard must be 0 (off) or >= 1, got {self.guard}")

    def num_selected(self, num_rounds: int) -> int:
        """T' = ceil(sigma T), at least 1 and at most T."""
        return max(1, min(num_rounds, ceil_rate(self.sigma, num_rounds)))

    def correction_interval(self, num_rounds: int) -> int:
        """T_c = ceil(beta T), at least 1."""
        return max(1, ceil_rate(self.beta, num_rounds))


#: The paper's parameters (Sec. VI-A); every other default in the project refers to these.
PAPER = StarfishParams()
