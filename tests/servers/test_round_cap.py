"""A round closes with at most ``clients_expected`` uploads, so N stays in range (issue 25, 4).

Against real daemons on loopback: three clients stage uploads at the per-upload sample cap
(max_total_samples / clients_expected, clients_expected = 2) at both servers while the two
servers cannot reach each other (each staged alone, in turn), so the leader sees all three at
its first look. Before, it closed with all three: N = 3 x cap exceeded max_total_samples and
server 1 refused every close. Now it closes with the two staged first at server 0 and drops
the third upload; both servers commit the round.
"""

from __future__ import annotations

import time

from servers.secure.ring_aggregation import max_total_samples
from tests.helpers.service_harness import Deployment
from tests.servers.test_service_abuse import _split, _upload


def test_a_round_closes_with_at_most_clients_expected_uploads(tmp_path):
    dep = Deployment(tmp_path, clients=3, overrides={"fl": {"rounds": 2, "clients_expected": 2}})
    cap = max_total_samples(16) // 2
    try:
        dep.start("dealer", ["dealer"])
        order = [2, 0, 1]                   # staging order at server 0: 2 first, then 0, then 1
        for p in (1, 0):                    # each server alone: no round can close meanwhile
            dep.start_server(p)
            dep.wait_ready((p,))
            for j in order:
                with dep.client(f"client-{j}", p) as c:
                    dim = c.call("state")["dim"]
                    _upload(c, p, 1, cap, dim, _SPLITS.setdefault(j, _split(dim)))
                    time.sleep(0.05)        # distinct staging times
            if p == 1:
                dep.procs.stop("server1")
        t0 = time.monotonic()
        dep.start_server(1)
        dep.wait_ready()
        with dep.client("admin", 0) as a0, dep.client("admin", 1) as a1:
            while a0.call("state")["T"] < 1 or a1.call("state")["T"] < 1:
                assert time.monotonic() - t0 < 60, dep.log("server0") + dep.log("server1")
                time.sleep(0.1)
            infos = [a.call("round_info", round=1) for a in (a0, a1)]
        n_total = sum(infos[0]["num_samples"])
        print(f"\nround 1 closed {time.monotonic() - t0:.1f} s after both servers were up, with "
              f"clients {infos[0]['participants']}, N = {n_total} (max {max_total_samples(16)})")
        for info in infos:
            assert info["participants"] == [0, 2]          # the first two staged at server 0
        assert n_total <= max_total_samples(16)
    finally:
        dep.close()


_SPLITS: dict = {}
