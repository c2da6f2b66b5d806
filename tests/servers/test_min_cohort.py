"""A round closes only with at least ``fl.min_clients`` participants (issue 25, finding 5).

Why: a round's public step M_(i-1) - M_i = eta sum_j w_j g_j is a client's update when it is
alone in the round (after its erasure, (M_(i-1) - M_i) / eta still gives it), and the other
participant's when two are. The default cohort is 3; against real daemons on loopback a round
with 2 uploads at both servers outlives its deadline, and closes when the third arrives; and a
client refused by the range check, which lowers the expected count to 2, does not let 2 close it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from common import wire
from common.service_config import ConfigError, FLSection, load_config, write_scratch_deployment
from tests.helpers.service_harness import Deployment
from common.sharing import share
from tests.servers.test_service_abuse import _split, _upload

DEADLINE = 1.0


def test_the_default_cohort_is_three_and_small_deployments_say_theirs(tmp_path):
    assert FLSection.min_clients == 3
    assert load_config(write_scratch_deployment(tmp_path / "a", clients=5)).fl.min_clients == 3
    # a scratch deployment of fewer clients needs every one of them in a round
    assert load_config(write_scratch_deployment(tmp_path / "b", clients=2)).fl.min_clients == 2
    one = write_scratch_deployment(tmp_path / "c", clients=2, overrides={"fl": {"min_clients": 1}})
    assert load_config(one).fl.min_clients == 1
    # a hand-written file of 2 expected clients without min_clients gets the default 3: refused
    text = one.read_text().replace("min_clients = 1\n", "")
    one.write_text(text)
    with pytest.raises(ConfigError, match="min_clients"):
        load_config(one)


def test_two_uploads_wait_past_the_deadline_and_the_third_closes_the_round(tmp_path):
    dep = Deployment(tmp_path, clients=3, overrides={"fl": {
        "rounds": 2, "round_deadline": DEADLINE, "range_check": False}})
    assert dep.cfg.fl.min_clients == 3 and dep.cfg.fl.clients_expected == 3
    try:
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        splits: dict = {}
        with dep.client("admin", 0) as a0, dep.client("admin", 1) as a1:
            def upload(j: int) -> None:
                for p in (0, 1):
                    with dep.client(f"client-{j}", p) as c:
                        dim = c.call("state")["dim"]
                        _upload(c, p, 1, 10, dim, splits.setdefault(j, _split(dim)))

            upload(0)
            upload(1)
            t0 = time.monotonic()
            # four deadlines: each one passes with 2 < 3 clients and restarts
            while time.monotonic() - t0 < 4 * DEADLINE + 1.0:
                assert a0.call("state")["T"] == 0 and a1.call("state")["T"] == 0, dep.log("server0")
                time.sleep(0.2)
            waited = time.monotonic() - t0
            assert "deadline passed with 2 clients at both servers (< 3)" in dep.log("server0", 200)
            upload(2)
            t1 = time.monotonic()
            while a0.call("state")["T"] < 1 or a1.call("state")["T"] < 1:
                assert time.monotonic() - t1 < 30, dep.log("server0") + dep.log("server1")
                time.sleep(0.1)
            closed = time.monotonic() - t1
            infos = [a.call("round_info", round=1) for a in (a0, a1)]
        print(f"\n2 uploads: round 1 still open {waited:.1f} s after they were in "
              f"(deadline {DEADLINE} s); the third closed it {closed:.2f} s later")
        for info in infos:
            assert info["participants"] == [0, 1, 2]
    finally:
        dep.close()


def test_a_refused_upload_does_not_shrink_the_round_below_the_cohort(tmp_path):
    """Refused (and forgotten) clients lower the count a round closes early at; before, with
    clients_expected = 3 and one upload out of range, the 2 honest ones closed the round at once."""
    dep = Deployment(tmp_path, clients=4, overrides={"fl": {"rounds": 2, "clients_expected": 3}})
    assert dep.cfg.fl.min_clients == 3 and dep.cfg.fl.round_deadline >= 60
    try:
        dep.start("dealer", ["dealer"])     # the 2PC range check
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        rng = np.random.default_rng(7)
        with dep.client("admin", 0) as a0, dep.client("admin", 1) as a1:
            dim = a0.call("state")["dim"]
            splits = {j: _split(dim) for j in (0, 1, 2)}
            for j in (0, 1):
                for p in (0, 1):
                    with dep.client(f"client-{j}", p) as c:
                        _upload(c, p, 1, 10, dim, splits[j])
            evil0 = rng.integers(-2**63, 2**63 - 1, size=dim, dtype=np.int64)
            evil1 = np.full(dim, 2**62, dtype=np.int64) - evil0   # 2**62 per coordinate
            n, d = share(np.array(1.0)), share(np.array(0.1))
            for p, ev in ((0, evil0), (1, evil1)):
                with dep.client("client-3", p) as c:
                    c.call("upload", round=1, num_samples=10, update=wire.tensor(ev),
                           norm=wire.tensor(n.share0 if p == 0 else n.share1),
                           delta=wire.tensor(d.share0 if p == 0 else d.share1))
            t0 = time.monotonic()
            while "failed the range check" not in dep.log("server0", 200):
                assert time.monotonic() - t0 < 60, dep.log("server0")
                time.sleep(0.2)
            time.sleep(2.0)                   # the leader decides again, without client 3
            assert a0.call("state")["T"] == 0 and a1.call("state")["T"] == 0, dep.log("server0")
            for p in (0, 1):
                with dep.client("client-2", p) as c:
                    _upload(c, p, 1, 10, dim, splits[2])
            t1 = time.monotonic()
            while a0.call("state")["T"] < 1 or a1.call("state")["T"] < 1:
                assert time.monotonic() - t1 < 60, dep.log("server0") + dep.log("server1")
                time.sleep(0.1)
            info = a0.call("round_info", round=1)
        assert info["participants"] == [0, 1, 2] and info["refused"] == [3]
    finally:
        dep.close()
