"""FL rounds on shares: the open round, closing it with the other server, committing it.

Server 0 leads (:class:`~servers.daemon.round_leader.RoundLeader`): each step it asks server 1
for its view (:class:`~servers.daemon.peer_messages.PeerState`), closes the open round once
enough clients reached both servers, and finishes or replays a round on which the two
histories differ. Server 1 follows (:class:`~servers.daemon.round_follower.RoundFollower`): it
checks each of the leader's requests against its own staged uploads and sizes and commits
first, so after a crash of either the leader can always finish or replay the round (commits
are idempotent).

``fl.rounds`` counts FL rounds; an unlearning round (the adopted model, no participants) is
a round of the history but not of training, so FL goes on for as many rounds after it. Closing a round: both servers
compute their weighted share sums (``servers.secure.ring_aggregation``, exact on the ring) over the
agreed participants, exchange them, publish the same M_i (checked by digest) and commit it.

Under a Byzantine-robust aggregator (``[fl] aggregator``, docs/service.md "Robust
aggregation") no share sum is exchanged (the FedAvg sum is not public then): after the range
check both servers run the round's aggregation session (``servers.secure.robust_session``), each
keeps the opened aggregate durably in its sidecar (``ServiceState.put_opened``), and the
close (:class:`~servers.daemon.peer_messages.CloseRobustRound`) compares its digest; each server
computes M_i from it (``servers.secure.robust_steps``), server 1 commits first and answers the
model's digest. A crash before server 1's commit re-runs the range check and the session;
after it, the leader finishes the round from its own stored aggregate, so the session is
never needed twice for a round server 1 committed.

This module holds what both roles do the same way: the open round, the share sums, M_i from
an opened aggregate, this server's side of a robust aggregation, and the commit.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from common.sample_count import METADATA_KEY, SampleCount, counts_from_metadata, counts_to_metadata
from common.service_config import ServiceConfig

from servers.secure.round_checks import check_round_uploads, open_round_session
from servers.secure.robust_session import aggregate_digest, aggregate_round_uploads
from servers.secure.robust_steps import robust_model
from servers.secure.ring_aggregation import (
    fedavg_weights,
    next_model,
    open_aggregate,
    weighted_share_sum,
)
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore
from servers.workers.server_workers import PreparedCheck, ServerWorkers

__all__ = ["RoundCoordinator"]

log = logging.getLogger("starfish.server")


class RoundCoordinator:
    """The FL rounds of one server, as both roles see them; ``RANK`` is the server's party."""

    RANK: ClassVar[int]

    def __init__(self, cfg: ServiceConfig, store: ShareStore, state: ServiceState, *,
                 stop: threading.Event, mpc_listener: socket.socket | None = None,
                 workers: ServerWorkers | None = None) -> None:
        self.cfg = cfg
        self.workers = workers     # None: one process; else the range check runs on coordinate shards
        self.store = store
        self.state = state
        self.stop_event = stop
        self.mpc_listener = mpc_listener
        # clients left out of the open round: failed its range check (fl.range_check) or, under
        # a robust rule, FedSECA's threshold check (also in _refused, so the round stops waiting
        # for them); in memory, a restart checks again
        self._refused: dict[int, set[int]] = {}
        self._threshold_refused: dict[int, set[int]] = {}
        self._wake = threading.Condition()
        self._round_opened = time.monotonic()

    def open_round(self) -> int | None:
        """The round uploads go to, or None once ``fl.rounds`` FL rounds are committed."""
        return self.store.num_rounds + 1 if self.store.fl_rounds < self.cfg.fl.rounds else None

    def wake(self) -> None:
        """Wake the leader now (an upload or a request arrived, or the daemon stops)."""
        with self._wake:
            self._wake.notify_all()

    def committed_sizes(self, r: int) -> dict[int, SampleCount]:
        return counts_from_metadata(self.store.metadata(r), f"round {r}'s metadata")

    def _share_sum(self, r: int, parts: list[int], sizes: dict[int, SampleCount]) -> np.ndarray:
        committed = r <= self.store.num_rounds
        if self.workers is not None and self.store.shards is not None:
            # the updates live on the shards: each worker adds its slices where they lie
            return self.workers.share_sum([(self.store.update_ref(r, j) if committed
                                            else self.store.staged_update_ref(r, j), int(sizes[j])) for j in parts])
        terms = []
        for j in parts:
            share = (self.store.update_share(r, j) if committed
                     else self.store.staged_upload(r, j).update)
            terms.append((sizes[j], share))
        return weighted_share_sum(terms, self.store.dim)

    def _check_uploads(self, r: int, parts: list[int], prepared: PreparedCheck | None,
                       peer_workers: Sequence[tuple[str, int]] | None) -> list[int]:
        """The participants whose staged upload is in range: in one 2PC session of the two
        servers, or (with workers) on coordinate shards, the verdict in that session."""
        if self.workers is None or prepared is None:
            return check_round_uploads(self.RANK, self.cfg, self.store, r, parts, self.mpc_listener)
        try:
            party = open_round_session(self.RANK, self.cfg, r, "check", parts, self.mpc_listener)
        except BaseException:
            self.workers.release(prepared)
            raise
        try:
            # a ticket per attempt, equal at both servers: the coordinators' session id
            ticket = f"round:{r}:check-shards:{party.extras['session_id']}".encode()
            return self.workers.check(prepared, party, ticket, peer_workers, self.store.precision)
        finally:
            party.close()

    def _round_model(self, r: int, a0: np.ndarray, a1: np.ndarray,
                     sizes: dict[int, SampleCount]) -> np.ndarray:
        total = sum(sizes.values())
        agg = open_aggregate(a0, a1, total, self.store.precision)
        return next_model(self.store.model(r - 1), agg, self.store.server_lr)

    def _commit(self, r: int, model: np.ndarray, parts: list[int], sizes: dict[int, SampleCount],
                refused: Sequence[int] = (), rule: dict | None = None) -> bool:
        """Commit round r; ``rule``: the robust rule's public metadata (None: FedAvg)."""
        meta: dict = {METADATA_KEY: counts_to_metadata(sizes, parts)}
        if refused:
            meta["refused"] = sorted(refused)
        meta.update(rule or {"aggregator": "fedavg"})
        done = self.store.commit_round(r, model, parts, fedavg_weights(sizes), meta)
        self.state.forget_rounds_before(r + 1)
        self._round_opened = time.monotonic()
        return done

    # ------------------------------------------------------------------ robust rounds
    def _robust(self) -> bool:
        return self.cfg.fl.aggregator != "fedavg"

    def _aggregate_here(self, r: int, parts: list[int]) -> tuple[dict, np.ndarray | None]:
        """This server's side of round r's robust aggregation; what it opened is kept durably
        (``ServiceState.put_opened``) before anyone can commit with it."""
        t0 = time.monotonic()
        opened = aggregate_round_uploads(self.RANK, self.cfg, self.store, r, parts, self.mpc_listener,
                                         workers=self.workers)
        gone = set(opened.threshold_refused)
        if gone:
            self._threshold_refused.setdefault(r, set()).update(gone)
            self._refused.setdefault(r, set()).update(gone)
        record = {"aggregator": self.cfg.fl.aggregator, "checked": list(opened.checked),
                  "participants": list(opened.participants),
                  "threshold_refused": sorted(opened.threshold_refused), "refused": [],
                  "aggregate_sha256": None if opened.vector is None else aggregate_digest(opened.vector)}
        if opened.vector is not None:
            self.state.put_opened(r, record, opened.vector)
        tot = opened.meters["total"]
        # one parseable line per round (the demo reports the per-round cost from it)
        log.info("round %d aggregated by %s in 2PC: %d clients checked, %d kept; online_bytes=%d "
                 "offline_bytes=%d rounds=%d seconds=%.3f served_ahead=%d pairs=%d", r, self.cfg.fl.aggregator,
                 len(parts), len(opened.participants), tot["online_bytes_sent"] + tot["online_bytes_received"],
                 tot.get("offline_bytes_sent", 0) + tot.get("offline_bytes_received", 0),
                 tot["online_rounds"], time.monotonic() - t0, opened.served_ahead, len(opened.meters.get("pairs", ())))
        return record, opened.vector

    def _robust_rule(self, r: int, record: dict, vector: np.ndarray) -> tuple[np.ndarray, dict]:
        """M_r and the round's public metadata of the rule (the same on both servers)."""
        model, rule = robust_model(self.cfg.fl, self.store, r, vector, len(record["participants"]))
        rule["aggregate_sha256"] = record["aggregate_sha256"]
        if record["threshold_refused"]:
            rule["threshold_refused"] = sorted(record["threshold_refused"])
        return model, rule
