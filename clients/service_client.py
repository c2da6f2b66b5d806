"""A client's (or the admin's) connection to one server of the service.

Why here: a client needs only its credentials, the wire schema and numpy; never torch or
the 2PC engine (docs/design.md 4). :class:`ServiceClient` sends one request at a time over a
mutually authenticated TLS 1.3 channel (it checks the server's certificate name,
``server0`` or ``server1``; the server checks ours), adds a strictly increasing nonce to
state-changing requests, and turns an error reply into :class:`ServiceError`.

Nonces are ``max(last sent + 1, time.time_ns())``: strictly increasing per client object and
close to real time, because a server refuses a nonce more than ``wire.NONCE_WINDOW_NS``
ahead of its own clock (so client clocks must not run that far ahead of the servers').

Retries: :meth:`ServiceClient.call` with ``retry_seconds`` reconnects and re-sends when the
connection fails at any level (refused, reset, broken pipe, a TLS error, a timeout; e.g. the
server restarts), never when the server answered with an error. A re-sent state-changing
request gets a fresh nonce, as the old one may already be recorded; uploads, task results,
unlearning requests and cancellations are idempotent on the server for identical content,
so a request that did arrive before the break is not applied twice. Every connection-level
failure reaches the caller as a ``ChannelError``, whatever the transport raised.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from net import tls
from net.channel import KIND_OBJECT, Channel, ChannelError, PeerDisconnected

from common import wire

__all__ = ["ServiceClient", "ServiceError"]


class ServiceError(RuntimeError):
    """The server refused a request; ``code`` is one of ``common.wire.ERROR_CODES``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ServiceClient:
    def __init__(self, keys_dir: str | os.PathLike[str], identity: str, party: int,
                 address: tuple[str, int], *, timeout: float = 120.0,
                 max_bytes: int = 1 << 30, connect_timeout: float = 10.0) -> None:
        self.identity = identity
        self.party = party
        self.address = address
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.connect_timeout = connect_timeout
        self._ctx = tls.client_context(tls.identity(keys_dir, identity))
        self._ch: Channel | None = None
        self._nonce = 0
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Open the channel now (a ChannelError if not; ``HandshakeError`` if we are refused)."""
        with self._lock:
            self._guarded(self._channel)

    def _channel(self) -> Channel:
        if self._ch is None:
            self._ch = Channel.connect(self.address, self._ctx, tls.PARTY_NAMES[self.party],
                                       kind="online", timeout=self.timeout,
                                       connect_timeout=self.connect_timeout)
        return self._ch

    def _next_nonce(self) -> int:
        self._nonce = max(self._nonce + 1, time.time_ns())
        return self._nonce

    def _exchange(self, kind: int, payload: bytes) -> bytearray:
        """Send one frame and wait for the reply frame (caller holds the lock)."""
        ch = self._channel()
        ch.send_frame(kind, payload)
        return ch.recv_frame(KIND_OBJECT)

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (caller holds the lock); any connection failure drops the channel and
        surfaces as a ChannelError.

        Why OSError and not only ChannelError: the transport does not wrap everything. A
        channel whose TLS state broke while it was idle (a record that failed to decrypt)
        raises ``ssl.SSLEOFError`` from its next send; that escaped the retry loop (so the
        CLI died) and left the dead channel in place, so every later call failed as well.
        Dropping the channel on a timeout also keeps a late reply to this request from being
        read as the answer to the next one.
        """
        try:
            return fn()
        except OSError as exc:            # ChannelError, ssl.SSLError, BrokenPipeError, ...
            if self._ch is not None:
                self._ch.close()
                self._ch = None
            if isinstance(exc, ChannelError):
                raise
            raise PeerDisconnected(f"connection to {tls.PARTY_NAMES[self.party]} at "
                                   f"{self.address} failed: {exc!r}") from exc

    def send_raw(self, payload: bytes, kind: int = KIND_OBJECT) -> dict:
        """Send an arbitrary frame and return the decoded reply map (tests of bad input)."""
        with self._lock:
            buf = self._guarded(lambda: self._exchange(kind, payload))
        return wire.unpack(buf, self.max_bytes)

    def call(self, op: str, *, retry_seconds: float = 0.0, retry_unavailable: bool = False,
             **fields: Any) -> dict:
        """One request; returns the reply map or raises ServiceError / ChannelError.

        With ``retry_seconds`` > 0 a connection failure is retried on a new connection until
        that many seconds have passed; a reply (ok or ServiceError) is final, except, with
        ``retry_unavailable``, an ``unavailable`` one (a server out of disk space or
        connections: nothing was stored), which is re-sent the same way. A mutating
        request whose ``nonce`` the caller chose is sent once: re-sending the same nonce after
        a break could only be refused as a replay, or would hide which attempt arrived.
        """
        pinned = op in wire.MUTATING_OPS and "nonce" in fields
        deadline = time.monotonic() + (0.0 if pinned else retry_seconds)
        delay = 0.05
        while True:
            try:
                return self._call_once(op, fields)
            except ChannelError:
                if time.monotonic() + delay > deadline:
                    raise
            except ServiceError as exc:
                if not (retry_unavailable and exc.code == "unavailable") or pinned \
                        or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)   # a restarting server: nothing to poll but the socket
            delay = min(1.0, delay * 2)

    def _call_once(self, op: str, fields: dict[str, Any]) -> dict:
        with self._lock:
            body = dict(fields)
            if op in wire.MUTATING_OPS and "nonce" not in body:
                body["nonce"] = self._next_nonce()   # per attempt: never the same nonce twice
            msg_id, payload = wire.make_request(op, **body)
            buf = self._guarded(lambda: self._exchange(KIND_OBJECT, payload))
        try:
            return wire.check_reply(buf, msg_id, self.max_bytes)
        except wire.WireError as exc:
            raise ServiceError(exc.code, exc.message) from None

    def close(self) -> None:
        ch, self._ch = self._ch, None
        if ch is not None:
            ch.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
