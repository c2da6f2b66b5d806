"""An unlearning request pauses FL only once both servers hold it (issue 25, finding 2).

Against real daemons on loopback (3 clients, the test drives FL with synthetic uploads; no range
check, so a round costs only its uploads and the close): FL rounds per minute are measured
without any request, then while client 2's ``unlearn`` sits at server 0 only (before: FL paused
on both servers until ``agree_timeout``; uploads got ``paused``). Then client 2 sends a burst of
requests to both servers in opposite orders (before: server 0 kept the first, server 1 another,
and both failed after ``agree_timeout``): the servers agree on one job, which both hold, and drop
the others they both hold as superseded at both (which one wins depends on the arrival order:
the leader agrees the first request it sees at both).
"""

from __future__ import annotations

import time

import pytest

from clients.service_client import ServiceError
from tests.helpers.service_harness import Deployment
from tests.servers.test_service_abuse import _split, _upload

WINDOW = 5.0   # seconds of FL per measurement


def _fl_round(clients, r: int, ids, dim: int) -> None:
    for j in ids:
        split = _split(dim)
        for p in (0, 1):
            _upload(clients[j][p], p, r, 10, dim, split)


def _wait_T(admins, r: int, dep, limit: float = 30.0) -> None:
    t0 = time.monotonic()
    while any(a.call("state")["T"] < r for a in admins):
        assert time.monotonic() - t0 < limit, dep.log("server0") + dep.log("server1")
        # 20 polls a second per server: the admin's token bucket allows 50 (a faster poll was
        # refused as rate_limited on a quiet machine, where rounds close quickly)
        time.sleep(0.05)


def _rounds_in(window: float, clients, admins, dep, dim: int) -> int:
    """FL rounds closed at both servers in ``window`` seconds (clients 0 and 1 upload each)."""
    t_end = time.monotonic() + window
    done = 0
    while time.monotonic() < t_end:
        r = admins[0].call("state")["T"] + 1
        _fl_round(clients, r, (0, 1), dim)
        _wait_T(admins, r, dep)
        done += 1
    return done


def test_a_half_sent_request_does_not_pause_fl_and_a_split_burst_ends_as_one_job(tmp_path):
    dep = Deployment(tmp_path, clients=3, overrides={
        "fl": {"rounds": 1000, "clients_expected": 2, "min_clients": 2, "round_deadline": 30.0,
               "range_check": False},
        "unlearning": {"agree_timeout": 30.0, "correction_timeout": 2.0}})
    clients: dict = {}
    admins: list = []
    try:
        dep.start("dealer", ["dealer"])
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        for j in range(3):
            clients[j] = [dep.client(f"client-{j}", p) for p in (0, 1)]
        admins = [dep.client("admin", p) for p in (0, 1)]
        dim = admins[0].call("state")["dim"]
        _fl_round(clients, 1, (0, 2), dim)      # client 2 takes part once: it may ask to be forgotten
        _wait_T(admins, 1, dep)

        before = _rounds_in(WINDOW, clients, admins, dep, dim)
        assert clients[2][0].call("unlearn", job="half-2")["state"] == "requested"   # server 0 only
        during = _rounds_in(WINDOW, clients, admins, dep, dim)   # an upload refused `paused` fails here
        assert not any(a.call("state")["paused"] for a in admins)
        print(f"\nFL rounds per minute: {60 * before / WINDOW:.0f} without a request, "
              f"{60 * during / WINDOW:.0f} while client 2's request is at server 0 only")
        assert during >= 0.5 * before and during >= 5

        burst = [f"burst-{k}" for k in range(4)]
        answers = {0: {}, 1: {}}
        for p, order in ((0, burst), (1, burst[::-1])):
            for job in order:
                try:
                    answers[p][job] = clients[2][p].call("unlearn", job=job)["state"]
                except ServiceError as exc:   # server 0 already holds half-2: at most 4 waiting
                    answers[p][job] = exc.code
        print(f"burst answers: {answers}")
        t0 = time.monotonic()
        while True:
            jobs = [{j["job"]: j for j in a.call("status")["jobs"]} for a in admins]
            agreed = [sorted(k for k, j in js.items() if k.startswith("burst")
                             and j["state"] not in ("requested", "failed")) for js in jobs]
            both = set(jobs[0]) & set(jobs[1])
            others = sorted(k for k in both if k.startswith("burst") and k not in agreed[0])
            settled = all(js[k]["state"] == "failed" and js[k]["error"].startswith("superseded")
                          for k in others for js in jobs)
            if len(agreed[0]) == 1 and agreed[0] == agreed[1] and settled:
                break
            assert time.monotonic() - t0 < 15, (jobs, dep.log("server0"))
            time.sleep(0.1)
        print(f"split burst: {time.monotonic() - t0:.1f} s to one job at both servers: {agreed[0]} "
              f"(superseded at both: {others})")
        # the agreed job counts against the client's quota at both servers
        for p in (0, 1):
            with pytest.raises(ServiceError) as e:
                clients[2][p].call("unlearn", job="another-2")
            assert e.value.code in ("rate_limited", "forgotten")
    finally:
        for c in [c for cs in clients.values() for c in cs] + admins:
            c.close()
        dep.close()
