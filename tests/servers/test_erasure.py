"""Forgetting takes effect (servers.store.erasure): adopt an unlearned model, erase the forgotten.

Oracles: the bytes of every file under the store (each erased share's marker, seed or
number must be found there before the erasure, so the scan can fail, and nowhere after;
the kept clients' traces must still be found), the values the test wrote (the rewritten
rounds must give back exactly the kept clients' shares, weights as stored, metadata as
written minus the erased clients), a SIGKILLed writer process (after a reopen the store is
entirely before or entirely after) and the rules of the issue written out in the tests.

This file is also the crash-test writer: ``python -m tests.servers.test_erasure writer ...``.
"""

from __future__ import annotations

import os
import shutil
import signal
import math
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from servers.store import blobs as blobs_mod
from servers.store import share_store as ss
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore
from tests.helpers.store_helpers import DIM, blob_files, expected_share, ring
from tests.servers.erasure_workload import (FORGOTTEN, JOB, STAGED, T, blob_count_after, build,
                                            expected_after, scan, spec)

REPO = Path(__file__).resolve().parents[2]


def _compact_flag(root: Path) -> str | None:
    conn = sqlite3.connect(root / "catalog.sqlite3")
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'compact_pending'").fetchone()
    finally:
        conn.close()
    return None if row is None else row[0]


def assert_after(root: Path, sp: dict, party: int) -> None:
    """The store is entirely after the adoption: round T+1, the clients erased, no trace."""
    with ShareStore(root, party=party) as store:
        assert store.num_rounds == T + 1 and store.fl_rounds == T
        assert store.round_kind(T + 1) == "unlearning" and store.round_kind(1) == "fl"
        assert np.array_equal(store.model(T + 1), sp["adopted"])
        assert store.participants(T + 1) == () and dict(store.weights(T + 1)) == {}
        assert store.metadata(T + 1) == {"kind": "unlearning", "job": JOB,
                                         "forgotten": list(FORGOTTEN)}
        for r, rd in sp["rounds"].items():
            parts, weights, meta = expected_after(sp, r)
            assert store.participants(r) == tuple(parts)
            assert dict(store.weights(r)) == weights  # renormalised where a client was erased
            if set(rd["parts"]) & set(FORGOTTEN) and parts:
                # the erased |D_j| is not recoverable: the remaining weights sum to 1, and are
                # the remaining (public) sizes over their own sum
                sizes = meta["num_samples"]
                assert math.isclose(sum(store.weights(r).values()), 1.0, rel_tol=1e-12)
                total = sum(sizes[str(c)] for c in parts)
                assert all(store.weights(r)[c] == sizes[str(c)] / total for c in parts)
            assert store.metadata(r) == meta
            assert np.array_equal(store.model(r), rd["model"])
            for c in parts:
                got, (u, n, d) = store.client_shares(r, c), rd["shares"][c].__dict__.values()
                assert np.array_equal(got.update, expected_share(u, (DIM,)))
                assert np.array_equal(got.norm, expected_share(n, ()))
                assert np.array_equal(got.delta, expected_share(d, ()))
            for c in FORGOTTEN:
                with pytest.raises(KeyError):
                    store.update_share(r, c)
        assert store.staged(T + 1) == () and store.staged(T + 2) == ()
        assert set(store.forgotten()) == set(FORGOTTEN)
        assert all(store.is_forgotten(c) for c in FORGOTTEN) and not store.is_forgotten(1)
        assert store.verify() == []
    assert len(blob_files(root)) == blob_count_after(sp), "an erased client's file survived"
    assert _compact_flag(root) is None
    hits = scan(root, sp["traces"]["forgotten"] + sp["traces"]["staged"])
    assert {t: f for t, f in hits.items() if f} == {}, "erased bytes are still on disk"
    assert all(scan(root, sp["traces"]["kept"]).values()), "the kept clients' data went too"


