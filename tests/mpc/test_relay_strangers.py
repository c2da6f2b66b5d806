"""The engine's inbound relay forwards only the peer, a few connections at once (issue 25, finding 7).

Before, it started a thread (then a connect to the library and two pumps) for every TCP
connection from anywhere: 300 strangers cost 297-693 threads in the engine process. Here an
inbound relay whose peer is 127.0.0.1 (Linux routes all of 127/8 to lo, so 127.0.0.2 is another
host as far as the relay can tell) is knocked on by strangers, and the link from the peer's
address still carries its bytes. The library behind it is an echo server: what the relay must
protect is its own threads and the link's slots, which do not depend on what it forwards to.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from mpc.metered_relay import RelayPair
from mpc.relay_gate import MAX_LINK_CONNECTIONS, RelayGate
from net.metering import Meter

pytestmark = pytest.mark.timeout(60)

PEER = "127.0.0.1"
STRANGER = "127.0.0.2"


class _Echo:
    """Our 'library': echoes whatever each connection sends."""

    def __init__(self) -> None:
        self.listener = socket.create_server((PEER, 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(4096):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def _connect(entry, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(entry)
    return s


def _roundtrip(s: socket.socket, payload: bytes = b"hello") -> bytes:
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = s.recv(len(payload) - len(got))
        if not chunk:
            break
        got += chunk
    return got


def _wait_until(cond, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def relay():
    echo = _Echo()
    relays = RelayPair(Meter(), lambda: "online", peer_host=PEER)
    relays.open_inbound(echo.address)
    yield relays
    relays.close()
    echo.close()


def test_300_strangers_cost_no_thread_and_one_log_line_and_the_peer_still_links(relay, caplog):
    caplog.set_level(logging.WARNING, logger="starfish.relay")
    entry = relay.inbound.address
    link = _connect(entry, PEER)                  # the peer's link, up before the flood
    assert _roundtrip(link) == b"hello"
    before = threading.active_count()
    strangers = []
    try:
        for i in range(300):
            if i % 50 == 49:
                time.sleep(0.01)   # the relay shares our GIL: let it drain its short accept queue
            strangers.append(_connect(entry, STRANGER))
        assert _wait_until(lambda: relay.inbound.gate.refused >= 300)
        extra = threading.active_count() - before
        closed = sum(1 for s in strangers[:20] if _closed(s))
        late = _connect(entry, PEER)              # a second link connection is still admitted
        print(f"\n300 strangers: {extra} extra threads, {relay.inbound.gate.refused} refused, "
              f"{len(caplog.records)} log line(s)")
        assert extra <= 2, extra
        assert closed == 20                       # closed at accept, not left hanging
        assert _roundtrip(link, b"still up") == b"still up"
        assert _roundtrip(late, b"second") == b"second"
        late.close()
        lines = [r.getMessage() for r in caplog.records if r.name == "starfish.relay"]
        assert len(lines) == 1 and "127.0.0.2" in lines[0] and "not the peer's address" in lines[0], lines
    finally:
        link.close()
        for s in strangers:
            s.close()


def _closed(s: socket.socket) -> bool:
    s.settimeout(2.0)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_the_peers_address_gets_at_most_the_cap_and_a_slot_frees_when_its_connection_ends(relay):
    entry = relay.inbound.address
    gate = relay.inbound.gate
    held = [_connect(entry, PEER) for _ in range(MAX_LINK_CONNECTIONS)]
    try:
        for s in held:
            assert _roundtrip(s) == b"hello"
        before = threading.active_count()
        over = [_connect(entry, PEER) for _ in range(50)]
        assert _wait_until(lambda: gate.refused >= 50)
        assert gate.live == MAX_LINK_CONNECTIONS
        assert threading.active_count() - before <= 2
        assert all(_closed(s) for s in over[:5])
        for s in over:
            s.close()
        held.pop().close()                        # its two pumps end, and give the slot back
        assert _wait_until(lambda: gate.live == MAX_LINK_CONNECTIONS - 1)
        again = _connect(entry, PEER)
        held.append(again)
        assert _roundtrip(again, b"again") == b"again"
    finally:
        for s in held:
            s.close()
    assert _wait_until(lambda: gate.live == 0)


def test_the_gate_compares_addresses_in_one_spelling_and_logs_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="starfish.relay")
    gate = RelayGate("::ffff:10.0.0.5", max_connections=1)
    assert gate.admit("10.0.0.5", now=0.0)        # the same host, written as IPv4
    assert not gate.admit("10.0.0.5", now=1.0)    # over the cap
    assert not gate.admit("10.0.0.6", now=2.0)    # not the peer
    assert not gate.admit("10.0.0.7", now=11.5)   # a new interval: a second line, with the count
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["engine link relay: closed a connection from 10.0.0.5 at accept (1 connections already "
                     "forwarded)", "engine link relay: closed 2 connections at accept in the last 10 s (the "
                     "last from 10.0.0.7: not the peer's address)"], lines
    gate.release()
    assert gate.admit("10.0.0.5", now=12.0) and gate.refused == 3
    anyone = RelayGate(None, max_connections=2)
    assert anyone.admit("192.0.2.1") and anyone.admit("198.51.100.7") and not anyone.admit("::1")
