"""FedEraser (Liu et al., IWQoS 2021): calibrate stored updates with cheap fresh ones.

Every ``interval``-th round of the history (rounds 1, 1+interval, ...) is replayed from
M_0. In each, every remaining client runs a short calibration training (``epoch_ratio``
of its usual local epochs) on the current unlearned model, and the server replaces the
stored update by one with the *direction of the old* update and the *norm of the new*:

    U_tilde^j = ||U_new^j|| * U_old^j / ||U_old^j||,
    M_tilde  <- M_tilde - eta * sum_j w_j U_tilde^j    (w renormalised over the rest).

Why it is a baseline: it needs no Hessian but every remaining client works in every
calibration round, and the norms of half-epoch updates understate the original steps.

Partial participation, erased clients and unlearning rounds (docs/unlearning.md): the rounds
counted are the candidate rounds C (a remaining client took part; every round under full
participation), every ``interval``-th of them is calibrated, and in each only the remaining
clients that took part in it train (weights renormalised over them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocols.starfish.ports import History, candidate_rounds, present_clients

from lab.fl import Participant, ProgressFn
from lab.recovery.base import ClientPool, CostRecord, RecoveryMethod, Timer, remaining_clients

__all__ = ["FedEraser", "calibrate"]


def calibrate(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """||new|| * old / ||old|| (the new update itself when the old one is zero)."""
    n_old = old.norm()
    if float(n_old) == 0.0:
        return new
    return old * (new.norm() / n_old)


class FedEraser(RecoveryMethod):
    name = "federaser"

    def __init__(self, interval: int = 2, epoch_ratio: float = 0.5,
                 local_epochs: float | None = None, server_lr: float | None = None) -> None:
        if interval < 1:
            raise ValueError("interval must be >= 1")
        self.interval = interval
        self.epoch_ratio = epoch_ratio
        self.local_epochs = local_epochs  # default: each client's own epochs
        self.server_lr = server_lr

    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest, self.trainer)
        by_id = {p.client_id: p for p in participants}
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        rounds = candidate_rounds(history, rest)[::self.interval]
        cost = CostRecord(self.name, history.num_rounds, selected_rounds=rounds)
        with Timer() as timer:
            m0_dtype = history.model(0).dtype
            model = history.model(0).to(torch.float64).clone()
            for step, t in enumerate(rounds, 1):
                present = present_clients(history, t, rest)
                sizes = {j: pool.num_samples(j) for j in present}
                total = float(sum(sizes.values()))
                agg = torch.zeros_like(model)
                epochs = {j: (self.local_epochs or float(getattr(by_id[j], "epochs", 1.0)))
                          * self.epoch_ratio for j in present}
                fresh = pool.exact_many(present, model.to(m0_dtype), t, epochs=epochs)
                for j in present:
                    new = fresh[j].to(torch.float64)
                    old = torch.as_tensor(history.update(t, j)).to(torch.float64)
                    agg += (sizes[j] / total) * calibrate(old, new)
                model = model - eta * agg
                if progress is not None:
                    progress(step, len(rounds), f"round {t}")
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = len(rounds)
        # FedEraser keeps only the calibrated rounds' updates (of every participant: who will
        # be forgotten is unknown while storing) and starts from M_0
        n_updates = sum(len(history.participants(t)) for t in rounds)
        cost.stored = {"rounds": len(rounds), "updates": n_updates, "models": 1,
                       "bytes": 4 * model.numel() * (n_updates + 1)}
        pool.fill(cost)
        return model.to(history.model(0).dtype), cost
