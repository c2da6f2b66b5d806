"""Unlearning-job records (servers.job_records): the state machine, durability, the enum.

Oracles: the records the test created (a reopened store must give them back), the
transition table written out in docs/share_store.md, and plain strings (a JobState must
compare, hash, print and serialise as its value, since the daemon and the CLI use strings).
"""

from __future__ import annotations

import json

import msgpack
import pytest

from servers import share_store as ss
from servers.job_records import FINISHED, TRANSITIONS, JobState
from servers.share_store import ShareStore
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
        store.update_job("job-1", state="running", progress=0.4)
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
        done = store.update_job("job-1", state="done", progress=1.0, result_path=tmp_path / "m.pt")
        assert done.result_path == str(tmp_path / "m.pt")
        with pytest.raises(ss.JobError, match="finished"):
            store.update_job("job-1", progress=0.5)
        assert [j.id for j in store.jobs()] == ["job-1", other.id]


def test_job_states_are_the_strings_the_service_uses():
    assert [s.value for s in JobState] == ["queued", "running", "done", "failed", "cancelled"]
    assert FINISHED == {"done", "failed", "cancelled"}
    assert "done" in FINISHED and "running" not in FINISHED
    assert {s for s, nxt in TRANSITIONS.items() if not nxt} == FINISHED
    assert TRANSITIONS[JobState.QUEUED] == {"running", "cancelled", "failed"}
    assert TRANSITIONS["running"] == {"running", "queued", "done", "failed", "cancelled"}
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
