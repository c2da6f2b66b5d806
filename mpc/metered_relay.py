"""A TCP forwarder that meters what crosses it and applies an emulated link.

Why: the two-party engine (``mpc.spu_engine``) talks over its library's own sockets, which our
meter cannot see and our link emulation does not touch. Each party therefore routes that link
through two of these relays on loopback: one in front of its own listener (what the peer sends
in) and one in front of the peer's (what it sends out). Every byte is counted where it meets a
socket, TLS records included, so the meter holds the bytes on the wire; the direction of each
pump says whether a byte was sent or received.

Link emulation is on the receiving pumps only (as in ``net.link``): a chunk read at ``t`` is
written on at ``max(t, link free) + bytes x 8 / bandwidth + latency`` by a second thread, so
chunks in flight overlap as on a FIFO link. A round is counted when this party sends after it
has received (or when a meter step opened since), as ``net.channel`` counts them.

Who may connect (issue 25, finding 7): the inbound relay listens where the peer can reach it,
so anyone else can too; a ``RelayGate`` (``mpc.relay_gate``) forwards only connections from
the peer's address and at most ``MAX_LINK_CONNECTIONS`` at once, closing the rest at accept,
before a thread is started. The peer's certificate is still checked by the library's TLS.

The relays also watch the peer (``_PeerWatch``): once the link is up, the peer closing every
peer-facing connection means its engine process is gone, and a long-lived engine's parent
(``mpc.spu_engine``) then fails the call in flight at once instead of at the library's timeout.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from typing import Callable

from net.link import NO_LINK, LinkProfile
from net.metering import Meter

from .relay_gate import MAX_LINK_CONNECTIONS, Countdown, RelayGate

__all__ = ["RelayPair", "Relay"]

_CHUNK = 1 << 16
#: seconds a relay keeps retrying a target that refuses connections (it is starting up)
CONNECT_PATIENCE = 10.0
# struct tcp_info (linux/tcp.h): tcpi_bytes_received at 128, tcpi_bytes_sent at 200 (Linux >= 5.5)
_TCPI_RECEIVED, _TCPI_SENT, _TCPI_LEN = 128, 200, 208


class _RoundState:
    """Shared by a party's relays: has it received since it last sent?"""

    def __init__(self, meter: Meter, kind: Callable[[], str]):
        self.meter = meter
        self.kind = kind
        self.lock = threading.Lock()
        self.received = True
        self.epoch = -1
        self.sent_total = 0
        self.received_total = 0

    def on_sent(self, n: int) -> None:
        kind = self.kind()
        with self.lock:
            if self.received or self.epoch != self.meter.epoch:
                self.meter.round(kind)
                self.received, self.epoch = False, self.meter.epoch
            self.sent_total += n
        self.meter.sent(kind, n)
        self.meter.wire(kind, sent=n)

    def on_received(self, n: int) -> None:
        kind = self.kind()
        with self.lock:
            self.received = True
            self.received_total += n
        self.meter.received(kind, n)
        self.meter.wire(kind, received=n)


class _PeerWatch:
    """Shared by a party's relays: the peer-facing connections that are open, and who is told
    when the peer has closed the last of them (its engine is gone: a dead process's kernel closes
    all its sockets). Armed only once the link is up: while the library is still connecting,
    its attempts may be closed by the peer's relay for want of a listener, which is no loss."""

    def __init__(self, on_peer_closed: Callable[[], None] | None):
        self._on_peer_closed = on_peer_closed
        self._lock = threading.Lock()
        self._open = 0
        self._armed = False

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self, by_peer: bool) -> None:
        with self._lock:
            self._open -= 1
            fire = by_peer and self._open == 0 and self._armed and self._on_peer_closed is not None
        if fire:
            self._on_peer_closed()


