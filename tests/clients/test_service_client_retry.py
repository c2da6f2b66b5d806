"""ServiceClient against a tiny real TLS server that misbehaves on purpose (issue 14, item 3).

``starfish unlearn --wait`` died when a server restarted: the retry loop caught only
``ChannelError``, but a channel whose TLS state broke while idle raises ``ssl.SSLEOFError``
from its next send; it escaped, and the dead channel stayed in place, so every later call
failed too. Here the server is a real mutually authenticated TLS 1.3 endpoint
(``net.channel`` over ``net.tls`` contexts), scripted per connection: answer, drop the
connection after reading a request (mid-way), corrupt the TLS stream while the client is
idle, refuse with an error reply, or restart on the same port. Checked: any
connection-level failure is retried on a new connection within ``retry_seconds``; an error
reply is never retried; a re-sent mutating request carries a fresh, larger nonce; a nonce
the caller chose is never sent twice; and without retries the caller sees a ChannelError
(never a raw ssl/OS error) and the next call works.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from clients.service_client import ServiceClient, ServiceError
from net import tls
from common import wire
from net.channel import KIND_OBJECT, Channel, ChannelError, listen

TIMEOUT = 5.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    tls.init_keys(d, clients=1)      # server0 and client-0 among them
    return str(d)


# ------------------------------------------------------------------ the scripted server
def answer(srv, ch, sock):
    """Serve requests until the client goes away (or the server stops)."""
    while not srv.stop.is_set():
        try:
            req = srv.read(ch)
        except ChannelError:
            return
        ch.send_frame(KIND_OBJECT, wire.ok_reply(req.id, op=req.op))


def drop_after_request(srv, ch, sock):
    """Read one request, then reset the connection without answering (a crash mid-call)."""
    srv.read(ch)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ch.close()


def corrupt_when_idle(srv, ch, sock):
    """Answer one request, then, while the client waits, send bytes that are no valid TLS
    record of this session: the client's TLS object fails without the client sending."""
    req = srv.read(ch)
    ch.send_frame(KIND_OBJECT, wire.ok_reply(req.id, op=req.op))
    time.sleep(0.1)
    sock.sendall(b"\x17\x03\x03\x00\x10" + bytes(16))   # application data, 16 bytes of junk
    srv.corrupted.set()
    srv.stop.wait(TIMEOUT)
    ch.close()


def refuse(srv, ch, sock):
    """Answer every request with an error reply (the server is up and says no)."""
    while not srv.stop.is_set():
        try:
            req = srv.read(ch)
        except ChannelError:
            return
        ch.send_frame(KIND_OBJECT, wire.error_reply(req.id, "unavailable", "try later"))


class TinyServer:
    """``server0`` on loopback; connection i is handled by ``script[i]`` (the last repeats)."""

    def __init__(self, keys: str, script: list, port: int = 0) -> None:
        self.script = script
        self.requests: list[wire.Request] = []
        self.connections = 0
        self.stop = threading.Event()
        self.corrupted = threading.Event()
        self._channels: list[Channel] = []
        self._ctx = tls.server_context(tls.identity(keys, "server0"))
        self._listener = listen(port=port)
        self.address = self._listener.getsockname()
        self._listener.settimeout(0.1)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def read(self, ch: Channel) -> wire.Request:
        req = wire.parse_request(ch.recv_frame(KIND_OBJECT), 1 << 20)
        self.requests.append(req)
        return req

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            behaviour = self.script[min(self.connections, len(self.script) - 1)]
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(behaviour, sock), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, behaviour, sock: socket.socket) -> None:
        try:
            ch = Channel.wrap_accepted(sock, self._ctx, lambda name: True, timeout=TIMEOUT)
        except ChannelError:
            return
        self._channels.append(ch)
        try:
            behaviour(self, ch, sock)
        except ChannelError:
            pass
        finally:
            ch.close()

    def close(self) -> None:
        """Stop like a killed process: no new connections, open ones cut."""
        self.stop.set()
        self._listener.close()
        for ch in self._channels:
            ch.close()
        for t in self._threads:
            t.join(TIMEOUT)


