"""Splitting test values into two int64 ring shares, and putting them back (numpy only).

The mask choices cover the sharings a protocol must handle: a uniform share, one party holding
everything (either one), and the ring's most negative element as a share.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

LO, HI = -(2**63), 2**63 - 1

MASKS = st.sampled_from(["uniform", "uniform", "zero", "all", "min"])


def split(x, how: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shares (share0, share1) with share0 + share1 = x mod 2**64: share1 uniform, 0 (party 0
    holds x), x (party 0 holds 0) or -2**63."""
    x = np.asarray(x, dtype=np.int64)
    if how == "uniform":
        mask = rng.integers(LO, HI, size=x.shape, dtype=np.int64, endpoint=True)
    elif how == "zero":
        mask = np.zeros_like(x)
    elif how == "all":
        mask = x.copy()
    elif how == "min":
        mask = np.full_like(x, LO)
    else:
        raise ValueError(f"unknown mask {how!r}")
    return (x.view(np.uint64) - mask.view(np.uint64)).view(np.int64), mask


def recon(s0, s1) -> np.ndarray:
    """The ring value of two int64 shares (sum mod 2**64, read signed)."""
    u0 = np.asarray(s0, dtype=np.int64).view(np.uint64)
    return (u0 + np.asarray(s1, dtype=np.int64).view(np.uint64)).view(np.int64)
