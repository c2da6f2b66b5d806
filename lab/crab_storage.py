"""Crab's selective storage (Jiang et al., arXiv:2401.08216, Sec. IV-B1, Alg. 1-2 Stage I).

Which rounds of a recorded FL history a Crab server keeps, which clients' updates it keeps in
those rounds, what that costs in bytes, and a read-only :class:`History` view that exposes only
what was kept (so Crab's recovery, or Starfish's Stage II, can be run on the reduced history and
cannot read anything the policy threw away).

Rules, with the paper's defaults (Sec. V-A1 "Recovery settings"):

* **Time windows** (loss rule, alpha = 0.1): starting from prev = F(M_0), rounds are buffered
  until the global model's loss has fallen by the fraction alpha, F(M_t) <= (1 - alpha) * prev
  (Alg. 2 line 12; equality closes the window); that round closes the window and
  prev <- F(M_t).
* **Round selection** (KL rule, lambda = 0.6): in each closed window of B_b rounds the
  P_b = ceil(lambda * B_b) rounds with the largest model change D_t are kept (Alg. 1 line 5), the
  others are discarded. D_t = KL(p(M_{t-1}) || p(M_t)), the mean over the data of the KL
  divergence between the predictive distributions of the model before and after round t (Eq. 1
  as its sum is written). Ties: the earlier round first.
* **Client selection** (cosine rule, delta = 0.7): in a kept round t the X = ceil(delta * n_t)
  participants whose update g_t^j has the largest cosine similarity with the round's global
  update G_t = (M_{t-1} - M_t) / eta are kept (Eq. 2, Alg. 1 line 10): the step the server
  actually took, which is the FedAvg sum sum_j w_j g_t^j under FedAvg (and the robust
  aggregate under another aggregator). Ties: the smaller client id first; a zero update has
  similarity 0.

Choices the paper leaves open (documented because they change what is stored):

* Round numbering is the project's (``protocols.starfish.ports``): round t's updates are
  computed on M_{t-1} and give M_t. D_t is the change *made by* round t, so a round is ranked
  by what its own updates did. (Alg. 1 pairs the buffered model M_{b,i} with the next one,
  M_{b,i+1}, which for the window's last model lies in the next window.)
* ceil for P_b and X, as Starfish's T' = ceil(sigma T): a window of one round (common early in
  training, when one round cuts the loss by more than alpha) keeps its round; with floor it
  would keep none and the steepest part of training would go unrecorded.
* The open window: rounds after the last closed window are still in the server's buffer when
  the targets are detected. By default (``keep_open_window=True``) the same lambda rule selects
  from them then; Alg. 2 leaves them unprocessed, which with ``keep_open_window=False``
  discards them (then the last rounds of training are never replayed).
* A round without participants (an unlearning round) has nothing to store and is never kept
  (it still counts in the loss rule).
* Models stored: M_0 (the initial model, an input of Alg. 2; Starfish's replay starts from it)
  and, for every kept round t, M_{t-1} (the model its updates were computed on: Crab's rollback
  candidate and the base of a calibration) and M_t (with M_{t-1} it records the round's global
  update, which Starfish's round selection reads); a model shared by consecutive kept rounds is
  stored once. The aggregated update of the kept clients (Alg. 1 line 11) is not stored: the
  kept updates and their weights determine it.

Bytes: ``stored_bytes`` = 4 m (models stored + updates stored), m parameters at float32; the
per-update scalars (weight, norm, delta) are left out here and in ``full_history_bytes`` =
4 m ((T + 1) + sum_t n_t), what storing every model and every update costs.
``peak_buffer_bytes`` is the largest window the server must hold before it selects (its models
and all its updates), transient memory on top of the stored bytes.

Data for the rules: F and p are the loss and the predictive distribution on the *full training
data* D (Sec. II-A), which the server does not hold. :func:`measure_signals` computes both as
the data-size-weighted mean over data sets scored separately; with one data set per client that
is exactly F(M) and the mean KL over D, from scalars each client can compute on its own data and
report (its mean loss of M_t and its mean KL between M_{t-1} and M_t). The lab does this
(``lab.recovery.crab.client_reported_signals``); a server-held validation split is the
other option (one data set), an approximation of F on D.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from protocols.starfish.params import ceil_rate
from protocols.starfish.ports import History, RoundRecord, Secret

__all__ = ["CrabStorageParams", "PAPER_STORAGE", "RoundSignals", "ScoredData", "measure_signals",
           "loss_windows", "select_storage", "CrabStorage", "StoredHistory", "NotStored",
           "full_history_bytes", "FLOAT32_BYTES"]

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class CrabStorageParams:
    """alpha: loss reduction closing a window; lam: share of a window's rounds kept;
    delta: share of a kept round's participants kept (paper Sec. V-A1: 0.1, 0.6, 0.7)."""

    alpha: float = 0.1
    lam: float = 0.6
    delta: float = 0.7
    keep_open_window: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"Crab's loss-reduction rate alpha must be in (0, 1), got {self.alpha}")
        if not 0.0 < self.lam <= 1.0:
            raise ValueError(f"Crab's round-selection ratio lambda must be in (0, 1], got {self.lam}")
        if not 0.0 < self.delta <= 1.0:
            raise ValueError(f"Crab's client-selection ratio delta must be in (0, 1], got {self.delta}")

    def rounds_kept(self, window: int) -> int:
        """P_b = ceil(lambda B_b), at least 1 and at most B_b (0 for an empty window)."""
        return 0 if window <= 0 else max(1, min(window, ceil_rate(self.lam, window)))

    def clients_kept(self, participants: int) -> int:
        """X = ceil(delta n_t), at least 1 and at most n_t (0 without participants)."""
        return 0 if participants <= 0 else max(1, min(participants, ceil_rate(self.delta, participants)))


