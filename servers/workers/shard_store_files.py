"""The store's shard directories reached through this server's workers (``[deployment] workers`` > 1).

Why a module of its own: the store (``servers.store.shard_files.ShardFiles``) must not know that
its shard k lives on whichever machine runs worker k; this adapter turns each of its calls into
one call on every worker at once (``WorkerGroup``), through ``ServerWorkers.on_workers``, so a
worker that fails a store write is ended like one that fails a 2PC step, and the write fails
with one line naming it (the catalog then refers to nothing the write left: the store's order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from common.service_config import ServiceConfig
from servers.store.shard_files import SliceDirs

from .shards import shard_bounds
from .worker_group import WorkerGroup

__all__ = ["WorkerShardFiles", "shard_dirs", "local_files"]


def shard_dirs(cfg: ServiceConfig, rank: int) -> list[str]:
    """Where worker k of server ``rank`` keeps its slices, on its own machine: ``[server<r>]
    shard_dir`` (default ``<data_dir>/shards``), then ``w<k>``."""
    me = cfg.server(rank)
    base = cfg.resolve(me.shard_dir) if me.shard_dir else cfg.data_dir(rank) / "shards"
    return [str(base / f"w{k}") for k in range(cfg.workers)]


def local_files(cfg: ServiceConfig, rank: int, dim: int) -> SliceDirs:
    """The shard directories read from this machine, where they all are here (one machine, or
    the directories gathered for an inspection): a server's store opened without its workers."""
    return SliceDirs(shard_dirs(cfg, rank), shard_bounds(dim, cfg.workers))


class WorkerShardFiles:
    """:class:`servers.store.shard_files.ShardFiles` at a server's workers, shard k at worker k:
    each call is ``on_workers(step)`` (``ServerWorkers.on_workers``: the live group, a failure ending it)."""

    def __init__(self, on_workers: Callable[[Callable[[WorkerGroup], Any]], Any], dim: int, workers: int) -> None:
        self._on = on_workers
        self.bounds = shard_bounds(dim, workers)

    def put(self, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
        self._on(lambda group: group.store_slices(arrays))

    def read(self, digest: str) -> list[np.ndarray]:
        return self._on(lambda group: group.read_slices(digest))

    def remove(self, digests: Iterable[str]) -> int:
        names = list(digests)
        return self._on(lambda group: group.remove_slices(names))

    def sweep(self, keep: set[str]) -> int:
        return self._on(lambda group: group.sweep_slices(keep))

    def names(self) -> list[set[str]]:
        return self._on(lambda group: group.slice_names())