# ====================================================================== the erasure itself
@pytest.mark.parametrize("party,same_session", [(0, True), (1, False)])
def test_erased_bytes_are_nowhere_on_disk_and_the_rest_reads_back(tmp_path, party, same_session):
    """Party 0 erases in the session that wrote the data (its WAL still holds the frames),
    party 1 after a reopen (everything is in the database file)."""
    sp = spec(11, party)
    root = tmp_path / "store"
    opened = build(root, sp, party, keep_open=same_session)
    state = ServiceState(tmp_path / "service.sqlite3")  # the daemon's sidecar file
    sizes = {(T + 1, 7): 2**60 + 12345, (T, 7): 2**60 + 777, (T + 1, 1): 2**60 + 4242}
    for (r, c), n in sizes.items():
        state.set_size(r, c, n)
    size_trace = {k: n.to_bytes(8, "big") for k, n in sizes.items()}  # SQLite's 8-byte int
    traces = sp["traces"]["forgotten"] + sp["traces"]["staged"] + sp["traces"]["kept"]
    before = scan(tmp_path, traces + list(size_trace.values()))
    missing = [t for t, files in before.items() if not files]
    assert missing == [], "the scan cannot see some values before the erasure"
    with opened or ShareStore(root, party=party) as store:
        hashes = {r: store.round_info(r).content_hash for r in sp["rounds"]}
        n_files = len(blob_files(root))
        report = store.adopt_unlearning(T + 1, sp["adopted"], job=JOB, forgotten=[8, 7, 7])
        assert report.job == JOB and report.clients == FORGOTTEN and report.round == T + 1
        assert report.rounds == (1, 2, 3) and report.party == party and not report.replayed
        assert report.share_rows == 4 and report.staged_rows == len(STAGED)
        assert report.blobs_removed == n_files + 1 - len(blob_files(root))  # + adopted model
        assert store.round_info(4).content_hash == hashes[4]  # an unaffected round is untouched
        assert store.erasure(JOB) == report and store.erasure("other") is None
        assert set(report.to_json()) == {"job", "clients", "rounds", "share_rows", "staged_rows",
                                         "blobs_removed", "round", "at", "party", "replayed"}
        assert report.to_json()["clients"] == [7, 8]
        erased = sp["traces"]["forgotten"] + sp["traces"]["staged"]
        assert not any(scan(root, erased).values()), "found while the store is open"
        assert state.forget_client(7) == 2 and state.forget_client(7) == 0
    assert state.sizes(T + 1) == {1: sizes[T + 1, 1]}
    hits = scan(tmp_path, list(size_trace.values()))
    assert not hits[size_trace[T + 1, 7]] and not hits[size_trace[T, 7]]
    assert hits[size_trace[T + 1, 1]]  # the other client's size is still there
    state.close()
    assert_after(root, sp, party)  # also: a reopen works, verify() is clean


