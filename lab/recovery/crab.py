"""Crab (Jiang et al., arXiv:2401.08216): selective storage, adaptive rollback, calibration.

1. Storage (``lab.crab_storage``): the server keeps only some rounds (loss windows, KL
   rule) and in them only some clients' updates (cosine rule). Everything below reads the
   history *through the storage view*, so it cannot use anything the policy discarded.
2. Adaptive rollback (Sec. IV-B2). For the j-th kept round t_j, with C the kept clients of
   t_j, C^- = C without the targets, and weights |D_c| / |D| renormalised over each set,

       I(C_{t_j})   = sum_{c in C}   w_c [g_{t_j}^c - Gbar_{t_{j-1}}]          (Eq. 3)
       I(C^-_{t_j}) = the same over C^- (the zero vector if C^- is empty),

   Gbar_{t_j} the aggregate of the kept updates of t_j (Gbar_{t_0} = 0). Candidate j (= 1..T'+1)
   is the model before kept round t_j, M_{t_j - 1}; candidate T'+1 is M_{t_T'}, after the last
   kept round. Its sensitivity and threshold accumulate over the kept rounds before it:

       S_j   = sum_{j' < j} ||I(C_{t_j'}) - I(C^-_{t_j'})||                    (Eq. 4)
       Phi_j = beta * sum_{j' < j} ||I(C^-_{t_j'})||                           (Eq. 5)

   and the rollback model is the latest candidate with S_j <= Phi_j (Eq. 6; j = 1 always
   qualifies, 0 <= 0). Eq. 5 writes a sum of vectors; its norms are summed here so that Phi is
   a scalar on the scale of S. A kept round in which no target's update was kept adds 0 to S.
3. Recovery (Sec. IV-B3, Eq. 7-10): from the rollback model, each kept round t_j, ...,
   t_T' in order is replayed once: every remaining client whose update of that round was kept
   trains E local epochs on the current model (batch order of round t) and the server keeps
   the *direction* of that fresh update and the *norm* of the stored one,

       g~^c = ||g_t^c|| * ghat^c / ||ghat^c||                                  (Eq. 8)
       M~  <- M~ - eta * sum_{c in C^-_t} |D_c| / |D^-_t| * g~^c               (Eq. 9-10)

   (a zero fresh update contributes zero: it has no direction). Only the kept remaining clients
   of a round train in it (Alg. 2 line 27 names every remaining client, but Eq. 9 aggregates
   over C^-_t, and only they have a stored norm); a kept round whose kept clients are all
   targets is skipped.

Where this differs from a literal reading of Alg. 2, and why: the paper rolls back to a stored
*post*-round model M_{t_j} and then calibrates with the norms of round t_j again, which applies
round t_j twice; here the candidate is the model round t_j started from (the model its stored
updates were computed on), and the replay starts with round t_j itself.

Defaults (Sec. V-A1): alpha 0.1, lambda 0.6, delta 0.7, beta 0.3; FedAvg; eta = the FL server
step. The storage rules' loss and KL are what the clients report on their own data
(:func:`client_reported_signals`); ``signals=`` replaces that (e.g. a server validation split).
``cost.wall_time_s`` covers rollback and recovery; the storage selection belongs to Stage I
(the server runs it during FL) and is timed apart (``extra["storage_seconds"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from protocols.starfish.ports import History

from lab.crab_storage import (
    CrabStorage,
    CrabStorageParams,
    RoundSignals,
    ScoredData,
    measure_signals,
    select_storage,
)
from lab.fl import Participant, ProgressFn
from lab.recovery.base import ClientPool, CostRecord, RecoveryMethod, Timer, data_on_device, remaining_clients

__all__ = ["Crab", "CrabRollback", "crab_rollback", "client_reported_signals", "SignalSource"]

#: Computes the storage rules' per-round scalars from the history and the client objects.
SignalSource = Callable[[History, Sequence[Participant]], RoundSignals]


@dataclass(frozen=True)
class CrabRollback:
    """The rollback decision. Candidates j = 1..T'+1 (1-based, as in the paper)."""

    index: int                       # j*
    model_round: int                 # r: the recovery starts from M_r
    replay: tuple[int, ...]          # kept rounds replayed, t_{j*}..t_{T'}
    gaps: tuple[float, ...]          # ||I(C) - I(C^-)|| per kept round
    influences: tuple[float, ...]    # ||I(C^-)|| per kept round
    sensitivity: tuple[float, ...]   # S_j per candidate
    threshold: tuple[float, ...]     # Phi_j per candidate


