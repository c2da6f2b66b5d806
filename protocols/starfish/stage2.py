"""Stage II of Starfish (Alg. 4): one driver for the plaintext lab and the 2PC servers.

``run_stage2`` reads a :class:`protocols.starfish.ports.History` whose per-client values are plain
tensors (plaintext lab) or this party's CrypTen shares (secure servers) and runs the Starfish steps
(one module each in this package) on them. Every operation on client data goes
through those sub-protocols or through operators CrypTen tensors share with torch, so the
same lines run on both backends. What it reveals is what the paper reveals: the selected
round indices, the correction flags, and the aggregated estimate G_hat of every replayed
round (the recovered model M_hat is public).

Steps, each metered under its own name when a two-party ``party`` is given:

* ``TD``  delta^j = max_i delta_i^j for every remaining client (batched SecMax);
* ``RS``  the T' = ceil(sigma T) rounds most aligned with the targets (SecRS);
* ``UE``  replay of the selected rounds: warm-up with exact updates until every client's
  buffer holds B pairs, then FedRecover's estimate g + H(M_hat - M) (SecUE);
* ``aggregate``  sum_j w_j g^j of every replayed round and its reveal (public weights, so
  local sums and one opening);
* ``TC``  every T_c = ceil(beta T) replayed rounds, the threshold check (SecTC);
* ``correction``  exact updates of the warm-up and of flagged clients replace estimates
  and refresh the buffers.

Schedule detail the paper leaves open: "t_i mod T_c == 0" (Alg. 4 line 15) is read with t_i
the position of the round in the replay (1..T'), so checks come every T_c replayed rounds.

Partial participation, erased clients and unlearning rounds (docs/unlearning.md): T above is
|C|, the number of candidate rounds (rounds in which a remaining client took part,
``ports.candidate_rounds``); only rounds of C are selected and replayed; delta^j is the max over
the rounds client j took part in; a replayed round uses only its present remaining clients
(their weights renormalised, their estimates, their thresholds), and the warm-up lasts while a
*present* client's buffer is not full. Who took part in which round is public. With full
participation every one of these rules is the rule above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from protocols.backend import stack, to_compute
from .params import StarfishParams
from .ports import CorrectionClients, History, candidate_rounds, remaining_clients, rounds_of
from .replay import Combine, ProgressFn, Replay, no_meter
from .round_selection import starfish_select
from .threshold_check import check_thresholds
from .threshold_determination import determine_thresholds
from .update_estimation import Inverse

__all__ = ["Stage2Result", "run_stage2", "client_thresholds"]

Selector = Callable[[History, Sequence[int], int, StarfishParams], list[int]]


@dataclass
class Stage2Result:
    model: torch.Tensor
    selected_rounds: list[int]
    candidate_rounds: list[int] = field(default_factory=list)        # C (public)
    thresholds_revealed: bool = False
    flags: dict[int, list[int]] = field(default_factory=dict)        # replay step -> flagged ids
    exact_requests: dict[int, list[int]] = field(default_factory=dict)  # replay step -> ids asked
    absent_answers: dict[int, list[int]] = field(default_factory=dict)  # step -> asked, left out
    warmup_steps: int = 0
    correction_steps: list[int] = field(default_factory=list)
    guard_steps: list[int] = field(default_factory=list)   # steps the divergence guard redid exactly
    estimated_updates: int = 0
    largest_estimate: float | None = None   # max |g_hat| over every estimate (plaintext only)
    seconds: float = 0.0
    meters: dict | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "selected_rounds": self.selected_rounds,
            "flags": {str(k): v for k, v in self.flags.items()},
            "exact_requests": {str(k): v for k, v in self.exact_requests.items()},
            "absent_answers": {str(k): v for k, v in self.absent_answers.items()},
            "warmup_steps": self.warmup_steps,
            "correction_steps": self.correction_steps,
            "guard_steps": self.guard_steps,
            "estimated_updates": self.estimated_updates,
            "largest_estimate": self.largest_estimate,
            "seconds": self.seconds,
        }


class _StarfishSchedule:
    """Warm-up while a present client's buffer holds fewer than B pairs; then SecTC every T_c
    replayed rounds, for the present clients against their own thresholds."""

    def __init__(self, interval: int, thresholds: Any, result: Stage2Result) -> None:
        self.interval = interval
        self.thresholds = thresholds
        self.result = result

    def exact_now(self, step: int, round_index: int, replay: Replay) -> bool:
        if replay.buffers.all_full(replay.present):
            return False
        self.result.warmup_steps += 1
        return True

    def reads_estimates(self, step: int, round_index: int, replay: Replay) -> bool:
        return step % self.interval == 0

    def rejected(self, step: int, round_index: int, estimates: Any, replay: Replay) -> list[int]:
        if not self.reads_estimates(step, round_index, replay):
            return []
        self.result.correction_steps.append(step)
        with replay.meter("TC"):
            flags = check_thresholds(estimates, self._present_thresholds(replay))
        ids = [j for r, j in enumerate(replay.present) if int(flags[r]) == 1]
        self.result.flags[step] = list(ids)
        return ids

    def _present_thresholds(self, replay: Replay) -> Any:
        """delta^j of the present clients (rows of ``rest`` picked by public indices: local)."""
        rows = replay.present_rows
        if len(rows) == len(replay.rest):
            return self.thresholds
        return stack([self.thresholds[r] for r in rows])


def client_thresholds(history: History, clients: Sequence[int]) -> Any:
    """TD: delta^j = max of delta_i^j over the rounds i client j took part in, one per client.

    The clients' participation differs, so each row is padded to the longest with the client's
    own first value (the max does not change; the batched SecMax stays rectangular). Public:
    who took part where. Full participation: the (n, T) matrix of every round, as in the paper.
    """
    rows = []
    for j in clients:
        own = [to_compute(history.delta(i, j)) for i in rounds_of(history, j)]
        if not own:
            raise ValueError(f"client {j} took part in no round")
        rows.append(own)
    width = max(len(r) for r in rows)
    padded = [r + [r[0]] * (width - len(r)) for r in rows]
    return determine_thresholds(stack([stack(r) for r in padded]))


def run_stage2(
    party: Any,
    history: History,
    targets: Sequence[int],
    params: StarfishParams,
    clients: CorrectionClients,
    progress: ProgressFn | None = None,
    *,
    inverse: Inverse | None = None,
    select: Selector = starfish_select,
    combine: Combine | None = None,
) -> Stage2Result:
    """Unlearn ``targets`` from ``history``; see the module docstring.

    ``party``: the two-party session handle (``mpc.session.Party``) for metering, or None
    in plaintext. ``select`` replaces round selection (the random-selection baseline);
    ``combine`` the FedAvg step of the replay (``replay.Combine``: the rule that made the history).
    """
    meter = party.meter if party is not None else no_meter
    t0 = time.perf_counter()
    targets = sorted(set(targets))
    rest = remaining_clients(history, targets)
    candidates = candidate_rounds(history, rest)
    T = len(candidates)                     # |C|; = history.num_rounds under full participation
    eta = params.server_lr if params.server_lr is not None else history.server_lr

    with meter("TD"):
        thresholds = client_thresholds(history, rest)
    with meter("RS"):
        selected = select(history, targets, params.num_selected(T), params)
    stray = sorted(set(selected) - set(candidates))
    if stray:
        raise ValueError(f"rounds {stray} were selected but no remaining client took part in them")
    result = Stage2Result(model=history.model(0), selected_rounds=list(selected),
                          candidate_rounds=candidates)

    replay = Replay(history, rest, clients, buffer=params.buffer, server_lr=eta, meter=meter,
                    inverse=inverse, combine=combine, guard=params.guard)
    schedule = _StarfishSchedule(params.correction_interval(T), thresholds, result)
    result.model = replay.run(selected, schedule, progress)
    result.estimated_updates = replay.estimated_updates
    result.largest_estimate = replay.largest_estimate
    result.exact_requests = replay.exact_requests
    result.guard_steps = replay.guard_steps
    result.absent_answers = replay.absent_answers
    result.seconds = time.perf_counter() - t0
    if party is not None:
        result.meters = party.meters()
    return result
