"""How the two parties of a session find each other on party 1's listening port.

Why not take the oldest queued connection: the port is reachable by anything on the network,
and party 0 itself may have left a dead connection queued by an earlier attempt. One such
stray at the head of the queue used to fail the handshake on both sides and keep them out of
step for every later session. Instead:

- Party 1 (``accept_peer``) accepts until its deadline and vets every connection on its own
  thread, under a short deadline (``HANDSHAKE_TIMEOUT``, never past the overall one): TLS with
  party 0's certificate name, the hello frames, then the session's *ticket* as the first
  frame. The first connection that passes gets a short ack; everything else is closed and
  logged at INFO. Vetting in parallel means a silent stray delays no one. At most
  ``MAX_VETTING`` are vetted at once (``net.admission``): a newcomer beyond that pushes out the
  *oldest* one, so a flood of idle sockets cannot keep party 0 out (closing newcomers instead
  would let 64 sockets renewed every 5 s do exactly that).
- Party 0 (``connect_peer``) sends the ticket and waits for the ack (``ACK_TIMEOUT``); on a
  refusal, a close or a timeout it reconnects until its own deadline. A certificate that
  fails verification is not retried: it is a deployment error, not a race.

A ticket names the attempt (e.g. ``b"job:<id>:attempt:<n>"``), so a connection left over from
an earlier attempt is refused instead of joining the wrong computation. Only the connection
that becomes the session is metered (strays and refused attempts are not session traffic).
"""

from __future__ import annotations

import hmac
import logging
import selectors
import socket
import ssl
import threading
import time

from net.admission import Admission
from net.channel import (
    HEADER_BYTES,
    KIND_TICKET,
    MAX_FRAME,
    NO_LINK,
    Channel,
    ChannelError,
    HandshakeError,
    LinkProfile,
    PeerTimeout,
    ProtocolError,
)
from net.metering import Meter

HANDSHAKE_TIMEOUT = 5.0  # party 1, per accepted connection: TLS, hello and ticket
# Party 0, per attempt: TCP, TLS and hello. Party 1 answers at once while it is accepting, so
# this only runs out when it is not accepting yet; waiting in its queue then beats churning it.
ATTEMPT_TIMEOUT = 15.0
ACK_TIMEOUT = 5.0  # party 0 waits this long for the ack after sending its ticket
MAX_TICKET = 1024
MAX_VETTING = 64  # connections vetted at once; beyond it the oldest is dropped (party 0 retries)
_ACK = b"starfish/ticket-ok"
_RETRY_PAUSE = 0.2  # between party 0's attempts: a refusal is instant, do not spin

log = logging.getLogger("starfish.peer")


def check_ticket(ticket: bytes | None) -> bytes:
    """The ticket as sent on the wire; ``None`` (no attempt naming) is the empty ticket."""
    if ticket is None:
        return b""
    if not isinstance(ticket, bytes) or len(ticket) > MAX_TICKET:
        raise ValueError(f"a ticket must be bytes of at most {MAX_TICKET} bytes")
    return ticket


def _adopt(ch: Channel, meter: Meter | None, *, sent: int = 0, received: int = 0, rounds: int = 0) -> None:
    """Meter ``ch`` from now on, including its set-up so far (it was vetted unmetered)."""
    if meter is None:
        return
    ch.meter = meter  # the reader is idle here: the other side waits for our next frame
    meter.wire(ch.kind, sent=ch.wire_sent, received=ch.wire_received)
    for _ in range(rounds):
        meter.round(ch.kind)
    if sent:
        meter.sent(ch.kind, sent + HEADER_BYTES)
    if received:
        meter.received(ch.kind, received + HEADER_BYTES)


class _Vetting:
    """Party 1's vetting: the pool of connections being vetted, and the one that won."""

    def __init__(self, kind: str) -> None:
        self.lock = threading.Lock()
        # one session: a single connection of the single identity may pass
        self.pool = Admission(f"{kind} session", max_handshakes=MAX_VETTING,
                              handshake_timeout=HANDSHAKE_TIMEOUT, max_connections=1, max_per_identity=1)
        self.done = False
        self.winner: Channel | None = None
        self.wake_r, self.wake_w = socket.socketpair()

    def finish(self) -> None:
        with self.lock:
            self.done = True
        self.pool.drop_pending()  # strays still vetting; their threads clean up and exit
        self.wake_r.close()
        self.wake_w.close()


