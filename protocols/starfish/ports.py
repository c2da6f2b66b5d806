"""The two ports of Stage II: what Starfish reads (History) and whom it asks (CorrectionClients).

Why ports: Stage II (``protocols.starfish.stage2``) runs unchanged on the plaintext lab and on
the two secure servers (docs/design.md 4.1). It needs, per round i = 1..T, the public global
models M_{i-1} and M_i, the participants and their FedAvg weights, and each participant's
update g_i^j, norm ||g_i^j|| and tolerance threshold delta_i^j; and during the replay, exact
updates from the remaining clients. The lab implements both ports on plain tensors
(``servers.lab``); each server implements them on its shares (``servers.share_history``,
``servers.correction_tasks``). Per-client values are typed :data:`Secret`: a plain torch
tensor in the lab, this party's CrypTen tensor on a server.

Conventions: rounds are 1-based; ``model(0)`` is the initial model M_0; ``model(i)`` is the
model published after round i, M_i = M_{i-1} - server_lr * sum_j w_i^j g_i^j, and the
updates of round i were computed on M_{i-1}.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["Secret", "RoundRecord", "History", "CorrectionClients", "check_record",
           "remaining_clients", "require_full_participation"]

#: A plain torch tensor (plaintext lab) or a secret-shared tensor (CrypTen MPCTensor).
Secret = Any


@dataclass(frozen=True)
class RoundRecord:
    """Everything stored for one FL round (what ``History.append_round`` accepts)."""

    model: torch.Tensor                   # M_i, public
    participants: tuple[int, ...]         # clients whose updates reached the servers
    weights: Mapping[int, float]          # FedAvg weights of this round, sum to 1
    updates: Mapping[int, Secret]         # g_i^j
    norms: Mapping[int, Secret]           # ||g_i^j||_2
    deltas: Mapping[int, Secret]          # delta_i^j


class History(ABC):
    """Read access to T rounds of FL, plus appending a round (Stage I)."""

    @property
    @abstractmethod
    def num_rounds(self) -> int:
        """T, the number of completed rounds."""

    @property
    @abstractmethod
    def server_lr(self) -> float:
        """eta in M_i = M_{i-1} - eta * sum_j w_j g_i^j."""

    @abstractmethod
    def model(self, i: int) -> torch.Tensor:
        """Public global model M_i, i = 0..T."""

    @abstractmethod
    def participants(self, i: int) -> tuple[int, ...]:
        """Client ids that took part in round i (sorted)."""

    @abstractmethod
    def weights(self, i: int) -> Mapping[int, float]:
        """FedAvg weights w_i^j = |D_j| / sum of |D_k| over round i's participants."""

    @abstractmethod
    def update(self, i: int, client: int) -> Secret:
        """g_i^j, computed by client j on M_{i-1}."""

    @abstractmethod
    def norm(self, i: int, client: int) -> Secret:
        """||g_i^j||_2 as reported by the client."""

    @abstractmethod
    def delta(self, i: int, client: int) -> Secret:
        """delta_i^j, the client's tolerance threshold for round i."""

    @abstractmethod
    def append_round(self, record: RoundRecord) -> None:
        """Store round T+1 (its model is M_{T+1})."""

    # ---- conveniences built on the abstract accessors -------------------------------
    def clients(self) -> tuple[int, ...]:
        """Every client that took part in any round."""
        seen: set[int] = set()
        for i in range(1, self.num_rounds + 1):
            seen.update(self.participants(i))
        return tuple(sorted(seen))

    def model_delta(self, i: int) -> torch.Tensor:
        """M_i - M_{i-1} (public)."""
        return self.model(i) - self.model(i - 1)

    def num_samples(self, client: int) -> float | None:
        """Relative data size of ``client`` (its weight in the first round it joined)."""
        for i in range(1, self.num_rounds + 1):
            w = self.weights(i)
            if client in w:
                return float(w[client])
        return None


def check_record(record: RoundRecord, dim: int | None) -> None:
    parts = tuple(record.participants)
    if tuple(sorted(set(parts))) != parts:
        raise ValueError("participants must be sorted and unique")
    for name, table in (("weights", record.weights), ("updates", record.updates),
                        ("norms", record.norms), ("deltas", record.deltas)):
        if set(table) != set(parts):
            raise ValueError(f"{name} must have exactly one entry per participant")
    total = sum(float(record.weights[j]) for j in parts)
    if parts and abs(total - 1.0) > 1e-6:
        raise ValueError(f"FedAvg weights must sum to 1, got {total}")
    if dim is not None and record.model.numel() != dim:
        raise ValueError(f"model has {record.model.numel()} entries, expected {dim}")


class CorrectionClients(Protocol):
    """The remaining clients as Stage II reaches them.

    ``exact_updates`` asks each client in ``client_ids`` for its exact update on the
    public ``model`` (batch order of historical round ``round_index``) and returns them:
    plain tensors in the lab, this party's CrypTen shares on a server.
    """

    def exact_updates(self, round_index: int, model: torch.Tensor,
                      client_ids: list[int]) -> dict[int, Secret]: ...


def remaining_clients(history: History, targets: Iterable[int]) -> list[int]:
    """The clients that stay after unlearning ``targets`` (all of them must have taken part)."""
    t = set(targets)
    unknown = t - set(history.clients())
    if unknown:
        raise ValueError(f"targets {sorted(unknown)} never took part in FL")
    rest = [j for j in history.clients() if j not in t]
    if not rest:
        raise ValueError("no client would remain after unlearning")
    return rest


def require_full_participation(history: History, clients: Iterable[int], method: str) -> None:
    """Refuse a history in which one of ``clients`` missed a round (the replay needs every update)."""
    wanted = list(clients)
    for i in range(1, history.num_rounds + 1):
        missing = [j for j in wanted if j not in history.participants(i)]
        if missing:
            raise NotImplementedError(f"{method} here assumes full participation: clients {missing} "
                                      f"missed round {i}")
