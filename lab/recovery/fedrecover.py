"""FedRecover (Cao et al., IEEE S&P 2023) in plaintext: the Hessian-estimate baseline.

Replays every round t = 1..T from M_0. Remaining clients send exact updates in

* warm-up: the first ``warmup`` rounds, and until every client's pair buffer is full;
* periodic correction: every T_c-th round after warm-up (T_c = ceil(beta*T) unless given);
* final tuning: the last ``final_tuning`` rounds;
* abnormality fixing: any other round in which the client's estimate has a coordinate
  with |g_hat| > tau. FedRecover's tau is one global threshold over all stored updates of
  the remaining clients: the value a fraction ``abnormal_alpha`` of their coordinates
  exceed (estimated from a seeded sample of at most ``tau_sample`` coordinates);
  ``abnormal_alpha=None`` switches abnormality fixing off.

Default tolerance: FedRecover flags a client when *any* coordinate exceeds tau, so a tau
at the paper's alpha = 0.4 quantile flags every client in every round (no saving at all);
we default to alpha = 0.001 (tau near the largest stored coordinates), which flags the
genuinely abnormal estimates only.

Otherwise the server estimates g_hat^j = g_t^j + H^j (M_hat - M_{t-1}) with the compact
L-BFGS product and the same replay loop as Starfish (``protocols.starfish.replay``), and
steps M_hat <- M_hat - eta * sum_j w_j g_hat^j.

Partial participation, erased clients and unlearning rounds (docs/unlearning.md): "every round"
means every candidate round C (a remaining client took part); in each only the present
remaining clients count (weights renormalised over them), and the schedule counts replayed
rounds, not round indices: warm-up while fewer than ``warmup`` rounds were replayed or a
present client's buffer is not full, a periodic correction every T_c = ceil(beta |C|) replayed
rounds after the last warm-up round, final tuning in the last ``final_tuning`` replayed rounds.
``cost.correction_steps`` lists replay steps (= round indices under full participation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from protocols.starfish.params import PAPER, ceil_rate
from protocols.starfish.ports import History, candidate_rounds, rounds_of
from protocols.starfish.replay import Replay
from protocols.starfish.update_estimation import Inverse

from lab.fl import Participant, ProgressFn
from lab.recovery.base import ClientPool, CostRecord, PoolClients, RecoveryMethod, Timer, remaining_clients

__all__ = ["FedRecover", "global_threshold", "plain_inverse"]


def plain_inverse(a: torch.Tensor) -> torch.Tensor:
    """Plaintext inverse for the baseline (FedRecover has no secure counterpart here)."""
    return torch.linalg.inv(a)


def global_threshold(history: History, clients: Sequence[int], alpha: float,
                     sample: int = 2_000_000, seed: int = 0) -> float:
    """Value exceeded by a fraction ``alpha`` of all coordinates of the clients' updates."""
    pieces = []
    n_vecs = sum(len(rounds_of(history, j)) for j in clients)
    m = history.model(0).numel()
    per_vec = m if m * n_vecs <= sample else max(1, sample // n_vecs)
    gen = torch.Generator().manual_seed(seed)
    for i in range(1, history.num_rounds + 1):
        for j in clients:
            if j not in history.participants(i):
                continue
            g = torch.as_tensor(history.update(i, j)).reshape(-1).abs()
            if per_vec < m:
                g = g[torch.randint(m, (per_vec,), generator=gen)]
            pieces.append(g.to(torch.float64))
    values = torch.cat(pieces)
    k = math.floor(alpha * values.numel())
    if k >= values.numel():
        return 0.0
    return float(torch.kthvalue(values, values.numel() - k).values)


class _FedRecoverSchedule:
    """Warm-up, periodic correction, final tuning; otherwise abnormality fixing (|g_hat| > tau)."""

    def __init__(self, method: FedRecover, num_rounds: int, interval: int, tau: float,
                 cost: CostRecord) -> None:
        self.m = method
        self.T = num_rounds
        self.interval = interval
        self.tau = tau
        self.cost = cost
        self.warm = 0
        self.abnormal_total = 0

    def exact_now(self, step: int, t: int, replay: Replay) -> bool:
        in_warmup = self.warm < self.m.warmup or not replay.buffers.all_full(replay.present)
        periodic = (not in_warmup) and self.warm > 0 and (step - self.warm) % self.interval == 0
        final = step > self.T - self.m.final_tuning
        if in_warmup:
            self.warm = step
        elif periodic or final:
            self.cost.correction_steps.append(step)
        return in_warmup or periodic or final

    def rejected(self, step: int, t: int, estimates: Any, replay: Replay) -> list[int]:
        abnormal = estimates.abs().amax(dim=-1) > self.tau
        ids = [j for k, j in enumerate(replay.present) if bool(abnormal[k])]
        self.abnormal_total += len(ids)
        return ids


class FedRecover(RecoveryMethod):
    name = "fedrecover"

    def __init__(self, buffer: int = PAPER.buffer, warmup: int = PAPER.buffer, beta: float = PAPER.beta,
                 correction_period: int | None = None, final_tuning: int = 2,
                 abnormal_alpha: float | None = 0.001, server_lr: float | None = None,
                 inverse: Inverse | None = None, tau_sample: int = 2_000_000) -> None:
        self.buffer = buffer
        self.warmup = warmup
        self.beta = beta
        self.correction_period = correction_period
        self.final_tuning = final_tuning
        self.abnormal_alpha = abnormal_alpha
        self.server_lr = server_lr
        self.inverse = inverse or plain_inverse
        self.tau_sample = tau_sample

    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest, self.trainer)
        rounds = candidate_rounds(history, rest)
        T = len(rounds)                     # |C|; = history.num_rounds under full participation
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        tc = self.correction_period or max(1, ceil_rate(self.beta, T))
        cost = CostRecord(self.name, history.num_rounds, selected_rounds=list(rounds))
        with Timer() as timer:
            tau = (math.inf if self.abnormal_alpha is None
                   else global_threshold(history, rest, self.abnormal_alpha, self.tau_sample))
            replay = Replay(history, rest, PoolClients(pool), buffer=self.buffer, server_lr=eta,
                            inverse=self.inverse)
            schedule = _FedRecoverSchedule(self, T, tc, tau, cost)
            model = replay.run(rounds, schedule, progress)
        cost.estimated_updates = replay.estimated_updates
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = T
        cost.extra.update({"tau": tau, "warmup_rounds": schedule.warm, "correction_period": tc,
                           "abnormal_fixes": schedule.abnormal_total})
        pool.fill(cost)
        return model, cost
