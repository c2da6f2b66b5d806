"""Server 1's FL rounds: it answers the leader's requests (``servers.daemon.round_coordinator``).

Server 1 never decides anything: it reports its view (:meth:`RoundFollower.peer_state`), joins
the 2PC sessions the leader opens (range check, robust aggregation; each in a thread, so the
control link answers at once), and checks every close against its own staged uploads, sizes
and session results before committing, first, the round the leader proposes.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import ClassVar

from common.service_config import ServiceConfig

from servers.store.crash_points import checkpoint
from servers.daemon.peer_messages import (
    AggregateRound,
    CheckRound,
    CloseRobustRound,
    CloseRound,
    JobRow,
    LastRound,
    ModelDigest,
    PeerState,
    RoundShare,
    WorkerAddresses,
)
from servers.daemon.round_coordinator import RoundCoordinator
from servers.secure.ring_aggregation import model_digest
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore
from servers.workers.server_workers import ServerWorkers

__all__ = ["RoundFollower"]

log = logging.getLogger("starfish.server")


class RoundFollower(RoundCoordinator):
    """Server 1's rounds: each leader request is checked here, then joined or committed."""

    RANK: ClassVar[int] = 1

    def __init__(self, cfg: ServiceConfig, store: ShareStore, state: ServiceState, *,
                 stop: threading.Event, mpc_listener: socket.socket | None,
                 workers: ServerWorkers | None = None) -> None:
        super().__init__(cfg, store, state, stop=stop, mpc_listener=mpc_listener, workers=workers)
        # this server's latest range-check verdict of the open round, and the session threads
        self._passed: dict[int, set[int]] = {}
        self._check_thread: threading.Thread | None = None
        self._aggregate_thread: threading.Thread | None = None

    def peer_state(self, jobs: Sequence[JobRow], busy: str | None) -> PeerState:
        """This server's view for the leader; ``jobs`` and ``busy`` come from the scheduler."""
        T = self.store.num_rounds
        r = T + 1
        sizes = self.state.sizes(r)
        staged = {j: sizes[j] for j in self.store.staged(r) if j in sizes}
        last = None
        if T >= 1:
            s = self.committed_sizes(T)
            parts = tuple(self.store.participants(T))
            job = self.store.metadata(T).get("job") if self.store.round_kind(T) == "unlearning" else None
            last = LastRound(T, parts, tuple(s[j] for j in parts), job)
        return PeerState(T, staged, last, tuple(jobs), busy)

    def follow_check(self, msg: CheckRound) -> WorkerAddresses:
        """Join the leader's range check of the open round, in a thread; with workers, this
        server's shares reach them first (a failure answers the leader at once) and the reply
        says where they wait for server 0's."""
        r, parts = msg.round, list(msg.participants)
        if r != self.store.num_rounds + 1:
            raise ValueError(f"round {r} is not the open round {self.store.num_rounds + 1}")
        if self._check_thread is not None and self._check_thread.is_alive():
            if self.workers is None:
                raise RuntimeError("a range check is already running")
            # the leader asks again only after its own attempt failed: end ours, which may wait
            # for a worker of server 0 that is gone, instead of letting it run to its timeout
            self.workers.reset("server 0 started the range check again")
            self._check_thread.join(10.0)
            if self._check_thread.is_alive():
                raise RuntimeError("a range check is still ending; the leader tries again")
        missing = [j for j in parts if j not in set(self.store.staged(r))]
        if missing:
            raise ValueError(f"clients {missing} have no staged upload for round {r} here")
        self._passed.pop(r, None)
        prepared = self.workers.prepare(self.store, r, parts) if self.workers is not None else None

        def run() -> None:
            try:
                passed = set(self._check_uploads(r, parts, prepared, None))
            except Exception:  # noqa: BLE001 - the leader's close then fails and is retried
                log.exception("range check of round %d failed", r)
                return
            self._refused.setdefault(r, set()).update(set(parts) - passed)
            self._passed[r] = passed
        self._check_thread = threading.Thread(target=run, name=f"check-{r}", daemon=True)
        self._check_thread.start()
        return WorkerAddresses(self.workers.addresses() if self.workers is not None else ())

    def _checked_here(self, r: int, parts: list[int], refused: Sequence[int]) -> None:
        """Server 1: the leader closes with exactly the uploads our own check passed."""
        if self._check_thread is not None:
            self._check_thread.join(self.cfg.limits.peer_timeout)
        passed = self._passed.get(r)
        if passed is None or set(parts) != passed or not set(refused) <= self._refused.get(r, set()):
            raise ValueError(f"round {r}: participants {parts} (refused {list(refused)}) are not what "
                             f"the range check passed here ({sorted(passed or ())})")

    def _check_staged(self, r: int, parts: list[int], given: dict[int, int]) -> None:
        """Server 1: the open round has at least ``min_clients`` participants, and each has an
        upload here with that |D_j|. The cohort is checked here too so that a leader with a
        smaller setting (or a bug) cannot publish a round of fewer (issue 25, finding 5)."""
        if len(parts) < self.cfg.fl.min_clients:
            raise ValueError(f"round {r}: {len(parts)} participants, fewer than min_clients = "
                             f"{self.cfg.fl.min_clients} here")
        staged = set(self.store.staged(r))
        mine = self.state.sizes(r)
        missing = [j for j in parts if j not in staged]
        if missing:
            raise ValueError(f"clients {missing} have no staged upload for round {r} here")
        differ = [j for j in parts if mine.get(j) != given[j]]
        if differ:
            raise ValueError(f"clients {differ} reported other data sizes here")

    def follow_close(self, msg: CloseRound) -> RoundShare:
        """Check the leader's round against this server's uploads, add, commit, answer."""
        r, parts, given = msg.round, list(msg.participants), msg.sizes_by_client()
        T = self.store.num_rounds
        # under a robust rule the FedAvg sum is not public: never exchange share sums for it
        if r <= T and self.store.metadata(r).get("aggregator", "fedavg") != "fedavg":
            raise ValueError(f"round {r} was aggregated with {self.store.metadata(r)['aggregator']}; "
                             "it is closed with close_robust_round, never with share sums")
        if r == T + 1 and self._robust():
            raise ValueError(f"this deployment aggregates with {self.cfg.fl.aggregator} "
                             "(fl.aggregator); a FedAvg close would open the FedAvg sum")
        if r <= T:
            if list(self.store.participants(r)) != parts or self.committed_sizes(r) != given:
                raise ValueError(f"round {r} is committed here with other participants or sizes")
        elif r == T + 1:
            self._check_staged(r, parts, given)
            if self.cfg.fl.range_check:
                self._checked_here(r, parts, msg.refused)
        else:
            raise ValueError(f"round {r} is not the open round {T + 1}")
        a1 = self._share_sum(r, parts, given)
        model = self._round_model(r, msg.share, a1, given)
        if r == T + 1:
            checkpoint("follower-before-commit")
            self._commit(r, model, parts, given, msg.refused)
            log.info("round %d committed with %d participants", r, len(parts))
        return RoundShare(a1, model_digest(model))

    def follow_aggregate(self, msg: AggregateRound) -> None:
        """Join the leader's robust aggregation of the open round, in a thread."""
        r, parts = msg.round, list(msg.participants)
        if not self._robust():
            raise ValueError("this deployment aggregates with fedavg (fl.aggregator)")
        if r != self.store.num_rounds + 1:
            raise ValueError(f"round {r} is not the open round {self.store.num_rounds + 1}")
        if self._check_thread is not None:   # the range check's session must be over here too
            self._check_thread.join(self.cfg.limits.peer_timeout)
        if self._aggregate_thread is not None and self._aggregate_thread.is_alive():
            raise RuntimeError("a robust aggregation is already running")
        missing = [j for j in parts if j not in set(self.store.staged(r))]
        if missing:
            raise ValueError(f"clients {missing} have no staged upload for round {r} here")
        if self.cfg.fl.range_check and self._passed.get(r) != set(parts):
            raise ValueError(f"round {r}: clients {parts} are not what the range check passed here "
                             f"({sorted(self._passed.get(r) or ())})")

        def run() -> None:
            try:
                self._aggregate_here(r, parts)
            except Exception:  # noqa: BLE001 - the leader's close then fails and is retried
                log.exception("robust aggregation of round %d failed", r)
        self._aggregate_thread = threading.Thread(target=run, name=f"aggregate-{r}", daemon=True)
        self._aggregate_thread.start()

    def follow_close_robust(self, msg: CloseRobustRound) -> ModelDigest:
        """Check the leader's robust round against this server's session, commit, answer."""
        r, parts, given = msg.round, list(msg.participants), msg.sizes_by_client()
        T = self.store.num_rounds
        if r <= T:   # the leader finishes a round committed here (idempotent)
            if list(self.store.participants(r)) != parts or self.committed_sizes(r) != given or \
                    self.store.metadata(r).get("aggregate_sha256") != msg.aggregate_sha256:
                raise ValueError(f"round {r} is committed here with other participants, sizes or aggregate")
            return ModelDigest(model_digest(self.store.model(r)))
        if r != T + 1:
            raise ValueError(f"round {r} is not the open round {T + 1}")
        if not self._robust():
            raise ValueError("this deployment aggregates with fedavg (fl.aggregator)")
        self._check_staged(r, parts, given)
        if self._aggregate_thread is not None:
            self._aggregate_thread.join(self.cfg.limits.peer_timeout)
        kept = self.state.opened(r)
        if kept is None:
            raise ValueError(f"no aggregate of round {r} was opened here")
        record, vector = kept
        if record["participants"] != parts or record["aggregate_sha256"] != msg.aggregate_sha256 \
                or not set(record["threshold_refused"]) <= set(msg.threshold_refused) \
                or not set(msg.threshold_refused) <= self._threshold_refused.get(r, set()):
            raise ValueError(f"round {r}: participants {parts} (threshold refused "
                             f"{list(msg.threshold_refused)}) and aggregate {msg.aggregate_sha256[:12]} "
                             f"are not what the session opened here ({record['participants']}, "
                             f"{str(record['aggregate_sha256'])[:12]})")
        if self.cfg.fl.range_check:
            self._checked_here(r, record["checked"], msg.refused)
        record = {**record, "threshold_refused": sorted(msg.threshold_refused)}
        model, rule = self._robust_rule(r, record, vector)
        checkpoint("follower-before-commit")
        self._commit(r, model, parts, given, msg.refused, rule)
        log.info("round %d committed with %d participants (%s)", r, len(parts), self.cfg.fl.aggregator)
        return ModelDigest(model_digest(model))
