"""FedAvg on additive shares without 2PC: an exact integer method on the ring Z_2^64.

Why no CrypTen here: the FedAvg weights w_j = |D_j| / N are public, and so is their
integer form. Each server multiplies its share of client j's fixed-point update by the
*integer* |D_j| and adds (mod 2^64); the two results are additive shares of

    A = sum_j |D_j| * enc(g_j)        (an integer; enc(x) = trunc(x * 2^f))

because integer multiplication and addition commute with the ring's reduction. No
truncation is needed, so nothing is approximated: opening A (the servers exchange their
sums) gives exactly sum_j |D_j| enc(g_j) as long as its magnitude stays below 2^63, i.e.
|sum_j |D_j| g_j| < 2^(63-f) = 2^47 for f = 16. A client's value is at most 2^30 by the encoding, so
N < 2^(63-30-f) (131071 samples per round at f = 16) rules overflow out; the servers
check N before opening (a larger federation needs a smaller f). Both servers then decode in float64 and
divide by N in the same order, so they publish bit-identical models:

    M_i = M_{i-1} - eta * A / (2^f * N).

The only error against plaintext FedAvg is the clients' own fixed-point encoding
(|g - dec(enc(g))| < 2^-f per coordinate); encoding the float weights instead would add
a weight error of up to 2^-f / w_j and make the weights no longer sum to one.

What this opens: A, i.e. N * (M_{i-1} - M_i) / eta up to float rounding: exactly the
public model step, nothing about any single client.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

from common.fedavg import fedavg_weights

from common.encoding import decode

__all__ = ["fedavg_weights", "weighted_share_sum", "open_aggregate", "next_model", "model_digest",
           "max_total_samples"]

#: Clients encode |x| <= 2^30 (common.encoding); with f fractional bits |enc(g)| <= 2^(30+f).
_MAX_ENCODED_LOG2 = 30


def max_total_samples(precision: int) -> int:
    """Largest N for which sum_j |D_j| enc(g_j) cannot leave (-2^63, 2^63)."""
    return (1 << max(0, 63 - _MAX_ENCODED_LOG2 - precision)) - 1


def weighted_share_sum(terms: Iterable[tuple[int, np.ndarray]], dim: int) -> np.ndarray:
    """sum_j n_j * share_j mod 2^64 (numpy int64 arithmetic wraps, which is the ring)."""
    acc = np.zeros(dim, dtype=np.int64)
    for n, share in terms:
        s = np.asarray(share, dtype=np.int64)
        if s.shape != (dim,):
            raise ValueError(f"share of shape {s.shape}, expected ({dim},)")
        with np.errstate(over="ignore"):
            acc += s * np.int64(n)
    return acc


def open_aggregate(share0: np.ndarray, share1: np.ndarray, total: int, precision: int) -> np.ndarray:
    """sum_j w_j dec(enc(g_j)) in float64 from the two servers' weighted share sums."""
    if not 0 < total <= max_total_samples(precision):
        raise ValueError(f"total sample count {total} outside 1..{max_total_samples(precision)} "
                         f"(the exact ring sum could overflow at {precision} fractional bits)")
    with np.errstate(over="ignore"):
        ring = np.asarray(share0, dtype=np.int64) + np.asarray(share1, dtype=np.int64)
    return decode(ring, precision) / float(total)


def next_model(previous: np.ndarray, aggregate: np.ndarray, server_lr: float) -> np.ndarray:
    """M_i = M_{i-1} - eta * aggregate, in float64."""
    return np.asarray(previous, dtype=np.float64) - float(server_lr) * aggregate


def model_digest(model: np.ndarray) -> str:
    """SHA-256 of a model's float64 bytes: the servers compare it before committing."""
    return hashlib.sha256(np.ascontiguousarray(model, dtype="<f8").tobytes()).hexdigest()
