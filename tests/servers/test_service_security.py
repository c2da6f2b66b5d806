"""Every kind of bad message gets a clear error reply and changes nothing; TLS refuses strangers.

Two real server processes (no dealer: nothing here computes in 2PC). Round 1 expects two
clients; client 0's upload reaches server 0 only and client 1 stays silent, so the deadline
closes the round with client 2 alone: a silent client does not stall a round, and an upload
that reached one server only is dropped.
"""

from __future__ import annotations

import os
import ssl

import msgpack
import numpy as np
import pytest

from clients.service_client import ServiceError
from net import tls
from net.channel import KIND_TENSOR, Channel, HandshakeError
from common.sharing import share
from common import wire
from tests.helpers.service_harness import Deployment

LIMIT = 64 * 1024
HARD_CAP = 256 * 1024


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("sec"), clients=3, overrides={
        # min_clients 1: the deadline closes round 1 with one client (the default cohort is 3)
        "fl": {"rounds": 3, "clients_expected": 2, "round_deadline": 1.0, "min_clients": 1},
        "limits": {"max_message_bytes": LIMIT, "max_frame_bytes": HARD_CAP}})
    try:
        d.start("dealer", ["dealer"])   # the range check of every round runs in 2PC
        d.start_server(1)
        d.start_server(0)
        d.wait_ready()
        yield d
    finally:
        d.close()


def _valid_upload(dim: int, party: int, seed_shares: bool = True) -> dict:
    g = share(np.linspace(-1, 1, dim), compress=True)
    n = share(np.array(np.linalg.norm(np.linspace(-1, 1, dim))), compress=True)
    d = share(np.array(0.5), compress=True)
    if party == 0 and seed_shares:
        return {"update": {"seed": g.seed0}, "norm": {"seed": n.seed0}, "delta": {"seed": d.seed0}}
    pick = (lambda s: s.materialize_share0()) if party == 0 else (lambda s: s.share1)
    return {k: wire.tensor(pick(s)) for k, s in (("update", g), ("norm", n), ("delta", d))}


def _raw(identity_client, msg: dict) -> dict:
    return identity_client.send_raw(msgpack.packb(msg, use_bin_type=True))


def _err(reply: dict) -> str:
    assert reply["ok"] is False, reply
    assert reply["error"]["message"]
    return reply["error"]["code"]


