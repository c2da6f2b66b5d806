"""K coordinate slices of one 2PC session standing for K worker pairs (``protocols.sharded``).

Each slice keeps its own named shares, as a worker does; every program runs in the one session
the test's party holds. What the coordinators would add (the shards' shares of a sum) is added
the same way, so a sharded Stage II is tested without Ray or extra processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servers.workers.shards import shard_bounds


class Slot:
    """One slice's named shares (``ShardWorker``'s ``share``/``put``/``drop``)."""

    def __init__(self) -> None:
        self.shares: dict[str, np.ndarray] = {}

    def share(self, name: str) -> np.ndarray:
        return self.shares[name]

    def put(self, name: str, arr: np.ndarray) -> int:
        self.shares[name] = np.array(arr, dtype=np.int64, copy=True)
        return self.shares[name].nbytes

    def has(self, name: str) -> bool:
        return name in self.shares

    def drop(self, names: list[str]) -> int:
        gone = 0
        for n in names:
            for key in [n, *(k for k in self.shares if k.startswith(n + "#"))]:
                gone += self.shares.pop(key, None) is not None and key == n
        return gone


class SliceShards:
    """``k`` slices of ``dim`` coordinates in ``party``'s session."""

    def __init__(self, party: Any, dim: int, k: int) -> None:
        self.party = party
        self.bounds = shard_bounds(dim, k)
        self.slots = [Slot() for _ in self.bounds]
        self.programs = 0

    def scatter(self, name: str, share: np.ndarray) -> None:
        for (lo, hi), slot in zip(self.bounds, self.slots):
            slot.put(name, share[..., lo:hi])

    def put_all(self, name: str, share: np.ndarray) -> None:
        for slot in self.slots:
            slot.put(name, share)

    def run(self, program, *args, per_shard=None) -> list[Any]:
        self.programs += 1
        return [program(self.party, slot, *args, *(per_shard[k] if per_shard else ()))
                for k, slot in enumerate(self.slots)]

    def drop(self, names: list[str]) -> None:
        for slot in self.slots:
            slot.drop(names)

    def held(self) -> int:
        """Shares still kept by any slice."""
        return sum(len(s.shares) for s in self.slots)
