"""Unlearning-job records (servers.store.job_records): the state machine, durability, the enum,
the columns added for adoption (attempts, result digest, receipt) and the migration of a
catalog created before them.

Oracles: the records the test created (a reopened store must give them back), the
transition table written out in docs/share_store.md, plain strings (a JobState must
compare, hash, print and serialise as its value, since the daemon and the CLI use strings)
and the previous release's ``jobs`` table, written out below as it was.
"""

from __future__ import annotations

import json
import sqlite3

import msgpack
import pytest

from servers.store import share_store as ss
from servers.store.job_records import FINISHED, TRANSITIONS, JobState
from servers.store.share_store import ShareStore
from tests.helpers.store_helpers import new_store


def test_unlearning_jobs_survive_reopen_and_follow_their_state_machine(tmp_path):
    root = tmp_path / "s"
    with new_store(root, 0) as store:
        job = store.create_job("client-3", [3], job_id="job-1", params={"sigma": 0.6})
        assert job.state == "queued" and job.progress == 0.0 and job.targets == (3,)
        assert store.create_job("client-3", [3], job_id="job-1", params={"sigma": 0.6}) == job
        with pytest.raises(ss.JobError, match="different request"):
            store.create_job("client-3", [3, 4], job_id="job-1")
        other = store.create_job("admin", [5, 1])
        assert other.targets == (1, 5) and len(other.id) == 16
        store.update_job("job-1", state="running", progress=0.4, attempts=1)
        with pytest.raises(ss.JobError, match="cannot go from running to bogus|unknown"):
            store.update_job("job-1", state="bogus")
        with pytest.raises(ss.JobError, match="progress"):
            store.update_job("job-1", progress=1.5)
        with pytest.raises(ss.JobError, match="cannot go from queued to done"):
            store.update_job(other.id, state="done")
        with pytest.raises(KeyError):
            store.update_job("nope", state="running")
    with ShareStore(root, party=0) as store:  # a restarted daemon finds the interrupted job
        running = store.jobs("running")
        assert [j.id for j in running] == ["job-1"] and running[0].progress == 0.4
        assert dict(running[0].params) == {"sigma": 0.6} and running[0].requester == "client-3"
        with pytest.raises(ss.JobError, match="cannot go from running to done"):
            store.update_job("job-1", state="done")  # done means adopted: computed first
        comp = store.update_job("job-1", state="computed", progress=1.0,
                                result_path=tmp_path / "m.pt", result_digest="ab" * 32)
        assert comp.result_path == str(tmp_path / "m.pt") and comp.result_digest == "ab" * 32
        assert comp.attempts == 1 and comp.receipt is None
        done = store.update_job("job-1", state="done")
        assert done.state == "done" and done.result_digest == "ab" * 32
        with pytest.raises(ss.JobError, match="finished"):
            store.update_job("job-1", progress=0.5)
        assert [j.id for j in store.jobs()] == ["job-1", other.id]


def test_job_states_are_the_strings_the_service_uses():
    assert [s.value for s in JobState] == ["requested", "queued", "running", "computed", "done",
                                           "failed", "cancelled"]
    assert FINISHED == {"done", "failed", "cancelled"}
    assert "done" in FINISHED and "running" not in FINISHED and "computed" not in FINISHED
    assert {s for s, nxt in TRANSITIONS.items() if not nxt} == FINISHED
    assert TRANSITIONS[JobState.REQUESTED] == {"queued", "cancelled", "failed"}
    assert TRANSITIONS[JobState.QUEUED] == {"running", "cancelled", "failed"}
    assert TRANSITIONS["running"] == {"running", "queued", "computed", "failed", "cancelled"}
    assert TRANSITIONS["computed"] == {"done", "queued", "running", "failed", "cancelled"}
    assert JobState.DONE == "done" and hash(JobState.DONE) == hash("done")
    assert f"{JobState.RUNNING}" == str(JobState.RUNNING) == "running"
    assert json.dumps({"state": JobState.FAILED}) == '{"state": "failed"}'
    assert msgpack.unpackb(msgpack.packb({"state": JobState.CANCELLED})) == {"state": "cancelled"}


def test_records_carry_a_job_state_and_accept_strings_or_states(tmp_path):
    with new_store(tmp_path / "s", 1) as store:
        job = store.create_job("admin", [2], job_id="j")
        assert job.state is JobState.QUEUED
        assert store.update_job("j", state=JobState.RUNNING).state is JobState.RUNNING
        assert [r.id for r in store.jobs(JobState.RUNNING)] == ["j"] == [r.id for r in store.jobs("running")]
        rec = store.update_job("j", state="cancelled", error="withdrawn")
        assert rec.state is JobState.CANCELLED and rec.state in FINISHED and rec.error == "withdrawn"
        with pytest.raises(ss.JobError, match="job j is cancelled; finished"):
            store.update_job("j", state="running")