def test_every_kind_of_bad_message_is_refused_and_changes_nothing(dep):
    c0 = dep.client("client-0", 0)
    c1s1 = dep.client("client-1", 1)
    st = c0.call("state")
    dim, r = st["dim"], st["open_round"]
    ok_fields = _valid_upload(dim, 0)
    mid = os.urandom(16)
    base = {"v": 1, "op": "upload", "id": mid, "round": r, "num_samples": 50, "nonce": 10**6, **ok_fields}
    bad = {
        "not msgpack": b"\xc1\xc1\xc1",
        "not a map": msgpack.packb([1, 2, 3]),
        "oversized": msgpack.packb({**base, "pad": b"x" * (LIMIT + 1)}, use_bin_type=True),
        "extension type": msgpack.packb(msgpack.ExtType(5, b"abc")),
    }
    for what, payload in bad.items():
        reply = c0.send_raw(payload)
        assert _err(reply) == ("too_large" if what == "oversized" else "bad_request"), what

    wrong_shape = {**ok_fields, "update": wire.tensor(np.zeros(dim + 1, dtype=np.int64))}
    wrong_dtype = {**ok_fields, "update": wire.tensor(np.zeros(dim, dtype=np.float64))}
    short_data = {**ok_fields, "update": {"dtype": "<i8", "shape": [dim], "data": b"\0" * 8}}
    bad_seed = {**ok_fields, "norm": {"seed": b"short"}}
    same_seed = {**ok_fields, "delta": {"seed": ok_fields["norm"]["seed"]}}
    cases = {
        "version": ({**base, "v": 2}, "version"),
        "no id": ({k: v for k, v in base.items() if k != "id"}, "bad_request"),
        "unknown op": ({**base, "op": "drop_tables"}, "unknown_op"),
        "missing field": ({k: v for k, v in base.items() if k != "num_samples"}, "bad_request"),
        "unknown field": ({**base, "extra": 1}, "bad_request"),
        "wrong type": ({**base, "round": "1"}, "bad_request"),
        "bool as int": ({**base, "num_samples": True}, "bad_request"),
        "out of range": ({**base, "num_samples": 0}, "bad_request"),
        "wrong shape": ({**base, **wrong_shape}, "bad_request"),
        "wrong dtype": ({**base, **wrong_dtype}, "bad_request"),
        "short data": ({**base, **short_data}, "bad_request"),
        "bad seed": ({**base, **bad_seed}, "bad_request"),
        "reused seed": ({**base, **same_seed}, "bad_request"),
        "future round": ({**base, "round": r + 5}, "closed"),
    }
    for what, (msg, code) in cases.items():
        reply = _raw(c0, msg)
        assert _err(reply) == code, (what, reply)
        if msg.get("id") == mid:
            assert reply["id"] == mid, what   # the error answers the request it refuses

    # a seed share to server 1 is refused as well (server 1's share is always the full array)
    reply = _raw(c1s1, {**base, "nonce": 10**6, **_valid_upload(dim, 0)})
    assert _err(reply) == "bad_request" and "server 0" in reply["error"]["message"]
    # a frame of the wrong kind gets an answer, and the connection goes on
    reply = c0.send_raw(b"\0" * 16, kind=KIND_TENSOR)
    assert _err(reply) == "bad_request"

    # nothing was staged, and no refused message advanced the nonce (10**6 was never accepted)
    with dep.client("admin", 0) as admin:
        assert admin.call("status")["staged"] == []
    good = c0.call("upload", round=r, num_samples=50, nonce=5, **ok_fields)
    assert good["stored"] is True
    # replays: the same nonce again, and an older one
    for nonce in (5, 4):
        with pytest.raises(ServiceError) as e:
            c0.call("upload", round=r, num_samples=50, nonce=nonce, **ok_fields)
        assert e.value.code == "replay"
    # a different upload for the same round is a conflict, the identical one is a no-op
    with pytest.raises(ServiceError) as e:
        c0.call("upload", round=r, num_samples=51, **ok_fields)
    assert e.value.code == "conflict"
    assert c0.call("upload", round=r, num_samples=50, **ok_fields)["stored"] is False
    c0.close()
    c1s1.close()


def _close_round_one(dep) -> None:
    """Client 2 uploads to both servers; the deadline closes round 1 without clients 0, 1."""
    import time

    with dep.client("client-2", 0) as a, dep.client("client-2", 1) as b:
        st = a.call("state")
        if st["T"] == 0:
            g = share(np.ones(st["dim"]), compress=True)
            n = share(np.array(np.sqrt(st["dim"])), compress=True)    # ||g||, as the range check wants
            d = share(np.array(0.1), compress=True)
            a.call("upload", round=1, num_samples=40, update={"seed": g.seed0},
                   norm={"seed": n.seed0}, delta={"seed": d.seed0})
            b.call("upload", round=1, num_samples=40, update=wire.tensor(g.share1),
                   norm=wire.tensor(n.share1), delta=wire.tensor(d.share1))
        deadline = time.monotonic() + 30
        while a.call("state")["T"] < 1 or b.call("state")["T"] < 1:
            assert time.monotonic() < deadline, dep.log("server0")
            time.sleep(0.1)   # polling the public state: the round closes at its deadline
        info = a.call("round_info", round=1)
        assert info["participants"] == [2] and info["weights"] == [1.0]