PAPER_STORAGE = CrabStorageParams()


@dataclass(frozen=True)
class RoundSignals:
    """The per-round scalars the rules read: F(M_0..M_T) and D_1..D_T."""

    losses: tuple[float, ...]
    divergences: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "losses", tuple(float(v) for v in self.losses))
        object.__setattr__(self, "divergences", tuple(float(v) for v in self.divergences))
        if len(self.losses) != len(self.divergences) + 1:
            raise ValueError(f"need T + 1 losses for T divergences, got {len(self.losses)} losses "
                             f"and {len(self.divergences)} divergences")
        if not all(math.isfinite(v) for v in self.losses + self.divergences):
            raise ValueError("losses and divergences must be finite")


@dataclass(frozen=True)
class ScoredData:
    """One data set the rules are measured on: ``log_probs(model) -> (n, K)`` log-probabilities
    of its n samples, their ``labels`` and its ``weight`` (its size, for a client's data)."""

    weight: float
    log_probs: Callable[[torch.Tensor], torch.Tensor]
    labels: torch.Tensor


def measure_signals(history: History, data: Sequence[ScoredData]) -> RoundSignals:
    """F(M_t) (mean cross-entropy) and D_t = mean KL(p(M_{t-1}) || p(M_t)) over ``data``,
    each data set weighted by ``weight`` (normalised): with one data set per client weighted by
    its size, these are the loss and the mean KL over the union of the clients' data."""
    if not data:
        raise ValueError("measure_signals needs at least one data set")
    total = float(sum(d.weight for d in data))
    if not total > 0 or any(d.weight < 0 for d in data):
        raise ValueError("data-set weights must be >= 0 with a positive sum")
    losses: list[float] = []
    divergences: list[float] = []
    previous: list[torch.Tensor | None] = [None] * len(data)
    for t in range(history.num_rounds + 1):
        model = history.model(t)
        loss = kl = 0.0
        for k, d in enumerate(data):
            lp = d.log_probs(model).to(torch.float64)
            w = d.weight / total
            loss += w * float(-lp.gather(1, d.labels.reshape(-1, 1).long()).mean())
            before = previous[k]
            if before is not None:
                kl += w * float((before.exp() * (before - lp)).sum(dim=1).mean())
            previous[k] = lp
        losses.append(loss)
        if t > 0:
            divergences.append(kl)
    return RoundSignals(tuple(losses), tuple(divergences))


