"""One client cannot halt training, take the FedAvg weight, flood a server or queue jobs (issue 14).

Against real daemons on loopback: an upload claiming more samples than the deployment's cap
is refused at the door (it used to be staged and make server 1 refuse every round close,
forever); the operator can list and drop staged uploads; a client sending faster than its
token bucket gets ``rate_limited`` while another client is served; a client gets a bounded
number of unlearning requests waiting for the other server, and a cool-down after one ended
without adoption.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from clients.service_client import ServiceError
from common import wire
from common.sharing import share
from servers.daemon.rate_limits import TokenBucket
from servers.secure.ring_aggregation import max_total_samples
from tests.helpers.service_harness import Deployment

BURST, RATE = 20, 5.0


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("abuse"), clients=4, overrides={
        # min_clients 1: rounds close at the deadline with one client (the default cohort is 3)
        "fl": {"rounds": 3, "clients_expected": 2, "round_deadline": 1.0, "min_clients": 1},
        "limits": {"request_burst": BURST, "requests_per_second": RATE}})
    try:
        d.start("dealer", ["dealer"])   # the range check of every round runs in 2PC
        d.start_server(1)
        d.start_server(0)
        d.wait_ready()
        yield d
    finally:
        d.close()


def _split(dim: int) -> tuple:
    """One honest upload's shares (the same split must go to both servers)."""
    g = np.linspace(-1, 1, dim)    # the range check also compares ||g|| with the reported norm
    return (share(g, compress=True), share(np.array(np.linalg.norm(g)), compress=True),
            share(np.array(0.5), compress=True))


def _upload(c, party: int, r: int, n: int, dim: int, split: tuple | None = None) -> dict:
    g, nn, dd = split or _split(dim)
    if party == 0:
        fields = {"update": {"seed": g.seed0}, "norm": {"seed": nn.seed0}, "delta": {"seed": dd.seed0}}
    else:
        fields = {k: wire.tensor(s.share1) for k, s in (("update", g), ("norm", nn), ("delta", dd))}
    return c.call("upload", round=r, num_samples=n, **fields)


def test_token_bucket_allows_the_burst_then_the_rate():
    now = [0.0]
    b = TokenBucket(2.0, 3, clock=lambda: now[0])
    assert [b.take() for _ in range(4)] == [True, True, True, False]
    now[0] += 0.5                       # one token back at 2 per second
    assert [b.take(), b.take()] == [True, False]
    now[0] += 100.0                     # never more than the burst
    assert sum(b.take() for _ in range(10)) == 3


def test_sample_counts_above_the_cap_are_refused_and_staged_uploads_can_be_dropped(dep):
    cap = max_total_samples(16) // 2            # clients_expected = 2, nothing configured
    with dep.client("client-3", 0) as c, dep.client("admin", 0) as admin:
        dim = c.call("state")["dim"]
        with pytest.raises(ServiceError) as e:
            _upload(c, 0, 1, 200_000, dim)
        assert e.value.code == "bad_request" and f"cap of {cap}" in e.value.message
        with pytest.raises(ServiceError) as e:
            _upload(c, 0, 1, cap + 1, dim)
        assert e.value.code == "bad_request"
        assert _upload(c, 0, 1, cap, dim)["stored"] is True
        rows = admin.call("staged")["uploads"]
        assert [(r["client"], r["num_samples"]) for r in rows] == [(3, cap)]
        with pytest.raises(ServiceError) as e:          # bookkeeping is for the operator
            c.call("staged")
        assert e.value.code == "unauthorized"
        assert admin.call("drop_staged", client=3)["dropped"] == [3]
        assert admin.call("staged")["uploads"] == []
        with pytest.raises(ServiceError) as e:
            admin.call("drop_staged", client=3)
        assert e.value.code == "not_found"


def test_a_fast_client_is_throttled_and_another_is_not(dep):
    with dep.client("client-0", 0) as fast, dep.client("client-1", 0) as calm:
        codes = []
        for _ in range(BURST + 15):
            try:
                fast.call("state")
                codes.append("ok")
            except ServiceError as exc:
                codes.append(exc.code)
        assert codes[:BURST] == ["ok"] * BURST and "rate_limited" in codes[BURST:]
        assert calm.call("state")["party"] == 0
        time.sleep(2.0 / RATE)                           # the bucket refills
        assert fast.call("state")["party"] == 0


