"""Starfish unlearning (Alg. 4, Stage II) in the lab, and its random-selection baseline.

The algorithm itself is ``protocols.starfish.run_stage2``, the same function the secure
servers run on shares; this module adapts it to the lab's RecoveryMethod interface (a
ClientPool answers the correction requests and counts client work for ARP).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from protocols.starfish.params import StarfishParams
from protocols.starfish.ports import History, candidate_rounds
from protocols.starfish.round_selection import starfish_select
from protocols.starfish.stage2 import run_stage2
from protocols.starfish.update_estimation import Inverse

from lab.aggregators import replay_rule
from lab.fl import Participant, ProgressFn
from lab.recovery.base import ClientPool, CostRecord, PoolClients, RecoveryMethod, Timer, remaining_clients

__all__ = ["Starfish", "RandomSelection"]


class Starfish(RecoveryMethod):
    """Plaintext Starfish: ``protocols.starfish.run_stage2`` on a plaintext history."""

    name = "starfish"

    def __init__(self, params: StarfishParams | None = None, *, inverse: Inverse | None = None,
                 aggregator: Any = None, **overrides: Any) -> None:
        """``params`` (default: the paper's), or single fields as keywords (sigma=, beta=, ...).

        ``aggregator``: the lab rule that made the history (``lab.aggregators``); the
        replay then steps with it instead of FedAvg (None or FedAvg: the paper's replay).
        """
        base = params or StarfishParams()
        self.params = StarfishParams(**{**base.__dict__, **overrides}) if overrides else base
        self.inverse = inverse
        self.aggregator = aggregator

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
        pool = ClientPool(participants, rest, self.trainer)
        cost = CostRecord(self.name, history.num_rounds)
        with Timer() as timer:
            res = run_stage2(None, history, targets, self.params, PoolClients(pool), progress,
                             inverse=self.inverse, select=self.select,
                             combine=replay_rule(self.aggregator))
        cost.wall_time_s = timer.elapsed
        cost.selected_rounds = res.selected_rounds
        cost.correction_steps = res.correction_steps
        cost.estimated_updates = res.estimated_updates
        cost.rounds_used = len(res.selected_rounds)
        cost.extra.update({"warmup_steps": res.warmup_steps,
                           "correction_interval": self.params.correction_interval(len(res.candidate_rounds)),
                           "candidate_rounds": list(res.candidate_rounds),
                           "flagged_corrections": sum(len(v) for v in res.flags.values()),
                           "flags": {int(step): list(ids) for step, ids in res.flags.items()},
                           "guard_steps": list(res.guard_steps), "guard": self.params.guard,
                           "sigma": self.params.sigma, "beta": self.params.beta,
                           "buffer": self.params.buffer,
                           "replay_rule": getattr(self.aggregator, "name", "fedavg")})
        pool.fill(cost)
        return res.model, cost


class RandomSelection(Starfish):
    """Starfish's replay on T' rounds chosen uniformly at random (seeded) - a baseline."""

    name = "random"

    def __init__(self, params: StarfishParams | None = None, *, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.seed = seed

    def select(self, history: History, targets: Sequence[int], k: int,
               params: StarfishParams | None = None) -> list[int]:
        """k of the candidate rounds C (every round under full participation), seeded."""
        rng = np.random.default_rng(self.seed)
        rounds = candidate_rounds(history, remaining_clients(history, targets))
        chosen = rng.choice(np.asarray(rounds), size=k, replace=False)
        return sorted(int(c) for c in chosen)