def loss_windows(losses: Sequence[float], alpha: float) -> tuple[list[list[int]], list[int]]:
    """(closed windows, open window): rounds 1..T cut where F(M_t) <= (1 - alpha) prev."""
    closed: list[list[int]] = []
    current: list[int] = []
    prev = float(losses[0])
    for t in range(1, len(losses)):
        current.append(t)
        if float(losses[t]) <= (1.0 - alpha) * prev:
            closed.append(current)
            current = []
            prev = float(losses[t])
    return closed, current


def _cosine(g: torch.Tensor, direction: torch.Tensor) -> float:
    ng, nd = float(g.norm()), float(direction.norm())
    if ng == 0.0 or nd == 0.0:
        return 0.0
    return float(g @ direction) / (ng * nd)


def full_history_bytes(history: History) -> int:
    """4 m ((T + 1) models + every participant's update of every round)."""
    m = history.model(0).numel()
    updates = sum(len(history.participants(t)) for t in range(1, history.num_rounds + 1))
    return FLOAT32_BYTES * m * (history.num_rounds + 1 + updates)


@dataclass(frozen=True)
class CrabStorage:
    """What Crab's policy keeps of a history (see the module docstring for the rules)."""

    params: CrabStorageParams
    num_rounds: int
    dim: int
    windows: tuple[tuple[int, ...], ...]          # closed windows, chronological
    open_window: tuple[int, ...]                  # rounds after the last closed window
    kept_rounds: tuple[int, ...]                  # t_1 < ... < t_T'
    kept_clients: Mapping[int, tuple[int, ...]]   # kept round -> kept client ids (sorted)
    stored_models: tuple[int, ...]                # indices i of the stored M_i
    stored_bytes: int
    full_history_bytes: int
    peak_buffer_bytes: int
    cosines: Mapping[int, Mapping[int, float]] = field(default_factory=dict)  # kept round -> j -> cos

    @property
    def kept_pairs(self) -> list[tuple[int, int]]:
        """Every kept (round, client), by round then client."""
        return [(t, j) for t in self.kept_rounds for j in self.kept_clients[t]]

    @property
    def stored_updates(self) -> int:
        return sum(len(c) for c in self.kept_clients.values())

    def view(self, history: History) -> StoredHistory:
        """``history`` as this policy stored it (read-only; see :class:`StoredHistory`)."""
        return StoredHistory(history, self)


def select_storage(history: History, signals: RoundSignals,
                   params: CrabStorageParams = PAPER_STORAGE) -> CrabStorage:
    """Apply Crab's three rules to ``history`` with the per-round ``signals``."""
    T = history.num_rounds
    if len(signals.divergences) != T:
        raise ValueError(f"signals cover {len(signals.divergences)} rounds, the history has {T}")
    closed, open_ = loss_windows(signals.losses, params.alpha)
    selecting = closed + ([open_] if open_ and params.keep_open_window else [])
    kept: list[int] = []
    for window in selecting:
        candidates = [t for t in window if history.participants(t)]
        ranked = sorted(candidates, key=lambda t: (-signals.divergences[t - 1], t))
        kept.extend(ranked[:params.rounds_kept(len(candidates))])
    kept.sort()

    kept_clients: dict[int, tuple[int, ...]] = {}
    cosines: dict[int, dict[int, float]] = {}
    for t in kept:
        direction = -history.model_delta(t).to(torch.float64)   # G_t up to eta > 0
        parts = history.participants(t)
        cos = {j: _cosine(torch.as_tensor(history.update(t, j)).reshape(-1).to(torch.float64),
                          direction.reshape(-1)) for j in parts}
        ranked = sorted(parts, key=lambda j: (-cos[j], j))
        kept_clients[t] = tuple(sorted(ranked[:params.clients_kept(len(parts))]))
        cosines[t] = cos

    m = history.model(0).numel()
    models = sorted({0} | {i for t in kept for i in (t - 1, t)})
    stored = FLOAT32_BYTES * m * (len(models) + sum(len(c) for c in kept_clients.values()))
    peak = max((FLOAT32_BYTES * m * (len(w) + sum(len(history.participants(t)) for t in w))
                for w in selecting), default=0)
    return CrabStorage(params=params, num_rounds=T, dim=m,
                       windows=tuple(tuple(w) for w in closed), open_window=tuple(open_),
                       kept_rounds=tuple(kept), kept_clients=kept_clients,
                       stored_models=tuple(models), stored_bytes=stored,
                       full_history_bytes=full_history_bytes(history), peak_buffer_bytes=peak,
                       cosines=cosines)


