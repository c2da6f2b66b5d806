"""Party programs for tests/protocols/test_robust_aggregation.py (module-level: the party
processes import them). Each call runs many cases; inputs are float64 arrays on the 16-bit
grid, the updates contributed by party 0 and the thresholds by party 1 (as uploads would be).
Everything is opened here only to compare it with the plaintext twin.
"""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols import comparator_networks
from protocols.robust_aggregation import brace_sign, check_thresholds, fedseca_elected_signs, fedseca_parts


def _shared(a: np.ndarray, src: int):
    return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)), src=src)


def _open(x) -> np.ndarray:
    return B.reveal(x).numpy().copy()


def fedseca_cases(party, cases: list, max_batch: int | None = None) -> list:
    """``max_batch`` splits the comparison calls into pieces of that many elements."""
    if max_batch is not None:
        comparator_networks.MAX_BATCH = max_batch
    out = []
    for case in cases:
        g = _shared(case["g"], 0)
        lam = _shared(case["lam"], 1)
        parts = fedseca_parts(g, gamma=case["gamma"], thresholds=lam)
        res = {name: _open(val) for name, val in parts._asdict().items()}
        res["elected"] = _open(fedseca_elected_signs(g))
        res["brace"] = _open(brace_sign(g, lam=case["brace_lam"]))
        out.append(res)
    return out


def check_cases(party, cases: list) -> list:
    return [check_thresholds(_shared(c["g"], 0), _shared(c["lam"], 1), c["gamma"]).numpy()
            for c in cases]


def missing_thresholds(party) -> str:
    try:
        fedseca_parts(_shared(np.ones((2, 3)), 0))
    except ValueError as exc:
        return str(exc)
    return "no error"


def fedseca_once(party, g: np.ndarray, lam: np.ndarray) -> None:
    """One aggregation, nothing opened (for round counts)."""
    fedseca_parts(_shared(g, 0), thresholds=_shared(lam, 1))