def test_every_transition_is_allowed_or_refused_as_the_table_says(tmp_path):
    """Walk each (from, to) pair on a fresh job; the oracle is the table in the docs."""
    allowed = {  # docs/share_store.md, "API"
        "requested": {"queued", "cancelled", "failed"},
        "queued": {"running", "cancelled", "failed"},
        "running": {"running", "queued", "computed", "failed", "cancelled"},
        "computed": {"done", "queued", "running", "failed", "cancelled"},
        "done": set(), "failed": set(), "cancelled": set(),
    }
    path_to = {"requested": [], "queued": [], "running": ["running"], "computed": ["running", "computed"],
               "done": ["running", "computed", "done"], "failed": ["failed"],
               "cancelled": ["cancelled"]}
    with new_store(tmp_path / "s", 0) as store:
        n = 0
        for src, dsts in allowed.items():
            for dst in allowed:
                n += 1
                jid = f"j{n}"
                store.create_job("admin", [1], job_id=jid,
                                 state=JobState.REQUESTED if src == "requested" else JobState.QUEUED)
                for step in path_to[src]:
                    store.update_job(jid, state=step)
                assert store.job(jid).state == src
                if dst in dsts:
                    assert store.update_job(jid, state=dst).state == dst
                elif dst == src and allowed[src]:  # staying put is an update, not a move
                    assert store.update_job(jid, state=dst).state == src
                else:
                    with pytest.raises(ss.JobError):
                        store.update_job(jid, state=dst)
                    assert store.job(jid).state == src


def test_attempts_digest_and_receipt_are_durable_and_checked(tmp_path):
    root = tmp_path / "s"
    receipt = {"job": "j", "rounds_erased": [1, 3], "confirmations": {"server0": {"round": 4}}}
    with new_store(root, 1) as store:
        store.create_job("admin", [2], job_id="j")
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(ss.JobError, match="attempts"):
                store.update_job("j", attempts=bad)
        with pytest.raises(ss.JobError, match="result_digest"):
            store.update_job("j", result_digest="")
        with pytest.raises(ss.JobError, match="receipt"):
            store.update_job("j", receipt={"x": float("nan")})
        assert store.job("j").attempts == 0  # refused updates changed nothing
        store.update_job("j", state="running", attempts=2)
        store.update_job("j", state="computed", result_digest="d1")
        store.update_job("j", state="running", attempts=3)  # the other server lost its result
        store.update_job("j", state="computed", result_digest="d2")
        store.update_job("j", state="done")
        with pytest.raises(ss.JobError, match="accepts only its receipt"):
            store.update_job("j", receipt=receipt, error="x")
        rec = store.update_job("j", receipt=receipt)  # a done job still takes its receipt
        assert rec.state == "done" and dict(rec.receipt) == receipt
        assert store.update_job("j", receipt=receipt).receipt == rec.receipt  # resent: same
    with ShareStore(root, party=1) as store:
        rec = store.job("j")
        assert (rec.attempts, rec.result_digest, rec.state) == (3, "d2", "done")
        assert json.loads(json.dumps(dict(rec.receipt))) == receipt
        cancelled = store.create_job("admin", [2], job_id="k")
        store.update_job("k", state="cancelled")
        with pytest.raises(ss.JobError, match="finished"):
            store.update_job("k", receipt=receipt)  # only a done job has a receipt
        assert cancelled.receipt is None


#: The ``jobs`` table as the previous release created it (before attempts/digest/receipt).
OLD_JOBS = """CREATE TABLE jobs(
    id TEXT PRIMARY KEY, requester TEXT NOT NULL, targets TEXT NOT NULL, params TEXT NOT NULL,
    state TEXT NOT NULL, progress REAL NOT NULL, result_path TEXT, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL)"""


def test_a_catalog_of_the_previous_release_opens_and_is_migrated(tmp_path):
    root = tmp_path / "s"
    new_store(root, 0).close()
    conn = sqlite3.connect(root / "catalog.sqlite3")
    with conn:  # turn it into what the previous release left: old jobs table, no new tables
        conn.executescript("DROP TABLE jobs; DROP TABLE erasures; DROP TABLE forgotten; " + OLD_JOBS)
        conn.execute("INSERT INTO jobs VALUES ('old', 'admin', '[4]', '{}', 'running', 0.5, NULL, "
                     "NULL, 1.0, 2.0)")
    conn.close()
    with ShareStore(root, party=0) as store:
        rec = store.job("old")
        assert (rec.state, rec.progress, rec.targets) == ("running", 0.5, (4,))
        assert (rec.attempts, rec.result_digest, rec.receipt) == (0, None, None)
        rec = store.update_job("old", state="computed", attempts=1, result_digest="f" * 64)
        assert rec.attempts == 1 and store.forgotten() == {} and store.erasure("old") is None
    conn = sqlite3.connect(root / "catalog.sqlite3")
    cols = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert {"attempts", "result_digest", "receipt"} <= cols and {"forgotten", "erasures"} <= tables
    with ShareStore(root, party=0) as store:  # a second open finds nothing to migrate
        assert store.job("old").state == "computed"
