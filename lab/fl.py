"""The plaintext FedAvg coordinator (Stage I of docs/design.md 3) that records a History.

Why the coordinator does not import ``clients``: in the real system a server talks to
clients over the network; here a client is anything with the :class:`Participant`
shape (``clients.training.LocalClient`` is one). The recovery methods use the same shape
to ask remaining clients for exact updates, so costs can be counted in one place.

Progress: ``run_federated`` calls ``progress(done, total, info)`` after every round (default:
nothing); the commands draw it as a bar with ``bench.progress.callback``.

Aggregation: by default the step direction is the FedAvg sum ``sum_j w_j g_j``; an
:class:`Aggregator` (``lab.aggregators``: FedSECA, BRACE's sign vote) replaces it,
keeping the step M_i = M_{i-1} - server_lr * direction and its own state across the rounds of
one run.

Training a round's clients: the coordinator hands the round's participants to a
:class:`Trainer` in one call, so that the clients can be trained together
(``clients.batched_training.ClientTrainer``: one batched program for all of them, the same
per-client math). The default, :class:`SequentialTrainer`, asks one participant after another.

Omniscient attackers: a participant with a ``train_omniscient`` method (``clients.attacks``)
is asked after the others of its round and is handed their uploads. That is the
omniscient-attacker model of the Byzantine literature (FedSECA sec. 3: attackers see every
honest update of the round before sending theirs); a real server would never show one
client's upload to another, it is a lab device to measure worst-case attacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch

from protocols.starfish.ports import History, RoundRecord
from common.fedavg import fedavg_weights

from lab.history import InMemoryHistory

__all__ = [
    "UpdateLike",
    "Participant",
    "OmniscientParticipant",
    "Aggregator",
    "ProgressFn",
    "Trainer",
    "SequentialTrainer",
    "collect_uploads",
    "aggregate",
    "run_federated",
]


class UpdateLike(Protocol):
    """A client's upload: update g, ||g||, delta, and its data size."""

    update: torch.Tensor
    norm: float
    delta: float
    num_samples: int


class Participant(Protocol):
    """A client the coordinator (and the recovery methods) can ask for an exact update."""

    client_id: int

    @property
    def num_samples(self) -> int: ...

    def train(self, model_vec: torch.Tensor, round_idx: int,
              epochs: float | None = None) -> UpdateLike: ...


class OmniscientParticipant(Participant, Protocol):
    """An attacker that crafts its upload from the others' uploads of the same round."""

    def train_omniscient(self, model_vec: torch.Tensor, round_idx: int,
                         others: Mapping[int, UpdateLike],
                         epochs: float | None = None) -> UpdateLike: ...


class Aggregator(Protocol):
    """Turns a round's updates into the server's step direction; named, stateful per run.

    ``reset()`` is called by :func:`run_federated` before its first round, so one object can
    drive several runs (the FL run, then Retrain's) without carrying state between them.
    """

    name: str

    def reset(self) -> None: ...

    def direction(self, updates: Mapping[int, torch.Tensor],
                  weights: Mapping[int, float]) -> torch.Tensor: ...


ProgressFn = Callable[[int, int, str], None]