def test_a_client_has_one_pending_job_at_a_time(dep):
    with dep.client("client-2", 0) as c, dep.client("client-2", 1) as c1, dep.client("admin", 0) as admin:
        dim = c.call("state")["dim"]
        if c.call("state")["T"] == 0:   # client 2 must have taken part in a committed round
            split = _split(dim)
            _upload(c, 0, 1, 10, dim, split)
            _upload(c1, 1, 1, 10, dim, split)
            deadline = time.monotonic() + 30
            while c.call("state")["T"] < 1 or c1.call("state")["T"] < 1:
                assert time.monotonic() < deadline, dep.log("server0")
                time.sleep(0.2)
        # sent to server 0 only: recorded as `requested`, no run, FL not paused (issue 25, 2)
        assert c.call("unlearn", job="first-2")["state"] == "requested"
        assert c.call("unlearn", job="first-2")["state"] == "requested"   # a replay is no new job
        for k in range(2, 5):           # at most MAX_REQUESTED = 4 waiting for the other server
            assert c.call("unlearn", job=f"req-{k}")["state"] == "requested"
        with pytest.raises(ServiceError) as e:
            c.call("unlearn", job="second-2")
        assert e.value.code == "rate_limited" and "first-2" in e.value.message
        assert not c.call("state")["paused"]
        for job in ("first-2", "req-2", "req-3", "req-4"):
            assert admin.call("cancel_job", job=job)["state"] == "cancelled"
        with pytest.raises(ServiceError) as e:    # ended without adoption: the client's cool-down
            c.call("unlearn", job="second-2")
        assert e.value.code == "rate_limited" and "request_cooldown" in e.value.message
        assert c.call("unlearn", job="first-2")["state"] == "cancelled"   # a replay is answered

def test_private_files_of_a_running_server_are_private(dep):
    for p in (0, 1):
        data = dep.cfg.data_dir(p)
        assert (data / "ready.json").stat().st_mode & 0o777 == 0o600
        assert data.stat().st_mode & 0o777 == 0o700
        assert (data / "service.sqlite3").stat().st_mode & 0o077 == 0


def test_an_upload_out_of_range_is_left_out_and_the_round_closes_without_it(dep):
    """Shares adding up to 2**62 per coordinate (each share alone uniform) used to be
    aggregated: the model's largest weight went to 2.1e13. Now the 2PC range check opens
    one bit for that client, the round closes with the honest client only, and says so."""
    rng = np.random.default_rng(5)
    with dep.client("client-1", 0) as a1, dep.client("client-1", 1) as b1, \
            dep.client("client-3", 0) as a3, dep.client("client-3", 1) as b3:
        st = a1.call("state")
        r, dim = st["T"] + 1, st["dim"]
        before = wire.decode_tensor(a1.call("get_model")["model"], "model", ("<f8",), (dim,))
        g, nn, dd = _split(dim)                                 # honest: one split, both shares
        a1.call("upload", round=r, num_samples=10, update={"seed": g.seed0}, norm={"seed": nn.seed0},
                delta={"seed": dd.seed0})
        b1.call("upload", round=r, num_samples=10, update=wire.tensor(g.share1),
                norm=wire.tensor(nn.share1), delta=wire.tensor(dd.share1))
        evil0 = rng.integers(-2**63, 2**63 - 1, size=dim, dtype=np.int64)
        evil1 = (np.full(dim, 2**62, dtype=np.int64) - evil0)   # wraps: sum = 2**62 per coordinate
        n0, d0 = share(np.array(1.0)), share(np.array(0.1))
        a3.call("upload", round=r, num_samples=10, update=wire.tensor(evil0),
                norm=wire.tensor(n0.share0), delta=wire.tensor(d0.share0))
        b3.call("upload", round=r, num_samples=10, update=wire.tensor(evil1),
                norm=wire.tensor(n0.share1), delta=wire.tensor(d0.share1))
        deadline = time.monotonic() + 60
        while a1.call("state")["T"] < r or b1.call("state")["T"] < r:
            assert time.monotonic() < deadline, dep.log("server0") + dep.log("server1")
            time.sleep(0.2)
        info = a1.call("round_info", round=r)
        assert info["participants"] == [1] and info["refused"] == [3]
        after = wire.decode_tensor(a1.call("get_model")["model"], "model", ("<f8",), (dim,))
        assert np.abs(after - before).max() < 10.0    # no 2**62-sized step


def test_a_far_future_nonce_and_a_float_version_are_refused_by_the_daemon(dep):
    """A nonce of 2**63-1 used to be accepted and lock the identity out for good; a version
    of 1.0 passed as 1."""
    with dep.client("client-3", 1) as c:
        msg = {"v": 1, "op": "unlearn", "id": b"\x01" * 16, "job": "far-future", "nonce": 2**63 - 1}
        reply = c.send_raw(msgpack.packb(msg, use_bin_type=True))
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert "ahead of this server's clock" in reply["error"]["message"]
        reply = c.send_raw(msgpack.packb({"v": 1.0, "op": "state", "id": b"\x02" * 16}, use_bin_type=True))
        assert reply["ok"] is False and reply["error"]["code"] == "version"
        with pytest.raises(ServiceError) as e:     # a normal nonce still passes the replay check:
            c.call("unlearn", job="after-far-future")
        assert e.value.code == "not_found"       # (client 3 took part in no round), not "replay"