class Relay:
    """Accepts on a loopback port and forwards every connection to ``target``."""

    def __init__(self, target: tuple[str, int] | None, state: _RoundState, *, inbound: bool,
                 link: LinkProfile = NO_LINK, host: str = "127.0.0.1", port: int = 0,
                 watch: _PeerWatch | None = None, peer_host: str | None = None,
                 max_connections: int = MAX_LINK_CONNECTIONS):
        """``target`` may be set later (``set_target``); connections wait for it up to 60 s.

        ``peer_host``: the only address whose connections are forwarded (``None``: any, for a
        relay that listens on loopback for our own library). ``max_connections``: forwarded at
        once; more are closed at accept (``mpc.relay_gate``).

        ``watch`` learns of every peer-facing connection and whether the peer or our side ended
        it: how a long-lived engine learns, while it waits inside a call, that the peer's engine
        is gone, instead of waiting for the library's receive timeout.
        """
        self._watch = watch or _PeerWatch(None)
        self._target = target
        self._target_set = threading.Event()
        if target is not None:
            self._target_set.set()
        self._state = state
        self._inbound = inbound   # True: the accepted side is the peer (what it sends is received)
        self._link = link
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._peer_socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.gate = RelayGate(peer_host, max_connections)
        self._listener = socket.create_server((host, port), backlog=64)
        self._thread = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def set_target(self, target: tuple[str, int]) -> None:
        self._target = target
        self._target_set.set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            if not self.gate.admit(addr[0]):
                conn.close()   # no thread, no connect to our library: a stranger costs an accept
                continue
            threading.Thread(target=self._forward, args=(conn,), daemon=True, name="relay-connect").start()

    def _connect_target(self) -> socket.socket | None:
        """A connection to the target, retried while it is not listening yet.

        At start-up each side's library dials before the other side's listener (its relay, or the
        library behind it) is up; a connection closed at once would fail the library's TLS
        handshake and make it log an error for a healthy start. So a refused connect is retried
        for up to ``CONNECT_PATIENCE`` seconds, which the library sees only as a slow handshake.
        """
        deadline = time.monotonic() + CONNECT_PATIENCE
        while not self._stop.is_set():
            try:
                out = socket.create_connection(self._target, timeout=10)
                out.settimeout(None)
                return out
            except OSError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
        return None

    def _forward(self, conn: socket.socket) -> None:
        if not self._target_set.wait(60.0):
            conn.close()
            self.gate.release()
            return
        out = self._connect_target()
        if out is None:
            conn.close()
            self.gate.release()
            return
        for s in (conn, out):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks += [conn, out]
            self._peer_socks.append(conn if self._inbound else out)
        self._watch.opened()
        # the accepted side of an inbound relay is the peer: its bytes are received here
        local_closed = threading.Event()   # our own library ended this connection first
        pumps = Countdown(2, self.gate.release)  # the slot is free once both directions are done
        self._pump(conn, out, received=self._inbound, local_closed=local_closed, done=pumps)
        self._pump(out, conn, received=not self._inbound, local_closed=local_closed, done=pumps)

    def _pump(self, src: socket.socket, dst: socket.socket, *, received: bool,
              local_closed: threading.Event, done: Countdown) -> None:
        if received and self._link.emulated:
            queue: collections.deque = collections.deque()
            ready = threading.Condition()
            threading.Thread(target=self._read, args=(src, dst, queue, ready, local_closed), daemon=True,
                             name="relay-read").start()
            threading.Thread(target=self._deliver, args=(dst, src, queue, ready, local_closed, done),
                             daemon=True, name="relay-deliver").start()
        else:
            threading.Thread(target=self._copy, args=(src, dst, received, local_closed, done), daemon=True,
                             name="relay-copy").start()

    def _peer_pump_ended(self, local_closed: threading.Event) -> None:
        """The pump reading from the peer is done (once per connection, however it ended)."""
        self._watch.closed(by_peer=not local_closed.is_set() and not self._stop.is_set())

    def _count(self, n: int, received: bool) -> None:
        (self._state.on_received if received else self._state.on_sent)(n)

    def _copy(self, src: socket.socket, dst: socket.socket, received: bool, local_closed: threading.Event,
              done: Countdown) -> None:
        reading = True   # False while writing: a failed write is the other side's end
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                self._count(len(data), received)
                reading = False
                dst.sendall(data)
                reading = True
        except OSError:
            pass
        if received == (not reading):   # our side ended it: reading it, or writing to it
            local_closed.set()
        _close(src, dst)
        if received:
            self._peer_pump_ended(local_closed)
        done.tick()

    def _read(self, src, dst, queue, ready, local_closed: threading.Event) -> None:
        free = 0.0
        try:
            while True:
                data = src.recv(_CHUNK)
                now = time.monotonic()
                if not data:
                    break
                done = max(now, free) + self._link.transfer_time(len(data))
                free = done
                with ready:
                    queue.append((done + self._link.latency, data))
                    ready.notify()
        except OSError:
            pass
        with ready:
            queue.append((0.0, None))
            ready.notify()
        self._peer_pump_ended(local_closed)

    def _deliver(self, dst, src, queue, ready, local_closed: threading.Event, done: Countdown) -> None:
        try:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, data = queue.popleft()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._count(len(data), True)
                dst.sendall(data)
        except OSError:
            local_closed.set()   # our library's socket refused the data: our side ended it
        _close(src, dst)
        done.tick()   # the read side ends with us: it queued our end, or its socket is closed now

    def kernel_totals(self) -> tuple[int, int]:
        """(sent, received) on the peer-facing sockets as the kernel counts them (TCP_INFO): an
        oracle for the meter that does not share its code."""
        sent = received = 0   # connections still open (the engine's are, until the session ends)
        with self._lock:
            for s in self._peer_socks:
                try:
                    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_LEN)
                except OSError:
                    continue
                if len(info) >= _TCPI_LEN:
                    sent += struct.unpack_from("Q", info, _TCPI_SENT)[0]
                    received += struct.unpack_from("Q", info, _TCPI_RECEIVED)[0]
        return sent, received

    def close(self) -> None:
        self._stop.set()
        _close(self._listener)
        with self._lock:
            _close(*self._socks)


