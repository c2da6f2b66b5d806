"""Connections are counted per stage: strangers cannot crowd out authenticated clients (issue 14).

A ``ClientAPI``-like server (the accept loop and connection handling of servers/daemon/client_api.py
with its ``Admission``, answering an echo) and the real dealer are attacked on loopback with
plain TCP sockets that never finish TLS; authenticated peers still get in at once, and the
number of threads stays bounded.
"""

from __future__ import annotations

import resource
import socket
import threading
import time

import pytest

from mpc import correlations
from net import peer_accept, tls
from common import wire
from net.admission import Admission, Refused, refuse
from net.channel import KIND_OBJECT, Channel, ChannelError, accept_loop, listen
from mpc.dealer import DEALER_CAPS, DealerLink, DealerServer
from mpc.launcher import ephemeral_keys
from common.service_config import LimitsSection
from tests.helpers.strangers import open_strangers

STRANGERS = 1000
FLOOD_SOURCE = "127.0.0.2"   # the strangers' address; clients connect from 127.0.0.1


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    tls.init_keys(d, clients=3)
    return d


def _pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    return [socket.socketpair() for _ in range(n)]


def _closed_by_server(s: socket.socket, within: float = 2.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# ------------------------------------------------------------------ the caps, one by one
def test_a_full_handshake_pool_drops_its_oldest_and_deadlines_cut_the_rest():
    adm = Admission("test", max_handshakes=3, handshake_timeout=0.3, max_connections=5, max_per_identity=2)
    pairs = _pairs(4)
    for server_end, _ in pairs:
        adm.offer(server_end)
    assert adm.counts()["handshakes"] == 3 and adm.counts()["dropped"] == 1
    assert _closed_by_server(pairs[0][1])            # the oldest made room for the newest
    assert not _closed_by_server(pairs[3][1], 0.05)
    time.sleep(0.35)
    assert adm.expire() is None and adm.counts()["handshakes"] == 0
    assert all(_closed_by_server(c) for _, c in pairs[1:])
    # a connection that finished its handshake too late is refused, not admitted
    with pytest.raises(Refused) as late:
        adm.connection(pairs[1][0], "client-1")
    assert late.value.code == "handshake_timeout"
    for a, b in pairs:
        a.close()
        b.close()


def test_authenticated_connections_are_capped_per_identity_and_in_all():
    adm = Admission("test", max_handshakes=10, handshake_timeout=5, max_connections=3, max_per_identity=2)
    held = [adm.connection(None, "client-1"), adm.connection(None, "client-1")]
    with pytest.raises(Refused, match="client-1 already has 2 open") as exc:
        adm.connection(None, "client-1")
    assert exc.value.code == "too_many_connections"
    held.append(adm.connection(None, "client-2"))   # another identity is not affected ...
    with pytest.raises(Refused, match="3 open connections"):
        adm.connection(None, "client-3")           # ... until the port is full
    held[0].close()
    held[0].close()                                 # giving a slot back twice is harmless
    with adm.connection(None, "client-1"):
        assert adm.counts()["by_identity"] == {"client-1": 2, "client-2": 1}
    for h in held:
        h.close()
    assert adm.counts()["connections"] == 0 and adm.counts()["by_identity"] == {}


# ------------------------------------------------------------------ a ClientAPI-like port
class EchoAPI:
    """servers/daemon/client_api.py's connection handling with the patch of issue 14, around an echo."""

    def __init__(self, keys, limits: LimitsSection):
        self.limits = limits
        self.admission = Admission.from_limits("client API", limits)
        self.ctx = tls.server_context(tls.identity(keys, "server0"))
        # a burst of connects fills a short kernel accept queue faster than any accept loop
        # drains it (SYNs are then dropped and retried after 1 s); that is the backlog's
        # business, not admission's, so give this test a long one
        self.listener = listen(backlog=1024)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=accept_loop, args=(self.listener, self._serve, self.stop),
                                       kwargs={"name": "client", "admission": self.admission}, daemon=True)
        self.thread.start()

    @property
    def address(self):
        return self.listener.getsockname()

    def _serve(self, sock: socket.socket) -> None:
        allowed = lambda n: n == tls.ADMIN_NAME or wire.client_id_of(n) is not None  # noqa: E731
        try:
            ch = Channel.wrap_accepted(sock, self.ctx, allowed, kind="online", timeout=self.limits.idle_timeout,
                                       max_frame=self.limits.max_frame_bytes, **self.admission.channel_options())
        except ChannelError:
            return
        try:
            with self.admission.connection(sock, ch.peer):
                while not self.stop.is_set():
                    buf = ch.recv_frame(KIND_OBJECT)
                    ch.send_frame(KIND_OBJECT, wire.ok_reply(None, echo=bytes(buf)))
        except Refused as exc:
            refuse(ch, wire.error_reply(None, "unavailable", str(exc)), wait=self.admission.handshake_timeout)
        except ChannelError:
            pass
        finally:
            ch.close()

    def close(self):
        self.stop.set()
        self.listener.close()
        self.thread.join(5)


