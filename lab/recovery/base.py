"""What every unlearning/recovery method shares: its interface, cost record, client pool.

Why a cost record: the methods trade client work for server work and accuracy; the lab
compares them on equal terms, so each method reports the same quantities: wall time,
how many exact local trainings each remaining client had to run (the paper's T_r, from
which ARP follows), how many global-model steps it took, and method-specific notes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from clients.training import resolve_device
from protocols.starfish.ports import History, remaining_clients

from lab.fl import Participant, ProgressFn, SequentialTrainer, Trainer

__all__ = ["CostRecord", "ClientPool", "PoolClients", "RecoveryMethod", "remaining_clients", "Timer",
           "data_on_device"]


def data_on_device(participant: Any) -> tuple[torch.Tensor, torch.Tensor, torch.device]:
    """(x, y, device): a client's own data where its local SGD runs (``--device``).

    The losses and predictions Crab's and FedADP's storage rules ask of every client for every
    round's model are as much work as a training epoch; on the CPU they dominated a GPU run.
    """
    dev = resolve_device(getattr(participant, "device", None) or "cpu")
    data_on = getattr(participant, "data_on", None)
    if callable(data_on):
        x, y = data_on(dev)
        return x, y, dev
    return participant.x.to(dev), participant.y.to(dev), dev


@dataclass
class CostRecord:
    """Costs of one unlearning run.

    ``client_computations[j]`` counts the exact local trainings client j ran for this
    unlearning (T_r in the paper's ARP); ``client_epochs[j]`` the local epochs they
    amounted to (FedEraser's calibration uses fewer epochs per training).
    """

    method: str
    history_rounds: int
    wall_time_s: float = 0.0
    rounds_used: int = 0
    client_computations: dict[int, int] = field(default_factory=dict)
    client_epochs: dict[int, float] = field(default_factory=dict)
    estimated_updates: int = 0
    selected_rounds: list[int] = field(default_factory=list)
    correction_steps: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    #: What the method needs the server to have kept of the FL history: ``{"rounds", "updates",
    #: "models", "bytes"}``. None: the whole recorded history (FedEraser, FedRecover, Starfish);
    #: methods that keep less (Crab, FedADP) or nothing (retraining) say so.
    stored: dict[str, int] | None = None

    def total_client_computations(self) -> int:
        return sum(self.client_computations.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["client_computations"] = {str(k): v for k, v in self.client_computations.items()}
        d["client_epochs"] = {str(k): v for k, v in self.client_epochs.items()}
        return d


class ClientPool:
    """The remaining clients, reachable for exact updates, with every request counted.

    ``trainer`` (``lab.fl.Trainer``) computes the requests; :meth:`request_many` hands it all
    the clients of one round at once, so they can be trained together (default: one after
    another).
    """

    def __init__(self, participants: Sequence[Participant], remaining: Iterable[int],
                 trainer: Trainer | None = None) -> None:
        self._trainer: Trainer = trainer if trainer is not None else SequentialTrainer()
        by_id = {p.client_id: p for p in participants}
        self.ids: list[int] = sorted(remaining)
        missing = [j for j in self.ids if j not in by_id]
        if missing:
            raise ValueError(f"no participant object for clients {missing}")
        self._clients = {j: by_id[j] for j in self.ids}
        self.computations: dict[int, int] = {j: 0 for j in self.ids}
        self.epochs: dict[int, float] = {j: 0.0 for j in self.ids}

    def request(self, client: int, model: torch.Tensor, round_idx: int,
                epochs: float | None = None) -> Any:
        """Ask ``client`` for its full upload on ``model`` (batch order of ``round_idx``).

        ``model`` is sent as given; callers pass it in the history's model dtype.
        """
        return self.request_many([client], model, round_idx, epochs)[client]

    def request_many(self, clients: Sequence[int], model: torch.Tensor | Mapping[int, torch.Tensor],
                     round_idx: int, epochs: float | Mapping[int, float] | None = None) -> dict[int, Any]:
        """:meth:`request` of every client in ``clients``, in one trainer call.

        ``model`` and ``epochs`` are one value for all or one per client (a mapping).
        """
        ups = self._trainer.train([self._clients[j] for j in clients], model, round_idx, epochs)
        for j in clients:
            asked = epochs.get(j) if isinstance(epochs, Mapping) else epochs
            self.computations[j] += 1
            base = getattr(self._clients[j], "epochs", 1.0)
            self.epochs[j] += float(base if asked is None else asked)
        return {j: ups[j] for j in clients}

    def request_omniscient(self, client: int, model: torch.Tensor, round_idx: int,
                           others: Any) -> Any:
        """Like :meth:`request` for an omniscient attacker shown the others' uploads (the FL loop's hook)."""
        up = self._clients[client].train_omniscient(model, round_idx, others)
        self.computations[client] += 1
        self.epochs[client] += float(getattr(self._clients[client], "epochs", 1.0))
        return up

    def exact(self, client: int, model: torch.Tensor, round_idx: int,
              epochs: float | None = None) -> torch.Tensor:
        """The exact update g of ``client`` on ``model``."""
        return self.request(client, model, round_idx, epochs).update

    def exact_many(self, clients: Sequence[int], model: torch.Tensor, round_idx: int,
                   epochs: float | Mapping[int, float] | None = None) -> dict[int, torch.Tensor]:
        """The exact updates of ``clients`` on ``model``, trained in one call."""
        return {j: up.update for j, up in self.request_many(clients, model, round_idx, epochs).items()}

    def trainer(self) -> Trainer:
        """A ``lab.fl.Trainer`` for this pool's :meth:`participant` views (Retrain's FL): the
        views of one round are trained in one call and counted like any request."""
        return _PoolTrainer(self)

    def participant(self, client: int) -> Participant:
        """A Participant view of ``client`` whose trainings are counted by this pool.

        An omniscient attacker (``train_omniscient``, see ``lab.fl``) keeps its hook
        through the view, so Retrain's FL faces the same attack as the original run.
        """
        if callable(getattr(self._clients[client], "train_omniscient", None)):
            return _CountedOmniscient(self, client)
        return _CountedParticipant(self, client)

    def num_samples(self, client: int) -> int:
        return self._clients[client].num_samples

    def weights(self) -> dict[int, float]:
        """FedAvg weights renormalised over the remaining clients."""
        total = float(sum(self.num_samples(j) for j in self.ids))
        return {j: self.num_samples(j) / total for j in self.ids}

    def fill(self, cost: CostRecord) -> None:
        cost.client_computations = dict(self.computations)
        cost.client_epochs = dict(self.epochs)


class _CountedParticipant:
    def __init__(self, pool: ClientPool, client_id: int) -> None:
        self.client_id = client_id
        self._pool = pool

    @property
    def num_samples(self) -> int:
        return self._pool.num_samples(self.client_id)

    def train(self, model_vec: torch.Tensor, round_idx: int, epochs: float | None = None) -> Any:
        return self._pool.request(self.client_id, model_vec, round_idx, epochs)


class _CountedOmniscient(_CountedParticipant):
    def train_omniscient(self, model_vec: torch.Tensor, round_idx: int, others: Any,
                         epochs: float | None = None) -> Any:
        return self._pool.request_omniscient(self.client_id, model_vec, round_idx, others)


class _PoolTrainer:
    def __init__(self, pool: ClientPool) -> None:
        self._pool = pool

    def train(self, participants: Sequence[Participant],
              model: torch.Tensor | Mapping[int, torch.Tensor], round_idx: int,
              epochs: float | Mapping[int, float] | None = None) -> dict[int, Any]:
        return self._pool.request_many([p.client_id for p in participants], model, round_idx, epochs)


class PoolClients:
    """A ClientPool behind Stage II's CorrectionClients port (each request counted; the
    clients of one correction are trained in one call)."""

    def __init__(self, pool: ClientPool) -> None:
        self._pool = pool

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Any]:
        return self._pool.exact_many(list(client_ids), model, round_index)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start


class RecoveryMethod(ABC):
    """``unlearn(history, targets, participants) -> (model vector, CostRecord)``.

    ``participants`` are the client objects the method may ask for exact updates (only
    the remaining ones are ever asked); ``progress`` gets (step, total, info).
    """

    name: str = "method"
    #: How the method's requests to remaining clients are trained (``lab.fl.Trainer``); None:
    #: one after another. The lab sets it to its batched trainer.
    trainer: Trainer | None = None

    @abstractmethod
    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        """Return the unlearned global model and what it cost."""
