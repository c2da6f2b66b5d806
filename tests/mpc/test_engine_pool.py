"""The two-party engine pool (``mpc.engine_pool.EnginePool``): one engine per peer pair across
sessions, a dead peer noticed fast, a fresh engine for the next session.

Both parties run one program (``run_parties`` with the test-only TFP provider, so that the
session itself starts no engine) and play several "sessions" on its channel, each borrowing the
engine from a pool of its own process, as a daemon's sessions do (``mpc.session.open_party(
engine_pool=...)``):

1. the first session starts an engine; the second reuses it (same process, no new start);
2. in the second session party 1's engine process is killed while both are inside a long
   engine call: party 1's call fails at once (its pipe closes), party 0's within seconds (its
   relay sees the peer close the link), far below the session's timeout;
3. the third session starts fresh engines on both sides and computes correctly; the fourth
   reuses those.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from mpc.launcher import PartyError, run_parties
from tests.helpers.ring_shares import HI, LO, recon, split

pytestmark = pytest.mark.timeout(600)

TIMEOUT = 60.0           # the sessions' timeout: a call would wait 4x this for a silent engine
BIG = 3 << 20            # elements of the call that is interrupted (several engine runs)


def _sign(engine, x0, x1, rank):
    return engine.nonnegative(np.asarray(x0 if rank == 0 else x1, dtype=np.int64))


def pool_program(party, x0, x1):
    from mpc.engine_pool import EnginePool
    from mpc.spu_engine import EngineError

    pool = EnginePool()
    rank = party.rank
    out: dict = {"sessions": []}
    try:
        # 1. a first session starts the engine
        e = pool.engine(rank, party.channel, party.metering, timeout=TIMEOUT)
        out["sessions"].append({"pid": e.pid, "share": _sign(e, x0, x1, rank), "started": pool.started})
        e.close()
        # 2. the second borrows it; party 1's engine is killed inside a long call
        t0 = time.monotonic()
        e = pool.engine(rank, party.channel, party.metering, timeout=TIMEOUT)
        acquire = time.monotonic() - t0
        rec = {"pid": e.pid, "started": pool.started, "acquire_s": acquire}
        if rank == 1:
            pid = e.pid
            threading.Timer(3.0, lambda: os.kill(pid, signal.SIGKILL)).start()
        big = np.random.default_rng(rank).integers(LO, HI, BIG, dtype=np.int64, endpoint=True)
        t0 = time.monotonic()
        try:
            e.nonnegative(big)
            rec["failed"] = None
        except EngineError as exc:
            rec["failed"] = str(exc)
        rec["fail_s"] = time.monotonic() - t0
        e.close()
        out["sessions"].append(rec)
        # 3. the next session makes fresh engines and computes; 4. the one after reuses them
        for _ in range(2):
            e = pool.engine(rank, party.channel, party.metering, timeout=TIMEOUT)
            out["sessions"].append({"pid": e.pid, "share": _sign(e, x0, x1, rank), "started": pool.started})
            e.close()
    finally:
        pool.close()
    return out


@pytest.fixture(scope="module")
def runs():
    rng = np.random.default_rng(26)
    x = np.array([0, 1, -1, 2**62, -(2**62), HI, LO] + rng.integers(LO, HI, 40, dtype=np.int64).tolist(),
                 dtype=np.int64)
    x0, x1 = split(x, "uniform", rng)
    try:
        res = run_parties(pool_program, x0, x1, insecure_tfp=True, timeout=TIMEOUT * 5)
    except PartyError as exc:
        pytest.fail(f"{exc}\n" + "\n".join(f"--- party {r}:\n{m}" for r, m in sorted(exc.errors.items())))
    return x, res.values


def test_a_second_session_reuses_the_engine(runs):
    _, (p0, p1) = runs
    for p in (p0, p1):
        first, second = p["sessions"][0], p["sessions"][1]
        assert first["started"] == second["started"] == 1
        assert second["pid"] == first["pid"]
        assert second["acquire_s"] < 15.0, second   # an offer, an answer and a barrier, no start


def test_a_killed_peer_engine_fails_the_session_fast(runs):
    _, (p0, p1) = runs
    killed, observer = p1["sessions"][1], p0["sessions"][1]
    assert killed["failed"] and "ended" in killed["failed"], killed
    # the observer's engine either reports the peer gone or, when the library crashes on the
    # dropped link before the relay notices (seen on CI: exit code -11), ends: both are failures
    assert observer["failed"] and ("gone" in observer["failed"] or "ended" in observer["failed"]), observer
    # the kill lands 3 s into the call; the observer notices within the grace, not at 4 x TIMEOUT
    assert observer["fail_s"] < 3.0 + 15.0, observer
    assert killed["fail_s"] < 3.0 + 10.0, killed


def test_the_next_session_starts_fresh_engines_and_computes(runs):
    x, (p0, p1) = runs
    want = (x >= 0).astype(np.int64)
    for k in (0, 2, 3):
        assert np.array_equal(recon(p0["sessions"][k]["share"], p1["sessions"][k]["share"]), want), k
    for p in (p0, p1):
        third, fourth = p["sessions"][2], p["sessions"][3]
        assert third["started"] == 2 and third["pid"] != p["sessions"][0]["pid"]
        assert fourth["started"] == 2 and fourth["pid"] == third["pid"]


def orphan_program(party, path):
    """Party 1 records its pooled engine's process id and dies (SIGKILL: no atexit, no pool
    close) 3 s into a long engine call, so that its engine is busy inside the library and does
    not read the pipe's end; party 0's call then fails (its peer is gone)."""
    from mpc.engine_pool import EnginePool
    from mpc.spu_engine import EngineError

    pool = EnginePool()
    e = pool.engine(party.rank, party.channel, party.metering, timeout=TIMEOUT)
    if party.rank == 1:
        with open(path, "w") as f:
            f.write(str(e.pid))
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        e.nonnegative(np.random.default_rng(party.rank).integers(LO, HI, BIG, dtype=np.int64, endpoint=True))
    except EngineError:
        pass
    pool.close()
    return None


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_an_engine_whose_server_died_ends_itself(tmp_path):
    """A daemon killed outright, its engine inside a call, leaves no engine behind: the engine
    watches its parent (else the library would wait for the peer up to the pooled link's hour)."""
    path = tmp_path / "pid"
    with pytest.raises(PartyError):
        run_parties(orphan_program, str(path), insecure_tfp=True, timeout=TIMEOUT * 3)
    pid = int(path.read_text())
    deadline = time.monotonic() + 15
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid), f"engine {pid} outlived its server"


def test_a_process_that_ends_with_an_engine_in_its_pool_ends_at_once():
    """A multiprocessing child (a benchmark's coordinator, a test's party) returns with an engine
    still in its shared pool: the pool is closed by multiprocessing's own exit function before it
    joins the child's children, so the process ends in seconds (before, the pool was closed only
    by atexit, which such a process never runs, and it joined its engine forever)."""
    import multiprocessing as mp

    from tests.helpers.pool_exit import end_with_an_engine_in_the_pool

    p = mp.get_context("spawn").Process(target=end_with_an_engine_in_the_pool)
    p.start()
    p.join(60)
    try:
        assert not p.is_alive() and p.exitcode == 0, "the process waited for its engine's process"
    finally:
        if p.is_alive():
            p.kill()
