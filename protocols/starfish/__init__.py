"""Starfish, written once for plaintext and secret-shared data: the one home of the scheme.

Why one code path (docs/design.md 4.1): the plaintext lab and the two secure servers must run
the same algorithm so that their results can be compared within fixed-point error. Every
operation on possibly-shared data here is either a ``protocols.*`` primitive (which accepts
torch tensors and CrypTen tensors alike) or an operator that CrypTen's MPCTensor supports
too: +, -, * (by a public or a shared value), matmul with the shared operand on the left,
transpose, indexing, sum. Public data is always a torch tensor.

Modules, in the order Stage II runs them:

* :mod:`.params` - StarfishParams: defaults (paper Sec. VI-A) and T' = ceil(sigma T), T_c = ceil(beta T)
* :mod:`.ports` - what Stage II needs from its host: History, CorrectionClients; the candidate
  rounds of partial participation and the ``without_clients`` view of an erasing store
* :mod:`.threshold_determination` - delta^j = max_i delta_i^j (SecMax, batched)
* :mod:`.round_selection` - SecRS: keys (one or several targets), top-k, the Method 1/2 switch
* :mod:`.update_estimation` - FedRecover's L-BFGS estimate, compact form (SecUE)
* :mod:`.pair_buffers` - the per-client L-BFGS pairs
* :mod:`.threshold_check` - correction flags (SecTC)
* :mod:`.correction` - exact updates replace estimates and refresh the pairs
* :mod:`.replay` - the replay loop shared with FedRecover
* :mod:`.stage2` - the Stage II driver, ``run_stage2``
* :mod:`.backend` - the few helpers that must know which kind of tensor they hold
"""

from .params import StarfishParams
from .ports import (CorrectionClients, History, RoundRecord, candidate_rounds, remaining_clients,
                    without_clients)
from .round_selection import combine_targets, num_selected, select_rounds, selection_keys, starfish_select
from .stage2 import Stage2Result, run_stage2
from .threshold_check import check_thresholds
from .threshold_determination import determine_thresholds
from .update_estimation import compact_hvp, estimate_updates

__all__ = [
    "StarfishParams",
    "History",
    "RoundRecord",
    "CorrectionClients",
    "remaining_clients",
    "candidate_rounds",
    "without_clients",
    "determine_thresholds",
    "selection_keys",
    "select_rounds",
    "starfish_select",
    "num_selected",
    "combine_targets",
    "compact_hvp",
    "estimate_updates",
    "check_thresholds",
    "run_stage2",
    "Stage2Result",
]
