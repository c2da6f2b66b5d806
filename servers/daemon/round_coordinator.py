"""FL rounds on shares: the open round, closing it with the other server, committing it.

Server 0 leads (:meth:`RoundCoordinator.lead_forever`): each step it asks server 1 for its
view (:class:`~servers.daemon.peer_messages.PeerState`), then, first that applies:

1. finishes or replays a round on which the two histories differ (an FL round, or the
   adoption of an unlearning job that server 1 committed first);
2. gives the step to the job scheduler (a receipt to send, a job to adopt or to run);
3. while a job is queued, running or waiting for adoption, does nothing more: FL waits;
4. closes the open round once ``clients_expected`` clients reached *both* servers with the
   same |D_j| (after ``round_deadline``, ``min_clients`` suffice).

``fl.rounds`` counts FL rounds; an unlearning round (the adopted model, no participants) is
a round of the history but not of training, so FL goes on for as many rounds after it. Closing a round: both servers
compute their weighted share sums (``servers.secure.ring_aggregation``, exact on the ring) over the
agreed participants, exchange them, publish the same M_i (checked by digest) and commit it.
Server 1 (:meth:`RoundCoordinator.follow_close`) checks the participants against its own
staged uploads and sizes and commits first, so after a crash of either the leader can always
finish or replay the round (commits are idempotent).

Under a Byzantine-robust aggregator (``[fl] aggregator``, docs/service.md "Robust
aggregation") no share sum is exchanged (the FedAvg sum is not public then): after the range
check both servers run the round's aggregation session (``servers.secure.robust_session``), each
keeps the opened aggregate durably in its sidecar (``ServiceState.put_opened``), and the
close (:class:`~servers.daemon.peer_messages.CloseRobustRound`) compares its digest; each server
computes M_i from it (``servers.secure.robust_steps``), server 1 commits first and answers the
model's digest. A crash before server 1's commit re-runs the range check and the session;
after it, the leader finishes the round from its own stored aggregate, so the session is
never needed twice for a round server 1 committed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Protocol

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
    JobRow,
    LastRound,
    ModelDigest,
    PeerState,
    RoundShare,
)
from servers.secure.robust_session import aggregate_digest, aggregate_round_uploads
from servers.secure.robust_steps import robust_model
from servers.secure.round_checks import check_round_uploads
from servers.secure.ring_aggregation import (
    fedavg_weights,
    model_digest,
    next_model,
    open_aggregate,
    weighted_share_sum,
)
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore

__all__ = ["RoundCoordinator"]

log = logging.getLogger("starfish.server")


class Jobs(Protocol):
    """What the leader needs of the job scheduler (``servers.daemon.job_scheduler.JobScheduler``)."""

    def lead(self, view: PeerState) -> bool: ...

    def finish_adoption(self, view: PeerState) -> None: ...

    def pending(self) -> bool: ...


class RoundCoordinator:
    """The FL rounds of one server: leader (``peer`` given, server 0) or follower (server 1)."""

    def __init__(self, cfg: ServiceConfig, store: ShareStore, state: ServiceState, *,
                 peer: PeerClient | None, stop: threading.Event,
                 mpc_listener: socket.socket | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.state = state
        self.peer = peer
        self.stop_event = stop
        self.mpc_listener = mpc_listener
        # range check of the open round (fl.range_check): who failed it, and server 1's
        # latest verdict (in memory: a restart checks again)
        self._refused: dict[int, set[int]] = {}
        self._passed: dict[int, set[int]] = {}
        self._check_thread: threading.Thread | None = None
        # robust aggregation (fl.aggregator): clients whose lambda_k failed the check this round
        # (also in _refused, so the round stops waiting for them), and server 1's session thread
        self._threshold_refused: dict[int, set[int]] = {}
        self._aggregate_thread: threading.Thread | None = None
        self._wake = threading.Condition()
        self._round_opened = time.monotonic()

    def open_round(self) -> int | None:
        """The round uploads go to, or None once ``fl.rounds`` FL rounds are committed."""
        return self.store.num_rounds + 1 if self.store.fl_rounds < self.cfg.fl.rounds else None

    def wake(self) -> None:
        """Wake the leader now (an upload or a request arrived, or the daemon stops)."""
        with self._wake:
            self._wake.notify_all()

    def expected_clients(self) -> int:
        """``clients_expected`` less the forgotten clients (who may not upload any more)."""
        gone = sum(1 for r in self.store.forgotten().values() if r.get("reenrolled_at") is None)
        return max(1, self.cfg.fl.clients_expected - gone)

    # ------------------------------------------------------------------ both roles
    def committed_sizes(self, r: int) -> dict[int, int]:
        meta = self.store.metadata(r).get("num_samples", {})
        return {int(k): int(v) for k, v in meta.items()}

    def _share_sum(self, r: int, parts: list[int], sizes: dict[int, int]) -> np.ndarray:
        committed = r <= self.store.num_rounds
        terms = []
        for j in parts:
            share = (self.store.update_share(r, j) if committed
                     else self.store.staged_upload(r, j).update)
            terms.append((sizes[j], share))
        return weighted_share_sum(terms, self.store.dim)

    def _round_model(self, r: int, a0: np.ndarray, a1: np.ndarray, sizes: dict[int, int]) -> np.ndarray:
        total = sum(sizes.values())
        agg = open_aggregate(a0, a1, total, self.store.precision)
        return next_model(self.store.model(r - 1), agg, self.store.server_lr)

    def _commit(self, r: int, model: np.ndarray, parts: list[int], sizes: dict[int, int],
                refused: Sequence[int] = (), rule: dict | None = None) -> bool:
        """Commit round r; ``rule``: the robust rule's public metadata (None: FedAvg)."""
        meta: dict = {"num_samples": {str(j): int(sizes[j]) for j in parts}}
        if refused:
            meta["refused"] = sorted(refused)
        meta.update(rule or {"aggregator": "fedavg"})
        done = self.store.commit_round(r, model, parts, fedavg_weights(sizes), meta)
        self.state.forget_rounds_before(r + 1)
        self._round_opened = time.monotonic()
        return done

    # ------------------------------------------------------------------ server 1: the follower
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

    def follow_check(self, msg: CheckRound) -> None:
        """Join the leader's range check of the open round, in a thread."""
        r, parts = msg.round, list(msg.participants)
        if r != self.store.num_rounds + 1:
            raise ValueError(f"round {r} is not the open round {self.store.num_rounds + 1}")
        if self._check_thread is not None and self._check_thread.is_alive():
            raise RuntimeError("a range check is already running")
        missing = [j for j in parts if j not in set(self.store.staged(r))]
        if missing:
            raise ValueError(f"clients {missing} have no staged upload for round {r} here")
        self._passed.pop(r, None)

        def run() -> None:
            try:
                passed = set(check_round_uploads(1, self.cfg, self.store, r, parts, self.mpc_listener))
            except Exception:  # noqa: BLE001 - the leader's close then fails and is retried
                log.exception("range check of round %d failed", r)
                return
            self._refused.setdefault(r, set()).update(set(parts) - passed)
            self._passed[r] = passed
        self._check_thread = threading.Thread(target=run, name=f"check-{r}", daemon=True)
        self._check_thread.start()

    def _checked_here(self, r: int, parts: list[int], refused: Sequence[int]) -> None:
        """Server 1: the leader closes with exactly the uploads our own check passed."""
        if self._check_thread is not None:
            self._check_thread.join(self.cfg.limits.peer_timeout)
        passed = self._passed.get(r)
        if passed is None or set(parts) != passed or not set(refused) <= self._refused.get(r, set()):
            raise ValueError(f"round {r}: participants {parts} (refused {list(refused)}) are not what "
                             f"the range check passed here ({sorted(passed or ())})")

    def _check_staged(self, r: int, parts: list[int], given: dict[int, int]) -> None:
        """Server 1: every participant of the open round has an upload here, with that |D_j|."""
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

    # ------------------------------------------------------------------ robust rounds
    def _robust(self) -> bool:
        return self.cfg.fl.aggregator != "fedavg"

    def _aggregate_here(self, rank: int, r: int, parts: list[int]) -> tuple[dict, np.ndarray | None]:
        """This server's side of round r's robust aggregation; what it opened is kept durably
        (``ServiceState.put_opened``) before anyone can commit with it."""
        t0 = time.monotonic()
        opened = aggregate_round_uploads(rank, self.cfg, self.store, r, parts,
                                         self.mpc_listener if rank == 1 else None)
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
                 "offline_bytes=%d rounds=%d seconds=%.3f", r, self.cfg.fl.aggregator, len(parts),
                 len(opened.participants), tot["online_bytes_sent"] + tot["online_bytes_received"],
                 tot.get("offline_bytes_sent", 0) + tot.get("offline_bytes_received", 0),
                 tot["online_rounds"], time.monotonic() - t0)
        return record, opened.vector

    def _robust_rule(self, r: int, record: dict, vector: np.ndarray) -> tuple[np.ndarray, dict]:
        """M_r and the round's public metadata of the rule (the same on both servers)."""
        model, rule = robust_model(self.cfg.fl, self.store, r, vector, len(record["participants"]))
        rule["aggregate_sha256"] = record["aggregate_sha256"]
        if record["threshold_refused"]:
            rule["threshold_refused"] = sorted(record["threshold_refused"])
        return model, rule

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
                self._aggregate_here(1, r, parts)
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

    # ------------------------------------------------------------------ server 0: the leader
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
        assert self.peer is not None
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
        if len(common) >= expected or (late and len(common) >= self.cfg.fl.min_clients):
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

    def _range_check(self, r: int, parts: list[int]) -> list[int]:
        """Both servers check these uploads in 2PC (``servers.secure.round_checks``); the refused
        are remembered for the round and left out of it."""
        assert self.peer is not None
        self.peer.call(CheckRound(r, tuple(parts)))
        passed = check_round_uploads(0, self.cfg, self.store, r, parts, None)
        gone = sorted(set(parts) - set(passed))
        if gone:
            self._refused.setdefault(r, set()).update(gone)
            log.warning("round %d: the uploads of clients %s failed the range check; left out", r, gone)
        return passed

    def _close_robust(self, r: int, parts: list[int], sizes: dict[int, int],
                      refused: Sequence[int]) -> None:
        """Aggregate round r robustly with server 1 and close it (unless the threshold check
        left fewer than ``min_clients``: then the round waits, without those clients)."""
        assert self.peer is not None
        self.peer.call(AggregateRound(r, tuple(parts)))
        record, vector = self._aggregate_here(0, r, parts)
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
        assert self.peer is not None
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
        assert self.peer is not None
        a0 = self._share_sum(r, parts, sizes)
        msg = CloseRound(r, tuple(parts), tuple(sizes[j] for j in parts), a0, tuple(refused))
        reply = RoundShare.from_wire(self.peer.call(msg), self.store.dim)
        model = self._round_model(r, a0, reply.share, sizes)
        if reply.model_sha256 != model_digest(model):
            raise RuntimeError(f"round {r}: server 1 computed a different model; not committing")
        checkpoint("leader-before-commit")
        if self._commit(r, model, parts, sizes, refused):
            log.info("round %d committed with %d participants", r, len(parts))
