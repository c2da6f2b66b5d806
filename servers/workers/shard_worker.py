"""One worker of one server: the shares of one coordinate shard and the 2PC that computes on them.

Why a worker is its own process with its own session: CrypTen's communicator is process-wide (one
session per process), and the point of workers is that shard k's memory and compute live
apart from the coordinator's. Worker k of server ``rank`` authenticates as ``server<rank>-w<k>``
and accepts only ``server<1-rank>-w<k>`` (``net.tls.party_name``), over its own TLS 1.3 link,
with its own dealer stream (``mpc.dealer``: a session's seeds go to one pair only) or its own
two-party engine (kept for the worker's lifetime, ``mpc.session.shared_engine_pool``).

This class is the actor's body and knows nothing of Ray (``worker_group`` makes it a Ray actor in
the server's own cluster), so the same code runs, and is tested, as a plain process.

What a worker holds: named int64 ring shares of its shard (``put``/``drop``), in memory (or, from
``spill_mib`` MiB a share up, in a file of its own temporary directory, read through a memory map
when a program uses it: its memory then follows a step's working set, not every share it keeps), and, where
its server keeps the stored updates on the shards, its slices of them in its own directory
(``shard_dir``: ``put_slices``, ``load``; ``servers.store.shard_files``); what
leaves it: what its coordinator asks for, which is either a share (this server's, never the
peer's) or a value the pair opened on purpose (a program's documented output).
"""

from __future__ import annotations

import hashlib
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.prg import expand
from mpc.session import open_party, shared_engine_pool
from net import tls
from servers.secure.ring_aggregation import weighted_share_sum
from servers.store.blobs import BlobError, BlobStore
from servers.store.shard_files import named_blob, removed_durably, slice_dir