@pytest.fixture
def serve(keys):
    servers: list[TinyServer] = []

    def start(script: list, port: int = 0) -> TinyServer:
        servers.append(TinyServer(keys, script, port))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def client(keys: str, srv: TinyServer) -> ServiceClient:
    return ServiceClient(keys, "client-0", 0, srv.address, timeout=TIMEOUT, connect_timeout=1.0)


def _wait_until_dead(c: ServiceClient) -> None:
    """Until the client's reader has seen the corruption (so the next *send* hits it)."""
    deadline = time.monotonic() + TIMEOUT
    while not c._ch.peer_closed:            # noqa: SLF001 - the state this test is about
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ------------------------------------------------------------------ the tests
def test_a_connection_dropped_mid_request_is_retried_on_a_new_connection(keys, serve):
    srv = serve([drop_after_request, answer])
    with client(keys, srv) as c:
        assert c.call("state", retry_seconds=10)["op"] == "state"
    assert [r.op for r in srv.requests] == ["state", "state"] and srv.connections == 2


def test_a_tls_failure_on_an_idle_channel_is_retried(keys, serve):
    """The reproduced cause: the next send raised ssl.SSLEOFError, not a ChannelError."""
    srv = serve([corrupt_when_idle, answer])
    with client(keys, srv) as c:
        c.call("state")
        assert srv.corrupted.wait(TIMEOUT)
        _wait_until_dead(c)
        assert c.call("status", retry_seconds=10)["op"] == "status"
    assert srv.connections == 2


def test_without_retries_the_failure_is_a_channel_error_and_the_next_call_reconnects(keys, serve):
    srv = serve([corrupt_when_idle, answer])
    with client(keys, srv) as c:
        c.call("state")
        assert srv.corrupted.wait(TIMEOUT)
        _wait_until_dead(c)
        with pytest.raises(ChannelError):
            c.call("state")
        assert c.call("state")["op"] == "state"     # the dead channel was dropped


def test_a_restarted_server_is_reached_again(keys, serve):
    first = serve([answer])
    with client(keys, first) as c:
        c.call("state")
        first.close()                                # the server goes away ...
        port = first.address[1]
        timer = threading.Timer(0.5, lambda: serve([answer], port))   # ... and comes back
        timer.start()
        try:
            assert c.call("status", retry_seconds=10)["op"] == "status"
        finally:
            timer.join()


def test_a_resent_mutating_request_has_a_fresh_larger_nonce(keys, serve):
    srv = serve([drop_after_request, answer])
    before = time.time_ns()
    with client(keys, srv) as c:
        c.call("unlearn", job="job-1", retry_seconds=10)
    nonces = [r.fields["nonce"] for r in srv.requests]
    assert len(nonces) == 2 and before <= nonces[0] < nonces[1]
    for n in nonces:                                 # time-based: inside any server's window
        wire.check_nonce_window(n)


def test_a_nonce_chosen_by_the_caller_is_never_sent_twice(keys, serve):
    srv = serve([drop_after_request, answer])
    with client(keys, srv) as c:
        with pytest.raises(ChannelError):
            c.call("unlearn", job="job-1", nonce=12345, retry_seconds=10)
    time.sleep(0.2)
    assert [r.fields["nonce"] for r in srv.requests] == [12345]


def test_an_error_reply_is_final(keys, serve):
    srv = serve([refuse])
    with client(keys, srv) as c:
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as info:
            c.call("unlearn", job="job-1", retry_seconds=10)
        assert info.value.code == "unavailable" and time.monotonic() - t0 < 2
    assert len(srv.requests) == 1


def test_retrying_stops_after_retry_seconds(keys, serve):
    srv = serve([answer])
    srv.close()                                      # nothing listens on that port any more
    c = ServiceClient(keys, "client-0", 0, srv.address, timeout=TIMEOUT, connect_timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(ChannelError):
        c.call("state", retry_seconds=1.0)
    assert time.monotonic() - t0 < 4
