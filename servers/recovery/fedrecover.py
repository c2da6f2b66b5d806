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
L-BFGS product (``protocols.starfish.update_estimation``, the same code as Starfish), and
steps M_hat <- M_hat - eta * sum_j w_j g_hat^j.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protocols.starfish.update_estimation import Inverse, estimate_updates

from ..fl import Participant, ProgressFn
from ..history import History
from .base import ClientPool, CostRecord, RecoveryMethod, Timer, remaining_clients
from ..lbfgs_pairs import PairBuffers

__all__ = ["FedRecover", "global_threshold", "plain_inverse"]


def plain_inverse(a: torch.Tensor) -> torch.Tensor:
    """Plaintext inverse for the baseline (FedRecover has no secure counterpart here)."""
    return torch.linalg.inv(a)


def global_threshold(history: History, clients: Sequence[int], alpha: float,
                     sample: int = 2_000_000, seed: int = 0) -> float:
    """Value exceeded by a fraction ``alpha`` of all coordinates of the clients' updates."""
    pieces = []
    n_vecs = history.num_rounds * len(clients)
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


class FedRecover(RecoveryMethod):
    name = "fedrecover"

    def __init__(self, buffer: int = 2, warmup: int = 2, beta: float = 0.1,
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
        pool = ClientPool(participants, rest)
        T = history.num_rounds
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        tc = self.correction_period or max(1, math.ceil(round(self.beta * T, 9)))
        cost = CostRecord(self.name, T, selected_rounds=list(range(1, T + 1)))
        with Timer() as timer:
            tau = (math.inf if self.abnormal_alpha is None
                   else global_threshold(history, rest, self.abnormal_alpha, self.tau_sample))
            buffers = PairBuffers(rest, self.buffer)
            m0_dtype = history.model(0).dtype
            model = history.model(0).to(torch.float64).clone()
            warm = 0
            abnormal_total = 0
            for t in range(1, T + 1):
                for j in rest:
                    if j not in history.participants(t):
                        raise NotImplementedError("FedRecover here assumes full participation")
                w_all = history.weights(t)
                wsum = sum(w_all[j] for j in rest)
                w = {j: w_all[j] / wsum for j in rest}
                s = model - history.model(t - 1).to(torch.float64)
                stored = {j: torch.as_tensor(history.update(t, j)).to(torch.float64) for j in rest}
                in_warmup = warm < self.warmup or not buffers.all_full()
                periodic = (not in_warmup) and warm > 0 and (t - warm) % tc == 0
                final = t > T - self.final_tuning
                used: dict[int, torch.Tensor] = {}
                if in_warmup or periodic or final:
                    if in_warmup:
                        warm = t
                    else:
                        cost.correction_steps.append(t)
                    exact_ids = list(rest)
                else:
                    S, Y = buffers.stacked(rest)
                    est = estimate_updates(torch.stack([stored[j] for j in rest]), s, S, Y,
                                           self.inverse)
                    cost.estimated_updates += len(rest)
                    abnormal = est.abs().amax(dim=-1) > tau
                    exact_ids = [j for k, j in enumerate(rest) if bool(abnormal[k])]
                    abnormal_total += len(exact_ids)
                    for k, j in enumerate(rest):
                        used[j] = est[k]
                for j in exact_ids:
                    gbar = pool.exact(j, model.to(m0_dtype), t).to(torch.float64)
                    buffers.push(j, s, gbar - stored[j])
                    used[j] = gbar
                model = model - eta * sum(w[j] * used[j] for j in rest)
                if progress is not None:
                    progress(t, T, f"exact {len(exact_ids)}/{len(rest)}")
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = T
        cost.extra.update({"tau": tau, "warmup_rounds": warm, "correction_period": tc,
                           "abnormal_fixes": abnormal_total})
        pool.fill(cost)
        return model.to(history.model(0).dtype), cost
