"""The lab's plaintext histories: in RAM (Stage I of a lab run) and on disk (re-analysis).

Both implement the Stage II port :class:`protocols.starfish.ports.History` on plain torch
tensors; the secure servers implement it on shares (``servers.secure.share_history``). Both accept
and round-trip a round without participants (an unlearning round: participants == (),
weights == {}, its model the adopted unlearned one) and rounds of any participation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocols.starfish.ports import History, RoundRecord, Secret, check_record

__all__ = ["InMemoryHistory", "NpzHistory", "NpzTwinRecorder"]


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
        check_record(record, self._models[0].numel())
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
        check_record(record, self._m0.numel())
        parts: Sequence[int] = record.participants

        def scalar(v: Secret) -> float:
            return float(v)

        model = record.model.detach().cpu().numpy()
        if parts:
            updates = np.stack([np.asarray(record.updates[c]) for c in parts])
        else:  # an unlearning round: no updates, an empty (0, m) array
            updates = np.zeros((0, model.size), dtype=model.dtype)
        self._write_npz(
            f"round_{self._count + 1:04d}.npz",
            model=model,
            participants=np.asarray(parts, dtype=np.int64).reshape(-1),
            weights=np.asarray([record.weights[c] for c in parts], dtype=np.float64),
            updates=updates,
            norms=np.asarray([scalar(record.norms[c]) for c in parts], dtype=np.float64),
            deltas=np.asarray([scalar(record.deltas[c]) for c in parts], dtype=np.float64),
        )
        self._count += 1


class NpzTwinRecorder:
    """The client simulator's plaintext twin written as an :class:`NpzHistory` (``TwinRecorder``)."""

    def __init__(self, directory: str | Path) -> None:
        self.location = str(directory)
        self._history: NpzHistory | None = None

    def start(self, initial_model: np.ndarray, server_lr: float) -> None:
        self._history = NpzHistory(self.location, initial_model=torch.from_numpy(initial_model),
                                   server_lr=server_lr)

    def round(self, model: np.ndarray, participants: tuple[int, ...], weights: dict[int, float],
              updates: dict[int, np.ndarray], norms: dict[int, float],
              deltas: dict[int, float]) -> None:
        if self._history is None:
            raise RuntimeError("start() the twin before recording rounds")
        self._history.append_round(RoundRecord(
            model=torch.from_numpy(model), participants=tuple(participants), weights=weights,
            updates={j: torch.from_numpy(updates[j]) for j in participants},
            norms={j: torch.tensor(norms[j], dtype=torch.float64) for j in participants},
            deltas={j: torch.tensor(deltas[j], dtype=torch.float64) for j in participants}))
