"""SIGKILL a server during an upload and during aggregation; restart it; training resumes.

The servers kill themselves at named points of their write path (``STARFISH_CRASH_AT``,
see ``servers/store/crash_points.py``), so each crash hits exactly the moment it is meant to:

* server 1 inside the SQLite transaction that stages a client's upload (an upload in
  flight: the client sees its connection die and retries after the restart);
* server 0 after server 1 committed a round and before server 0 did (aggregation: the
  shares were exchanged, one history has the round, the other not yet);
* server 1 inside the transaction that commits a round (aggregation on the other side).

The test restarts each killed server (without the crash point) and lets the simulated
clients run to the end. Then every round 1..T is in both histories exactly once, with the
same public content, all participants, and every model is plaintext FedAvg of the one
upload each client made per round (so no round was lost, duplicated or mixed up).
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np

from servers.store.share_store import ShareStore
from tests.helpers.service_harness import Deployment

N, ROUNDS = 3, 6
#: per server: the crash point of each successive run (None: run to the end)
PLAN = {1: ["staged-in-transaction:5", "round-in-transaction:2", None],
        0: ["leader-before-commit:3", None]}


def test_sigkill_during_upload_and_aggregation_loses_and_duplicates_nothing(tmp_path):
    dep = Deployment(tmp_path, clients=N, overrides={"fl": {"rounds": ROUNDS, "round_deadline": 120.0}})
    runs = {p: list(PLAN[p]) for p in (0, 1)}
    kills = {0: 0, 1: 0}
    try:
        dep.start("dealer", ["dealer"])   # every round's range check runs in 2PC
        for p in (1, 0):
            dep.start_server(p, runs[p].pop(0))
        dep.wait_ready()
        clients = dep.start("clients", ["clients", "--n", str(N), "--summary", str(tmp_path / "s.json"),
                                        "--twin-dir", str(tmp_path / "twin"), "--max-seconds", "150"])
        deadline = time.monotonic() + 170
        while clients.poll() is None:
            assert time.monotonic() < deadline, dep.log("clients") + dep.log("server0") + dep.log("server1")
            for p in (0, 1):
                rc = dep.procs.procs[f"server{p}"].poll()
                if rc is None:
                    continue
                assert rc == -signal.SIGKILL, f"server{p} exited with {rc}:\n{dep.log(f'server{p}')}"
                assert runs[p], f"server{p} was killed more often than planned"
                kills[p] += 1
                dep.start_server(p, runs[p].pop(0))
            time.sleep(0.1)  # process exits are polled; nothing else to wait on
        assert clients.returncode == 0, dep.log("clients")
        logs = {p: (tmp_path / "logs" / f"server{p}.log").read_text() for p in (0, 1)}
    finally:
        dep.close()

    assert kills == {0: 1, 1: 2}, kills
    assert "SIGKILL at staged-in-transaction" in logs[1] and "SIGKILL at round-in-transaction" in logs[1]
    assert "SIGKILL at leader-before-commit" in logs[0]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["T"] == ROUNDS and summary["rounds_uploaded"] == ROUNDS
    assert summary["fedavg_max_abs_error"] < 1e-4
    stores = [ShareStore(dep.cfg.data_dir(p) / "store", party=p) for p in (0, 1)]
    try:
        for st in stores:
            assert st.num_rounds == ROUNDS
            assert st.verify() == []
            assert st.staged(ROUNDS + 1) == ()
        for i in range(1, ROUNDS + 1):
            a, b = (st.round_info(i) for st in stores)
            assert a.participants == b.participants == tuple(range(N))
            assert dict(a.weights) == dict(b.weights) and a.model_digest == b.model_digest
            assert np.array_equal(stores[0].model(i), stores[1].model(i))
    finally:
        for st in stores:
            st.close()
