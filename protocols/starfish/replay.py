"""The replay of stored rounds on the recovered model: the loop Starfish and FedRecover share.

Why one loop: Starfish's Stage II, the FedRecover baseline and the per-step benchmark all
replay FL rounds t from M_hat = M_0 in the same way and differ only in *when* they ask the
clients for exact updates. Per replayed round t, with present_t = the remaining clients that
took part in round t (public; all of them under full participation):

1. s = M_hat - M_{t-1} (public, M_{t-1} the round's own stored model) and the stored updates
   g_t^j of the present clients;
2. the schedule says whether every present client sends an exact update now (warm-up,
   periodic or final correction), or their updates are estimated (``UE``: g + H(M_hat -
   M_{t-1}) from the clients' L-BFGS pairs) and the schedule then names the clients whose
   estimate it rejects (Starfish: the threshold check; FedRecover: its abnormality test);
3. ``correction``: those clients' exact updates replace their rows; ``pairs``: their secants
   are offered to the L-BFGS buffers (kept if they pass the curvature test). A client the port
   leaves out (no answer in time, an answer refused by the servers' range check) is absent from
   the step: a flagged client keeps its estimate; in a warm-up step, where it has none, it is
   left out of the round like a client that did not take part (the others' weights
   renormalised; nobody left: M_hat carries over). Its buffer is unchanged either way;
4. ``aggregate``: M_hat <- M_hat - eta sum_j w_j g^j with the stored FedAvg weights of round
   t renormalised over present_t; the aggregate is the only value opened. Where the schedule
   reads no estimate of the round (``Schedule.reads_estimates``), a shared replay without reused
   masks forms that sum directly, without each client's row (``estimate_aggregate``, issue 26). A history made by
   another rule (the lab's robust aggregators) can be replayed with that rule instead:
   ``combine(rows, weights, present, t)`` returns the opened direction of round t.

Divergence guard (``guard`` = R > 0; Starfish's default, ``StarfishParams.guard``): the compact
L-BFGS estimate is a secant model, and on a deep non-convex model (the paper's CNN on
Fashion-MNIST) pairs whose secants are not curvature (5 local epochs of SGD from a slightly
different model) can give an H whose estimates grow about 20x per replayed round; the threshold
check comes only every T_c rounds, so the model was destroyed (NaN) before the next check
(measured: docs/unlearning.md, "Divergence guard"). So, in an estimated round, the opened step
eta * G_hat is compared with the longest step of the history, max_t ||M_{t-1} - M_t|| (public:
the global models are); longer than R times that, the round is redone as a correction step:
every present client not already corrected sends its exact update (its pair is offered to its
buffer) and the aggregate is opened again. Only public values decide; what it reveals beyond
the paper is the discarded estimated aggregate, which the paper reveals for every replayed
round anyway.

Rounds without a present client (an unlearning round, a round of targets only) cannot be
replayed (``replay_round`` refuses them); callers replay only candidate rounds
(``ports.candidate_rounds``) and M_hat carries over the rounds they skip.

In step with the history: while the replay has only reproduced stored rounds, M_hat *is* a
stored model. It starts as M_0; replaying round t when M_hat is M_{t-1} and every participant
of t is present (no target, no erased client: the renormalised weights are the stored ones)
gives M_t again. Such a round's s is 0 by construction and is taken as exactly 0 (no L-BFGS
pair: it would carry no curvature, only rounding, which differs between 2PC and plaintext); the
decision is public (participation and the replayed rounds are). Under full participation only
a replay that starts with round 1 is in step, and only in its first step (s = M_0 - M_0 = 0).

Each of the three phases is metered under its name when a meter is given. Works on plain
and shared values alike (docs/design.md 4.1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, ContextManager, Protocol

import torch

from mpc import reused_masks

from protocols.backend import is_shared, reveal, stack, to_compute, weighted_sum
from protocols.sharded import is_sharded
from .correction import apply_corrections
from .pair_buffers import PairBuffers
from .ports import CorrectionClients, History
from .update_estimation import Inverse, estimate_aggregate, estimate_updates

__all__ = ["Schedule", "Replay", "Combine", "Meter", "ProgressFn", "no_meter", "longest_step"]

Meter = Callable[[str], ContextManager[Any]]
ProgressFn = Callable[[int, int, str], None]


#: ``combine(rows, weights, present, t)``: the direction of replayed round ``t`` from its rows (one
#: per present client, estimated or exact), their renormalised FedAvg weights and the client ids.
Combine = Callable[[list, list, list, int], Any]


def no_meter(_name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


class Schedule(Protocol):
    """When a replay asks for exact updates (the only thing the methods disagree on)."""

    def exact_now(self, step: int, round_index: int, replay: Replay) -> bool:
        """True: every present client (``replay.present``) sends its exact update in this round."""

    def rejected(self, step: int, round_index: int, estimates: Any, replay: Replay) -> list[int]:
        """Clients whose estimate is replaced by an exact update (ids from ``replay.present``,
        whose order the rows of ``estimates`` follow)."""

    # Optional: ``reads_estimates(step, round_index, replay) -> bool``, False where ``rejected``
    # would neither look at this step's estimates nor reject any. A schedule without it is asked
    # every step. Where it says False, a shared replay without reused masks forms only the
    # round's aggregate of the estimates (``estimate_aggregate``: no per-client m-long product).


class Replay:
    """Replays rounds of ``history`` for the clients ``rest`` from M_hat = M_0.

    ``present``: the remaining clients of the round being replayed (set before the schedule is
    asked); ``present_rows``: their positions in ``rest``; ``synced_round``: r while M_hat is
    the stored M_r by construction (module docstring), else None.
    """

    def __init__(self, history: History, rest: Sequence[int], clients: CorrectionClients, *,
                 buffer: int, server_lr: float, meter: Meter = no_meter,
                 inverse: Inverse | None = None, combine: Combine | None = None,
                 guard: float = 0.0) -> None:
        self.history = history
        self.rest = list(rest)
        self.clients = clients
        self.buffers = PairBuffers(self.rest, buffer)
        self.eta = float(server_lr)
        self.meter = meter
        self.inverse = inverse
        self.combine = combine
        self.out_dtype = history.model(0).dtype
        self.model = history.model(0).to(torch.float64).clone()
        self.step = 0
        self.estimated_updates = 0
        # plaintext only: the largest |g_hat| seen, beside SecTC's 32-bit domain (docs/protocols.md)
        self.largest_estimate: float | None = None
        self.exact_requests: dict[int, list[int]] = {}
        self.absent_answers: dict[int, list[int]] = {}   # step -> asked but no accepted answer
        self.last_aggregate: torch.Tensor | None = None
        self.present: list[int] = list(self.rest)
        self.present_rows: list[int] = list(range(len(self.rest)))
        self.synced_round: int | None = 0
        self.guard = float(guard)
        self.guard_steps: list[int] = []        # replay steps the divergence guard redid exactly
        self._longest_step: float | None = None

    def run(self, rounds: Sequence[int], schedule: Schedule,
            progress: ProgressFn | None = None) -> torch.Tensor:
        """Replay ``rounds`` in the given order; returns M_hat in the history's dtype."""
        for t in rounds:
            exact = self.replay_round(t, schedule)
            if progress is not None:
                progress(self.step, len(rounds), f"round {t}, exact {len(exact)}/{len(self.present)}")
        return self.model.to(self.out_dtype)

    def replay_round(self, t: int, schedule: Schedule) -> list[int]:
        """One replayed round (module docstring); returns the clients asked for exact updates."""
        history = self.history
        taken = set(history.participants(t))
        rows_of = [r for r, j in enumerate(self.rest) if j in taken]
        if not rows_of:
            raise ValueError(f"round {t} has no remaining client to replay")
        self.step += 1
        present = [self.rest[r] for r in rows_of]     # present_t, in the order of self.rest
        self.present, self.present_rows = present, rows_of
        w_all = history.weights(t)
        wsum = sum(w_all[j] for j in present)
        weights = [w_all[j] / wsum for j in present]
        in_step = self.synced_round == t - 1
        s = self.model - history.model(t - 1).to(torch.float64)
        if in_step:
            s = torch.zeros_like(s)      # M_hat is M_{t-1}: s = 0, not rounding noise
        stored = [to_compute(history.update(t, j)) for j in present]
        rows: list[Any] = [None] * len(present)
        folded = None     # the estimates' weighted sum, where only it was formed
        if schedule.exact_now(self.step, t, self):
            exact_ids = list(present)
        else:
            # the reused masks' products (dealer mode) depend on the buffers, so their material is
            # fetched here, as the estimate's offline part (the benchmarks' "offline:" steps)
            with self.meter("offline:UE"):
                y_masks = self.buffers.masked_columns(present)
                if y_masks is not None:
                    reused_masks.prefetch_matvec(y_masks)
            self.estimated_updates += len(present)
            if self._folds(schedule, t, stored, y_masks):
                with self.meter("UE"):
                    S, Y = self.buffers.stacked(present)
                    folded = estimate_aggregate(stack(stored), weights, s, S, Y, self.inverse)
                exact_ids = []
            else:
                with self.meter("UE"):
                    est = self._estimate(present, stored, s, y_masks)
                rows = [est[r] for r in range(len(present))]
                exact_ids = schedule.rejected(self.step, t, est, self)
        if exact_ids:
            self.exact_requests[self.step] = list(exact_ids)
            self._correct(t, exact_ids, present, stored, rows, s)
            if any(row is None for row in rows):
                # a warm-up step whose client gave no (accepted) answer: no estimate exists, so the
                # client is absent from this round as under partial participation (weights
                # renormalised over the others, its buffer unchanged); the ids are public
                keep = [r for r, row in enumerate(rows) if row is not None]
                present = [present[r] for r in keep]
                rows = [rows[r] for r in keep]
                wsum = sum(w_all[j] for j in present)
                weights = [w_all[j] / wsum for j in present]
                if not present:   # nobody answered: M_hat carries over, as for a skipped round
                    self.synced_round = None
                    return exact_ids
        with self.meter("aggregate"):
            if folded is not None:
                aggregate = reveal(folded).to(torch.float64)
            else:
                aggregate = self._open_aggregate(rows, weights, present, t)
        if self.guard > 0 and len(exact_ids) < len(present) and self._diverging(aggregate):
            self.guard_steps.append(self.step)
            late = [j for j in present if j not in set(exact_ids)]
            exact_ids = list(exact_ids) + late
            self.exact_requests[self.step] = list(exact_ids)
            self._correct(t, late, present, stored, rows, s)
            missing = [r for r, row in enumerate(rows) if row is None]
            if missing:
                # a folded round whose late client gave no answer keeps its estimate, which was
                # never formed on its own: those rows are estimated now (their buffers are as
                # they were: an absent client offers no pair)
                with self.meter("UE"):
                    est = self._estimate([present[r] for r in missing], [stored[r] for r in missing], s, None)
                for k, r in enumerate(missing):
                    rows[r] = est[k]
            with self.meter("aggregate"):
                aggregate = self._open_aggregate(rows, weights, present, t)
        self.model = self.model - self.eta * aggregate
        self.last_aggregate = aggregate
        everyone = len(present) == len(history.participants(t)) and abs(wsum - 1.0) <= 1e-9
        self.synced_round = t if in_step and everyone else None
        return exact_ids

    def _folds(self, schedule: Schedule, t: int, stored: list, y_masks: Any) -> bool:
        """Whether this estimated round forms only its aggregate (``Schedule.reads_estimates``):
        FedAvg's replay of shared rows on one machine without reused masks (two-party mode)."""
        reads = getattr(schedule, "reads_estimates", None)
        return (reads is not None and not reads(self.step, t, self) and self.combine is None
                and y_masks is None and all(is_shared(g) and not is_sharded(g) for g in stored))

    def _estimate(self, present: list, stored: list, s: torch.Tensor, y_masks: Any) -> Any:
        """The present clients' estimated updates, one row each (``estimate_updates``)."""
        S, Y = self.buffers.stacked(present)
        est = estimate_updates(stack(stored), s, S, Y, self.inverse, y_masks=y_masks)
        if not is_shared(est):
            peak = float(torch.as_tensor(est).abs().max()) if est.numel() else 0.0
            self.largest_estimate = max(peak, self.largest_estimate or 0.0)
        return est

    def _correct(self, t: int, ids: list, present: list, stored: list, rows: list, s: torch.Tensor) -> None:
        """Ask ``ids`` for their exact updates on M_hat: each answer replaces its row in ``rows``
        and offers its secant to the client's buffer; who gave none is recorded as absent."""
        with self.meter("correction"):
            secants = apply_corrections(self.clients, t, self.model.to(self.out_dtype), ids,
                                        present, stored, rows)
        absent = [j for j in ids if j not in secants]
        if absent:
            self.absent_answers.setdefault(self.step, []).extend(absent)
        with self.meter("pairs"):
            if secants:
                self.buffers.push_many(list(secants), s, list(secants.values()))

    def _open_aggregate(self, rows: list, weights: list, present: list, t: int) -> torch.Tensor:
        """The round's opened direction: FedAvg of the rows, or the history's own rule."""
        if self.combine is None:
            return reveal(weighted_sum(rows, weights)).to(torch.float64)
        return torch.as_tensor(self.combine(rows, weights, present, t)).to(torch.float64)

    def _diverging(self, aggregate: torch.Tensor) -> bool:
        """Whether eta * G_hat is longer than ``guard`` x the history's longest step (public) or
        not finite (a plaintext estimate can overflow; 2PC's cannot, its aggregate then is huge)."""
        if self._longest_step is None:
            self._longest_step = longest_step(self.history)
        step = float((self.eta * aggregate).norm())
        return not math.isfinite(step) or step > self.guard * self._longest_step


def longest_step(history: History) -> float:
    """max_t ||M_{t-1} - M_t|| over the history's global models (public). A history that keeps
    only some models (Crab's storage view) gives, between two kept models M_a and M_b, the mean
    step ||M_a - M_b|| / (b - a), which is no longer than the longest (a stricter guard)."""
    kept = []
    for i in range(history.num_rounds + 1):
        try:
            kept.append((i, history.model(i).double()))
        except LookupError:       # not stored by the view (Crab's NotStored)
            continue
    steps = [float((ma - mb).norm()) / (b - a) for (a, ma), (b, mb) in zip(kept, kept[1:])]
    return max(steps, default=0.0)
