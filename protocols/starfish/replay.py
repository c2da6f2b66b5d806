"""The replay of stored rounds on the recovered model: the loop Starfish and FedRecover share.

Why one loop: Starfish's Stage II, the FedRecover baseline and the per-step benchmark all
replay FL rounds t from M_hat = M_0 in the same way and differ only in *when* they ask the
clients for exact updates. Per replayed round t:

1. s = M_hat - M_{t-1} (public) and the stored updates g_t^j of the remaining clients;
2. the schedule says whether every client sends an exact update now (warm-up, periodic or
   final correction), or the updates are estimated (``UE``: g + H(M_hat - M_{t-1}) from the
   clients' L-BFGS pairs) and the schedule then names the clients whose estimate it rejects
   (Starfish: the threshold check; FedRecover: its abnormality test);
3. ``correction``: those clients' exact updates replace their rows; ``pairs``: their secants
   are offered to the L-BFGS buffers (kept if they pass the curvature test);
4. ``aggregate``: M_hat <- M_hat - eta sum_j w_j g^j with FedAvg weights renormalised over
   the remaining clients; the aggregate is the only value opened.

Each of the three phases is metered under its name when a meter is given. Works on plain
and shared values alike (docs/design.md 4.1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ContextManager, Protocol

import torch

from .backend import reveal, stack, to_compute, weighted_sum
from .correction import apply_corrections
from .pair_buffers import PairBuffers
from .ports import CorrectionClients, History
from .update_estimation import Inverse, estimate_updates

__all__ = ["Schedule", "Replay", "Meter", "ProgressFn", "no_meter"]

Meter = Callable[[str], ContextManager[Any]]
ProgressFn = Callable[[int, int, str], None]


def no_meter(_name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


class Schedule(Protocol):
    """When a replay asks for exact updates (the only thing the methods disagree on)."""

    def exact_now(self, step: int, round_index: int, replay: Replay) -> bool:
        """True: every remaining client sends its exact update in this round."""

    def rejected(self, step: int, round_index: int, estimates: Any, replay: Replay) -> list[int]:
        """Clients whose estimate is replaced by an exact update (ids from ``replay.rest``)."""


class Replay:
    """Replays rounds of ``history`` for the clients ``rest`` from M_hat = M_0."""

    def __init__(self, history: History, rest: Sequence[int], clients: CorrectionClients, *,
                 buffer: int, server_lr: float, meter: Meter = no_meter,
                 inverse: Inverse | None = None) -> None:
        self.history = history
        self.rest = list(rest)
        self.clients = clients
        self.buffers = PairBuffers(self.rest, buffer)
        self.eta = float(server_lr)
        self.meter = meter
        self.inverse = inverse
        self.out_dtype = history.model(0).dtype
        self.model = history.model(0).to(torch.float64).clone()
        self.step = 0
        self.estimated_updates = 0
        self.exact_requests: dict[int, list[int]] = {}
        self.last_aggregate: torch.Tensor | None = None

    def run(self, rounds: Sequence[int], schedule: Schedule,
            progress: ProgressFn | None = None) -> torch.Tensor:
        """Replay ``rounds`` in the given order; returns M_hat in the history's dtype."""
        for t in rounds:
            exact = self.replay_round(t, schedule)
            if progress is not None:
                progress(self.step, len(rounds), f"round {t}, exact {len(exact)}/{len(self.rest)}")
        return self.model.to(self.out_dtype)

    def replay_round(self, t: int, schedule: Schedule) -> list[int]:
        """One replayed round (module docstring); returns the clients asked for exact updates."""
        self.step += 1
        history, rest = self.history, self.rest
        w_all = history.weights(t)
        wsum = sum(w_all[j] for j in rest)
        weights = [w_all[j] / wsum for j in rest]
        s = self.model - history.model(t - 1).to(torch.float64)
        stored = [to_compute(history.update(t, j)) for j in rest]
        rows: list[Any] = [None] * len(rest)
        if schedule.exact_now(self.step, t, self):
            exact_ids = list(rest)
        else:
            with self.meter("UE"):
                S, Y = self.buffers.stacked(rest)
                est = estimate_updates(stack(stored), s, S, Y, self.inverse)
            self.estimated_updates += len(rest)
            rows = [est[r] for r in range(len(rest))]
            exact_ids = schedule.rejected(self.step, t, est, self)
        if exact_ids:
            self.exact_requests[self.step] = list(exact_ids)
            with self.meter("correction"):
                secants = apply_corrections(self.clients, t, self.model.to(self.out_dtype), exact_ids,
                                            rest, stored, rows)
            with self.meter("pairs"):
                self.buffers.push_many(list(secants), s, list(secants.values()))
        with self.meter("aggregate"):
            aggregate = reveal(weighted_sum(rows, weights)).to(torch.float64)
            self.model = self.model - self.eta * aggregate
        self.last_aggregate = aggregate
        return exact_ids
