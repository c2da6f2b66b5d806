"""Per-client L-BFGS pair buffers shared by FedRecover and Starfish.

Each remaining client j has its own buffer of the last B pairs
(s = M_hat - M_{t-1}, y^j = gbar^j - g_t^j), refreshed whenever j sends an exact update.
s is public; y is shared in the secure servers (the buffer never looks inside it).

A pair with s = 0 (the first replayed round when it is round 1: M_hat = M_0 = M_0) holds
no curvature information and would make sigma = 0/0, so it is skipped; whether s = 0 is
public. Warm-up therefore lasts until every buffer holds B pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .backend import stack

__all__ = ["PairBuffers"]


class PairBuffers:
    def __init__(self, clients: Sequence[int], size: int) -> None:
        if size < 1:
            raise ValueError("buffer size B must be >= 1")
        self.size = size
        self._s: dict[int, list[torch.Tensor]] = {j: [] for j in clients}
        self._y: dict[int, list[Any]] = {j: [] for j in clients}

    def push(self, client: int, s: torch.Tensor, y: Any) -> bool:
        """Append a pair (dropping the oldest beyond B); False if s = 0 was skipped."""
        if float(s.norm()) == 0.0:
            return False
        self._s[client].append(s)
        self._y[client].append(y)
        if len(self._s[client]) > self.size:
            self._s[client].pop(0)
            self._y[client].pop(0)
        return True

    def all_full(self) -> bool:
        return all(len(v) >= self.size for v in self._s.values())

    def stacked(self, clients: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """S (n, m, B) public and Y (n, m, B), oldest pair first."""
        S = torch.stack([torch.stack(self._s[j], dim=-1) for j in clients])
        Y = stack([stack(self._y[j], dim=-1) for j in clients])
        return S, Y
