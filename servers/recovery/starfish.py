"""Starfish unlearning (Alg. 4, Stage II) and its random-round-selection baseline.

The loop below is written against the History interface and the four sub-protocols of
``protocols.starfish``; it never looks inside a client's update except through them, and
it reveals exactly what the paper reveals: the selected round indices, the correction
flags, and the aggregated estimate G_hat of every replayed round (M_hat is public).
With a plaintext History it is the plaintext Starfish of the lab; the secure servers run
it on a History whose per-client values are shares.

Steps (DESIGN.md 3, Stage II):

1. delta^j = max_i delta_i^j for the remaining clients (``determine_thresholds``).
2. Select T' = ceil(sigma*T) rounds by the cosine similarity of the target's update with
   the global step (``selection_keys`` + ``select_rounds``), chronological order.
3. Replay the selected rounds from M_0. While some client's pair buffer holds fewer than
   B pairs (warm-up), all remaining clients send exact updates. Afterwards the servers
   estimate every update (``estimate_updates``); every T_c = ceil(beta*T)-th replayed
   round they check the estimates against the thresholds (``check_thresholds``), and the
   flagged clients send exact updates, which replace their estimates and refresh their
   buffers.
4. M_hat <- M_hat - eta_u * sum_j w_j g_use^j with FedAvg weights renormalised over the
   remaining clients; eta_u defaults to the FL server step.

Schedule detail the paper leaves open: "t_i mod T_c == 0" (Alg. 4 line 15) is read with
t_i the position of the round in the replay (1..T'), so corrections come every T_c
replayed rounds regardless of which historical rounds were selected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from protocols.starfish import (
    check_thresholds,
    combine_targets,
    determine_thresholds,
    estimate_updates,
    num_selected,
    select_rounds,
    selection_keys,
)
from protocols.starfish.backend import reveal, stack, to_compute, weighted_sum
from protocols.starfish.round_selection import DEFAULT_T_DELTA, Method
from protocols.starfish.update_estimation import Inverse

from ..fl import Participant, ProgressFn
from ..history import History
from .base import ClientPool, CostRecord, RecoveryMethod, Timer, remaining_clients
from .pairs import PairBuffers

__all__ = ["Starfish", "RandomSelection", "STARFISH_DEFAULTS"]

#: Paper defaults (Sec. VI-A): selection rate, tolerance rate, interval rate, buffer.
#: alpha is used by the clients in Stage I (it shapes delta_i^j), not here.
STARFISH_DEFAULTS = {"sigma": 0.6, "alpha": 0.4, "beta": 0.1, "buffer": 2}


class Starfish(RecoveryMethod):
    name = "starfish"

    def __init__(self, sigma: float = 0.6, beta: float = 0.1, buffer: int = 2,
                 method: Method = "auto", t_delta: int = DEFAULT_T_DELTA,
                 server_lr: float | None = None, inverse: Inverse | None = None) -> None:
        self.sigma = sigma
        self.beta = beta
        self.buffer = buffer
        self.method = method
        self.t_delta = t_delta
        self.server_lr = server_lr
        self.inverse = inverse

    # ------------------------------------------------------------------ round selection
    def select(self, history: History, targets: Sequence[int], k: int) -> list[int]:
        """SecRS: the k rounds most aligned with the targets, chronological."""
        T = history.num_rounds
        rounds = range(1, T + 1)
        for i in rounds:
            if any(t not in history.participants(i) for t in targets):
                raise NotImplementedError("round selection assumes the targets took part "
                                          "in every round")
        dm = torch.stack([history.model_delta(i) for i in rounds]).to(torch.float64)
        if len(targets) == 1:
            t = targets[0]
            g = stack([to_compute(history.update(i, t)) for i in rounds])
            norms = stack([to_compute(history.norm(i, t)) for i in rounds])
            u, v = selection_keys(g, dm, norms)
        else:
            per_round = []
            for i in rounds:
                w = history.weights(i)
                wt = [w[t] for t in targets]
                total = sum(wt)
                per_round.append(combine_targets([to_compute(history.update(i, t)) for t in targets],
                                                 [x / total for x in wt]))
            u, v = selection_keys(stack(per_round), dm, None)
        return select_rounds(u, v, k, self.method, self.t_delta)

    # ------------------------------------------------------------------ the replay
    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        targets = sorted(set(targets))
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest)
        T = history.num_rounds
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        tc = max(1, math.ceil(round(self.beta * T, 9)))
        k = num_selected(T, self.sigma)
        cost = CostRecord(self.name, T)
        with Timer() as timer:
            for i in range(1, T + 1):
                if any(j not in history.participants(i) for j in rest):
                    raise NotImplementedError("Starfish here assumes full participation")
            deltas = stack([stack([to_compute(history.delta(i, j)) for i in range(1, T + 1)])
                            for j in rest])
            thresholds = determine_thresholds(deltas)
            selected = self.select(history, targets, k)
            cost.selected_rounds = list(selected)
            buffers = PairBuffers(rest, self.buffer)
            m0_dtype = history.model(0).dtype
            model = history.model(0).to(torch.float64).clone()
            warmup_steps = 0
            flagged_total = 0
            for step, t in enumerate(selected, 1):
                w_all = history.weights(t)
                wsum = sum(w_all[j] for j in rest)
                w = [w_all[j] / wsum for j in rest]
                s = model - history.model(t - 1).to(torch.float64)
                stored = [to_compute(history.update(t, j)) for j in rest]
                rows: list[Any]
                exact_ids: list[int]
                if not buffers.all_full():
                    warmup_steps += 1
                    exact_ids = list(rest)
                    rows = [None] * len(rest)
                else:
                    S, Y = buffers.stacked(rest)
                    est = estimate_updates(stack(stored), s, S, Y, self.inverse)
                    cost.estimated_updates += len(rest)
                    rows = [est[r] for r in range(len(rest))]
                    exact_ids = []
                    if step % tc == 0:
                        cost.correction_steps.append(step)
                        flags = check_thresholds(est, thresholds)
                        exact_ids = [j for r, j in enumerate(rest) if int(flags[r]) == 1]
                        flagged_total += len(exact_ids)
                for r, j in enumerate(rest):
                    if j in exact_ids:
                        gbar = to_compute(pool.exact(j, model.to(m0_dtype), t))
                        buffers.push(j, s, gbar - stored[r])
                        rows[r] = gbar
                aggregate = weighted_sum(rows, w)        # sum_j w_j g_use^j (shared if shared)
                model = model - eta * reveal(aggregate).to(torch.float64)
                if progress is not None:
                    progress(step, len(selected), f"round {t}, exact {len(exact_ids)}/{len(rest)}")
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = len(selected)
        cost.extra.update({"warmup_steps": warmup_steps, "correction_interval": tc,
                           "flagged_corrections": flagged_total, "sigma": self.sigma,
                           "beta": self.beta, "buffer": self.buffer})
        pool.fill(cost)
        return model.to(history.model(0).dtype), cost


class RandomSelection(Starfish):
    """Starfish's replay on T' rounds chosen uniformly at random (seeded) - a baseline."""

    name = "random"

    def __init__(self, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed

    def select(self, history: History, targets: Sequence[int], k: int) -> list[int]:
        rng = np.random.default_rng(self.seed)
        chosen = rng.choice(np.arange(1, history.num_rounds + 1), size=k, replace=False)
        return sorted(int(c) for c in chosen)
