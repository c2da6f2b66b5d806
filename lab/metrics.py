"""Cost metrics of unlearning: ARP, client computations, distance to the retrained model.

ARP (Starfish Sec. VI-A): with T_r the number of rounds in which a client is instructed
to compute an exact update during unlearning, the round-saving percentage of that client
is (T - T_r) / T * 100%, T the number of FL rounds; ARP is its average over the remaining
clients. Retraining from scratch has T_r = T (ARP = 0). We count every exact local
training a method requests as one round of T_r (warm-up, periodic correction, abnormality
fixing, final tuning, FedEraser calibration), whatever its number of epochs.
"""

from __future__ import annotations

import torch

from protocols.starfish.ports import History

from lab.crab_storage import full_history_bytes
from lab.recovery.base import CostRecord

__all__ = ["arp", "l2_distance", "cost_summary", "stored_history"]


def arp(cost: CostRecord) -> float:
    """Average round-saving percentage over the remaining clients (0..100, may be < 0)."""
    if not cost.client_computations:
        return float("nan")
    T = cost.history_rounds
    saves = [(T - tr) / T * 100.0 for tr in cost.client_computations.values()]
    return sum(saves) / len(saves)


def l2_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).norm())


def cost_summary(cost: CostRecord) -> dict[str, float]:
    n = max(1, len(cost.client_computations))
    return {
        "arp": arp(cost),
        "wall_time_s": cost.wall_time_s,
        "rounds_used": float(cost.rounds_used),
        "client_computations_mean": cost.total_client_computations() / n,
        "client_epochs_mean": sum(cost.client_epochs.values()) / n,
        "estimated_updates": float(cost.estimated_updates),
    }


def stored_history(cost: CostRecord, history: History) -> dict[str, int]:
    """What of the FL history a method relied on (float32 models and updates, see CostRecord)."""
    if cost.stored is not None:
        return dict(cost.stored)
    updates = sum(len(history.participants(i)) for i in range(1, history.num_rounds + 1))
    return {"rounds": history.num_rounds, "updates": updates, "models": history.num_rounds + 1,
            "bytes": full_history_bytes(history)}
