"""Starfish unlearning (Alg. 4, Stage II) in the lab, and its random-selection baseline.

The algorithm itself is ``servers.unlearning.run_stage2``, the same function the secure
servers run on shares; this module adapts it to the lab's RecoveryMethod interface (a
ClientPool answers the correction requests and counts client work for ARP).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from protocols.starfish.round_selection import DEFAULT_T_DELTA, Method
from protocols.starfish.update_estimation import Inverse

from ..fl import Participant, ProgressFn
from ..history import History
from ..unlearning import StarfishParams, run_stage2, starfish_select
from .base import ClientPool, CostRecord, RecoveryMethod, Timer, remaining_clients

__all__ = ["Starfish", "RandomSelection", "STARFISH_DEFAULTS"]

#: Paper defaults (Sec. VI-A): selection rate, tolerance rate, interval rate, buffer.
#: alpha is used by the clients in Stage I (it shapes delta_i^j), not here.
STARFISH_DEFAULTS = {"sigma": 0.6, "alpha": 0.4, "beta": 0.1, "buffer": 2}


class _PoolClients:
    """The lab's simulated clients behind Stage II's CorrectionClients interface."""

    def __init__(self, pool: ClientPool) -> None:
        self._pool = pool

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Any]:
        return {j: self._pool.exact(j, model, round_index) for j in client_ids}


class Starfish(RecoveryMethod):
    """Plaintext Starfish: ``servers.unlearning.run_stage2`` on a plaintext history."""

    name = "starfish"

    def __init__(self, sigma: float = 0.6, beta: float = 0.1, buffer: int = 2,
                 method: Method = "auto", t_delta: int = DEFAULT_T_DELTA,
                 server_lr: float | None = None, inverse: Inverse | None = None) -> None:
        self.params = StarfishParams(sigma=sigma, beta=beta, buffer=buffer, method=method,
                                     t_delta=t_delta, server_lr=server_lr)
        self.inverse = inverse

    @property
    def sigma(self) -> float:
        return self.params.sigma

    def select(self, history: History, targets: Sequence[int], k: int,
               params: StarfishParams | None = None) -> list[int]:
        """SecRS: the k rounds most aligned with the targets, chronological."""
        return starfish_select(history, targets, k, params or self.params)

    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest)
        cost = CostRecord(self.name, history.num_rounds)
        with Timer() as timer:
            res = run_stage2(None, history, targets, self.params, _PoolClients(pool), progress,
                             inverse=self.inverse, select=self.select)
        cost.wall_time_s = timer.elapsed
        cost.selected_rounds = res.selected_rounds
        cost.correction_steps = res.correction_steps
        cost.estimated_updates = res.estimated_updates
        cost.rounds_used = len(res.selected_rounds)
        T = history.num_rounds
        cost.extra.update({"warmup_steps": res.warmup_steps,
                           "correction_interval": max(1, math.ceil(round(self.params.beta * T, 9))),
                           "flagged_corrections": sum(len(v) for v in res.flags.values()),
                           "sigma": self.params.sigma, "beta": self.params.beta,
                           "buffer": self.params.buffer})
        pool.fill(cost)
        return res.model, cost


class RandomSelection(Starfish):
    """Starfish's replay on T' rounds chosen uniformly at random (seeded) - a baseline."""

    name = "random"

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def select(self, history: History, targets: Sequence[int], k: int,
               params: StarfishParams | None = None) -> list[int]:
        rng = np.random.default_rng(self.seed)
        chosen = rng.choice(np.arange(1, history.num_rounds + 1), size=k, replace=False)
        return sorted(int(c) for c in chosen)