def aggregate(updates: dict[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """sum_j w_j g_j in a fixed client order (so results are reproducible bit for bit)."""
    out: torch.Tensor | None = None
    for j in sorted(updates):
        term = updates[j] * weights[j]
        out = term if out is None else out + term
    if out is None:
        raise ValueError("no updates to aggregate")
    return out


class Trainer(Protocol):
    """Trains several participants on one round: ``{p.client_id: p.train(model, round_idx,
    epochs)}`` in effect, however it is computed. ``model`` and ``epochs`` may also be given
    per client id (a mapping)."""

    def train(self, participants: Sequence[Participant],
              model: torch.Tensor | Mapping[int, torch.Tensor], round_idx: int,
              epochs: float | Mapping[int, float] | None = None) -> dict[int, UpdateLike]: ...


class SequentialTrainer:
    """One participant after another (the reference every batched trainer must equal)."""

    def train(self, participants: Sequence[Participant],
              model: torch.Tensor | Mapping[int, torch.Tensor], round_idx: int,
              epochs: float | Mapping[int, float] | None = None) -> dict[int, UpdateLike]:
        def pick(value, j):
            return value.get(j) if isinstance(value, Mapping) else value

        return {p.client_id: p.train(pick(model, p.client_id), round_idx, pick(epochs, p.client_id))
                for p in participants}


def _is_omniscient(p: Participant) -> bool:
    return callable(getattr(p, "train_omniscient", None))


def collect_uploads(present: Sequence[Participant], model: torch.Tensor,
                    round_idx: int, trainer: Trainer | None = None) -> dict[int, UpdateLike]:
    """Every present participant's upload for this round, keyed in ``present``'s order.

    The participants that are not omniscient train in one ``trainer`` call (default: one
    after another). Omniscient participants train last and see (read-only) the uploads of
    all the others, i.e. the honest clients when a single attack runs.
    """
    seeing = [p for p in present if _is_omniscient(p)]
    trainer = trainer if trainer is not None else SequentialTrainer()
    ups: dict[int, UpdateLike] = dict(trainer.train([p for p in present if not _is_omniscient(p)],
                                                    model, round_idx))
    if seeing:
        view = MappingProxyType(dict(ups))
        for p in seeing:
            ups[p.client_id] = p.train_omniscient(model, round_idx, view)
    return {p.client_id: ups[p.client_id] for p in present}


def run_federated(participants: Sequence[Participant], initial_model: torch.Tensor,
                  rounds: int, server_lr: float, *, exclude: Iterable[int] = (),
                  history: History | None = None,
                  progress: ProgressFn | None = None,
                  participation: Sequence[Iterable[int]] | None = None,
                  aggregator: Aggregator | None = None,
                  trainer: Trainer | None = None) -> History:
    """Run ``rounds`` of FL over all participants not in ``exclude``.

    Every round each participant trains on M_{i-1}; the server sets
    M_i = M_{i-1} - server_lr * d_i and records the round, where d_i is the FedAvg sum
    sum_j w_j g_i^j (``aggregator`` None, the default) or ``aggregator.direction(updates,
    weights)``. Determinism comes from the participants (per-(client, round) seeds), not
    from this loop.

    ``participation``: partial participation, one collection of client ids per round (those
    not excluded take part; the round's FedAvg weights are over them); a round left with no
    one is refused. Default: every participant in every round.

    ``trainer``: how a round's participants are trained (:class:`Trainer`; default one after
    another).
    """
    excluded = set(exclude)
    active = sorted((p for p in participants if p.client_id not in excluded),
                    key=lambda p: p.client_id)
    if not active:
        raise ValueError("no participants left")
    if participation is not None and len(participation) != rounds:
        raise ValueError(f"participation names {len(participation)} rounds, expected {rounds}")
    hist = history if history is not None else InMemoryHistory(initial_model, server_lr)
    if hist.num_rounds != 0:
        raise ValueError("run_federated starts from an empty history")
    all_weights = fedavg_weights({p.client_id: p.num_samples for p in active})
    model = initial_model.detach().clone().reshape(-1)
    if aggregator is not None:
        aggregator.reset()
    for i in range(1, rounds + 1):
        if participation is None:
            present, weights = active, all_weights
        else:
            wanted = set(participation[i - 1])
            present = [p for p in active if p.client_id in wanted]
            if not present:
                raise ValueError(f"no participant takes part in round {i}")
            weights = fedavg_weights({p.client_id: p.num_samples for p in present})
        ups = collect_uploads(present, model, i, trainer)
        g = {j: u.update for j, u in ups.items()}
        direction = aggregate(g, weights) if aggregator is None else aggregator.direction(g, weights)
        step = server_lr * direction
        model = model - step
        hist.append_round(RoundRecord(
            model=model,
            participants=tuple(sorted(ups)),
            weights=weights,
            updates=g,
            norms={j: torch.tensor(u.norm, dtype=torch.float64) for j, u in ups.items()},
            deltas={j: torch.tensor(u.delta, dtype=torch.float64) for j, u in ups.items()},
        ))
        if progress is not None:
            progress(i, rounds, f"|M_i - M_(i-1)| = {float(step.norm()):.4g}")
    return hist
