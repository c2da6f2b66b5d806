"""Durable unlearning-job records: the job states, their transitions, the ``jobs`` table.

Why a module of its own: an unlearning request outlives processes (docs/design.md 4.4: "2PC job
with durable progress; a crash of any process resumes or re-runs it"), so each server keeps
a record per job in its store's catalog, next to the history the job reads. A record is
public bookkeeping (who asked, which clients to forget, parameters, state, progress, where
the result is, the error, the run count, the digest of the computed model, the erasure
receipt), never a share. :class:`JobState` is the one spelling of the states for the whole
service; :data:`TRANSITIONS` the only moves between them.
"""

from __future__ import annotations

import enum
import json
import math
import operator
import os
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from servers.store import store_validation as check
from servers.store.store_catalog import StoreCatalog, locked
from servers.store.store_errors import CatalogCorruptError, JobError

__all__ = ["JobState", "FINISHED", "TRANSITIONS", "JobRecord", "JobRecords"]


class JobState(str, enum.Enum):
    """State of an unlearning job. A str: ``JobState.DONE == "done"``, and it is stored,
    sent and printed as its value."""

    #: recorded at this server only; not yet agreed with the other server, so FL does not wait
    #: for it (issue 25: a request sent to one server paused FL on both for agree_timeout)
    REQUESTED = "requested"
    QUEUED = "queued"
    RUNNING = "running"
    #: the result is written; waiting for both servers to adopt it
    COMPUTED = "computed"
    #: adopted as the new global model and the targets erased (``ShareStore.adopt_unlearning``)
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    # printed as the plain value on every Python version (f-strings, str(), logs)
    __str__ = str.__str__
    __format__ = str.__format__


#: States a job never leaves.
FINISHED: frozenset[JobState] = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})

#: The transitions allowed from each state. ``requested -> queued`` is the servers' agreement
#: (both hold the same request); ``running -> queued`` lets a restarted daemon
#: re-queue a job its crash interrupted; ``running -> running`` records progress;
#: ``computed -> queued | running`` re-runs a job whose result the other server lost.
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = MappingProxyType({
    JobState.REQUESTED: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.COMPUTED,
                                 JobState.FAILED, JobState.CANCELLED}),
    JobState.COMPUTED: frozenset({JobState.DONE, JobState.QUEUED, JobState.RUNNING,
                                  JobState.FAILED, JobState.CANCELLED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
})

_JOB_ID_RE = check.JOB_ID_RE
_COLUMNS = ("id, requester, targets, params, state, progress, result_path, error, "
            "created_at, updated_at, attempts, result_digest, receipt")
_MAX_DIGEST = 256


@dataclass(frozen=True)
class JobRecord:
    """A durable unlearning-job record (public bookkeeping, no shares)."""

    id: str
    requester: str
    targets: tuple[int, ...]
    params: Mapping[str, Any]
    state: JobState
    progress: float
    result_path: str | None
    error: str | None
    created_at: float
    updated_at: float
    #: runs started so far (set by the scheduler)
    attempts: int = 0
    #: digest of the computed model (state computed or done)
    result_digest: str | None = None
    #: the erasure receipt (public JSON object), once recorded
    receipt: Mapping[str, Any] | None = None


