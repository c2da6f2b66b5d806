"""Helpers shared by the history-store tests (test_share_store, test_staging,
test_job_records, test_share_history): random ring elements, the oracle's view of a share,
a fresh store of DIM parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from common import prg
from servers.store.share_store import ClientShares, ShareStore

I64 = np.iinfo(np.int64)
DIM = 257


def ring(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(I64.min, I64.max, size=shape, dtype=np.int64, endpoint=True)


def expected_share(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The oracle's view of a share: a seed expands with the client's PRG, else the array."""
    if isinstance(value, bytes):
        return prg.expand(value, shape)
    return np.asarray(value, dtype=np.int64).reshape(shape)


def blob_files(root: Path) -> list[Path]:
    return sorted((root / "blobs").iterdir())


def new_store(root: Path, party: int, m0: np.ndarray | None = None) -> ShareStore:
    m0 = np.linspace(-1, 1, DIM, dtype=np.float32) if m0 is None else m0
    return ShareStore(root, party=party, initial_model=m0, server_lr=0.25)


def uploads(rng: np.random.Generator, clients: list[int]) -> dict[int, ClientShares]:
    return {c: ClientShares(ring(rng, (DIM,)), ring(rng, ()), ring(rng, ())) for c in clients}
