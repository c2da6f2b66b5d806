"""Stored update shares on coordinate shards: slice k of every update in shard k's own directory.

Why a module of its own: with ``[deployment] workers = K`` (issue 30) the m-long update shares,
nearly all of a store's bytes, live where the worker that computes on their coordinates reads
them, not at the coordinator; the coordinator keeps the catalog, the public models and the
scalar shares. The catalog does not change: an update is still ``blob:<digest>``, the digest of
the whole array; each shard's file of it is that array's slice, in the blob format
(``servers.store.blobs``), under the same name. A read of a whole update joins the slices and
checks the result against its name, so a lost, stale or swapped slice is found.

:class:`ShardFiles` is what the store needs of the shards' directories; :class:`SliceDirs` is
it for directories this process can reach (one machine, and each worker's own directory:
``servers.workers.shard_worker``); a server whose workers run elsewhere reaches them through its
workers (``servers.workers.shard_store_files``).

The order of a write is the store's (blobs durable, then the catalog), shard by shard: every
slice is durable before :meth:`ShardFiles.put` returns. A crash in between leaves slices no
catalog row names, which :meth:`ShardFiles.sweep` removes, as ``BlobStore.sweep`` does locally.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from servers.store.blobs import BlobCorruptError, BlobStore, EncodedBlob, encode_blob, fsync_dir

__all__ = ["ShardFiles", "SliceDirs", "named_blob", "slice_dir", "removed_durably", "join_checked"]


class ShardFiles(Protocol):
    """K directories, shard k holding coordinates ``bounds[k]`` of every stored update."""

    bounds: Sequence[tuple[int, int]]

    def put(self, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
        """Each ``(digest, update)``'s slice k made durable in shard k under ``digest``."""

    def read(self, digest: str) -> list[np.ndarray]:
        """The slices of ``digest``, shard by shard (each checked against its own checksum)."""

    def remove(self, digests: Iterable[str]) -> int:
        """Delete the named slices from every shard; the number of files removed."""

    def sweep(self, keep: set[str]) -> int:
        """Delete every slice not named in ``keep`` and every temporary file, on every shard."""

    def names(self) -> list[set[str]]:
        """The digests each shard holds a slice of."""


def slice_dir(root: str | os.PathLike[str]) -> BlobStore:
    """One shard's directory (created if new): slices named by their whole update's digest."""
    path = Path(root)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return BlobStore(path, keyed=False)


def named_blob(digest: str, part: np.ndarray) -> EncodedBlob:
    """A slice of the update ``digest`` in the blob format, named by the whole update's digest."""
    enc = encode_blob(np.ascontiguousarray(np.asarray(part, dtype=np.int64)))
    return EncodedBlob(digest, enc.prefix, enc.payload)


def join_checked(digest: str, parts: Sequence[np.ndarray], dim: int, where: str) -> np.ndarray:
    """The slices side by side, checked to be the update named ``digest`` (``BlobCorruptError`` if not)."""
    whole = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]) if parts \
        else np.zeros(0, np.int64)
    if whole.shape != (dim,) or encode_blob(whole).digest != digest:
        raise BlobCorruptError(f"{where}: the shards' slices of blob {digest[:16]}... do not join to it "
                         f"({whole.size} of {dim} coordinates, or a slice changed): a shard's directory "
                         "is damaged or belongs to another store")
    return whole


def removed_durably(d: BlobStore, removed: list[Path]) -> int:
    """The removals made durable (an erasure's slices must not come back after a power cut)."""
    if removed:
        fsync_dir(d.dir)
    return len(removed)


class SliceDirs:
    """:class:`ShardFiles` over directories this process reads and writes itself."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]], bounds: Sequence[tuple[int, int]]) -> None:
        if len(roots) != len(bounds):
            raise ValueError(f"{len(roots)} shard directories for {len(bounds)} shards")
        self.bounds = list(bounds)
        self.dirs = [slice_dir(r) for r in roots]

    def put(self, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
        for k, d in enumerate(self.dirs):
            a, b = self.bounds[k]
            d.put_many([named_blob(digest, arr[a:b]) for digest, arr in arrays])

    def read(self, digest: str) -> list[np.ndarray]:
        return [d.read(digest) for d in self.dirs]

    def remove(self, digests: Iterable[str]) -> int:
        names = list(digests)
        return sum(removed_durably(d, d.remove(names)) for d in self.dirs)

    def sweep(self, keep: set[str]) -> int:
        return sum(removed_durably(d, d.sweep(keep)) for d in self.dirs)

    def names(self) -> list[set[str]]:
        return [d.digests() for d in self.dirs]
