"""Additive secret sharing over Z_2^64, for clients (numpy only) and servers.

A client encodes its update in fixed point (``common.encoding``) and splits it into two
shares that add up (mod 2^64) to the encoding. Share 0 is either a full array of
uniform ring elements from ``os.urandom`` or, seed-compressed, a 16-byte seed that
server 0 expands with the AES-CTR PRG; share 1 is always the difference. Either way
each share alone is uniformly distributed and says nothing about the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from common.encoding import DEFAULT_PRECISION, decode, encode
from common.prg import expand, new_seed


@dataclass(frozen=True)
class Shares:
    """Two additive shares of one tensor; ``share0`` is None when ``seed0`` is used."""

    shape: tuple[int, ...]
    share1: np.ndarray
    share0: np.ndarray | None = None
    seed0: bytes | None = None
    precision: int = DEFAULT_PRECISION

    def materialize_share0(self) -> np.ndarray:
        if self.share0 is not None:
            return self.share0
        assert self.seed0 is not None
        return expand(self.seed0, self.shape)


def random_ring(shape) -> np.ndarray:
    """Uniform ring elements straight from the OS CSPRNG."""
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return np.frombuffer(bytearray(os.urandom(8 * n)), dtype="<i8").reshape(shape)


def share_ring(ring: np.ndarray, compress: bool = False, precision: int = DEFAULT_PRECISION,
               seed: bytes | None = None) -> Shares:
    """Split already-encoded ring elements.

    ``seed`` (compressed shares only): the seed of share 0, for a client that must be able to
    send the *same* shares again after a crash (a fresh split of a value one server already
    holds a share of would pair two unrelated shares). It must be secret and used for one
    value only; the simulator derives it from its private key and the upload's label.
    """
    ring = np.asarray(ring, dtype=np.int64)
    if seed is not None and not compress:
        raise ValueError("a given seed needs compress=True")
    if compress:
        seed = new_seed() if seed is None else seed
        share0 = expand(seed, ring.shape)
        return Shares(ring.shape, ring - share0, seed0=seed, precision=precision)
    share0 = random_ring(ring.shape)
    return Shares(ring.shape, ring - share0, share0=share0, precision=precision)


def share(x, compress: bool = False, precision: int = DEFAULT_PRECISION,
          seed: bytes | None = None) -> Shares:
    """Encode real values and split them into two additive shares (``seed``: see share_ring)."""
    return share_ring(encode(x, precision), compress=compress, precision=precision, seed=seed)


def reconstruct_ring(share0: np.ndarray, share1: np.ndarray) -> np.ndarray:
    return np.asarray(share0, dtype=np.int64) + np.asarray(share1, dtype=np.int64)


def reconstruct(share0: np.ndarray, share1: np.ndarray, precision: int = DEFAULT_PRECISION) -> np.ndarray:
    return decode(reconstruct_ring(share0, share1), precision)
