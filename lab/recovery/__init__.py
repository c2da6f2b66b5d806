"""Unlearning / recovery methods behind one interface.

``method.unlearn(history, targets, participants, progress=None) -> (model_vector, CostRecord)``

* :class:`Retrain` - FL from scratch without the targets (the reference).
* :class:`FedEraser` - calibrated replay of every ``interval``-th round.
* :class:`FedRecover` - L-BFGS-estimated replay of every round with corrections.
* :class:`Starfish` - the paper's scheme on selected rounds (plaintext run of the same
  code the secure servers run).
* :class:`RandomSelection` - Starfish's replay on randomly chosen rounds.
* :class:`FedADP` - DP-noised stored updates, dual selection, projection calibration.
* :class:`Crab` - selective storage, adaptive rollback, norm-calibrated replay of kept rounds.
"""

from lab.recovery.base import ClientPool, CostRecord, RecoveryMethod
from lab.recovery.crab import Crab
from lab.recovery.fedadp import FedADP
from lab.recovery.federaser import FedEraser
from lab.recovery.fedrecover import FedRecover
from lab.recovery.retrain import Retrain
from lab.recovery.starfish import RandomSelection, Starfish

METHODS = {
    "retrain": Retrain,
    "federaser": FedEraser,
    "fedrecover": FedRecover,
    "starfish": Starfish,
    "random": RandomSelection,
    "fedadp": FedADP,
    "crab": Crab,
}

__all__ = ["ClientPool", "CostRecord", "RecoveryMethod", "Retrain", "FedEraser",
           "FedRecover", "Starfish", "RandomSelection", "FedADP", "Crab", "METHODS"]
