"""Retrain from scratch: FL again from M_0 with the remaining clients only.

The gold standard every other method is measured against: it trivially contains no
trace of the targets, and costs every remaining client all T rounds (ARP = 0).
It reuses the Stage I coordinator, so with per-(client, round) seeds it equals a plain FL
run that never included the targets, bit for bit.

Partial participation, erased clients and unlearning rounds (docs/unlearning.md): by default the
retraining follows the history's participation pattern restricted to the remaining clients: one
round per candidate round C (a remaining client took part) in which exactly those remaining
clients train (FedAvg weights over them), i.e. the FL the deadlines would have produced without
the targets; unlearning rounds and rounds of targets only drop out. Under full participation
that is T rounds of all remaining clients, as before. With ``rounds`` given, all remaining
clients train in every one of those rounds (no pattern is known beyond the history).

Aggregation: ``aggregator`` (``lab.aggregators``; default None = FedAvg) must be the
rule the history was made with, so the retrained model is what that FL would have produced
without the targets; remaining Byzantine clients keep attacking (an omniscient one still sees
the others' uploads through the pool's counted views).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocols.starfish.ports import History, candidate_rounds, present_clients

from lab.fl import Aggregator, Participant, ProgressFn, run_federated
from lab.recovery.base import ClientPool, CostRecord, RecoveryMethod, Timer, remaining_clients

__all__ = ["Retrain"]


class Retrain(RecoveryMethod):
    name = "retrain"

    def __init__(self, rounds: int | None = None, aggregator: Aggregator | None = None) -> None:
        self.rounds = rounds  # default: as many rounds as the history has
        self.aggregator = aggregator

    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest, self.trainer)
        if self.rounds:
            rounds, pattern = self.rounds, None
        else:
            kept = candidate_rounds(history, rest)
            rounds, pattern = len(kept), [present_clients(history, t, rest) for t in kept]
        cost = CostRecord(self.name, history.num_rounds)
        with Timer() as timer:
            wrapped = [pool.participant(j) for j in rest]
            new_hist = run_federated(wrapped, history.model(0), rounds, history.server_lr,
                                     progress=progress, participation=pattern,
                                     aggregator=self.aggregator, trainer=pool.trainer())
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = rounds
        cost.stored = {"rounds": 0, "updates": 0, "models": 0, "bytes": 0}
        pool.fill(cost)
        return new_hist.model(new_hist.num_rounds), cost