def test_a_client_cannot_unlearn_another_or_read_its_job(dep):
    _close_round_one(dep)
    with dep.client("client-1", 0) as c1, dep.client("client-2", 0) as c2, \
            dep.client("admin", 0) as admin:
        jobs_before = admin.call("status")["jobs"]
        with pytest.raises(ServiceError) as e:
            c1.call("unlearn", job="steal-1", targets=[2])
        assert e.value.code == "unauthorized" and "own data" in e.value.message
        with pytest.raises(ServiceError) as e:     # the admin cannot upload: it is no client
            admin.call("upload", round=2, num_samples=1, **_valid_upload(c2.call("state")["dim"], 0))
        assert e.value.code == "unauthorized"
        with pytest.raises(ServiceError) as e:     # client 1 never took part: nothing to forget
            c1.call("unlearn", job="own-1")
        assert e.value.code == "not_found"
        assert admin.call("status")["jobs"] == jobs_before
        # client 2's own request is accepted (sent to server 0 only, so no 2PC job starts)
        assert c2.call("unlearn", job="mine-2")["state"] == "requested"
        with pytest.raises(ServiceError) as e:     # another's job looks like no job at all
            c1.call("job_status", job="mine-2")
        assert e.value.code == "not_found"
        with pytest.raises(ServiceError) as e2:
            c1.call("job_status", job="no-such-job")
        assert e2.value.code == "not_found"
        assert e.value.message.replace("mine-2", "X") == e2.value.message.replace("no-such-job", "X")
        with pytest.raises(ServiceError) as e:     # only the operator cancels or re-enrols
            c2.call("cancel_job", job="mine-2")
        assert e.value.code == "unauthorized"
        assert c2.call("job_status", job="mine-2")["targets"] == [2]
        assert admin.call("job_status", job="mine-2")["requester"] == "client-2"
        with pytest.raises(ServiceError) as e:     # the same job id with another request
            admin.call("unlearn", job="mine-2", targets=[2])
        assert e.value.code == "conflict"
        # at server 0 only, the request pauses nothing (FL waits once both servers hold it:
        # tests/servers/test_unlearn_agreement.py)
        assert c2.call("state")["paused"] is False
        assert admin.call("cancel_job", job="mine-2")["state"] == "cancelled"
        assert c2.call("job_status", job="mine-2")["state"] == "cancelled"
        assert c2.call("state")["paused"] is False


def test_connections_without_a_valid_certificate_are_refused_at_the_tls_layer(dep, tmp_path):
    addr = dep.cfg.server0.api().address
    keys = dep.cfg.keys_dir

    def ctx_with(cert_dir, name, ca_dir=keys):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cafile=str(ca_dir / "ca.pem"))
        if name is not None:
            ctx.load_cert_chain(str(cert_dir / f"{name}.pem"), str(cert_dir / f"{name}.key"))
        return ctx

    other = tmp_path / "other-ca"
    tls.init_keys(other, clients=1)
    for what, ctx in {
        "no certificate": ctx_with(keys, None),
        "certificate of another CA": ctx_with(other, "client-0"),
        "a server's certificate (not a client)": ctx_with(keys, "server1"),
        "the dealer's certificate": ctx_with(keys, "dealer"),
    }.items():
        with pytest.raises(HandshakeError):
            Channel.connect(addr, ctx, "server0", timeout=10, connect_timeout=5)
        print("refused:", what)
    # and a client refuses a server that is not the one it expects
    with pytest.raises(HandshakeError):
        Channel.connect(addr, tls.client_context(tls.identity(keys, "client-0")), "server1",
                        timeout=10, connect_timeout=5)


def test_a_frame_above_the_hard_cap_ends_only_that_connection(dep):
    from net.channel import ChannelError

    c = dep.client("client-1", 0)
    with pytest.raises(ChannelError):   # the server's reader refuses to allocate it and hangs up
        c.send_raw(b"\0" * (HARD_CAP + 1))
    c.close()
    with dep.client("client-1", 0) as again:
        assert again.call("state")["party"] == 0