def _kept_aggregate(view: History, t: int, clients: Sequence[int]) -> torch.Tensor | None:
    """sum_c w_c g_t^c over ``clients`` with their weights renormalised (None if empty)."""
    if not clients:
        return None
    w = view.weights(t)
    total = sum(float(w[c]) for c in clients)
    out = torch.zeros(view.model(0).numel(), dtype=torch.float64)
    for c in clients:
        out += (float(w[c]) / total) * torch.as_tensor(view.update(t, c)).reshape(-1).to(torch.float64)
    return out


def crab_rollback(view: History, kept_rounds: Sequence[int], targets: Sequence[int],
                  beta: float) -> CrabRollback:
    """Eq. 3-6 on the stored history ``view`` (see the module docstring)."""
    if not beta >= 0.0:
        raise ValueError(f"Crab's sensitivity ratio beta must be >= 0, got {beta}")
    rounds = list(kept_rounds)
    tset = set(targets)
    prev = torch.zeros(view.model(0).numel(), dtype=torch.float64)
    gaps: list[float] = []
    influences: list[float] = []
    for t in rounds:
        kept = list(view.participants(t))
        benign = [c for c in kept if c not in tset]
        agg = _kept_aggregate(view, t, kept)
        if agg is None:
            raise ValueError(f"kept round {t} has no kept client")
        benign_agg = _kept_aggregate(view, t, benign)
        inf_all = agg - prev
        inf_benign = torch.zeros_like(prev) if benign_agg is None else benign_agg - prev
        gaps.append(float((inf_all - inf_benign).norm()))
        influences.append(float(inf_benign.norm()))
        prev = agg
    sens = [0.0]
    thr = [0.0]
    for gap, inf in zip(gaps, influences):
        sens.append(sens[-1] + gap)
        thr.append(thr[-1] + inf)
    thr = [beta * v for v in thr]
    index = max(j for j in range(1, len(sens) + 1) if sens[j - 1] <= thr[j - 1])
    if index <= len(rounds):
        model_round = rounds[index - 1] - 1
    else:
        model_round = rounds[-1] if rounds else 0
    return CrabRollback(index=index, model_round=model_round, replay=tuple(rounds[index - 1:]),
                        gaps=tuple(gaps), influences=tuple(influences),
                        sensitivity=tuple(sens), threshold=tuple(thr))


def client_reported_signals(history: History, participants: Sequence[Participant]) -> RoundSignals:
    """F(M_t) and D_t as the clients would report them from their own data (the lab's twin).

    Each client c scores every model on its training data (mean cross-entropy, mean KL between
    consecutive models) and the server averages the reports with weights |D_c|: exactly the
    loss and mean KL on the union of the clients' data, the paper's F and p on D. Needs client
    objects shaped like ``clients.training.LocalClient`` (``x``, ``y``, ``model_factory``); the
    regulariser is not part of F.
    """
    by_id = {p.client_id: p for p in participants}
    data: list[ScoredData] = []
    for j in history.clients():
        p = by_id.get(j)
        if p is None or not all(hasattr(p, a) for a in ("x", "y", "model_factory")):
            raise ValueError(f"Crab's storage rules need client {j}'s reported loss: give a client "
                             "object with x, y and model_factory, or pass signals= to Crab")
        data.append(ScoredData(float(p.num_samples), _log_probs_on(p.model_factory, *_x_and_device(p)),
                               p.y))
    return measure_signals(history, data)


def _x_and_device(participant: Any) -> tuple[torch.Tensor, torch.device]:
    x, _y, dev = data_on_device(participant)
    return x, dev


def _log_probs_on(factory: Callable[[], torch.nn.Module], x: torch.Tensor, dev: torch.device,
                  batch: int = 1024) -> Callable[[torch.Tensor], torch.Tensor]:
    net = factory().to(dev)
    net.eval()

    def log_probs(vector: torch.Tensor) -> torch.Tensor:
        params = list(net.parameters())
        dtype = params[0].dtype
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(vector.reshape(-1).to(dev, dtype), params)
            return torch.cat([F.log_softmax(net(x[k:k + batch]), dim=-1)
                              for k in range(0, len(x), batch)]).cpu()

    return log_probs