def test_replays_conflicts_order_and_a_second_erasure(tmp_path):
    sp = spec(12, 1)
    root = tmp_path / "store"
    build(root, sp, 1)
    rng = np.random.default_rng(3)
    with ShareStore(root, party=1) as store:
        with pytest.raises(ss.RoundOrderError, match="next is 5"):
            store.adopt_unlearning(T + 2, sp["adopted"], job=JOB, forgotten=FORGOTTEN)
        with pytest.raises(ss.RoundConflictError, match="FL round"):
            store.adopt_unlearning(2, sp["adopted"], job=JOB, forgotten=FORGOTTEN)
        for bad in ([], "7", [-1]):
            with pytest.raises((TypeError, ValueError)):
                store.adopt_unlearning(T + 1, sp["adopted"], job=JOB, forgotten=bad)
        with pytest.raises(ValueError, match="job id"):
            store.adopt_unlearning(T + 1, sp["adopted"], job="a/b", forgotten=FORGOTTEN)
        assert store.num_rounds == T and store.staged(T + 1) == tuple(STAGED)  # nothing changed
        first = store.adopt_unlearning(T + 1, sp["adopted"], job=JOB, forgotten=FORGOTTEN)
        files = sorted((p.name, p.stat().st_size) for p in blob_files(root))
        again = store.adopt_unlearning(T + 1, sp["adopted"].copy(), job=JOB, forgotten=(8, 7))
        assert again.replayed and again == ss.ErasureReport(**{**first.__dict__, "replayed": True})
        assert sorted((p.name, p.stat().st_size) for p in blob_files(root)) == files
        for kwargs, msg in (({"model": sp["adopted"] + 1}, "model"),
                            ({"forgotten": [7]}, "forgotten clients"),
                            ({"job": "job-2"}, "adoption of job job-1")):
            args = {"round": T + 1, "model": sp["adopted"], "job": JOB, "forgotten": FORGOTTEN,
                    **kwargs}
            with pytest.raises(ss.RoundConflictError, match=msg):
                store.adopt_unlearning(**args)
        with pytest.raises(ss.RoundConflictError):  # an FL round over the adopted one
            store.commit_round(T + 1, sp["adopted"], [1], {1: 1.0})
        # forgotten clients are refused, in staging and in append_round, until re-enrolled
        up = (ring(rng, (DIM,)), ring(rng, ()), ring(rng, ()))
        with pytest.raises(ss.ForgottenClientError, match="client 7 was forgotten by"):
            store.stage_upload(T + 2, 7, *up)
        with pytest.raises(ss.ForgottenClientError):
            store.append_round(T + 2, sp["adopted"], [1, 8], {1: 0.5, 8: 0.5},
                               {1: ss.ClientShares(*up), 8: ss.ClientShares(*up)})
        with pytest.raises(KeyError, match="not forgotten"):
            store.reenrol(1, "admin")
        assert store.reenrol(7, "admin:alice") is None
        store.reenrol(7, "admin:bob")  # already re-enrolled: no change
        info = store.forgotten()[7]
        assert info["job"] == JOB and info["reenrolled_by"] == "admin:alice"
        assert info["reenrolled_at"] >= info["at"] and store.forgotten()[8]["reenrolled_at"] is None
        assert not store.is_forgotten(7) and store.is_forgotten(8)
        for r in (1, 3):  # re-enrolling does not bring anything back
            with pytest.raises(KeyError):
                store.update_share(r, 7)
        assert store.stage_upload(T + 2, 7, *up) and store.stage_upload(T + 2, 1, *up)
        summary = store.staged_summary(T + 2)
        assert [s["client"] for s in summary] == [1, 7] and set(summary[0]) == {
            "client", "staged_at", "upload_hash"}
        store.commit_round(T + 2, sp["rounds"][1]["model"], [1, 7], {1: 0.5, 7: 0.5},
                           {"num_samples": {"1": 3, "7": 4}})
        with pytest.raises(ss.RoundConflictError, match="already adopted as round 5"):
            store.adopt_unlearning(T + 3, sp["adopted"], job=JOB, forgotten=FORGOTTEN)
        second = store.adopt_unlearning(T + 3, sp["rounds"][2]["model"], job="job-2", forgotten=[7])
        assert second.rounds == (T + 2,) and second.share_rows == 1 and second.staged_rows == 0
        assert store.metadata(T + 2) == {"num_samples": {"1": 3}, "erased": [7]}
        assert store.forgotten()[7] == {"job": "job-2", "at": second.at, "reenrolled_at": None,
                                        "reenrolled_by": None}
        assert [store.round_kind(i) for i in range(1, T + 4)] == ["fl"] * T + ["unlearning", "fl",
                                                                               "unlearning"]
        assert store.fl_rounds == T + 1 and store.num_rounds == T + 3
        with pytest.raises(IndexError):
            store.round_kind(T + 4)
        assert store.verify() == []
    with ShareStore(root, party=1) as store:
        assert store.fl_rounds == T + 1 and store.erasure("job-2") == second
        assert store.recovered_files == ()