def accept_peer(listener: socket.socket, ctx: ssl.SSLContext, peer_name: str, ticket: bytes, *,
                timeout: float, kind: str = "online", meter: Meter | None = None,
                link: LinkProfile = NO_LINK, max_frame: int = MAX_FRAME) -> Channel:
    """Party 1's side: the first connection on ``listener`` that authenticates as ``peer_name``
    and presents ``ticket``, within ``timeout`` seconds; see the module docstring."""
    deadline = time.monotonic() + timeout
    state = _Vetting(kind)
    previous = listener.gettimeout()
    listener.setblocking(False)
    sel = selectors.DefaultSelector()  # not select(): a server may hold fds above 1024
    sel.register(listener, selectors.EVENT_READ)
    sel.register(state.wake_r, selectors.EVENT_READ)

    def vet(sock: socket.socket, addr: tuple, budget: float) -> None:
        ch, won = None, False
        try:
            # sends get the session's timeout from the start: the reader thread shares the fd,
            # whose blocking mode must not change under it later
            ch = Channel.wrap_accepted(sock, ctx, peer_name, kind=kind, link=link, timeout=timeout,
                                       handshake_timeout=budget, max_frame=MAX_TICKET)
            ch.timeout = budget
            got = bytes(ch.recv_frame(KIND_TICKET))
            if not hmac.compare_digest(got, ticket):
                raise ProtocolError(f"ticket {got[:64]!r} is not this session's")
            with state.lock:
                if state.done:
                    raise ProtocolError("accepting has ended")
                # Refused if another connection claimed the session or this one timed out
                claim = state.pool.connection(sock, peer_name)
            ch.max_frame = max_frame  # safe: party 0 sends nothing more before our ack
            _adopt(ch, meter, received=len(got))
            try:
                ch.send_frame(KIND_TICKET, _ACK)
            except ChannelError:
                claim.close()  # the session is free again for another connection
                raise
            ch.timeout = timeout
            with state.lock:
                if not state.done:  # else accept_peer has given up: ours is closed below
                    state.winner, ch, won = ch, None, True
                    state.wake_w.send(b"!")
        except (ChannelError, OSError) as exc:
            # anyone who reaches the port can cause this: rate-limited like the other ports
            state.pool.handshake_failed(f"dropped a connection from {addr[0]}:{addr[1]}: {exc}")
        finally:
            state.pool.release(sock)
            if ch is not None:
                ch.close()
            elif not won:
                sock.close()  # Channel.wrap_accepted failed and already closed what it made

    try:
        while True:
            now = time.monotonic()
            next_cut = state.pool.expire(now)
            with state.lock:
                if state.winner is not None:
                    return state.winner
            if now >= deadline:
                raise PeerTimeout(f"no {peer_name} with this session's ticket connected within {timeout:.0f}s")
            wait = min(deadline, next_cut if next_cut is not None else deadline) - now
            for key, _ in sel.select(max(wait, 0.0)):
                if key.fileobj is state.wake_r:
                    state.wake_r.recv(64)
                    continue
                try:
                    sock, addr = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                until = min(time.monotonic() + HANDSHAKE_TIMEOUT, deadline)
                state.pool.offer(sock, deadline=until)  # a full pool drops its oldest
                threading.Thread(target=vet, args=(sock, addr, max(until - time.monotonic(), 0.01)),
                                 name=f"vet {addr[0]}:{addr[1]}", daemon=True).start()
    finally:
        sel.close()
        state.finish()
        listener.settimeout(previous)


def _fatal(exc: BaseException) -> bool:
    """A certificate or TLS failure (ours or the peer's verdict): retrying cannot help."""
    benign = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
              ssl.SSLWantWriteError)  # a close, a reset or a timeout: the peer may admit us later
    seen: BaseException | None = exc
    while seen is not None:  # explicit causes only: the transport chains them with ``from``
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, benign):
            return True
        seen = seen.__cause__
    return False


def connect_peer(address: tuple[str, int], ctx: ssl.SSLContext, peer_name: str, ticket: bytes, *,
                 timeout: float, kind: str = "online", meter: Meter | None = None,
                 link: LinkProfile = NO_LINK, max_frame: int = MAX_FRAME) -> Channel:
    """Party 0's side: connect to ``address`` until ``peer_name`` admits ``ticket``, within
    ``timeout`` seconds; see the module docstring."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"{peer_name} at {address[0]}:{address[1]} did not admit this session "
                              f"within {timeout:.0f}s; last attempt: {last}") from last
        budget = min(ATTEMPT_TIMEOUT, left)
        ch = None
        try:
            ch = Channel.connect(address, ctx, peer_name, kind=kind, link=link, timeout=timeout,
                                 connect_timeout=budget, handshake_timeout=budget, max_frame=max_frame)
            ch.send_frame(KIND_TICKET, ticket)
            ch.timeout = max(min(ACK_TIMEOUT, deadline - time.monotonic()), 0.01)
            ack = bytes(ch.recv_frame(KIND_TICKET))
            if ack != _ACK:
                raise ProtocolError(f"unexpected answer to our ticket: {ack[:64]!r}")
        except ChannelError as exc:
            if ch is not None:
                ch.close()
            if isinstance(exc, HandshakeError) and _fatal(exc):
                raise
            last = exc
            log.info("%s: attempt to open the session failed, retrying: %s", peer_name, exc)
            time.sleep(max(min(_RETRY_PAUSE, deadline - time.monotonic()), 0.0))
            continue
        _adopt(ch, meter, sent=len(ticket), received=len(ack), rounds=1)
        ch.timeout = timeout
        return ch
