"""Stage II of Starfish (Alg. 4): one function for the plaintext lab and the 2PC servers.

``run_stage2`` reads a :class:`servers.history.History` whose per-client values are plain
tensors (plaintext lab) or this party's CrypTen shares (secure servers) and runs the four
sub-protocols of ``protocols.starfish`` on them. Every operation on client data goes
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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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

from .history import History, Secret, remaining_clients
from .lbfgs_pairs import PairBuffers

__all__ = ["StarfishParams", "CorrectionClients", "Stage2Result", "run_stage2", "starfish_select"]

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class StarfishParams:
    """Paper defaults (Sec. VI-A): sigma 0.6, beta 0.1, B 2; alpha acts in Stage I."""

    sigma: float = 0.6
    beta: float = 0.1
    buffer: int = 2
    method: Method = "auto"
    t_delta: int = DEFAULT_T_DELTA
    server_lr: float | None = None


class CorrectionClients(Protocol):
    """The remaining clients as Stage II reaches them.

    ``exact_updates`` asks each client in ``client_ids`` for its exact update on the
    public ``model`` (batch order of historical round ``round_index``) and returns them:
    plain tensors in the lab, this party's CrypTen shares on a server.
    """

    def exact_updates(self, round_index: int, model: torch.Tensor,
                      client_ids: list[int]) -> dict[int, Secret]: ...


@dataclass
class Stage2Result:
    model: torch.Tensor
    selected_rounds: list[int]
    thresholds_revealed: bool = False
    flags: dict[int, list[int]] = field(default_factory=dict)        # replay step -> flagged ids
    exact_requests: dict[int, list[int]] = field(default_factory=dict)  # replay step -> ids asked
    warmup_steps: int = 0
    correction_steps: list[int] = field(default_factory=list)
    estimated_updates: int = 0
    seconds: float = 0.0
    meters: dict | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "selected_rounds": self.selected_rounds,
            "flags": {str(k): v for k, v in self.flags.items()},
            "exact_requests": {str(k): v for k, v in self.exact_requests.items()},
            "warmup_steps": self.warmup_steps,
            "correction_steps": self.correction_steps,
            "estimated_updates": self.estimated_updates,
            "seconds": self.seconds,
        }


def starfish_select(history: History, targets: Sequence[int], k: int, params: StarfishParams) -> list[int]:
    """SecRS: the k rounds most aligned with the targets, chronological."""
    T = history.num_rounds
    rounds = range(1, T + 1)
    for i in rounds:
        if any(t not in history.participants(i) for t in targets):
            raise NotImplementedError("round selection assumes the targets took part in every round")
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
    return select_rounds(u, v, k, params.method, params.t_delta)


def run_stage2(
    party: Any,
    history: History,
    targets: Sequence[int],
    params: StarfishParams,
    clients: CorrectionClients,
    progress: ProgressFn | None = None,
    *,
    inverse: Inverse | None = None,
    select: Callable[[History, Sequence[int], int, StarfishParams], list[int]] = starfish_select,
) -> Stage2Result:
    """Unlearn ``targets`` from ``history``; see the module docstring.

    ``party``: the two-party session handle (``mpc.session.Party``) for metering, or None
    in plaintext. ``select`` replaces round selection (the random-selection baseline).
    """
    meter = party.meter if party is not None else (lambda _name: contextlib.nullcontext())
    t0 = time.perf_counter()
    targets = sorted(set(targets))
    rest = remaining_clients(history, targets)
    T = history.num_rounds
    for i in range(1, T + 1):
        if any(j not in history.participants(i) for j in rest):
            raise NotImplementedError("Starfish here assumes full participation of the remaining clients")
    eta = params.server_lr if params.server_lr is not None else history.server_lr
    tc = max(1, math.ceil(round(params.beta * T, 9)))
    k = num_selected(T, params.sigma)

    with meter("TD"):
        deltas = stack([stack([to_compute(history.delta(i, j)) for i in range(1, T + 1)]) for j in rest])
        thresholds = determine_thresholds(deltas)
    with meter("RS"):
        selected = select(history, targets, k, params)
    result = Stage2Result(model=history.model(0), selected_rounds=list(selected))

    buffers = PairBuffers(rest, params.buffer)
    out_dtype = history.model(0).dtype
    model = history.model(0).to(torch.float64).clone()
    for step, t in enumerate(selected, 1):
        w_all = history.weights(t)
        wsum = sum(w_all[j] for j in rest)
        w = [w_all[j] / wsum for j in rest]
        s = model - history.model(t - 1).to(torch.float64)
        stored = [to_compute(history.update(t, j)) for j in rest]
        rows: list[Any] = [None] * len(rest)
        exact_ids: list[int] = []
        if not buffers.all_full():
            result.warmup_steps += 1
            exact_ids = list(rest)
        else:
            with meter("UE"):
                S, Y = buffers.stacked(rest)
                est = estimate_updates(stack(stored), s, S, Y, inverse)
            result.estimated_updates += len(rest)
            rows = [est[r] for r in range(len(rest))]
            if step % tc == 0:
                result.correction_steps.append(step)
                with meter("TC"):
                    flags = check_thresholds(est, thresholds)
                exact_ids = [j for r, j in enumerate(rest) if int(flags[r]) == 1]
                result.flags[step] = list(exact_ids)
        if exact_ids:
            result.exact_requests[step] = list(exact_ids)
            with meter("correction"):
                fresh = clients.exact_updates(t, model.to(out_dtype), list(exact_ids))
                for r, j in enumerate(rest):
                    if j in exact_ids:
                        gbar = to_compute(fresh[j])
                        buffers.push(j, s, gbar - stored[r])
                        rows[r] = gbar
        with meter("aggregate"):
            aggregate = weighted_sum(rows, w)  # sum_j w_j g_use^j, shared if the rows are
            model = model - eta * reveal(aggregate).to(torch.float64)
        if progress is not None:
            progress(step, len(selected), f"round {t}, exact {len(exact_ids)}/{len(rest)}")
    result.model = model.to(out_dtype)
    result.seconds = time.perf_counter() - t0
    if party is not None:
        result.meters = party.meters()
    return result
