"""What a toy client uploads in the lab's hand-computed tests (the ``UpdateLike`` shape)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ToyUpdate:
    update: torch.Tensor
    norm: float
    delta: float
    num_samples: int
