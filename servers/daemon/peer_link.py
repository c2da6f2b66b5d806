"""The control link between the two servers: request/reply over mutually authenticated TLS.

Why a separate link from the 2PC session: FL rounds need only small agreements (which
clients reached both servers, the exchange of aggregate shares) at any time, while a 2PC
session (``mpc.session.open_party``, with its dealer connection and CrypTen's global
communicator) exists only for the duration of one unlearning job. Server 0 leads: it
sends one request at a time and server 1 answers, so the two can never wait for each
other. Server 1 listens (``peer_port``) and requires the certificate ``server0``; server
0 requires ``server1``. Both sides survive the other's restart: server 0 reconnects on
its next request, server 1 accepts the new connection and drops the old one.

Messages are msgpack maps (``common.wire.pack``) ``{"op": str, ...fields}``; replies
``{"ok": true, ...}`` or ``{"ok": false, "error": str}``. This module moves them; what they
say is ``servers.daemon.peer_messages`` (typed requests and replies that check their fields). The
peer is a server of the same deployment, but its messages are still size-bounded and
type-checked.

Server 1's port is reachable by anyone, but only ``server0`` has business there:
``PEER_CAPS`` admits a few handshakes at once, each for ``handshake_timeout`` seconds, and
two links of ``server0`` (the new one wins; the old one is being closed). A link over the cap
gets ``{"ok": false}`` with the reason (``net.admission``).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from net import tls
from common import wire
from net.admission import Admission, Refused, refuse
from net.channel import KIND_OBJECT, Channel, ChannelError, PeerTimeout, accept_loop

__all__ = ["PeerUnavailable", "PeerRefused", "PeerRequest", "PeerClient", "PeerServer"]

log = logging.getLogger("starfish.peer")

#: One legitimate identity (server0) with one link, two while a reconnect replaces the old one.
PEER_CAPS = {"max_handshakes": 4, "max_connections": 2, "max_per_identity": 2}


class PeerUnavailable(ConnectionError):
    """The other server cannot be reached (down, restarting, or the link broke)."""


class PeerRefused(RuntimeError):
    """The other server answered the request with an error."""


class PeerRequest(Protocol):
    """A control request (``servers.daemon.peer_messages``): its op and its fields."""

    OP: ClassVar[str]

    def to_wire(self) -> dict[str, Any]: ...


class PeerClient:
    """Server 0's end: ``call(request)`` sends one request and returns the reply map."""

    def __init__(self, keys_dir: Any, address: tuple[str, int], *, timeout: float,
                 max_bytes: int, connect_timeout: float = 2.0) -> None:
        self._ctx = tls.client_context(tls.identity(keys_dir, tls.PARTY_NAMES[0]))
        self._address = address
        self._timeout = timeout
        self._max = max_bytes
        self._connect_timeout = connect_timeout
        self._ch: Channel | None = None
        self._lock = threading.Lock()

    def _channel(self) -> Channel:
        if self._ch is None:
            try:
                self._ch = Channel.connect(self._address, self._ctx, tls.PARTY_NAMES[1], kind="online",
                                           timeout=self._timeout, connect_timeout=self._connect_timeout)
            except ChannelError as exc:
                raise PeerUnavailable(f"server 1 at {self._address} unreachable: {exc}") from exc
            log.info("control link to server 1 at %s:%d established", *self._address)
        return self._ch

    def call(self, request: PeerRequest) -> dict:
        op = request.OP
        with self._lock:
            ch = self._channel()
            try:
                ch.send_frame(KIND_OBJECT, wire.pack({"op": op, **request.to_wire()}))
                reply = wire.unpack(ch.recv_frame(KIND_OBJECT), self._max)
            except (ChannelError, wire.WireError) as exc:
                self._drop()
                raise PeerUnavailable(f"control link to server 1 failed during {op!r}: {exc}") from exc
        if reply.get("ok") is not True:
            raise PeerRefused(f"server 1 refused {op!r}: {reply.get('error', '(no reason)')}")
        return reply

    def _drop(self) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class PeerServer:
    """Server 1's end: accepts server 0 and answers its requests with ``handler``.

    ``handler(op, msg) -> dict`` returns the reply fields or raises; any exception becomes
    an ``{"ok": false}`` reply with its message (the link stays up).
    """

    def __init__(self, keys_dir: Any, listener: socket.socket,
                 handler: Callable[[str, dict], dict], *, timeout: float, max_bytes: int,
                 stop: threading.Event, handshake_timeout: float = 5.0) -> None:
        self._ctx = tls.server_context(tls.identity(keys_dir, tls.PARTY_NAMES[1]))
        # control messages are small: a link may buffer one message of max_bytes at a time
        self.admission = Admission("peer", handshake_timeout=handshake_timeout,
                                   max_buffered_per_identity=2 * max_bytes, **PEER_CAPS)
        self._listener = listener
        self._handler = handler
        self._timeout = timeout
        self._max = max_bytes
        self._stop = stop
        self._current: Channel | None = None
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        accept_loop(self._listener, self._serve, self._stop, name="peer-link", admission=self.admission)

    def _serve(self, sock: socket.socket) -> None:
        try:
            ch = Channel.wrap_accepted(sock, self._ctx, tls.PARTY_NAMES[0], kind="online",
                                       timeout=self._timeout, max_frame=self._max,
                                       **self.admission.channel_options())
        except ChannelError as exc:
            self.admission.handshake_failed(exc)  # anyone can cause this: rate-limited
            return
        try:
            slot = self.admission.connection(sock, ch.peer)
        except Refused as exc:
            log.warning("refused a control link of %s: %s", ch.peer, exc)
            refuse(ch, wire.pack({"ok": False, "error": str(exc)}), wait=self.admission.handshake_timeout)
            return
        with slot:
            self._serve_link(ch)

    def _serve_link(self, ch: Channel) -> None:
        with self._lock:
            old, self._current = self._current, ch
        if old is not None:
            old.close()  # server 0 reconnected (e.g. after a restart): the new link wins
        log.info("control link from server 0 established")
        try:
            while not self._stop.is_set():
                try:
                    buf = ch.recv_frame(KIND_OBJECT)
                except PeerTimeout:
                    continue  # an idle leader is fine
                try:
                    msg = wire.unpack(buf, self._max)
                    op = msg.get("op")
                    if not isinstance(op, str):
                        raise ValueError("control message without an op")
                    reply = {"ok": True, **self._handler(op, msg)}
                except Exception as exc:  # noqa: BLE001 - reported to server 0, link stays up
                    if not isinstance(exc, (ValueError, KeyError, LookupError, RuntimeError)):
                        log.exception("control request failed")
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                ch.send_frame(KIND_OBJECT, wire.pack(reply))
        except ChannelError as exc:
            log.info("control link from server 0 closed: %s", exc)
        finally:
            ch.close()