class JobRecords(StoreCatalog):
    """The job records of a store (a part of :class:`servers.store.share_store.ShareStore`)."""

    def _job_from_row(self, row: Sequence[Any]) -> JobRecord:
        (jid, req, targets, params, state, progress, result, error, created, updated,
         attempts, digest, receipt) = row
        try:
            job_state = JobState(str(state))
        except ValueError:
            raise CatalogCorruptError(f"{self.root}: job {jid} has unknown state {state!r}") from None
        return JobRecord(str(jid), str(req), tuple(int(t) for t in json.loads(targets)),
                         MappingProxyType(json.loads(params)), job_state, float(progress),
                         result, error, float(created), float(updated), int(attempts),
                         None if digest is None else str(digest),
                         None if receipt is None else MappingProxyType(json.loads(receipt)))

    def _job_row(self, job_id: str) -> JobRecord | None:
        assert self._conn is not None
        row = self._conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._job_from_row(row)

    @locked
    def create_job(self, requester: str, targets: Iterable[int], *, job_id: str | None = None,
                   params: Mapping[str, Any] | None = None,
                   state: JobState = JobState.QUEUED) -> JobRecord:
        """Record a new unlearning job in state ``queued`` (or ``requested``: the daemons record a
        client's request so until both servers hold it).

        Idempotent for a replayed request: the same ``job_id`` with the same requester,
        targets and params returns the stored record; different content raises JobError.
        """
        if not isinstance(requester, str) or not 0 < len(requester) <= 256:
            raise JobError("requester must be a non-empty string of at most 256 characters")
        if state not in (JobState.QUEUED, JobState.REQUESTED):
            raise JobError(f"a new job is queued or requested, not {state}")
        tgt = check.participants(targets)
        params_json = check.metadata(params)
        jid = secrets.token_hex(8) if job_id is None else job_id
        if not isinstance(jid, str) or not _JOB_ID_RE.match(jid):
            raise JobError(f"job id must match {_JOB_ID_RE.pattern}, got {jid!r}")
        old = self._job_row(jid)
        if old is not None:
            same = (old.requester == requester and old.targets == tgt
                    and json.dumps(dict(old.params), sort_keys=True, separators=(",", ":")) == params_json)
            if not same:
                raise JobError(f"job {jid} already exists with a different request")
            return old
        now = time.time()
        with self._txn() as c:
            c.execute(f"INSERT INTO jobs({_COLUMNS}) VALUES (?, ?, ?, ?, ?, 0.0, NULL, NULL, ?, ?, "
                      "0, NULL, NULL)",
                      (jid, requester, json.dumps(list(tgt)), params_json, JobState(state).value,
                       now, now))
        rec = self._job_row(jid)
        assert rec is not None
        return rec

    @locked
    def update_job(self, job_id: str, *, state: JobState | str | None = None,
                   progress: float | None = None,
                   result_path: str | os.PathLike[str] | None = None,
                   error: str | None = None, attempts: int | None = None,
                   result_digest: str | None = None,
                   receipt: Mapping[str, Any] | None = None) -> JobRecord:
        """Change a job's state/progress/result/run count/receipt durably (one transaction).

        Allowed transitions are :data:`TRANSITIONS`; None leaves a field as it is. A
        finished job (done, failed, cancelled) keeps its state and fields, with one
        exception: a done job may still get its erasure ``receipt`` recorded (the receipt
        is assembled after both servers adopted; a later one replaces it).
        """
        rec = self._job_row(job_id)
        if rec is None:
            raise KeyError(f"no unlearning job {job_id!r}")
        try:
            receipt_json = None if receipt is None else check.metadata(receipt)
        except (TypeError, ValueError) as exc:
            raise JobError(f"job {job_id}: bad receipt ({exc})") from None
        if not TRANSITIONS[rec.state]:
            only_receipt = (receipt is not None and rec.state == JobState.DONE
                            and all(v is None for v in (progress, result_path, error,
                                                        attempts, result_digest))
                            and (state is None or str(state) == rec.state.value))
            if not only_receipt:
                raise JobError(f"job {job_id} is {rec.state}; finished jobs cannot change"
                               + (" (a done job accepts only its receipt)"
                                  if rec.state == JobState.DONE else ""))
        try:
            new_state = rec.state if state is None else JobState(state)
        except ValueError:
            raise JobError(f"unknown job state {state!r}; states are "
                           f"{sorted(s.value for s in JobState)}") from None
        if new_state != rec.state and new_state not in TRANSITIONS[rec.state]:
            raise JobError(f"job {job_id}: cannot go from {rec.state} to {new_state}")
        new_progress = rec.progress if progress is None else float(progress)
        if not (math.isfinite(new_progress) and 0.0 <= new_progress <= 1.0):
            raise JobError(f"progress must be in [0, 1], got {progress}")
        new_result = rec.result_path if result_path is None else os.fspath(result_path)
        new_error = rec.error if error is None else str(error)
        new_attempts = rec.attempts
        if attempts is not None:
            try:
                new_attempts = -1 if isinstance(attempts, bool) else operator.index(attempts)
            except TypeError:
                new_attempts = -1
            if new_attempts < 0:
                raise JobError(f"attempts must be an integer >= 0, got {attempts!r}")
        if result_digest is not None and (not isinstance(result_digest, str)
                                          or not 0 < len(result_digest) <= _MAX_DIGEST):
            raise JobError(f"result_digest must be a non-empty string of at most {_MAX_DIGEST} "
                           "characters")
        new_digest = rec.result_digest if result_digest is None else result_digest
        with self._txn() as c:
            c.execute("UPDATE jobs SET state = ?, progress = ?, result_path = ?, error = ?, "
                      "attempts = ?, result_digest = ?, receipt = COALESCE(?, receipt), updated_at = ? "
                      "WHERE id = ?",
                      (new_state.value, new_progress, new_result, new_error, new_attempts,
                       new_digest, receipt_json, time.time(), job_id))
        out = self._job_row(job_id)
        assert out is not None
        return out

    @locked
    def job(self, job_id: str) -> JobRecord:
        rec = self._job_row(job_id)
        if rec is None:
            raise KeyError(f"no unlearning job {job_id!r}")
        return rec

    @locked
    def jobs(self, state: JobState | str | None = None) -> list[JobRecord]:
        """Job records in creation order, optionally only those in ``state``.

        After a restart, ``jobs(JobState.RUNNING)`` are the jobs the crash interrupted: the
        daemon decides whether to re-queue or fail them.
        """
        assert self._conn is not None
        sql = f"SELECT {_COLUMNS} FROM jobs"
        args: tuple[Any, ...] = ()
        if state is not None:
            sql += " WHERE state = ?"
            args = (str(state),)
        return [self._job_from_row(r) for r in self._conn.execute(sql + " ORDER BY rowid", args)]
