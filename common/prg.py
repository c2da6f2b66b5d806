"""AES-CTR pseudo-random generator over the ring Z_2^64.

Why AES-CTR: all randomness that hides a secret must come from a CSPRNG (docs/design.md 2).
Keys come from ``os.urandom``; a 16-byte key then expands to any number of ring
elements, which is what makes seed-compressed shares possible (a party or client sends
16 bytes instead of a whole share). Different ``stream`` numbers under one key give
independent streams (they are the CTR nonce), so one seed can serve many requests.
"""

from __future__ import annotations

import os

import numpy as np
from Crypto.Cipher import AES

SEED_BYTES = 16


def new_seed() -> bytes:
    return os.urandom(SEED_BYTES)


class Prg:
    """Deterministic stream of uniform ring elements from (seed, stream)."""

    def __init__(self, seed: bytes, stream: int = 0):
        if len(seed) != SEED_BYTES:
            raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
        if not 0 <= stream < 2**64:
            raise ValueError("PRG stream number must fit in 64 bits")
        self._cipher = AES.new(
            seed, AES.MODE_CTR, nonce=stream.to_bytes(8, "big"), initial_value=0
        )

    def _keystream(self, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        self._cipher.encrypt(buf, output=buf)  # CTR keystream = encryption of zeros
        return buf

    def ring(self, shape) -> np.ndarray:
        """Uniform int64 elements (every one of the 2**64 ring values equally likely)."""
        shape = _shape(shape)
        return np.frombuffer(self._keystream(8 * _count(shape)), dtype="<i8").reshape(shape)

    def bits(self, shape) -> np.ndarray:
        """Uniform 0/1 int64 elements (one PRG byte each, its low bit)."""
        shape = _shape(shape)
        raw = np.frombuffer(self._keystream(_count(shape)), dtype=np.uint8)
        return (raw & 1).astype(np.int64).reshape(shape)


def _shape(shape) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)


def _count(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def expand(seed: bytes, shape, stream: int = 0) -> np.ndarray:
    return Prg(seed, stream).ring(tuple(shape))