class Crab(RecoveryMethod):
    name = "crab"

    def __init__(self, alpha: float = 0.1, lam: float = 0.6, delta: float = 0.7,
                 beta: float = 0.3, *, keep_open_window: bool = True,
                 server_lr: float | None = None, signals: SignalSource | None = None) -> None:
        self.storage_params = CrabStorageParams(alpha=alpha, lam=lam, delta=delta,
                                                keep_open_window=keep_open_window)
        if not beta >= 0.0:
            raise ValueError(f"Crab's sensitivity ratio beta must be >= 0, got {beta}")
        if server_lr is not None and not server_lr > 0.0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        self.beta = float(beta)
        self.server_lr = server_lr
        self.signals = signals or client_reported_signals

    def store(self, history: History, participants: Sequence[Participant]) -> CrabStorage:
        """What Crab's server would have kept of ``history`` (Stage I, replayed after the fact)."""
        return select_storage(history, self.signals(history, participants), self.storage_params)

    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        pool = ClientPool(participants, rest, self.trainer)
        rest_set = set(rest)
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        cost = CostRecord(self.name, history.num_rounds)
        with Timer() as storage_timer:
            storage = self.store(history, participants)
        view = storage.view(history)
        out_dtype = history.model(0).dtype
        replayed: list[int] = []
        with Timer() as timer:
            roll = crab_rollback(view, storage.kept_rounds, targets, self.beta)
            model = view.model(roll.model_round).to(torch.float64).clone()
            for step, t in enumerate(roll.replay, 1):
                present = [j for j in view.participants(t) if j in rest_set]
                if present:
                    model = model - eta * self._calibrated_step(view, t, present, model, pool, out_dtype)
                    replayed.append(t)
                if progress is not None:
                    progress(step, len(roll.replay), f"round {t}, {len(present)} clients")
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = len(replayed)
        cost.selected_rounds = replayed
        cost.extra.update(self._extra(storage, roll, storage_timer.elapsed))
        cost.stored = {"rounds": len(storage.kept_rounds), "updates": storage.stored_updates,
                       "models": len(storage.stored_models), "bytes": storage.stored_bytes}
        pool.fill(cost)
        return model.to(out_dtype), cost

    @staticmethod
    def _calibrated_step(view: History, t: int, present: Sequence[int], model: torch.Tensor,
                         pool: ClientPool, out_dtype: torch.dtype) -> torch.Tensor:
        """sum_c w_c ||g_t^c|| ghat^c / ||ghat^c|| over ``present`` (weights renormalised)."""
        w = view.weights(t)
        total = sum(float(w[j]) for j in present)
        step = torch.zeros_like(model)
        updates = pool.exact_many(list(present), model.to(out_dtype), t)
        for j in present:
            fresh = updates[j].reshape(-1).to(torch.float64)
            n_fresh = float(fresh.norm())
            if n_fresh == 0.0:
                continue
            n_stored = float(torch.as_tensor(view.update(t, j)).to(torch.float64).norm())
            step += (float(w[j]) / total) * (n_stored / n_fresh) * fresh
        return step

    def _extra(self, storage: CrabStorage, roll: CrabRollback, storage_seconds: float) -> dict[str, Any]:
        p = storage.params
        return {
            "stored_bytes": storage.stored_bytes,
            "stored_rounds": len(storage.kept_rounds),
            "stored_updates": storage.stored_updates,
            "stored_models": len(storage.stored_models),
            "full_history_bytes": storage.full_history_bytes,
            "peak_buffer_bytes": storage.peak_buffer_bytes,
            "rollback_round": roll.model_round,
            "kept_rounds": list(storage.kept_rounds),
            "windows": [list(w) for w in storage.windows],
            "open_window": list(storage.open_window),
            "sensitivity": list(roll.sensitivity),
            "threshold": list(roll.threshold),
            "storage_seconds": storage_seconds,
            "alpha": p.alpha, "lambda": p.lam, "delta": p.delta, "beta": self.beta,
            "keep_open_window": p.keep_open_window,
        }
