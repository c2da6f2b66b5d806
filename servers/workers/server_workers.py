"""A server daemon's workers (``[deployment] workers`` > 1): kept across rounds, replaced after a failure.

Why a keeper of its own: the daemon's rounds (and later its jobs) need the same K workers again
and again (a Ray actor and its pair's link take seconds to start), but a worker that died, or
whose pair's session broke, must not poison the next attempt. So every failure of a sharded
step ends this server's workers (``WorkerGroup.stop_workers``; the catalog and the shard
directories keep every stored share, so nothing committed is lost) and the next attempt starts new ones on new ports; server 1 tells
server 0 where its workers listen at every check (``WorkerAddresses``).

A sharded range check is two halves, because the servers meet in between: :meth:`prepare`
(this server's shares of the staged uploads at the workers, shard k at worker k, read from the
shard directories where the store keeps them there; fails fast on
a dead worker before the peer is asked anything) and :meth:`check` (the pairs' sessions and the
coordinators' verdict, ``sharded_round.check_on_shards``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import wire
from common.service_config import ServiceConfig
from net.channel import KIND_OBJECT
from net import tls
from protocols.fedseca_shards import fedseca_on_shards
from servers.store.crash_points import checkpoint, planned
from servers.store.share_store import ShareStore

from .shard_store_files import WorkerShardFiles, shard_dirs
from .sharded_round import check_on_shards, vote_on_shards
from .worker_group import WorkerGroup, connect_cluster

__all__ = ["ServerWorkers", "PreparedCheck", "missing_worker_keys"]

log = logging.getLogger("starfish.server")


def missing_worker_keys(cfg: ServiceConfig, rank: int) -> list[str]:
    """The certificate names of this server's workers that ``keys_dir`` lacks."""
    out = []
    for k in range(cfg.workers):
        name = tls.party_name(rank, k)
        try:
            tls.identity(cfg.keys_dir, name)
        except FileNotFoundError:
            out.append(name)
    return out


@dataclass(frozen=True)
class PreparedCheck:
    """What :meth:`ServerWorkers.prepare` left at the workers for one check."""

    round: int
    participants: tuple[int, ...]
    names: tuple[str, ...]          # the workers' names of each participant's update shares
    norms: np.ndarray               # this server's shares of the reported norms, (n,)
    deltas: np.ndarray              # and of the thresholds delta_j, (n,)


#: the crash-test seam a job's programs on the workers pass (``servers.store.crash_points``)
JOB_SEAM = "job-shard-program"