__all__ = ["ShardWorker", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker was asked for something it cannot do (no session, an unknown share)."""


def _plain(exc: BaseException) -> WorkerError:
    """The failure as a ``WorkerError`` naming its type: Ray sends a worker's exception to the
    coordinator by pickling it, and several of ours (and CrypTen's) cannot be rebuilt there, which
    left the coordinator with "Failed to deserialize exception" instead of the reason."""
    text = str(exc).strip().splitlines()
    return WorkerError(f"{type(exc).__name__}: {text[0][:500] if text else ''}")


def _machine_address() -> str:
    """This machine's address as its Ray node knows it (a worker listening on every interface);
    outside Ray, the address of its host name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class _Spilled:
    """A share kept in a file of the worker's spill directory (``ShardWorker`` with ``spill_mib``)."""
    path: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 8 * math.prod(self.shape)

    def array(self) -> np.ndarray:
        # a fresh map per use: pages a step touched leave the process's memory with the step
        return np.memmap(self.path, dtype=np.int64, mode="r+", shape=self.shape)


class ShardWorker:
    """Worker ``worker`` of server ``rank`` (see the module docstring).

    ``keys_dir`` holds this worker's certificate and key (``server<rank>-w<k>.pem``/``.key``), the
    CA certificate and CRL; ``offline`` is the deployment's mode and ``dealer_address`` the
    dealer's endpoint in dealer mode. Server 1's workers listen for their peer on
    ``listen_host`` (port ``listen_port``; 0: any free one), reported by ``address``.
    ``spill_mib`` > 0: shares of at least that many MiB live in files under the worker's own
    temporary directory (swept at start, as its other files) instead of in memory.
    """

    def __init__(self, rank: int, worker: int, keys_dir: str, *, offline: str,
                 dealer_address: tuple[str, int] | None = None, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, timeout: float = 120.0, shard_dir: str | None = None,
                 spill_mib: float = 0.0) -> None:
        self.name = tls.party_name(rank, worker)
        try:
            tls.identity(keys_dir, self.name)       # fail at start, naming the missing file
        except FileNotFoundError as exc:
            raise _plain(exc) from None
        # this worker's temporary files (its two-party engine's per-link key) in a directory of
        # its own identity, swept at start: a worker killed outright (Ray ends its children with
        # it) cannot remove them, and the next worker of the same name on this machine does
        tag = hashlib.sha256(os.path.abspath(keys_dir).encode()).hexdigest()[:8]
        self._tmp = os.path.join(tempfile.gettempdir(), f"starfish-{self.name}-{tag}")
        shutil.rmtree(self._tmp, ignore_errors=True)
        os.makedirs(self._tmp, mode=0o700)
        tempfile.tempdir = self._tmp
        self.rank, self.worker, self.keys_dir = rank, worker, keys_dir
        self.offline, self.dealer_address, self.timeout = offline, dealer_address, timeout
        self._listener: socket.socket | None = None
        if rank == 1:
            self._listener = socket.create_server((listen_host, listen_port))
        self._shares: dict[str, np.ndarray | _Spilled] = {}
        self._held = self._peak_held = 0        # bytes of shares kept, now and at most
        self._spill_from = int(spill_mib * 2**20) if spill_mib > 0 else 0
        self._spill_dir = os.path.join(self._tmp, "spill")
        self._spilled_bytes = self._peak_spilled = self._spill_count = 0
        self._party: Any = None
        self._ticket: bytes | None = None
        # this shard's slices of the stored updates (``servers.store.shard_files``), on this machine
        try:
            self._files: BlobStore | None = slice_dir(shard_dir) if shard_dir else None
        except OSError as exc:
            raise WorkerError(f"{self.name}: cannot use its shard directory {shard_dir}: {exc}") from None
        self._started = time.time()

    # ------------------------------------------------------------------ the pair's link
    def address(self) -> tuple[str, int] | None:
        """Where server 0's worker of this pair connects (server 1's workers; None for server 0's)."""
        if self._listener is None:
            return None
        host, port = self._listener.getsockname()[:2]
        if host in ("0.0.0.0", "::"):    # every interface: server 0's worker needs one it can reach
            host = _machine_address()
        return host, port

    def open(self, ticket: bytes, peer_address: tuple[str, int] | None = None) -> str:
        """Join the pair's 2PC session named ``ticket``; returns the session id (both sides equal)."""
        if self._party is not None:
            raise WorkerError(f"{self.name} is already in session {self._ticket!r}: close it first")
        source: dict[str, Any] = {"offline": self.offline}
        if self.offline == "dealer":
            source["dealer_address"] = tuple(self.dealer_address) if self.dealer_address else None
        else:
            source["engine_pool"] = shared_engine_pool()
        try:
            self._party = open_party(self.rank, self.keys_dir, worker=self.worker,
                                     peer_listener=self._listener,
                                     peer_address=tuple(peer_address) if peer_address else None,
                                     ticket=ticket, timeout=self.timeout, **source)
        except Exception as exc:  # noqa: BLE001 - see _plain
            raise _plain(exc) from None
        self._ticket = ticket
        return self._party.extras["session_id"]

    def close(self) -> None:
        """Leave the pair's session (nothing else: the shares stay until dropped)."""
        party, self._party, self._ticket = self._party, None, None
        if party is not None:
            party.close()

    def shutdown(self) -> None:
        """Leave the session, end the pair's engine (it removes its key) and this worker's
        temporary files: what ``WorkerGroup.stop_workers`` asks before it ends the process."""
        self.close()
        if self.offline != "dealer":
            shared_engine_pool().close()
        self.drop(list(self._shares))
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ------------------------------------------------------------------ shares
    def put(self, name: str, share: np.ndarray) -> int:
        """Keep this server's share ``share`` of shard values under ``name``; returns its bytes."""
        arr = np.asarray(share)
        if arr.dtype != np.int64:
            raise WorkerError(f"{self.name}: a share is int64 ring elements, not {arr.dtype}")
        old = self._shares.get(name)
        if self._spill_from and arr.nbytes >= self._spill_from:
            self._shares[name] = self._spill(arr)
        else:
            # a copy of our own: what Ray hands over is a read-only view of its object store, which
            # ``drop`` could not zero
            self._shares[name] = np.array(arr, order="C", copy=True)
        if old is not None:           # a name put again: the share it held goes as a drop would
            self._forget(old)
        self._held += arr.nbytes
        self._peak_held = max(self._peak_held, self._held)
        self._peak_spilled = max(self._peak_spilled, self._spilled_bytes)
        return arr.nbytes

    def _spill(self, arr: np.ndarray) -> _Spilled:
        os.makedirs(self._spill_dir, mode=0o700, exist_ok=True)
        self._spill_count += 1
        path = os.path.join(self._spill_dir, f"{self._spill_count}.i64")
        try:
            with open(path, "wb") as f:
                np.ascontiguousarray(arr).tofile(f)
        except OSError as exc:
            try:
                os.unlink(path)       # a part written before the disk filled
            except OSError:
                pass
            raise WorkerError(f"{self.name}: cannot write a share to its spill directory {self._spill_dir}: "
                              f"{exc}; free space there (the worker's TMPDIR chooses the disk) or keep shares "
                              f"in memory ([deployment] worker_spill_mib = 0)") from None
        self._spilled_bytes += arr.nbytes
        return _Spilled(path, arr.shape)

    def _forget(self, held: np.ndarray | _Spilled) -> None:
        """Zero a share in memory; a spilled one's file is unlinked (the store's blobs go the same way,
        ``servers.store.blobs``: what the file system's unlink reaches)."""
        if isinstance(held, _Spilled):
            try:
                os.unlink(held.path)
            except FileNotFoundError:
                pass
            self._spilled_bytes -= held.nbytes
        else:
            held.fill(0)
        self._held -= held.nbytes

    def drop(self, names: list[str]) -> int:
        """Forget the named shares and what a program kept beside each (``name#...``: its reused
        Beaver mask, ``shard_steps``), zeroed first: erasure must not leave them in freed memory."""
        gone = 0
        for n in names:
            for key in [n, *(k for k in self._shares if k.startswith(n + "#"))]:
                held = self._shares.pop(key, None)
                if held is not None:
                    self._forget(held)
                    gone += key == n
        return gone

    def has(self, name: str) -> bool:
        return name in self._shares

    def share(self, name: str) -> np.ndarray:
        try:
            held = self._shares[name]
        except KeyError:
            raise WorkerError(f"{self.name} holds no share named {name!r}") from None
        return held.array() if isinstance(held, _Spilled) else held

    # ------------------------------------------------------------------ the stored slices
    def _slices(self) -> BlobStore:
        if self._files is None:
            raise WorkerError(f"{self.name} has no shard directory (its server keeps every share)")
        return self._files

    def put_slices(self, items: list[tuple[str, np.ndarray]]) -> int:
        """Each ``(digest, slice)`` made durable under ``digest`` (the whole update's name)."""
        return len(self._slices().put_many([named_blob(digest, part) for digest, part in items]))

    def read_slice(self, digest: str) -> np.ndarray:
        try:
            return self._slices().read(digest)
        except BlobError as exc:
            raise WorkerError(f"{self.name}: {exc}") from None

    def remove_slices(self, digests: list[str]) -> int:
        files = self._slices()
        return removed_durably(files, files.remove(digests))

    def sweep_slices(self, keep: set[str]) -> int:
        files = self._slices()
        return removed_durably(files, files.sweep(set(keep)))

    def slice_names(self) -> set[str]:
        return self._slices().digests()

    def load(self, name: str, ref: str, bounds: tuple[int, int], dim: int) -> int:
        """Keep this shard of the stored update ``ref`` (a catalog reference: ``blob:<digest>``, read
        from this worker's directory, or ``seed:<hex>``, expanded here) under ``name``: a stored
        share reaches the pair without passing through the coordinator."""
        return self.put(name, self._stored(ref, bounds, dim))

    def weighted_sum(self, terms: list[tuple[str, int]], bounds: tuple[int, int], dim: int) -> np.ndarray:
        """sum_j n_j * (this shard of the stored update ref_j) on the ring, for ``terms`` [(ref_j, n_j)]:
        an FL round's FedAvg share sum, shard by shard (``servers.secure.ring_aggregation``)."""
        return weighted_share_sum(((n, self._stored(ref, bounds, dim)) for ref, n in terms), bounds[1] - bounds[0])

    def _stored(self, ref: str, bounds: tuple[int, int], dim: int) -> np.ndarray:
        kind, _, value = ref.partition(":")
        if kind == "blob":
            part = self.read_slice(value)
        elif kind == "seed":
            part = expand(bytes.fromhex(value), (dim,))[bounds[0]:bounds[1]]
        else:
            raise WorkerError(f"{self.name}: {ref[:40]!r} is not a stored update's reference")
        if part.shape != (bounds[1] - bounds[0],):
            raise WorkerError(f"{self.name}: the slice of {ref[:40]} has {part.size} coordinates, "
                              f"its shard {bounds[1] - bounds[0]}")
        return part

    # ------------------------------------------------------------------ computing
    def run(self, program: Callable[..., Any], *args: Any) -> Any:
        """``program(party, worker, *args)`` in the pair's open session (a module-level function,
        run by both workers of the pair in the same order, as ``mpc.launcher.run_parties`` does)."""
        if self._party is None:
            raise WorkerError(f"{self.name} has no open session: open one first")
        try:
            return program(self._party, self, *args)
        except WorkerError:
            raise
        except Exception as exc:  # noqa: BLE001 - see _plain
            raise _plain(exc) from None

    def meters(self) -> dict[str, Any]:
        """This worker's traffic and time per step in its open session."""
        if self._party is None:
            raise WorkerError(f"{self.name} has no open session: open one first")
        return self._party.meters()

    def state(self) -> dict[str, Any]:
        """What ``starfish status`` shows of a worker."""
        return {"name": self.name, "pid": os.getpid(), "session": self._ticket is not None,
                "shares": len(self._shares), "bytes": self._held, "peak_bytes": self._peak_held,
                "spilled_bytes": self._spilled_bytes, "peak_spilled_bytes": self._peak_spilled,
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "up_s": round(time.time() - self._started, 1),
                **({"slices": len(self._files.digests())} if self._files is not None else {})}
