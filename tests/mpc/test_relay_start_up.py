"""The engine's relay waits for a target that is still starting, instead of cutting the caller.

At a two-party start each server's library dials the other's before that one listens. A relay
that closed such a connection at once made the library fail its TLS handshake and log
``[error] Fail to SSL_do_handshake`` on a healthy start (issue 27, item 5); the relay now retries
a refused connect for ``CONNECT_PATIENCE`` seconds, so the caller only sees a slower connect.
"""

from __future__ import annotations

import socket
import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from mpc.metered_relay import CONNECT_PATIENCE, RelayPair
from net.metering import Meter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_connection_waits_for_a_target_that_listens_late_and_carries_its_bytes():
    assert CONNECT_PATIENCE >= 2.0
    # the target's port is held (bound) from the start but refuses until it listens: a port only
    # picked free could be taken meanwhile by any outgoing connection on the machine (a CI run
    # failed so: "Address already in use" when the late server bound it)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    relays = RelayPair(Meter(), lambda: "online")
    try:
        entry = relays.open_inbound(("127.0.0.1", port))
        got: list[bytes] = []

        def late_server() -> None:
            time.sleep(1.0)                   # the target starts listening a second later
            srv.listen()
            conn, _ = srv.accept()
            with conn:
                got.append(conn.recv(5))
                conn.sendall(b"world")

        t = threading.Thread(target=late_server, daemon=True)
        t.start()
        with socket.create_connection(entry, timeout=10) as c:
            c.sendall(b"hello")
            c.settimeout(10)
            assert c.recv(5) == b"world"      # not cut: the relay connected once the target was up
        t.join(10)
        assert got == [b"hello"]
    finally:
        relays.close()
        srv.close()


def test_a_target_that_never_listens_is_given_up_after_the_patience(monkeypatch):
    import mpc.metered_relay as mr

    monkeypatch.setattr(mr, "CONNECT_PATIENCE", 0.5)
    relays = RelayPair(Meter(), lambda: "online")
    try:
        entry = relays.open_inbound(("127.0.0.1", _free_port()))
        with socket.create_connection(entry, timeout=10) as c:
            c.settimeout(10)
            t0 = time.monotonic()
            assert c.recv(1) == b""           # closed, not held forever
            assert time.monotonic() - t0 < 5.0
    finally:
        relays.close()



@given(st.lists(st.sampled_from(["arm", "open", "peer_closes", "we_close"]), max_size=40))
def test_the_peer_is_gone_once_it_closed_the_last_connection_after_arming(ops):
    """What the engine's parent waits on (``_PeerWatch``), against a model of its rule: "gone"
    is told when the peer closes the last open peer-facing connection while armed, never for a
    connection we closed or one closed before the link was up."""
    from mpc.metered_relay import _PeerWatch

    told: list[int] = []
    watch = _PeerWatch(lambda: told.append(1))
    armed, open_, expected = False, 0, 0
    for op in ops:
        if op == "arm":
            watch.arm()
            armed = True
        elif op == "open":
            watch.opened()
            open_ += 1
        elif open_:     # a close needs an open connection
            watch.closed(by_peer=op == "peer_closes")
            open_ -= 1
            expected += op == "peer_closes" and open_ == 0 and armed
    assert len(told) == expected
