"""Threshold determination (Starfish Alg. 4 line 13): delta^j = max_i delta_i^j.

Why per client and a max: FedRecover's single global threshold needs a secure sort of all
m*n*T stored coordinates; Starfish lets each client report its own per-round threshold
delta_i^j (the value a fraction alpha of |g_i^j| exceeds) and the servers only take the
maximum over rounds. Batched over clients, this is one SecMax over a (n, T) matrix, i.e.
ceil(log2 T) rounds of parallel comparisons (paper Sec. V-A, "Alternative thresholds").
"""

from __future__ import annotations

from typing import Any

from protocols.maximum import max as secure_max

__all__ = ["determine_thresholds"]


def determine_thresholds(deltas: Any) -> Any:
    """Row-wise maximum of ``deltas`` (n clients x T rounds); result stays shared if shared.

    Plaintext and shared inputs both go through ``protocols.maximum.max`` so the 2PC run
    and the lab run the same code.
    """
    if len(deltas.shape) != 2:
        raise ValueError(f"deltas must be (clients, rounds), got shape {tuple(deltas.shape)}")
    out = secure_max(deltas, dim=-1)
    return out[0] if isinstance(out, tuple) else out
