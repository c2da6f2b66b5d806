"""Server 0's FL rounds: it leads every round close (``servers.daemon.round_coordinator``).

Each step (:meth:`RoundLeader.lead_forever`) asks server 1 for its view
(:class:`~servers.daemon.peer_messages.PeerState`), then, first that applies:

1. finishes or replays a round on which the two histories differ (an FL round, or the
   adoption of an unlearning job that server 1 committed first);
2. gives the step to the job scheduler (a receipt to send, a job to adopt or to run);
3. while a job is queued, running or waiting for adoption, does nothing more: FL waits;
4. closes the open round once ``clients_expected`` clients reached *both* servers with the
   same |D_j| (after ``round_deadline``, ``min_clients`` suffice; never fewer than
   ``min_clients``, even when forgotten clients lower the expected count): range check, then
   the FedAvg close (share sums exchanged) or the robust one (aggregation session, digests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np

from common.service_config import ServiceConfig

from servers.store.crash_points import checkpoint
from servers.daemon.peer_link import PeerClient, PeerUnavailable
from servers.daemon.peer_messages import (
    AggregateRound,
    CheckRound,
    CloseRobustRound,
    CloseRound,
    GetState,
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

__all__ = ["RoundLeader", "Jobs"]

log = logging.getLogger("starfish.server")


class Jobs(Protocol):
    """What the leader needs of the job scheduler (``servers.daemon.job_scheduler.JobScheduler``)."""

    def lead(self, view: PeerState) -> bool: ...

    def finish_adoption(self, view: PeerState) -> None: ...

    def pending(self) -> bool: ...


class RoundLeader(RoundCoordinator):
    """Server 0's rounds: it decides when a round closes and drives server 1 through it."""

    RANK: ClassVar[int] = 0

    def __init__(self, cfg: ServiceConfig, store: ShareStore, state: ServiceState, *,
                 peer: PeerClient, stop: threading.Event, workers: ServerWorkers | None = None) -> None:
        super().__init__(cfg, store, state, stop=stop, workers=workers)
        self.peer = peer

    def expected_clients(self) -> int:
        """``clients_expected`` less the forgotten clients (who may not upload any more)."""
        gone = sum(1 for r in self.store.forgotten().values() if r.get("reenrolled_at") is None)
        return max(1, self.cfg.fl.clients_expected - gone)

    def lead_forever(self, jobs: Jobs) -> None:
        """Lead until stopped (the module docstring says what one step does)."""
        backoff = 0.05
        while not self.stop_event.is_set():
            try:
                busy = self._lead_step(jobs)
                backoff = 0.05
                if not busy:
                    with self._wake:
                        self._wake.wait(0.05 if self.open_round() is not None else 0.2)
            except PeerUnavailable as exc:
                log.info("waiting for server 1: %s", exc)
                self.stop_event.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except Exception:  # noqa: BLE001 - keep leading; the log has the cause
                log.exception("leader step failed")
                self.stop_event.wait(1.0)

    def _lead_step(self, jobs: Jobs) -> bool:
        """One decision (module docstring); returns whether it did something."""
        view = PeerState.from_wire(self.peer.call(GetState()))
        if self._catch_up(view, jobs) or jobs.lead(view):
            self._round_opened = time.monotonic()
            return True
        if jobs.pending():
            return False
        return self._lead_round(view)

    def _catch_up(self, f: PeerState, jobs: Jobs) -> bool:
        """Finish or replay the round on which the histories differ, if they do."""
        T, fT = self.store.num_rounds, f.T
        if fT > T + 1 or fT < T - 1:
            raise RuntimeError(f"the servers' histories diverged: T = {T} here, {fT} at server 1")
        if fT == T + 1:   # server 1 committed the round we did not: finish it here
            if f.last is None:
                raise RuntimeError(f"server 1 has {fT} rounds but reports no last round")
            if f.last.job is not None:
                jobs.finish_adoption(f)
                return True
            kept = self.state.opened(T + 1)
            if kept is not None and kept[0]["participants"] == list(f.last.participants):
                # a robust round: from the aggregate this server opened and kept, no new session
                self._finish_robust(T + 1, kept[0], kept[1], f.last.sizes_by_client())
            else:
                self._close_round(T + 1, list(f.last.participants), f.last.sizes_by_client())
            return True
        if fT == T - 1:   # cannot happen with our commit order; replay for safety
            if self.store.round_kind(T) == "unlearning":
                raise RuntimeError(f"round {T} is an adoption that server 1 does not have; "
                                   "server 1 always adopts first, so its store was rolled back")
            if self.store.metadata(T).get("aggregator", "fedavg") != "fedavg":
                raise RuntimeError(f"round {T} was aggregated robustly and server 1 does not have "
                                   "it; server 1 always commits first, so its store was rolled back")
            self._close_round(T, list(self.store.participants(T)), self.committed_sizes(T))
            return True
        return False

    def _lead_round(self, f: PeerState) -> bool:
        T = self.store.num_rounds
        if self.open_round() is None:
            return False
        r = T + 1
        mine = self.state.sizes(r)
        theirs = f.staged
        refused = self._refused.get(r, set())
        common = sorted(j for j in self.store.staged(r)
                        if j in theirs and mine.get(j) == theirs[j] and j not in refused)
        late = time.monotonic() >= self._round_opened + self.cfg.fl.round_deadline
        expected = self.expected_clients() - len(refused)
        # min_clients bounds every close, the early one too: forgotten or refused clients can
        # bring ``expected`` below it, and a round of 1 or 2 publishes a client's update in its
        # step (issue 25, finding 5). Keeping up to min_clients (<= clients_expected) keeps N in range.
        cohort = self.cfg.fl.min_clients
        if len(common) >= cohort and (len(common) >= expected or late):
            common = self._first_staged(r, common, max(expected, cohort))
            if self.cfg.fl.range_check:
                passed = self._range_check(r, common)
                if passed != common:
                    return True   # decide again without the refused uploads
            if late and len(common) < expected:
                log.warning("round %d: deadline passed; closing with %d of %d clients", r,
                            len(common), expected)
            if self._robust():
                self._close_robust(r, common, {j: mine[j] for j in common}, sorted(refused))
            else:
                self._close_round(r, common, {j: mine[j] for j in common}, sorted(refused))
            return True
        if late:
            log.warning("round %d: deadline passed with %d clients at both servers (< %d); "
                        "waiting another %.0fs", r, len(common), self.cfg.fl.min_clients,
                        self.cfg.fl.round_deadline)
            self._round_opened = time.monotonic()
        return False

    def _first_staged(self, r: int, common: list[int], expected: int) -> list[int]:
        """At most ``expected`` of ``common``: the earliest staged here (ties: lower id).

        Why (issue 25, finding 4): each |D_j| is capped at max_total_samples / clients_expected,
        so only a round of at most ``clients_expected`` uploads keeps N = sum |D_j| inside the
        ring's range; with more, server 1 refused every close. The choice is the leader's (its
        staging times are durable, so a restarted leader makes it again) and server 1 checks only
        membership. The others' uploads are dropped at the commit, like any upload outside the
        round; the client sees it is not in ``round_info``'s participants and trains the next round.
        """
        if len(common) <= expected:
            return common
        at = {u["client"]: u["staged_at"] for u in self.store.staged_summary(r)}
        keep = sorted(sorted(common, key=lambda j: (at.get(j, float("inf")), j))[:expected])
        log.warning("round %d: %d clients at both servers, more than the %d expected; closing with "
                    "the first staged %s, the uploads of %s are dropped", r, len(common), expected,
                    keep, sorted(set(common) - set(keep)))
        return keep

    def _range_check(self, r: int, parts: list[int]) -> list[int]:
        """Both servers check these uploads in 2PC (``servers.secure.round_checks``); the refused
        are remembered for the round and left out of it. With workers, this server's shares go to
        its workers first (a dead worker fails the attempt before server 1 is asked anything),
        and server 1 answers where its workers wait."""
        prepared = self.workers.prepare(self.store, r, parts) if self.workers is not None else None
        try:
            reply = WorkerAddresses.from_wire(self.peer.call(CheckRound(r, tuple(parts))))
        except BaseException:
            if prepared is not None:
                self.workers.release(prepared)
            raise
        passed = self._check_uploads(r, parts, prepared, reply.workers)
        gone = sorted(set(parts) - set(passed))
        if gone:
            self._refused.setdefault(r, set()).update(gone)
            log.warning("round %d: the uploads of clients %s failed the range check; left out", r, gone)
        return passed

    def _close_robust(self, r: int, parts: list[int], sizes: dict[int, int],
                      refused: Sequence[int]) -> None:
        """Aggregate round r robustly with server 1 and close it (unless the threshold check
        left fewer than ``min_clients``: then the round waits, without those clients)."""
        self.peer.call(AggregateRound(r, tuple(parts)))
        record, vector = self._aggregate_here(r, parts)
        if record["threshold_refused"]:
            log.warning("round %d: the thresholds (lambda_k) of clients %s failed FedSECA's check; "
                        "left out", r, record["threshold_refused"])
        if vector is None or len(record["participants"]) < self.cfg.fl.min_clients:
            return
        gone = self._threshold_refused.get(r, set())
        record["refused"] = sorted(set(refused) - gone)
        record["threshold_refused"] = sorted(gone)
        self.state.put_opened(r, record, vector)   # the lists too, for a restart's catch-up
        self._finish_robust(r, record, vector, {j: sizes[j] for j in record["participants"]})

    def _finish_robust(self, r: int, record: dict, vector: np.ndarray, sizes: dict[int, int]) -> None:
        """Close robust round r from the opened aggregate: server 1 commits, then this server."""
        parts = list(record["participants"])
        model, rule = self._robust_rule(r, record, vector)
        msg = CloseRobustRound(r, tuple(parts), tuple(sizes[j] for j in parts), record["aggregate_sha256"],
                               tuple(record["refused"]), tuple(record["threshold_refused"]))
        reply = ModelDigest.from_wire(self.peer.call(msg))
        if reply.model_sha256 != model_digest(model):
            raise RuntimeError(f"round {r}: server 1 computed a different model; not committing")
        checkpoint("leader-before-commit")
        if self._commit(r, model, parts, sizes, record["refused"], rule):
            log.info("round %d committed with %d participants (%s)", r, len(parts), self.cfg.fl.aggregator)

    def _close_round(self, r: int, parts: list[int], sizes: dict[int, int],
                     refused: Sequence[int] = ()) -> None:
        a0 = self._share_sum(r, parts, sizes)
        msg = CloseRound(r, tuple(parts), tuple(sizes[j] for j in parts), a0, tuple(refused))
        reply = RoundShare.from_wire(self.peer.call(msg), self.store.dim)
        model = self._round_model(r, a0, reply.share, sizes)
        if reply.model_sha256 != model_digest(model):
            raise RuntimeError(f"round {r}: server 1 computed a different model; not committing")
        checkpoint("leader-before-commit")
        if self._commit(r, model, parts, sizes, refused):
            log.info("round %d committed with %d participants", r, len(parts))
