"""Unlearning jobs on a server: queueing requests, agreeing on a run, adopting the result.

The life of a request (docs/service.md, "The life of an unlearning request"):

0. **requested**: the request reached this server (each checks the requester's certificate
   itself) and is recorded in the history store. It pauses nothing yet: a request sent to one
   server only used to pause FL on both for ``agree_timeout`` (issue 25, finding 2).
1. **queued**: server 0 found the same request at both servers and agreed it with server 1
   (:class:`JobAgree`; server 1 first). While any job is queued, running or computed, FL
   waits: the leader closes no round and uploads are refused with ``paused``. A requester has
   at most its quota of agreed jobs; its other requests are then dropped at both servers
   (``superseded``), so a burst of requests that reached the servers in different orders ends
   as one job at both. A request at one server only fails after ``agree_timeout``.
2. **running**: server 0 (:meth:`JobScheduler.lead`) picks the oldest job both servers hold
   as the same request, asks server 1 to start run ``attempt`` (:class:`JobStart`) and runs it
   too; both run Stage II in a fresh 2PC session (``servers.secure.unlearning_jobs``). A run whose
   session is lost (a peer died, a crash, a worker died or lost its peer) is abandoned and the
   job re-queued; the next run gets the next attempt number (persisted), up to
   :data:`MAX_JOB_ATTEMPTS`.
3. **computed**: both servers wrote the same model (digest checked inside the session).
4. **done**: server 0 asks server 1 to adopt (:class:`AdoptJob`): server 1 commits the model
   as round T+1 and erases the targets in one store transaction, and answers its erasure
   report; then server 0 does the same, assembles the receipt (both reports) and gives it to
   server 1 (:class:`JobReceipt`). Server 1 adopts first, so after a crash of either the
   leader can always finish: it sees server 1 one round ahead with that job's adoption and
   adopts from its own computed result (adoption is idempotent in the store).

Requests are queued, not batched: one job runs at a time, in the order they were recorded,
and each is adopted before the next starts, so every job reads the history the previous one
left (its targets erased, its model adopted). An admin can cancel a job that has not been
adopted (:meth:`JobScheduler.cancel`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from net.channel import ChannelError
from common.service_config import ServiceConfig

from servers.secure.correction_tasks import LockstepError, TaskBoard
from servers.store.crash_points import checkpoint
from servers.store.job_records import FINISHED, JobRecord, JobState
from servers.daemon.peer_link import PeerClient, PeerRefused
from servers.daemon.peer_messages import (
    MAX_JOB_ROWS,
    AdoptJob,
    Confirmation,
    JobAgree,
    JobFail,
    JobReceipt,
    JobRow,
    JobStart,
    PeerState,
    params_key,
)
from servers.secure.ring_aggregation import model_digest
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore
from servers.secure.unlearning_jobs import JobWorkers, job_params, read_result, run_job
from servers.workers.shard_worker import WorkerError

__all__ = ["JobScheduler", "JobCancelled", "MAX_JOB_ATTEMPTS", "PENDING", "MAX_REQUESTED",
           "ADMIN_PENDING_JOBS", "SUPERSEDED", "job_quota"]

log = logging.getLogger("starfish.server")

#: Runs of a job (2PC sessions lost, crashes) before it fails for good.
MAX_JOB_ATTEMPTS = 5
#: Job states during which FL waits: agreed by both servers and not ended (``requested`` is not
#: among them: a request one server alone holds pauses nothing).
PENDING = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.COMPUTED})
#: Requests of one requester a server keeps ``requested`` at once. More than one, so that a burst
#: sent to both servers, arriving in different orders, still has a request both hold; bounded,
#: so that one-sided requests cost a server at most this many records per requester at a time.
MAX_REQUESTED = 4
#: Agreed unlearning jobs the operator may have pending at once (clients: ``limits.max_pending_jobs``).
ADMIN_PENDING_JOBS = 16
#: The error of a request dropped because another request of its requester was agreed.
SUPERSEDED = "superseded"


def job_quota(cfg: ServiceConfig, requester: str) -> int:
    """Agreed jobs ``requester`` may have pending at once."""
    return ADMIN_PENDING_JOBS if requester == "admin" else cfg.limits.max_pending_jobs


class JobCancelled(RuntimeError):
    """An admin cancelled the job while it ran."""


class JobScheduler:
    """The unlearning jobs of one server: leader (``peer`` given, server 0) or follower."""

    def __init__(self, cfg: ServiceConfig, party: int, store: ShareStore, state: ServiceState,
                 board: TaskBoard, *, results_dir: Path, mpc_listener: socket.socket | None,
                 peer: PeerClient | None, stop: threading.Event, workers: JobWorkers | None = None) -> None:
        self.cfg = cfg
        self.workers = workers     # [deployment] workers > 1: a job's Stage II on coordinate shards
        self.party = party
        self.store = store
        self.state = state
        self.board = board
        self.results_dir = results_dir
        self.mpc_listener = mpc_listener
        self.peer = peer
        self.stop_event = stop
        self._thread: threading.Thread | None = None
        self._running: str | None = None
        self._cancel: set[str] = set()
        self._progress_at: dict[str, float] = {}
        self._adopt_lock = threading.Lock()

    @property
    def running(self) -> str | None:
        """The id of the job this server is running, if any."""
        return self._running

    def pending(self) -> bool:
        """Whether a job is queued, running or waiting for adoption (FL waits meanwhile)."""
        return any(j.state in PENDING for j in self.store.jobs())

    def requeue_interrupted(self) -> None:
        """At start-up: re-queue runs the stop interrupted; finish the record of an adoption
        that committed just before the stop."""
        for rec in self.store.jobs(JobState.RUNNING):
            log.warning("job %s was running when the server stopped; re-queued", rec.id)
            self.store.update_job(rec.id, state=JobState.QUEUED)
        for rec in self.store.jobs(JobState.COMPUTED):
            if self.store.erasure(rec.id) is not None:
                self.store.update_job(rec.id, state=JobState.DONE)
                log.warning("job %s was adopted when the server stopped; recorded as done", rec.id)
        # the sidecar is a second database: a stop between the store's erasure and this one's
        # would leave a forgotten client's reported sizes behind
        self._forget_sizes(c for c, r in self.store.forgotten().items() if r.get("reenrolled_at") is None)

    def submit(self, requester: str, targets: Iterable[int], job_id: str) -> JobRecord:
        """Record a request as a requested job (idempotent for a replayed request); it becomes
        queued when server 0 agrees it with server 1."""
        return self.store.create_job(requester, targets, job_id=job_id, params=job_params(self.cfg),
                                     state=JobState.REQUESTED)

    def cancel(self, job_id: str, by: str) -> JobRecord:
        """Cancel a job that is not adopted yet; a running run stops at its next round."""
        rec = self.store.job(job_id)
        if rec.state in (JobState.REQUESTED, JobState.QUEUED, JobState.COMPUTED):
            return self.store.update_job(job_id, state=JobState.CANCELLED, error=f"cancelled by {by}")
        if rec.state == JobState.RUNNING:
            self._cancel.add(job_id)
        return rec

    def rows(self) -> list[JobRow]:
        """The most recent jobs, as the leader compares them (server 1's side)."""
        return [JobRow.of(j) for j in self.store.jobs()[-MAX_JOB_ROWS:]]

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ server 0: the leader
    def lead(self, view: PeerState) -> bool:
        """One step of job work when both histories have the same rounds: send a missing
        receipt, adopt a computed job, or run the next one (blocks while it runs)."""
        assert self.peer is not None
        theirs = {row.id: row for row in view.jobs}
        if self._send_receipts(theirs):
            return True
        picked = self._pick(theirs, view.busy)
        if picked is None:
            return False
        action, rec, row = picked
        if action == "agree":
            self._agree(rec)
        elif action == "adopt":
            self._adopt(rec, self.store.num_rounds + 1)
        else:
            self._run(rec, row)
        return True

    def finish_adoption(self, view: PeerState) -> None:
        """Server 1 adopted a job's model (it is one round ahead): adopt it here too."""
        assert view.last is not None and view.last.job is not None
        rec = self.store.job(view.last.job)
        if rec.state != JobState.COMPUTED:
            raise RuntimeError(f"server 1 adopted job {rec.id} as round {view.last.round}, but the "
                               f"job is {rec.state} here; operator action needed")
        self._adopt(rec, view.last.round)

    def _send_receipts(self, theirs: Mapping[str, JobRow]) -> bool:
        assert self.peer is not None
        for rec in self.store.jobs(JobState.DONE):
            o = theirs.get(rec.id)
            if rec.receipt is not None and o is not None and o.state == JobState.DONE and not o.has_receipt:
                self.peer.call(JobReceipt(rec.id, rec.receipt))
                return True
        return False

    def _pick(self, theirs: Mapping[str, JobRow], their_busy: str | None
              ) -> tuple[str, JobRecord, JobRow] | None:
        assert self.peer is not None
        mine = {j.id: j for j in self.store.jobs()}
        now = time.time()
        agree = self.cfg.unlearning.agree_timeout
        for jid, o in theirs.items():   # requests that reached server 1 only, or ended here
            m = mine.get(jid)
            if o.state in (JobState.REQUESTED, JobState.QUEUED, JobState.COMPUTED) and (
                    (m is None and now - o.created_at > agree) or (m is not None and m.state in FINISHED)):
                reason = ("the request reached server 1 only" if m is None
                          else f"server 0 has the job {m.state}: {m.error or ''}")
                state = JobState.CANCELLED if m is not None and m.state == JobState.CANCELLED else JobState.FAILED
                self.peer.call(JobFail(jid, reason, state))
        agreed = self._agreement(mine, theirs, now, agree)
        if agreed is not None:
            return agreed
        for jid, m in mine.items():
            if m.state not in (JobState.QUEUED, JobState.COMPUTED):
                continue
            o = theirs.get(jid)
            if o is None:
                if now - m.created_at > agree:
                    self.store.update_job(jid, state=JobState.FAILED, error="the request reached server 0 only")
                    continue
                return None   # the oldest job waits for server 1; the later ones wait behind it
            if self._end_if_they_differ(jid, m, o):
                continue
            if (m.state == o.state == JobState.COMPUTED and m.result_digest is not None
                    and m.result_digest == o.result_digest):
                return "adopt", m, o
            if o.state in (JobState.QUEUED, JobState.COMPUTED) and their_busy is None:
                return "run", m, o
            return None   # server 1 still runs an abandoned run of it; it notices and re-queues
        return None

    def _end_if_they_differ(self, jid: str, m: JobRecord, o: JobRow) -> bool:
        """End a job the servers cannot agree on (other requests under one id, or server 1
        ended it); True if it was ended here."""
        if not o.same_request(m):
            self.store.update_job(jid, state=JobState.FAILED, error="the servers hold different requests")
            self.peer.call(JobFail(jid, "the servers hold different requests"))
            return True
        if o.state in (JobState.FAILED, JobState.CANCELLED):
            self.store.update_job(jid, state=o.state, error=f"server 1: {o.error or o.state}")
            return True
        return False

    def _agreement(self, mine: Mapping[str, JobRecord], theirs: Mapping[str, JobRow], now: float,
                   agree: float) -> tuple[str, JobRecord, JobRow] | None:
        """The next request to agree (held by both servers), in the order server 0 recorded
        them; on the way, end the requests past ``agree_timeout`` at server 0 only and those of a
        requester whose quota of agreed jobs is full (``superseded``, at both servers)."""
        assert self.peer is not None
        for jid, m in mine.items():
            o = theirs.get(jid)
            if not (m.state == JobState.REQUESTED
                    or (m.state == JobState.QUEUED and o is not None and o.state == JobState.REQUESTED)):
                continue
            if o is None:
                if now - m.created_at > agree:
                    self.store.update_job(jid, state=JobState.FAILED, error="the request reached server 0 only")
                continue   # it pauses nothing meanwhile
            if self._end_if_they_differ(jid, m, o):
                continue
            if m.state == JobState.REQUESTED:
                others = [j.id for j in mine.values()
                          if j.requester == m.requester and j.state in PENDING and j.id != jid]
                if len(others) >= job_quota(self.cfg, m.requester):
                    error = f"{SUPERSEDED}: {m.requester} already has the job(s) {others} pending"
                    self.store.update_job(jid, state=JobState.FAILED, error=error)
                    self.peer.call(JobFail(jid, error))
                    continue
            return "agree", m, o
        return None

    def _agree(self, rec: JobRecord) -> None:
        """Agree a request both servers hold: server 1 queues it first, then this server (a
        lost reply is repaired at the next step: server 1 then shows it queued)."""
        assert self.peer is not None
        try:
            self.peer.call(JobAgree.of(rec))
        except PeerRefused as exc:
            log.warning("job %s: server 1 did not agree: %s", rec.id, exc)
            return
        if rec.state == JobState.REQUESTED:
            self.store.update_job(rec.id, state=JobState.QUEUED)
        log.info("job %s of %s agreed by both servers; FL waits for it", rec.id, rec.requester)

    def _run(self, rec: JobRecord, row: JobRow) -> None:
        assert self.peer is not None
        attempt = max(rec.attempts, row.attempts) + 1
        if attempt > MAX_JOB_ATTEMPTS:
            error = f"gave up after {MAX_JOB_ATTEMPTS} runs; the last error: {rec.error or 'none'}"
            self.store.update_job(rec.id, state=JobState.FAILED, error=error)
            self.peer.call(JobFail(rec.id, error))
            return
        rounds = self.store.num_rounds
        rec = self.store.update_job(rec.id, state=JobState.RUNNING, progress=0.0, attempts=attempt)
        try:
            self.peer.call(JobStart(rec.id, rounds, attempt))
        except PeerRefused as exc:
            log.warning("job %s: server 1 did not start run %d: %s", rec.id, attempt, exc)
            self.store.update_job(rec.id, state=JobState.QUEUED)
            return
        self._execute(rec, rounds, attempt)

    # ------------------------------------------------------------------ server 1: the follower
    def follow_agree(self, msg: JobAgree) -> None:
        """Queue a request the leader found at both servers, if this server holds the same one."""
        rec = self.store.job(msg.job)
        if (rec.requester, tuple(rec.targets), params_key(rec.params)) != (msg.requester, msg.targets, msg.params):
            raise ValueError(f"job {rec.id} is another request here")
        if rec.state in FINISHED:
            raise RuntimeError(f"job {rec.id} is {rec.state} here")
        if rec.state == JobState.REQUESTED:
            self.store.update_job(rec.id, state=JobState.QUEUED)
            log.info("job %s of %s agreed by both servers; FL waits for it", rec.id, rec.requester)

    def follow_start(self, msg: JobStart) -> None:
        """Start the run the leader starts, in a thread (refused if busy or not startable)."""
        jid, rounds = msg.job, msg.rounds
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"busy with job {self._running}")
        rec = self.store.job(jid)
        if rec.state not in (JobState.QUEUED, JobState.COMPUTED):
            raise RuntimeError(f"job {jid} is {rec.state} here")
        if self.store.num_rounds != rounds:
            raise RuntimeError(f"job {jid} is to run on {rounds} rounds, this server has "
                               f"{self.store.num_rounds}")
        self._running = jid
        rec = self.store.update_job(jid, state=JobState.RUNNING, progress=0.0, attempts=msg.attempt)
        self._thread = threading.Thread(target=self._execute, args=(rec, rounds, msg.attempt),
                                        name=f"job-{jid}", daemon=True)
        self._thread.start()

    def follow_fail(self, msg: JobFail) -> None:
        """End a job the leader ended, unless it already ended here (a run stops first)."""
        rec = self.store.job(msg.job)
        if rec.id == self._running:
            if msg.state == JobState.CANCELLED:
                self._cancel.add(rec.id)
            return
        if rec.state not in FINISHED:
            self.store.update_job(rec.id, state=msg.state, error=msg.error[:2000])

    def follow_adopt(self, msg: AdoptJob) -> Confirmation:
        """Adopt the job's model as round ``msg.round`` and erase its targets (idempotent)."""
        rec = self.store.job(msg.job)
        if rec.state == JobState.DONE:
            done = self.store.erasure(rec.id)
            if done is None:
                raise RuntimeError(f"job {rec.id} is done here without an erasure report")
            return Confirmation(done.to_json())
        if rec.state != JobState.COMPUTED or rec.result_digest != msg.model_sha256:
            raise RuntimeError(f"job {rec.id} is {rec.state} here with model {rec.result_digest}, "
                               f"not computed with {msg.model_sha256}")
        return Confirmation(self._adopt_here(rec, msg.round))

    def follow_receipt(self, msg: JobReceipt) -> None:
        rec = self.store.job(msg.job)
        if rec.state != JobState.DONE:
            raise RuntimeError(f"job {rec.id} is {rec.state} here; a receipt needs an adopted job")
        self.store.update_job(rec.id, receipt=msg.receipt)

    # ------------------------------------------------------------------ adoption (both roles)
    def _adopt(self, rec: JobRecord, round_no: int) -> None:
        """Leader: server 1 adopts first, then this server; then the receipt goes to both."""
        assert self.peer is not None
        reply = Confirmation.from_wire(self.peer.call(AdoptJob(rec.id, round_no, rec.result_digest or "")))
        checkpoint("leader-after-peer-adopted")
        mine = self._adopt_here(rec, round_no)
        receipt = {
            "job": rec.id, "clients": list(rec.targets), "adopted_round": round_no,
            "rounds_erased": sorted(set(mine["rounds"]) | set(reply.report.get("rounds", []))),
            "model_sha256": rec.result_digest, "at": time.time(),
            "confirmations": {"server0": mine, "server1": dict(reply.report)},
        }
        self.store.update_job(rec.id, receipt=receipt)
        self.peer.call(JobReceipt(rec.id, receipt))
        log.info("job %s adopted as round %d; clients %s erased from rounds %s", rec.id, round_no,
                 list(rec.targets), receipt["rounds_erased"])

    def _adopt_here(self, rec: JobRecord, round_no: int) -> dict[str, Any]:
        with self._adopt_lock:
            if rec.result_path is None:
                raise RuntimeError(f"job {rec.id} has no result to adopt")
            _, model = read_result(rec.result_path)
            if model_digest(model) != rec.result_digest:
                raise RuntimeError(f"job {rec.id}: the result file does not hold the computed model")
            report = self.store.adopt_unlearning(round_no, model, job=rec.id, forgotten=rec.targets)
            self._forget_sizes(rec.targets)
            self.state.forget_rounds_before(round_no + 1)   # sizes of the superseded open round
            self.board.close_job(rec.id)
            self.store.update_job(rec.id, state=JobState.DONE, progress=1.0)
            return report.to_json()

    def _forget_sizes(self, clients: Iterable[int]) -> None:
        for c in clients:
            self.state.forget_client(int(c))

    # ------------------------------------------------------------------ running (both roles)
    def _progress(self, jid: str, fraction: float) -> None:
        if jid in self._cancel:
            raise JobCancelled(f"job {jid} was cancelled")
        now = time.monotonic()
        if fraction >= 1.0 or now - self._progress_at.get(jid, 0.0) > 0.5:
            self._progress_at[jid] = now
            self.store.update_job(jid, progress=min(1.0, max(0.0, fraction)))

    def _execute(self, rec: JobRecord, rounds: int, attempt: int) -> None:
        jid = rec.id
        self._running = jid
        log.info("job %s: run %d unlearning %s from %d rounds (2PC)", jid, attempt, list(rec.targets), rounds)
        try:
            path, digest = run_job(rank=self.party, cfg=self.cfg, store=self.store, board=self.board,
                                   job_id=jid, targets=list(rec.targets), rounds=rounds,
                                   results_dir=self.results_dir, mpc_listener=self.mpc_listener,
                                   stop=self.stop_event, attempt=attempt,
                                   progress=lambda fr, info: self._progress(jid, fr), workers=self.workers)
            self.store.update_job(jid, state=JobState.COMPUTED, progress=1.0, result_path=path,
                                  result_digest=digest)
            log.info("job %s computed (run %d): model %s", jid, attempt, digest[:16])
        except JobCancelled as exc:
            self.store.update_job(jid, state=JobState.CANCELLED, error=str(exc))
        except (ChannelError, ConnectionError, TimeoutError, LockstepError, WorkerError) as exc:
            # a worker that died or lost its peer ends its pair's session: the run is lost, not
            # the job (the next run starts new workers; ``ServerWorkers.end_job``)
            if self.stop_event.is_set() or attempt < MAX_JOB_ATTEMPTS:
                log.warning("job %s: run %d lost its session (%s: %s); re-queued", jid, attempt,
                            type(exc).__name__, exc)
                self.store.update_job(jid, state=JobState.QUEUED, error=f"run {attempt}: {exc}"[:2000])
            else:
                self.store.update_job(jid, state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])
        except Exception as exc:  # noqa: BLE001 - recorded in the job
            log.exception("job %s failed", jid)
            self.store.update_job(jid, state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            self._cancel.discard(jid)
            self._running = None