# ====================================================================== crash safety
def _writer_main(argv: list[str]) -> int:
    """Open the store and adopt the spec's model; SIGKILL itself at POINT (HIT-th pass).
    With mode ``open`` it only opens the store (the compaction at open is what dies)."""
    mode, root, seed, party, point, hit = argv[0], Path(argv[1]), int(argv[2]), int(argv[3]), \
        argv[4], int(argv[5])
    count = [0]

    def crash(name: str) -> None:
        if name == point:
            count[0] += 1
            if count[0] == hit:
                os.kill(os.getpid(), signal.SIGKILL)

    ss._checkpoint = crash
    blobs_mod._checkpoint = crash
    with ShareStore(root, party=party) as store:
        if mode == "adopt":
            store.adopt_unlearning(T + 1, spec(seed, party)["adopted"], job=JOB, forgotten=FORGOTTEN)
    print("finished", flush=True)
    return 0


def _run_writer(mode: str, root: Path, seed: int, party: int, point: str) -> int:
    cmd = [sys.executable, "-m", "tests.servers.test_erasure", "writer", mode, str(root),
           str(seed), str(party), point, "1"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=120).returncode


def assert_before(root: Path, sp: dict, party: int) -> tuple:
    with ShareStore(root, party=party) as store:
        assert store.num_rounds == T and store.fl_rounds == T
        assert store.forgotten() == {} and store.erasure(JOB) is None
        assert store.staged(T + 1) == tuple(STAGED)
        for r, rd in sp["rounds"].items():
            assert store.participants(r) == tuple(rd["parts"]) and store.metadata(r) == rd["meta"]
            for c in rd["parts"]:
                assert np.array_equal(store.update_share(r, c),
                                      expected_share(rd["shares"][c].update, (DIM,)))
        assert store.verify() == []
        recovered = store.recovered_files
    assert all(scan(root, sp["traces"]["forgotten"]).values())
    return recovered


def test_a_kill_at_any_step_leaves_the_store_entirely_before_or_after(tmp_path):
    seed, party = 13, 0
    sp = spec(seed, party)
    template = tmp_path / "template"
    build(template, sp, party)
    plan = [("adopt-model-durable", False), ("adopt-in-transaction", False),
            ("adopt-committed", True), ("adopt-blobs-removed", True), ("compact-vacuumed", True)]
    for point, after in plan:
        root = tmp_path / point
        shutil.copytree(template, root)
        assert _run_writer("adopt", root, seed, party, point) == -signal.SIGKILL, point
        if after:
            assert _compact_flag(root) == "1", point  # the kill came before the compaction
            assert_after(root, sp, party)  # the open finished removal and compaction
            with ShareStore(root, party=party) as store:  # and a replay is recognised
                assert store.adopt_unlearning(T + 1, sp["adopted"], job=JOB,
                                              forgotten=FORGOTTEN).replayed
        else:
            recovered = assert_before(root, sp, party)
            assert [p.parent.name for p in recovered] == ["blobs"], point  # the new model
            with ShareStore(root, party=party) as store:  # the adoption can simply run again
                assert not store.adopt_unlearning(T + 1, sp["adopted"], job=JOB,
                                                  forgotten=FORGOTTEN).replayed
            assert_after(root, sp, party)
    # a kill during the compaction at open: the next open compacts again
    root = tmp_path / "twice"
    shutil.copytree(template, root)
    assert _run_writer("adopt", root, seed, party, "adopt-committed") == -signal.SIGKILL
    assert _run_writer("open", root, seed, party, "compact-vacuumed") == -signal.SIGKILL
    assert _compact_flag(root) == "1"
    assert_after(root, sp, party)
    assert _run_writer("adopt", root, seed, party, "none") == 0  # replay in a fresh process


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "writer":
    sys.exit(_writer_main(sys.argv[2:]))