class RelayPair:
    """A party's two relays: ``inbound`` faces the peer (forwards to our own listener),
    ``outbound`` is what our library dials to reach the peer's inbound relay."""

    def __init__(self, meter: Meter, kind: Callable[[], str], link: LinkProfile = NO_LINK,
                 listen_host: str = "127.0.0.1", on_peer_closed: Callable[[], None] | None = None,
                 peer_host: str | None = None):
        """``on_peer_closed``: called when the peer has closed every peer-facing connection of
        both relays, once ``arm()`` has been called (the link is up). ``peer_host``: the only
        address the inbound relay forwards (``None``: any; tests of the relay alone)."""
        self.state = _RoundState(meter, kind)
        self.watch = _PeerWatch(on_peer_closed)
        self._link = link
        self._listen_host = listen_host
        self._peer_host = peer_host
        self.inbound: Relay | None = None
        self.outbound: Relay | None = None

    def open_inbound(self, own_listener: tuple[str, int] | None = None) -> tuple[str, int]:
        """The peer-facing relay; its target (our library's listener) may be set later."""
        self.inbound = Relay(own_listener, self.state, inbound=True, link=self._link, host=self._listen_host,
                             watch=self.watch, peer_host=self._peer_host)
        return self.inbound.address

    def open_outbound(self, peer_inbound: tuple[str, int]) -> tuple[str, int]:
        self.outbound = Relay(peer_inbound, self.state, inbound=False, link=self._link, watch=self.watch)
        return self.outbound.address

    def arm(self) -> None:
        """The link is up: from now on the peer closing it is reported."""
        self.watch.arm()

    @property
    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received) through both relays so far."""
        return self.state.sent_total, self.state.received_total

    def kernel_totals(self) -> tuple[int, int]:
        sent = received = 0
        for r in (self.inbound, self.outbound):
            if r is not None:
                s, rcv = r.kernel_totals()
                sent, received = sent + s, received + rcv
        return sent, received

    def close(self) -> None:
        for r in (self.inbound, self.outbound):
            if r is not None:
                r.close()


def _close(*socks) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass
