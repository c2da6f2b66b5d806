"""Correlated randomness: the dealer's corrections make correct, hidden correlations."""

import numpy as np
import pytest
import torch

from mpc import correlations as C
from common.prg import new_seed

S0, S1 = new_seed(), new_seed()


def _both(req, index=5):
    p0 = C.party0_shares(req, S0, index)
    p1 = C.party1_shares(req, S1, index, C.correction(req, S0, S1, index))
    return p0, p1


def test_arithmetic_triple_mul_and_matmul():
    for req in (C.make_request("triple", (7,), (7,), "mul"),
                C.make_request("triple", (3, 1), (1, 4), "mul"),
                C.make_request("triple", (3, 5), (5, 2), "matmul")):
        (a0, b0, c0), (a1, b1, c1) = _both(req)
        a, b, c = a0 + a1, b0 + b1, c0 + c1
        op = torch.mul if req[3] == "mul" else torch.matmul
        assert torch.equal(c, op(a, b))


def test_square_binary_triple_b2a_and_wraps():
    (r0, s0), (r1, s1) = _both(C.make_request("square", (9,)))
    assert torch.equal(s0 + s1, (r0 + r1) * (r0 + r1))
    (a0, b0, c0), (a1, b1, c1) = _both(C.make_request("binary_triple", (6,), (6,)))
    assert torch.equal(c0 ^ c1, (a0 ^ a1) & (b0 ^ b1))
    (ra0, rb0), (ra1, rb1) = _both(C.make_request("b2a_rng", (1000,)))
    bit = rb0 ^ rb1
    assert set(bit.unique().tolist()) == {0, 1} and torch.equal(ra0 + ra1, bit)
    (r0, t0), (r1, t1) = _both(C.make_request("wrap_rng", (1000,)))
    exact = r0.numpy().astype(object) + r1.numpy().astype(object)
    wraps = np.array([(v - ((v + 2**63) % 2**64 - 2**63)) // 2**64 for v in exact], dtype=np.int64)
    assert np.array_equal((t0 + t1).numpy(), wraps)


def test_streams_differ_between_requests_and_seeds():
    req = C.make_request("triple", (64,), (64,), "mul")
    assert not torch.equal(C.party0_shares(req, S0, 1)[0], C.party0_shares(req, S0, 2)[0])
    assert not torch.equal(C.party0_shares(req, S0, 1)[0], C.party1_free_shares(req, S0, 1)[0]) or S0 != S1


@pytest.mark.parametrize("bad", [
    ["triple", [3], [3], "exec", [], []],
    ["nonsense", [3]],
    "triple",
    ["square", [-1]],
    ["square", [1 << 20, 1 << 20]],
])
def test_malformed_requests_are_rejected(bad):
    with pytest.raises((C.RequestError, TypeError, ValueError)):
        C.validate(bad)


@pytest.mark.parametrize("s0,s1", [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((5, 2, 3), (3, 4)),
                                   ((1, 2, 3), (4, 3, 5)), ((2, 3), (3, 4))])
def test_matmul_result_shape_matches_torch(s0, s1):
    expected = torch.matmul(torch.zeros(s0), torch.zeros(s1)).shape
    assert C.correction_shape(C.make_request("triple", s0, s1, "matmul")) == tuple(expected)


def _dealer():
    import threading

    from net import tls
    from mpc.dealer import DealerServer
    from mpc.launcher import ephemeral_keys

    keys = ephemeral_keys()
    server = DealerServer(tls.identity(keys, tls.DEALER_NAME))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return keys, server


def _link(keys, server, cert_name, rank, session):
    from net import tls
    from net.channel import Channel
    from mpc.dealer import DealerLink

    ch = Channel.connect(server.address, tls.client_context(tls.identity(keys, cert_name)), tls.DEALER_NAME,
                         kind="offline", timeout=10)
    return DealerLink(ch, rank, session)


def _assert_a_triple(p0, p1, n):
    """The two links' seeds and party 1's correction make a Beaver triple: c = a * b."""
    req = C.make_request("triple", (n,), (n,), "mul")
    a0, b0, c0 = C.party0_shares(req, p0.seed, 0)
    a1, b1, c1 = C.party1_shares(req, p1.seed, 0, p1.get(0, req))
    assert torch.equal(c0 + c1, (a0 + a1) * (b0 + b1))


def test_dealer_gives_each_seed_once_and_only_to_its_own_server():
    import os

    keys, server = _dealer()
    try:
        sid = os.urandom(16)
        with pytest.raises(C.RequestError, match="may not act as rank 0"):
            _link(keys, server, "server1", 0, sid)  # server 1 asking for party 0's seed
        first = _link(keys, server, "server0", 0, sid)
        assert len(first.seed) == 16
        with pytest.raises(C.RequestError, match="already handed out"):
            _link(keys, server, "server0", 0, sid)
        p1 = _link(keys, server, "server1", 1, sid)
        assert p1.seed != first.seed
        _assert_a_triple(first, p1, 5)
        p1.close()
        first.close()
    finally:
        server.stop()


def test_dealer_gives_a_sessions_seeds_to_one_worker_pair_only():
    """Workers (issue 30): server0-wk and server1-wk share a session's seeds; a worker of another
    pair, a server, or a worker acting as the other rank gets nothing."""
    import os

    from net import tls

    keys, server = _dealer()
    for name in ("server0-w0", "server1-w0", "server1-w1"):
        tls.issue(keys, name)
    try:
        sid = os.urandom(16)
        with pytest.raises(C.RequestError, match="server1-w0 may not act as rank 0"):
            _link(keys, server, "server1-w0", 0, sid)
        p0 = _link(keys, server, "server0-w0", 0, sid)
        with pytest.raises(C.RequestError, match="another pair"):
            _link(keys, server, "server1-w1", 1, sid)
        with pytest.raises(C.RequestError, match="another pair"):
            _link(keys, server, "server1", 1, sid)
        p1 = _link(keys, server, "server1-w0", 1, sid)
        _assert_a_triple(p0, p1, 4)
        p1.close()
        p0.close()
        # and the servers' own sessions stay theirs: a worker cannot join one
        sid2 = os.urandom(16)
        s0 = _link(keys, server, "server0", 0, sid2)
        with pytest.raises(C.RequestError, match="another pair"):
            _link(keys, server, "server1-w0", 1, sid2)
        s0.close()
    finally:
        server.stop()
