"""A server's K workers as Ray actors in that server's own Ray cluster (issue 30).

Why Ray, and why one cluster per server: a server that outgrows one machine needs processes on
other machines, placed, started, restarted and reached by an existing engine, not a home-made
one; Ray does this (``ray_address`` joins a cluster the operator runs across machines, by
default a local one is started). Never one cluster for both servers: a cluster's head, object
store and logs are one control plane, and the two servers are separate trust domains (each
server's shares must stay under its own operator). So each coordinator (the daemon) connects
only to its own cluster, under the namespace ``starfish-server<rank>``, and the pairs' 2PC
traffic runs over the workers' own TLS links (``shard_worker``), never through Ray.

Ray is an optional dependency (``pip install '.[scale]'``; ``make setup`` installs it): a
deployment with ``workers = 1`` never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from net import tls

from .shard_worker import ShardWorker, WorkerError
from .shards import join, shard_bounds, split

__all__ = ["WorkerGroup", "connect_cluster", "ray_missing_message"]


def ray_missing_message() -> str:
    return ("a server with workers > 1 runs them on Ray, which is not installed: "
            "`pip install '.[scale]'` (or `make setup`) installs it")


def _ray():
    try:
        import ray  # noqa: PLC0415  (optional: only a server with workers > 1 needs it)
    except ImportError:
        raise RuntimeError(ray_missing_message()) from None
    return ray


def connect_cluster(rank: int, workers: int, *, ray_address: str | None = None,
                    ray_dir: str | os.PathLike | None = None, cpus_per_worker: float = 1.0) -> None:
    """Connect this process to server ``rank``'s own Ray cluster (once; a local one if no address).

    Call it from the thread that lives as long as the process (a daemon's main thread): Ray ties
    a local cluster's processes to the thread that started them (the kernel's parent-death
    signal fires when that *thread* ends), and a cluster started from a short-lived thread lost
    its control store a second after the thread returned."""
    ray = _ray()
    if ray.is_initialized():
        return
    # a local cluster never spills objects to disk: the shares a coordinator hands its workers
    # pass through the object store, and erasure must not have to find them in spill files
    # worker k's resource (its name, one unit) pins it to the node of its shard's directory; a local
    # cluster is that node for every shard
    local = {} if ray_address else {"num_cpus": max(os.cpu_count() or 1, int(workers * cpus_per_worker)),
                                    "resources": {tls.party_name(rank, k): 1 for k in range(tls.MAX_WORKERS)},
                                    "_temp_dir": str(ray_dir) if ray_dir else None,
                                    "_system_config": {"automatic_object_spilling_enabled": False}}
    ray.init(address=ray_address, namespace=f"starfish-server{rank}", include_dashboard=False,
             log_to_driver=False, configure_logging=False, **local)


class WorkerGroup:
    """Server ``rank``'s ``workers`` workers, worker k owning coordinate shard k of ``dim``.

    ``ray_address``: join that cluster (it must be this server's own); None starts a local one
    with its files under ``ray_dir``. ``worker_options``: ``ShardWorker`` keywords (offline mode,
    dealer address, listen host). ``cpus_per_worker``: what each actor reserves in the cluster.
    """

    def __init__(self, rank: int, keys_dir: str | os.PathLike, workers: int, dim: int, *,
                 ray_address: str | None = None, ray_dir: str | os.PathLike | None = None,
                 cpus_per_worker: float = 1.0, shard_dirs: Sequence[str] | None = None,
                 **worker_options: Any) -> None:
        ray = self._ray = _ray()
        self.rank, self.workers, self.dim = rank, workers, dim
        self.bounds = shard_bounds(dim, workers)
        connect_cluster(rank, workers, ray_address=ray_address, ray_dir=ray_dir, cpus_per_worker=cpus_per_worker)
        names = [tls.party_name(rank, k) for k in range(workers)]
        undeclared = [n for n in names if ray.cluster_resources().get(n, 0) < 1]
        if undeclared:
            raise WorkerError(
                f"the Ray cluster at {ray_address or 'this machine'} declares no resource {undeclared[0]!r}: "
                f"worker k runs on the node that declares its name, where its shard's files and key are; "
                f"start that node with `ray start --address=... --resources='{{\"{undeclared[0]}\": 1}}'`")
        dirs = list(shard_dirs) if shard_dirs is not None else [None] * workers
        self.actors = [ray.remote(ShardWorker).options(num_cpus=cpus_per_worker, max_restarts=0,
                                                       resources={names[k]: 1})
                       .remote(rank, k, str(keys_dir), shard_dir=dirs[k], **worker_options)
                       for k in range(workers)]
        try:
            self.addresses = self._all("address")     # waits until every worker is up
        except BaseException:
            self.stop_workers()     # a group that never came up leaves no worker behind
            raise

    def _all(self, method: str, *per_worker: Sequence[Any], common: tuple = ()) -> list[Any]:
        """``method`` on every worker at once (worker k gets the k-th item of each ``per_worker``).

        Fails as soon as one worker fails, naming every worker that has failed by then: the
        others' parts are of no use to a round or job that must be tried again, and a worker whose
        pair lost its peer may only fail at its session's timeout."""
        refs = [getattr(a, method).remote(*(p[k] for p in per_worker), *common)
                for k, a in enumerate(self.actors)]
        index = {ref: k for k, ref in enumerate(refs)}
        out: dict[int, Any] = {}
        failures: list[str] = []
        pending = list(refs)
        while pending and not failures:
            done, pending = self._ray.wait(pending, num_returns=1)
            # whatever else has finished by now is read too, so one error line names them all
            more, pending = self._ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
            for ref in [*done, *more]:
                k = index[ref]
                try:
                    out[k] = self._ray.get(ref)
                except self._ray.exceptions.RayError as exc:
                    failures.append(self._failure(k, exc))
        if failures:
            raise WorkerError(f"{method} failed on {len(failures)} of {self.workers} workers: " + "; ".join(failures))
        return [out[k] for k in range(len(refs))]

    def _failure(self, k: int, exc: Exception) -> str:
        """One line for worker k's failure (its own exception, or why it is gone)."""
        name = f"server{self.rank}-w{k}"
        if isinstance(exc, self._ray.exceptions.RayTaskError):
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            text = str(cause).strip().splitlines()
            return f"{name}: {type(cause).__name__}: {text[-1][:300] if text else ''}"
        if isinstance(exc, self._ray.exceptions.RayActorError):
            text = str(exc)
            why = text[text.index("WorkerError: ") + 13:].splitlines()[0][:300] if "WorkerError: " in text \
                else f"{type(exc).__name__}; the server starts its workers again on the next round or job run"
            return f"{name} is gone: {why}"
        text = str(exc).strip().splitlines()    # e.g. an answer that could not be read
        return f"{name}: {type(exc).__name__}: {text[0][:300] if text else ''}"

    def open(self, ticket: bytes, peer_addresses: Sequence[tuple[str, int] | None] | None = None) -> list[str]:
        """Every pair's session ``ticket`` (server 0 passes server 1's ``addresses``)."""
        peers = list(peer_addresses) if peer_addresses is not None else [None] * self.workers
        if len(peers) != self.workers:
            raise ValueError(f"{len(peers)} peer addresses for {self.workers} workers")
        return self._all("open", [ticket] * self.workers, peers)

    def close(self) -> None:
        self._all("close")

    def scatter(self, name: str, share: np.ndarray) -> None:
        """This server's share of a (…, dim) value, its shard k to worker k."""
        self._all("put", [name] * self.workers, split(share, self.bounds))

    def put_all(self, name: str, share: np.ndarray) -> None:
        """This server's share of a small value (not split: every worker keeps all of it)."""
        self._all("put", [name] * self.workers, [share] * self.workers)

    def drop(self, names: list[str]) -> list[int]:
        return self._all("drop", common=(list(names),))

    # ------------------------------------------------------------------ the stored slices
    def store_slices(self, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
        """Each ``(digest, update)``'s slice k made durable at worker k (``servers.store.shard_files``)."""
        self._all("put_slices", [[(d, np.ascontiguousarray(arr[a:b])) for d, arr in arrays] for a, b in self.bounds])

    def read_slices(self, digest: str) -> list[np.ndarray]:
        return self._all("read_slice", common=(digest,))

    def remove_slices(self, digests: Sequence[str]) -> int:
        return sum(self._all("remove_slices", common=(list(digests),)))

    def sweep_slices(self, keep: set[str]) -> int:
        return sum(self._all("sweep_slices", common=(set(keep),)))

    def slice_names(self) -> list[set[str]]:
        return self._all("slice_names")

    def weighted_sum(self, terms: Sequence[tuple[str, int]]) -> np.ndarray:
        """sum_j n_j * (stored update ref_j) on the ring, each worker its shard from its own files."""
        return join(self._all("weighted_sum", [list(terms)] * self.workers, self.bounds, common=(self.dim,)))

    def load(self, name: str, ref: str) -> None:
        """The stored update ``ref``'s shard k kept by worker k under ``name``, read where it lives."""
        self._all("load", [name] * self.workers, [ref] * self.workers, self.bounds, common=(self.dim,))

    def meters(self) -> list[dict[str, Any]]:
        """Each pair's traffic so far in its open session (``Party.meters``)."""
        return self._all("meters")

    def run(self, program: Callable[..., Any], *args: Any, per_shard: Sequence[tuple] | None = None) -> list[Any]:
        """``program(party, worker, *args, *per_shard[k])`` on every pair at once (worker k gets
        the k-th ``per_shard`` tuple: its slice of a public value); one result per shard."""
        if per_shard is None:
            return self._all("run", common=(program, *args))
        if len(per_shard) != self.workers:
            raise ValueError(f"{len(per_shard)} per-shard argument tuples for {self.workers} workers")
        return self._all("run", *zip(*[(program, *args, *extra) for extra in per_shard]))

    def state(self) -> list[dict[str, Any]]:
        """Each worker's state, or the reason it cannot answer (a dead worker)."""
        out = []
        for k, a in enumerate(self.actors):
            try:
                out.append(self._ray.get(a.state.remote(), timeout=10))
            except Exception as exc:  # noqa: BLE001 - a status must show a dead worker, not fail
                out.append({"name": f"server{self.rank}-w{k}", "error": str(exc).splitlines()[0][:200]})
        return out

    def stop_workers(self) -> None:
        """End this group's workers and keep the cluster: what a coordinator does before it
        starts a new group for the next attempt of a round or a job (a dead worker's shares are
        gone with it; the store still holds them, so the next attempt reads or scatters them again)."""
        # a live worker ends its engine and removes its files first; a dead or stuck one is
        # ended anyway, and its successor sweeps its files (``ShardWorker``)
        refs = [a.shutdown.remote() for a in self.actors]
        if refs:
            self._ray.wait(refs, num_returns=len(refs), timeout=10)
        for a in self.actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []

    def shutdown(self) -> None:
        """End the workers and this process's connection to the cluster (a local cluster the
        group started stops with it)."""
        self.stop_workers()
        self._ray.shutdown()