def _client(keys, name: str, addr) -> Channel:
    return Channel.connect(addr, tls.client_context(tls.identity(keys, name)), "server0", timeout=10,
                           connect_timeout=10)


def _ask(ch: Channel, payload: bytes = b"ping") -> dict:
    ch.send_frame(KIND_OBJECT, payload)
    return wire.unpack(ch.recv_frame(KIND_OBJECT), 1 << 20)


def _raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return min(need, max(hard - 200, 0) // 2)  # both ends live in this process


def test_a_thousand_strangers_do_not_delay_an_authenticated_client(keys):
    n = _raise_fd_limit(STRANGERS)
    assert n >= 300, "the fd limit is too low for a meaningful flood"
    api = EchoAPI(keys, LimitsSection())
    threads_before = threading.active_count()
    strangers = []
    try:
        t0 = time.monotonic()
        # the flood comes from another address than the client's: the pool is shared out by source
        # address (net/source_limits.py), and a client behind the flooding address shares that
        # address's part, so from one address the client's handshake could be pushed out by the
        # strangers admitted after it (seen once on CI: "peer rejected the connection")
        strangers = open_strangers(api.address, n, source=FLOOD_SOURCE)
        flood_seconds = time.monotonic() - t0
        assert len(strangers) >= 0.9 * n
        counts = api.admission.counts()
        assert counts["handshakes"] <= LimitsSection().max_handshakes and counts["connections"] == 0
        t0 = time.monotonic()
        with _client_ctx(keys, "client-0", api.address) as ch:
            assert _ask(ch)["echo"] == b"ping"
        waited = time.monotonic() - t0
        with _client_ctx(keys, "admin", api.address) as ch:
            assert _ask(ch, b"status")["echo"] == b"status"
        threads = threading.active_count() - threads_before
        print(f"\n{len(strangers)} strangers opened in {flood_seconds:.2f}s; an authenticated request "
              f"took {waited * 1000:.0f} ms; {threads} extra threads; {api.admission.counts()}")
        assert waited < 2.0, waited
        assert threads <= LimitsSection().max_handshakes + 10
    finally:
        for s in strangers:
            s.close()
        api.close()


class _client_ctx:
    def __init__(self, keys, name, addr):
        self.ch = _client(keys, name, addr)

    def __enter__(self) -> Channel:
        return self.ch

    def __exit__(self, *exc):
        self.ch.close()


def test_an_identity_over_its_cap_is_told_why_and_others_still_get_in(keys):
    limits = LimitsSection(max_connections=6, max_connections_per_identity=2)
    api = EchoAPI(keys, limits)
    held = [_client(keys, "client-1", api.address) for _ in range(2)]
    try:
        for ch in held:
            assert _ask(ch)["ok"] is True
        extra = _client(keys, "client-1", api.address)  # TLS succeeds; the refusal is the reply
        reply = _ask(extra)
        assert reply["ok"] is False and reply["error"]["code"] == "unavailable"
        assert reply["error"]["message"].startswith("too_many_connections: client-1 already has 2")
        extra.close()
        with _client_ctx(keys, "client-2", api.address) as other:
            assert _ask(other)["ok"] is True
        # the refused connection took no connection slot, and a freed slot is usable again
        held.pop().close()
        deadline = time.monotonic() + 5
        while api.admission.counts()["by_identity"].get("client-1", 0) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with _client_ctx(keys, "client-1", api.address) as again:
            assert _ask(again)["ok"] is True
    finally:
        for ch in held:
            ch.close()
        api.close()


# ------------------------------------------------------------------ the dealer's port
def test_300_sockets_on_the_dealer_port_cost_a_few_threads_and_servers_still_get_seeds():
    keys = ephemeral_keys()
    _raise_fd_limit(300)
    server = DealerServer(tls.identity(keys, tls.DEALER_NAME), handshake_timeout=5.0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    before = threading.active_count()
    strangers = open_strangers(server.address, 300)
    try:
        peak = threading.active_count() - before
        assert server.admission.counts()["handshakes"] <= DEALER_CAPS["max_handshakes"]
        ch = Channel.connect(server.address, tls.client_context(tls.identity(keys, "server0")),
                             tls.DEALER_NAME, kind="offline", timeout=10)
        link = DealerLink(ch, 0, b"s" * 16)
        assert len(link.seed) == 16
        link.close()
        print(f"\ndealer: {len(strangers)} strangers -> {peak} extra threads (before: one per socket)")
        assert len(strangers) >= 250 and peak <= DEALER_CAPS["max_handshakes"] + 5
    finally:
        for s in strangers:
            s.close()
        server.stop()
        t.join(5)


def test_a_server_over_its_cap_at_the_dealer_is_told_why():
    keys = ephemeral_keys()
    server = DealerServer(tls.identity(keys, tls.DEALER_NAME))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    ctx = tls.client_context(tls.identity(keys, "server1"))
    open_ = [Channel.connect(server.address, ctx, tls.DEALER_NAME, kind="offline", timeout=10)
             for _ in range(DEALER_CAPS["max_per_identity"])]
    try:
        deadline = time.monotonic() + 5
        while server.admission.counts()["by_identity"].get("server1", 0) < len(open_):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = Channel.connect(server.address, ctx, tls.DEALER_NAME, kind="offline", timeout=10)
        with pytest.raises(correlations.RequestError, match="too_many_connections: server1 already has 4"):
            DealerLink(extra, 1, b"x" * 16)
        extra.close()
        # server0 is another identity: still served
        link = DealerLink(Channel.connect(server.address, tls.client_context(tls.identity(keys, "server0")),
                                          tls.DEALER_NAME, kind="offline", timeout=10), 0, b"x" * 16)
        assert len(link.seed) == 16
        link.close()
    finally:
        for ch in open_:
            ch.close()
        server.stop()
        t.join(5)


def test_idle_sockets_on_the_2pc_port_do_not_keep_party_0_out():
    """The session port vets at most 64 connections at once; a newcomer pushes out the oldest.
    (Closing newcomers instead kept party 0 out for as long as 64 idle sockets were renewed.)"""
    keys = ephemeral_keys()
    listener = listen(backlog=1024)
    strangers = open_strangers(listener.getsockname(), 200)
    box: dict = {}

    def party1():
        try:
            box["ch"] = peer_accept.accept_peer(listener, tls.server_context(tls.identity(keys, "server1")),
                                                "server0", b"job:1:attempt:1", timeout=20)
        except Exception as exc:  # noqa: BLE001 - checked below
            box["ch"] = exc

    t = threading.Thread(target=party1, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        ch0 = peer_accept.connect_peer(listener.getsockname(), tls.client_context(tls.identity(keys, "server0")),
                                       "server1", b"job:1:attempt:1", timeout=15)
        took = time.monotonic() - t0
        t.join(10)
        assert isinstance(box["ch"], Channel), box["ch"]
        print(f"\n2PC port: {len(strangers)} idle strangers; party 0 got in after {took * 1000:.0f} ms")
        assert took < 3.0  # before: only after the strangers' 5 s deadlines
        ch0.close()
        box["ch"].close()
    finally:
        for s in strangers:
            s.close()
        listener.close()