class _JobSeam:
    """A job's group, passing :data:`JOB_SEAM` before each program: a test kills this server's
    last worker mid-job (its pair's session open, its shares held) with ``STARFISH_CRASH_AT``."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def _last(self) -> tuple[str, int]:
        last = self._group.state()[-1]
        return last["name"], int(last["pid"])

    def run(self, program: Callable[..., Any], *args: Any, per_shard: Sequence[tuple] | None = None) -> list[Any]:
        checkpoint(JOB_SEAM, victim=self._last)
        return self._group.run(program, *args, per_shard=per_shard)


class ServerWorkers:
    """Server ``rank``'s ``cfg.workers`` workers for a model of ``dim`` coordinates."""

    def __init__(self, cfg: ServiceConfig, rank: int, dim: int) -> None:
        self.cfg, self.rank, self.dim = cfg, rank, dim
        self._group: WorkerGroup | None = None
        self._lock = threading.RLock()
        self._ray_dir: str | None = None
        self.starts = 0                        # groups started so far (status)
        self.last_failure: str | None = None   # why the last group was ended (status)

    # ------------------------------------------------------------------ the group's life
    def _options(self) -> dict[str, Any]:
        me = self.cfg.server(self.rank)
        opts: dict[str, Any] = {"offline": str(self.cfg.offline.value), "timeout": self.cfg.limits.peer_timeout,
                                "listen_host": me.worker_host or me.host, "spill_mib": self.cfg.worker_spill_mib}
        if opts["offline"] == "dealer":
            opts["dealer_address"] = self.cfg.dealer.endpoint().address
        return opts

    def files(self) -> WorkerShardFiles:
        """The store's shard directories at these workers (``ShareStore(..., shards=)``)."""
        return WorkerShardFiles(self.on_workers, self.dim, self.cfg.workers)

    def connect(self) -> None:
        """Join (or start) this server's Ray cluster: from the daemon's main thread
        (``worker_group.connect_cluster`` says why)."""
        with self._lock:
            if not self.cfg.ray_address and self._ray_dir is None:
                # short: Ray's sockets live under it (AF_UNIX paths end at 107 bytes)
                self._ray_dir = tempfile.mkdtemp(prefix=f"sfray{self.rank}-")
            connect_cluster(self.rank, self.cfg.workers, ray_address=self.cfg.ray_address or None,
                            ray_dir=self._ray_dir)

    def ensure(self) -> WorkerGroup:
        """This server's live group, started (seconds) if there is none."""
        with self._lock:
            if self._group is None:
                t0 = time.monotonic()
                self.connect()
                self._group = WorkerGroup(self.rank, self.cfg.keys_dir, self.cfg.workers, self.dim,
                                          ray_address=self.cfg.ray_address or None, ray_dir=self._ray_dir,
                                          shard_dirs=shard_dirs(self.cfg, self.rank), **self._options())
                self.starts += 1
                wait = "".join(f" {h}:{p}" for h, p in self._peer_side())
                log.info("%s: %d workers up in %.1fs%s", tls.PARTY_NAMES[self.rank], self.cfg.workers,
                         time.monotonic() - t0, f", waiting for their peers at{wait}" if wait else "")
            return self._group

    def _peer_side(self) -> list[tuple[str, int]]:
        assert self._group is not None
        return [a for a in self._group.addresses if a is not None]

    def addresses(self) -> tuple[tuple[str, int], ...]:
        """Where this server's workers wait for their peers (server 1; empty for server 0)."""
        return tuple(self._peer_side()) if self.rank == 1 else ()

    def reset(self, why: str) -> None:
        """End the current workers (the next attempt starts new ones)."""
        with self._lock:
            group, self._group = self._group, None
            self.last_failure = why
        if group is not None:
            log.warning("%s: ending the workers after a failure (%s); new ones start for the next "
                        "attempt", tls.PARTY_NAMES[self.rank], why)
            group.stop_workers()

    def state(self) -> list[dict[str, Any]]:
        """Each worker's state for ``status`` (or that none is running now)."""
        group = self._group
        if group is None:
            return [{"name": tls.party_name(self.rank, k), "state": "not running",
                     **({"last_failure": self.last_failure} if self.last_failure else {})}
                    for k in range(self.cfg.workers)]
        return [{"state": "error" if "error" in s else "up", **s} for s in group.state()]

    def shutdown(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            group.shutdown()
        if self._ray_dir is not None:
            shutil.rmtree(self._ray_dir, ignore_errors=True)

    def on_workers(self, step: Callable[[WorkerGroup], Any]) -> Any:
        """``step`` on the live group (started if there is none); a failure ends the workers."""
        group = self.ensure()
        try:
            return step(group)
        except BaseException as exc:
            self.reset(str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            raise

    @staticmethod
    def _stage(group: WorkerGroup, store: ShareStore, r: int, j: int, name: str) -> None:
        """Client ``j``'s staged update of round ``r`` at the workers as ``name``: read by each worker
        where the store keeps it on the shards, else sent from here."""
        if store.shards is not None:
            group.load(name, store.staged_update_ref(r, j))
        else:
            group.scatter(name, store.staged_upload(r, j).update)

    def share_sum(self, terms: Sequence[tuple[str, int]]) -> np.ndarray:
        """An FL round's FedAvg share sum of the stored updates ``terms`` [(ref_j, n_j)], each worker
        adding its shard from its own directory (the store keeps its updates on the shards)."""
        return self.on_workers(lambda group: group.weighted_sum(terms))

    # ------------------------------------------------------------------ the range check
    def prepare(self, store: ShareStore, r: int, participants: Sequence[int]) -> PreparedCheck:
        """This server's shares of round ``r``'s staged uploads, shard k to worker k."""
        parts = tuple(participants)
        names = tuple(f"round{r}/client{j}" for j in parts)

        def scatter(group: WorkerGroup) -> PreparedCheck:
            for n, j in zip(names, parts):
                self._stage(group, store, r, j, n)
            scalars = [store.staged_scalars(r, j) for j in parts]
            return PreparedCheck(r, parts, names, np.array([int(a.reshape(-1)[0]) for a, _ in scalars], np.int64),
                                 np.array([int(b.reshape(-1)[0]) for _, b in scalars], np.int64))
        return self.on_workers(scatter)

    def check(self, prepared: PreparedCheck, party: Any, ticket: bytes,
              peer_addresses: Sequence[tuple[str, int]] | None, precision: int) -> list[int]:
        """The participants whose upload is in range: the pairs' sessions ``ticket`` (server 0
        passes server 1's ``peer_addresses``), the coordinators' verdict in ``party``."""
        if peer_addresses is not None and len(peer_addresses) != self.cfg.workers:
            raise RuntimeError(f"server 1 runs {len(peer_addresses)} workers and this server "
                               f"{self.cfg.workers}: [deployment] workers must be the same at both servers")

        def run(group: WorkerGroup) -> list[int]:
            group.open(ticket, list(peer_addresses) if peer_addresses is not None else None)
            bits = check_on_shards(group, party, prepared.names, prepared.norms, prepared.deltas,
                                   precision=precision)
            group.close()
            group.drop(list(prepared.names))
            return [j for j, ok in zip(prepared.participants, bits) if ok]
        return self.on_workers(run)

    # ------------------------------------------------------------------ an unlearning job
    def open_job(self, party: Any, ticket: bytes) -> WorkerGroup:
        """The pairs' sessions ``ticket`` for a job (``servers.secure.unlearning_jobs.JobWorkers``):
        server 1 sends where its workers wait over the job's own session, server 0 reads it."""
        def meet(group: WorkerGroup) -> WorkerGroup:
            self._meet(group, party, ticket)
            return _JobSeam(group) if planned(JOB_SEAM) else group
        return self.on_workers(meet)

    def _meet(self, group: WorkerGroup, party: Any, ticket: bytes) -> None:
        """Open the pairs' sessions ``ticket``: server 1 sends where its workers wait over the
        coordinators' session ``party``, server 0 reads it."""
        if self.rank == 1:
            party.channel.send_frame(KIND_OBJECT, wire.pack({"workers": [f"{h}:{p}" for h, p in self.addresses()]}))
            peers = None
        else:
            msg = wire.unpack(party.channel.recv_frame(KIND_OBJECT), 1 << 16)
            peers = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in msg.get("workers", []))]
            if len(peers) != self.cfg.workers:
                raise RuntimeError(f"server 1 runs {len(peers)} workers and this server {self.cfg.workers}: "
                                   "[deployment] workers must be the same at both servers")
        group.open(ticket, peers)

    # ------------------------------------------------------------------ a BRACE round's vote
    def brace_vote(self, store: ShareStore, r: int, participants: Sequence[int], party: Any, ticket: bytes,
                   lam: float) -> tuple[np.ndarray, list[dict]]:
        """Round ``r``'s BRACE vote over the participants' staged uploads on the shards: the
        pairs' sessions ``ticket`` met through ``party``, each shard voted and opened by its pair
        (``sharded_round.vote_on_shards``), the shares dropped. The opened +-1 vector and the
        pairs' meters."""
        names = [f"round{r}/vote/client{j}" for j in participants]

        def run(group: WorkerGroup) -> tuple[np.ndarray, list[dict]]:
            # after a failure the workers are ended (``on_workers``), their shares with them
            self._meet(group, party, ticket)
            for n, j in zip(names, participants):
                self._stage(group, store, r, j, n)
            vote = vote_on_shards(group, names, lam, store.precision)
            group.drop(names)
            meters = group.meters()
            group.close()
            return vote, meters
        return self.on_workers(run)

    def fedseca_round(self, store: ShareStore, r: int, participants: Sequence[int], thresholds: Sequence[np.ndarray],
                      party: Any, ticket: bytes, gamma: float) -> tuple[list[bool], np.ndarray | None, list[dict]]:
        """Round ``r``'s FedSECA on the participants' staged uploads, its coordinate-wise work on the
        shards (``protocols.fedseca_shards``): the pairs' sessions ``ticket`` met through ``party``,
        the coordinators' small steps in ``party``; ``thresholds``: this server's shares of the
        claimed lambda_k, one per participant (as the round's session checked them). The verdict per participant, the opened
        aggregate of the kept (None if none), the pairs' meters."""
        names = [f"round{r}/fedseca/client{j}" for j in participants]
        lam = np.array([int(np.asarray(t).reshape(-1)[0]) for t in thresholds], np.int64)

        def run(group: WorkerGroup) -> tuple[list[bool], np.ndarray | None, list[dict]]:
            self._meet(group, party, ticket)
            for n, j in zip(names, participants):
                self._stage(group, store, r, j, n)
            ok, vector = fedseca_on_shards(group, party, names, lam, store.dim, gamma=gamma,
                                           precision=store.precision, tag=f"round{r}/fedseca")
            group.drop(names)
            meters = group.meters()
            group.close()
            return [bool(b) for b in ok.tolist()], vector, meters
        return self.on_workers(run)

    def end_job(self, failed: str | None) -> list[dict]:
        """After a job's run: each pair's meters and its session closed, or (``failed``: why) the
        workers ended, so that the next run starts new ones."""
        if failed is not None:
            self.reset(failed)
            return []
        return self.on_workers(lambda group: (group.meters(), group.close())[0])

    def release(self, prepared: PreparedCheck) -> None:
        """Drop a prepared check's shares that no check consumed (its round moved on)."""
        group = self._group
        if group is not None:
            try:
                group.drop(list(prepared.names))
            except Exception as exc:  # noqa: BLE001 - a dead worker's shares are gone with it
                self.reset(str(exc).splitlines()[0][:300])
