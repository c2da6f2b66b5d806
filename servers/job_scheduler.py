"""Unlearning jobs on a server: queueing requests, agreeing on a job, running it, recovery.

A request must reach both servers (each checks the requester's certificate itself) and is
recorded as a queued job in the history store. Server 0 picks the job to run
(:meth:`JobScheduler.lead`): one that server 1 holds as the same request and queued while
server 1 is idle. It fails requests that reached one server only (after
``unlearning.agree_timeout``) or differ between the servers, asks server 1 to start
(:class:`~servers.peer_messages.JobStart`) and then runs the job itself; server 1 runs it in
a thread (:meth:`JobScheduler.follow_start`). Both run Stage II in a fresh 2PC session
(``servers.unlearning_jobs``), with this server's correction :class:`TaskBoard`, and record
the progress and the result durably. A lost session re-queues the job (up to
``MAX_JOB_ATTEMPTS`` runs); a job that was running when the server stopped is re-queued on
restart (:meth:`JobScheduler.requeue_interrupted`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from mpc.channel import ChannelError
from mpc.service_config import ServiceConfig

from .correction_tasks import TaskBoard
from .job_records import FINISHED, JobRecord, JobState
from .peer_link import PeerClient, PeerRefused
from .peer_messages import MAX_JOB_ROWS, JobFail, JobRow, JobStart, PeerState
from .share_store import ShareStore
from .unlearning_jobs import job_params, run_job

__all__ = ["JobScheduler", "MAX_JOB_ATTEMPTS"]

log = logging.getLogger("starfish.server")

#: Runs of a job whose 2PC session was lost before it fails for good.
MAX_JOB_ATTEMPTS = 3


class JobScheduler:
    """The unlearning jobs of one server: leader (``peer`` given, server 0) or follower."""

    def __init__(self, cfg: ServiceConfig, party: int, store: ShareStore, board: TaskBoard, *,
                 results_dir: Path, mpc_listener: socket.socket | None, peer: PeerClient | None,
                 stop: threading.Event) -> None:
        self.cfg = cfg
        self.party = party
        self.store = store
        self.board = board
        self.results_dir = results_dir
        self.mpc_listener = mpc_listener
        self.peer = peer
        self.stop_event = stop
        self._thread: threading.Thread | None = None
        self._running: str | None = None
        self._attempts: dict[str, int] = {}
        self._progress_at: dict[str, float] = {}

    @property
    def running(self) -> str | None:
        """The id of the job this server is running, if any."""
        return self._running

    def requeue_interrupted(self) -> None:
        """Re-queue the jobs that were running when the server stopped (at start-up)."""
        for rec in self.store.jobs(JobState.RUNNING):
            log.warning("job %s was running when the server stopped; re-queued", rec.id)
            self.store.update_job(rec.id, state=JobState.QUEUED)

    def submit(self, requester: str, targets: Iterable[int], job_id: str) -> JobRecord:
        """Record a request as a queued job (idempotent for a replayed request)."""
        return self.store.create_job(requester, targets, job_id=job_id, params=job_params(self.cfg))

    def rows(self) -> list[JobRow]:
        """The most recent jobs, as the leader compares them (server 1's side)."""
        return [JobRow.of(j) for j in self.store.jobs()[-MAX_JOB_ROWS:]]

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ server 0: the leader
    def lead(self, view: PeerState) -> bool:
        """Start the next job both servers hold, if any (blocks while it runs)."""
        job = self._pick(view.jobs, view.busy)
        if job is None:
            return False
        self._lead(job, self.store.num_rounds)
        return True

    def _pick(self, their_rows: Iterable[JobRow], their_busy: str | None) -> JobRecord | None:
        assert self.peer is not None
        theirs = {row.id: row for row in their_rows}
        mine = {j.id: j for j in self.store.jobs()}
        now = time.time()
        agree = self.cfg.unlearning.agree_timeout
        for jid, o in theirs.items():   # requests that reached server 1 only, or ended here
            m = mine.get(jid)
            if o.state == JobState.QUEUED and ((m is None and now - o.created_at > agree)
                                               or (m is not None and m.state in FINISHED)):
                reason = ("the request reached server 1 only" if m is None
                          else f"server 0 has the job {m.state}: {m.error or ''}")
                self.peer.call(JobFail(jid, reason))
        for jid, m in mine.items():
            if m.state != JobState.QUEUED:
                continue
            o = theirs.get(jid)
            if o is None:
                if now - m.created_at > agree:
                    self.store.update_job(jid, state=JobState.FAILED,
                                          error="the request reached server 0 only")
                continue
            if not o.same_request(m):
                self.store.update_job(jid, state=JobState.FAILED, error="the servers hold different requests")
                self.peer.call(JobFail(jid, "the servers hold different requests"))
            elif o.state in (JobState.FAILED, JobState.CANCELLED):
                self.store.update_job(jid, state=JobState.FAILED, error=f"server 1: {o.error or o.state}")
            elif o.state == JobState.QUEUED and their_busy is None:
                return m
        return None

    def _lead(self, rec: JobRecord, rounds: int) -> None:
        assert self.peer is not None
        try:
            self.peer.call(JobStart(rec.id, rounds))
        except PeerRefused as exc:
            log.warning("job %s: server 1 did not start: %s", rec.id, exc)
            return
        self._execute(rec, rounds)

    # ------------------------------------------------------------------ server 1: the follower
    def follow_start(self, msg: JobStart) -> None:
        """Start the job the leader starts, in a thread (refused if busy or not queued here)."""
        jid, rounds = msg.job, msg.rounds
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"busy with job {self._running}")
        rec = self.store.job(jid)
        if rec.state != JobState.QUEUED:
            raise RuntimeError(f"job {jid} is {rec.state} here")
        if self.store.num_rounds < rounds:
            raise RuntimeError(f"job {jid} needs {rounds} rounds, this server has {self.store.num_rounds}")
        self._running = jid
        self.store.update_job(jid, state=JobState.RUNNING, progress=0.0)
        self._thread = threading.Thread(target=self._execute, args=(rec, rounds),
                                        name=f"job-{jid}", daemon=True)
        self._thread.start()

    def follow_fail(self, msg: JobFail) -> None:
        """Fail a job the leader failed, unless it already ended or runs here."""
        rec = self.store.job(msg.job)
        if rec.state not in FINISHED and rec.id != self._running:
            self.store.update_job(rec.id, state=JobState.FAILED, error=msg.error[:2000])

    # ------------------------------------------------------------------ both roles
    def _progress(self, jid: str, fraction: float) -> None:
        now = time.monotonic()
        if fraction >= 1.0 or now - self._progress_at.get(jid, 0.0) > 0.5:
            self._progress_at[jid] = now
            self.store.update_job(jid, progress=min(1.0, max(0.0, fraction)))

    def _execute(self, rec: JobRecord, rounds: int) -> None:
        jid = rec.id
        self._running = jid
        if self.store.job(jid).state != JobState.RUNNING:
            self.store.update_job(jid, state=JobState.RUNNING, progress=0.0)
        log.info("job %s: unlearning %s from %d rounds (2PC)", jid, list(rec.targets), rounds)
        try:
            path = run_job(rank=self.party, cfg=self.cfg, store=self.store, board=self.board,
                           job_id=jid, targets=list(rec.targets), rounds=rounds,
                           results_dir=self.results_dir, mpc_listener=self.mpc_listener,
                           stop=self.stop_event,
                           progress=lambda fr, info: self._progress(jid, fr))
            self.store.update_job(jid, state=JobState.DONE, progress=1.0, result_path=path)
            log.info("job %s done: %s", jid, path)
        except (ChannelError, ConnectionError, TimeoutError) as exc:
            n = self._attempts[jid] = self._attempts.get(jid, 0) + 1
            if n < MAX_JOB_ATTEMPTS and not self.stop_event.is_set():
                log.warning("job %s: session lost (%s); re-queued (attempt %d)", jid, exc, n)
                self.store.update_job(jid, state=JobState.QUEUED)
            else:
                self.store.update_job(jid, state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded in the job
            log.exception("job %s failed", jid)
            self.store.update_job(jid, state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            self._running = None
