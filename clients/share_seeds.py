"""A client's shares are reproducible from its private key: re-sending them, and finding them.

Why: a client that crashes between its two uploads must send the *same* shares again (a fresh
split would pair the share one server already holds with an unrelated one, and the sum would
be garbage), and a client that was forgotten wants to check that nothing of what it sent is
left on the servers' disks. Both follow from one rule: the seed of share 0 of every value is
HMAC-SHA256(private key, label) truncated to the PRG's seed length, with a label that names
the value (``round/<r>/update``, ``task/<id>/update``, ...) so no seed serves two values.
The key never leaves the client, so the seeds are as secret as fresh random ones; server 0
learns each seed (it is share 0), which tells it nothing about the key or other seeds.

:func:`disk_traces` lists the byte strings a value's shares leave in a server's store (the
seed, raw and in hex, at server 0; share 1's ring elements, raw and as the catalog's decimal
text for scalars, at server 1); :func:`find_traces` scans every file under a directory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from common.prg import SEED_BYTES
from common.sharing import Shares, share

__all__ = ["share_seed", "seeded_shares", "disk_traces", "find_traces"]

#: Raw bytes of a share 1 looked for: long enough to be unique, short enough to sit in one page.
_PREFIX_BYTES = 64


def share_seed(key: bytes, label: str) -> bytes:
    """The share-0 seed of the value named ``label`` (secret: derived from the private key)."""
    if not key:
        raise ValueError("a share seed needs the client's private key")
    return hmac.new(key, b"starfish-share-seed/" + label.encode(), hashlib.sha256).digest()[:SEED_BYTES]


def seeded_shares(key: bytes, label: str, values: Mapping[str, np.ndarray],
                  precision: int) -> dict[str, Shares]:
    """The two shares of each value (``<label>/<name>`` seeds), as the client uploads them."""
    return {name: share(v, compress=True, precision=precision, seed=share_seed(key, f"{label}/{name}"))
            for name, v in values.items()}


def disk_traces(shares: Mapping[str, Shares]) -> dict[int, list[bytes]]:
    """Per server (0, 1), byte strings that are on its disk while it stores these shares."""
    out: dict[int, list[bytes]] = {0: [], 1: []}
    for s in shares.values():
        assert s.seed0 is not None
        out[0] += [s.seed0, s.seed0.hex().encode()]
        ring = np.asarray(s.share1, dtype="<i8").reshape(-1)
        out[1].append(ring.tobytes()[:_PREFIX_BYTES])
        if ring.size == 1:
            out[1].append(f"int:{int(ring[0])}".encode())
    return out


def find_traces(root: str | os.PathLike[str], traces: Iterable[bytes]) -> list[tuple[str, bytes]]:
    """Every (file, trace) such that the file under ``root`` contains the trace."""
    wanted = [t for t in traces if t]
    hits = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            try:
                data = path.read_bytes()
            except OSError:
                continue   # removed while we walk (a WAL being checkpointed)
            hits += [(str(path), t) for t in wanted if t in data]
    return hits
