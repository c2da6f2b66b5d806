"""Secret values held on coordinate shards by worker pairs, as the protocols see them (issue 30).

Why a seam here: a server may be a coordinator and K workers, worker k of each server holding
coordinate shard k of every m-long secret (an update, a secant, an estimate). Stage II is
written once (``protocols.starfish``) against the backend's functions; a value of this kind is
secret (``backend.is_shared`` says so) and the few backend functions that touch every coordinate
(stack, weighted sums, openings, rescaling, inner products) and Starfish's coordinate-wide steps
(update estimation, the threshold check, the curvature test) hand it to its own implementation
(``protocols.starfish.on_shards``), which runs each shard's part on its worker pair and only the
small rest (sums of shares, the 2B x 2B solve, the per-row OR) at the coordinators.

``ShardExecutor`` is what that implementation needs of the workers: the shards' bounds, putting
this server's share of a value shard by shard, running a program on every pair, dropping shares.
A server's Ray workers are one (``servers.workers``); the tests use K slices of one session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["ShardedValue", "ShardExecutor", "is_sharded"]


class ShardedValue:
    """Marker base of secret values held on coordinate shards (see the module docstring)."""


class ShardExecutor(Protocol):
    """A server's worker pairs as a sharded value reaches them."""

    bounds: Sequence[tuple[int, int]]     # coordinate shard k = [lo, hi) of worker k

    def scatter(self, name: str, share: np.ndarray) -> None:
        """This server's share of a (..., m) value: its shard k to worker k, kept as ``name``."""

    def run(self, program: Callable[..., Any], *args: Any,
            per_shard: Sequence[tuple] | None = None) -> list[Any]:
        """``program(party, worker, *args, *per_shard[k])`` on every pair; one result per shard."""

    def put_all(self, name: str, share: np.ndarray) -> None:
        """This server's share of a small value (not split: every worker keeps all of it)."""

    def drop(self, names: list[str]) -> None:
        """Forget (zero) the named shares at every worker."""

    def load(self, name: str, ref: str) -> None:
        """A stored value's shards, read by each worker where they lie (``History.stored_update``'s
        reference), kept as ``name``; only asked of an executor whose history gives references."""


def is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedValue)