class NotStored(LookupError):
    """Reading something Crab's storage policy did not keep."""


class StoredHistory(History):
    """Read-only view of ``base`` holding only what ``storage`` kept.

    Round numbers are the base history's (1..T). A kept round's participants are its kept
    clients and its weights their stored FedAvg weights (not renormalised, as for erased
    clients in ``ports.without_clients``); a round that was not kept looks like a round without
    participants (``participants(t) == ()``), so Stage II never selects or replays it. Reading a
    model, update, norm or delta that was not stored raises :class:`NotStored`.
    """

    def __init__(self, base: History, storage: CrabStorage) -> None:
        if base.num_rounds != storage.num_rounds or base.model(0).numel() != storage.dim:
            raise ValueError(f"this storage was selected on a history of {storage.num_rounds} "
                             f"rounds and {storage.dim} parameters, not on this one "
                             f"({base.num_rounds} rounds, {base.model(0).numel()} parameters)")
        self._base = base
        self.storage = storage
        self._models = frozenset(storage.stored_models)
        self._kept = {t: frozenset(c) for t, c in storage.kept_clients.items()}

    @property
    def num_rounds(self) -> int:
        return self._base.num_rounds

    @property
    def server_lr(self) -> float:
        return self._base.server_lr

    def _round(self, i: int) -> None:
        if not 1 <= i <= self.num_rounds:
            raise IndexError(f"round {i} not in 1..{self.num_rounds}")

    def model(self, i: int) -> torch.Tensor:
        if not 0 <= i <= self.num_rounds:
            raise IndexError(f"model {i} not in 0..{self.num_rounds}")
        if i not in self._models:
            raise NotStored(f"model M_{i} was not stored by Crab's storage policy "
                            f"(stored models: {sorted(self._models)})")
        return self._base.model(i)

    def participants(self, i: int) -> tuple[int, ...]:
        self._round(i)
        return self.storage.kept_clients.get(i, ())

    def weights(self, i: int) -> Mapping[int, float]:
        self._round(i)
        w = self._base.weights(i)
        return {j: w[j] for j in self.storage.kept_clients.get(i, ())}

    def _stored(self, i: int, client: int) -> None:
        self._round(i)
        if i not in self._kept:
            raise NotStored(f"round {i} was not stored by Crab's storage policy "
                            f"(kept rounds: {list(self.storage.kept_rounds)})")
        if client not in self._kept[i]:
            raise NotStored(f"client {client}'s update of round {i} was not stored by Crab's "
                            f"storage policy (kept clients of round {i}: "
                            f"{list(self.storage.kept_clients[i])})")

    def update(self, i: int, client: int) -> Secret:
        self._stored(i, client)
        return self._base.update(i, client)

    def norm(self, i: int, client: int) -> Secret:
        self._stored(i, client)
        return self._base.norm(i, client)

    def delta(self, i: int, client: int) -> Secret:
        self._stored(i, client)
        return self._base.delta(i, client)

    def append_round(self, record: RoundRecord) -> None:
        raise TypeError("a Crab storage view is read-only; append to the underlying history")
