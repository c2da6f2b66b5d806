"""The FL history that unlearning reads: one interface, a plaintext and an on-disk store.

Why one interface: the recovery methods and the Starfish sub-protocols must run unchanged
on the plaintext lab and on the two secure servers (DESIGN.md 4.1). They only need, per
round i = 1..T: the public global models M_{i-1} and M_i, the participants and their
FedAvg weights, each participant's update g_i^j, its norm ||g_i^j|| and its tolerance
threshold delta_i^j. In the secure servers the last three are secret-shared tensors
(each server holds one share); here they are plain torch tensors. The interface says
nothing about which: per-client values are typed :data:`Secret`.

Conventions: rounds are 1-based; ``model(0)`` is the initial model M_0; ``model(i)`` is
the model published after round i, M_i = M_{i-1} - server_lr * sum_j w_i^j g_i^j, and
the updates of round i were computed on M_{i-1}.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Secret", "RoundRecord", "History", "InMemoryHistory", "NpzHistory", "remaining_clients"]

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


def _check_record(record: RoundRecord, dim: int | None) -> None:
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


class InMemoryHistory(History):
    """Plaintext history kept in RAM: the lab's Stage I output."""

    def __init__(self, initial_model: torch.Tensor, server_lr: float) -> None:
        self._models: list[torch.Tensor] = [initial_model.detach().clone().reshape(-1)]
        self._rounds: list[RoundRecord] = []
        self._lr = float(server_lr)

    @property
    def num_rounds(self) -> int:
        return len(self._rounds)

    @property
    def server_lr(self) -> float:
        return self._lr

    def _round(self, i: int) -> RoundRecord:
        if not 1 <= i <= len(self._rounds):
            raise IndexError(f"round {i} not in 1..{len(self._rounds)}")
        return self._rounds[i - 1]

    def model(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self._models):
            raise IndexError(f"model {i} not in 0..{len(self._models) - 1}")
        return self._models[i]

    def participants(self, i: int) -> tuple[int, ...]:
        return self._round(i).participants

    def weights(self, i: int) -> Mapping[int, float]:
        return self._round(i).weights

    def update(self, i: int, client: int) -> Secret:
        return self._round(i).updates[client]

    def norm(self, i: int, client: int) -> Secret:
        return self._round(i).norms[client]

    def delta(self, i: int, client: int) -> Secret:
        return self._round(i).deltas[client]

    def append_round(self, record: RoundRecord) -> None:
        _check_record(record, self._models[0].numel())
        model = record.model.detach().clone().reshape(-1)
        self._rounds.append(RoundRecord(model, tuple(record.participants),
                                        dict(record.weights), dict(record.updates),
                                        dict(record.norms), dict(record.deltas)))
        self._models.append(model)


class NpzHistory(History):
    """Plaintext history on disk: one ``round_XXXX.npz`` per round plus ``meta.json``.

    For lab runs that should be re-analysed without retraining. Each round file is
    written to a temporary name and renamed, so a crash never leaves a half-written round
    visible. (The secure servers' durable store is a different module; this one holds
    plaintext and is for experiments only.)
    """

    def __init__(self, directory: str | Path, initial_model: torch.Tensor | None = None,
                 server_lr: float | None = None) -> None:
        self.dir = Path(directory)
        meta_path = self.dir / "meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            self._lr = float(meta["server_lr"])
        else:
            if initial_model is None or server_lr is None:
                raise FileNotFoundError(f"{meta_path} missing; give initial_model and server_lr")
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lr = float(server_lr)
            self._write_npz("model_0000.npz", model=initial_model.detach().cpu().numpy())
            meta_path.write_text(json.dumps({"server_lr": self._lr, "format": 1}))
        self._cache: dict[int, dict[str, Any]] = {}
        self._count = len(sorted(self.dir.glob("round_*.npz")))
        self._m0 = torch.from_numpy(np.load(self.dir / "model_0000.npz")["model"])

    def _write_npz(self, name: str, **arrays: np.ndarray) -> None:
        tmp = self.dir / (name + ".tmp")
        with tmp.open("wb") as fh:
            np.savez(fh, **arrays)
        tmp.replace(self.dir / name)

    def _load(self, i: int) -> dict[str, Any]:
        if not 1 <= i <= self._count:
            raise IndexError(f"round {i} not in 1..{self._count}")
        if i not in self._cache:
            with np.load(self.dir / f"round_{i:04d}.npz") as z:
                parts = tuple(int(c) for c in z["participants"])
                self._cache[i] = {
                    "model": torch.from_numpy(z["model"]),
                    "participants": parts,
                    "weights": {c: float(w) for c, w in zip(parts, z["weights"])},
                    "updates": {c: torch.from_numpy(z["updates"][k]) for k, c in enumerate(parts)},
                    "norms": {c: torch.tensor(float(v)) for c, v in zip(parts, z["norms"])},
                    "deltas": {c: torch.tensor(float(v)) for c, v in zip(parts, z["deltas"])},
                }
        return self._cache[i]

    @property
    def num_rounds(self) -> int:
        return self._count

    @property
    def server_lr(self) -> float:
        return self._lr

    def model(self, i: int) -> torch.Tensor:
        return self._m0 if i == 0 else self._load(i)["model"]

    def participants(self, i: int) -> tuple[int, ...]:
        return self._load(i)["participants"]

    def weights(self, i: int) -> Mapping[int, float]:
        return self._load(i)["weights"]

    def update(self, i: int, client: int) -> Secret:
        return self._load(i)["updates"][client]

    def norm(self, i: int, client: int) -> Secret:
        return self._load(i)["norms"][client]

    def delta(self, i: int, client: int) -> Secret:
        return self._load(i)["deltas"][client]

    def append_round(self, record: RoundRecord) -> None:
        _check_record(record, self._m0.numel())
        parts: Sequence[int] = record.participants

        def scalar(v: Secret) -> float:
            return float(v)

        self._write_npz(
            f"round_{self._count + 1:04d}.npz",
            model=record.model.detach().cpu().numpy(),
            participants=np.asarray(parts, dtype=np.int64),
            weights=np.asarray([record.weights[c] for c in parts], dtype=np.float64),
            updates=np.stack([np.asarray(record.updates[c]) for c in parts]),
            norms=np.asarray([scalar(record.norms[c]) for c in parts]),
            deltas=np.asarray([scalar(record.deltas[c]) for c in parts]),
        )
        self._count += 1


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
