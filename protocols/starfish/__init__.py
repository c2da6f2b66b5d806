"""Starfish's four sub-protocols, written once for plaintext and secret-shared data.

Why one code path (DESIGN.md 4.1): the plaintext lab and the two secure servers must run
the same algorithm so that their results can be compared within fixed-point error. Every
operation on possibly-shared data in this package is either a ``protocols.*`` primitive
(which accepts torch tensors and CrypTen tensors alike) or an operator that CrypTen's
MPCTensor supports too: +, -, * (by a public or a shared value), matmul with the shared
operand on the left, transpose, indexing, sum. Public data is always a torch tensor.

Modules:

* :mod:`.threshold_determination` - delta^j = max_i delta_i^j (SecMax, batched)
* :mod:`.round_selection` - cosine-similarity ranking of the target's rounds (SecRS)
* :mod:`.update_estimation` - FedRecover's L-BFGS estimate, compact form (SecUE)
* :mod:`.threshold_check` - correction flags (SecTC)
* :mod:`.backend` - the few helpers that must know which kind of tensor they hold
"""

from .round_selection import combine_targets, num_selected, select_rounds, selection_keys
from .threshold_check import check_thresholds
from .threshold_determination import determine_thresholds
from .update_estimation import compact_hvp, estimate_updates

__all__ = [
    "determine_thresholds",
    "selection_keys",
    "select_rounds",
    "num_selected",
    "combine_targets",
    "compact_hvp",
    "estimate_updates",
    "check_thresholds",
]
