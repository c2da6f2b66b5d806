"""A client's (or the admin's) connection to one server of the service.

Why here: a client needs only its credentials, the wire schema and numpy; never torch or
the 2PC engine (docs/design.md 4). :class:`ServiceClient` sends one request at a time over a
mutually authenticated TLS 1.3 channel (it checks the server's certificate name,
``server0`` or ``server1``; the server checks ours), adds a strictly increasing nonce to
state-changing requests, and turns an error reply into :class:`ServiceError`.

Retries: :meth:`ServiceClient.call` with ``retry_seconds`` reconnects and re-sends when the
connection breaks (e.g. the server restarts). A re-sent request gets a fresh nonce; uploads,
task results and unlearning requests are idempotent on the server for identical content,
so a request that did arrive before the break is not applied twice.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from mpc import tls
from mpc.channel import KIND_OBJECT, Channel, ChannelError

from mpc import wire

__all__ = ["ServiceClient", "ServiceError"]


class ServiceError(RuntimeError):
    """The server refused a request; ``code`` is one of ``mpc.wire.ERROR_CODES``."""

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
        """Open the channel now (raises ``mpc.channel.HandshakeError`` if we are refused)."""
        with self._lock:
            self._channel()

    def _channel(self) -> Channel:
        if self._ch is None:
            self._ch = Channel.connect(self.address, self._ctx, tls.PARTY_NAMES[self.party],
                                       kind="online", timeout=self.timeout,
                                       connect_timeout=self.connect_timeout)
        return self._ch

    def _next_nonce(self) -> int:
        self._nonce = max(self._nonce + 1, time.time_ns())
        return self._nonce

    def send_raw(self, payload: bytes, kind: int = KIND_OBJECT) -> dict:
        """Send an arbitrary frame and return the decoded reply map (tests of bad input)."""
        with self._lock:
            ch = self._channel()
            ch.send_frame(kind, payload)
            return wire.unpack(ch.recv_frame(KIND_OBJECT), self.max_bytes)

    def call(self, op: str, *, retry_seconds: float = 0.0, **fields: Any) -> dict:
        """One request; returns the reply map or raises ServiceError / ChannelError."""
        deadline = time.monotonic() + retry_seconds
        delay = 0.05
        while True:
            try:
                return self._call_once(op, fields)
            except ChannelError:
                self.close()
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)   # a restarting server: nothing to poll but the socket
                delay = min(1.0, delay * 2)

    def _call_once(self, op: str, fields: dict[str, Any]) -> dict:
        with self._lock:
            body = dict(fields)
            if op in wire.MUTATING_OPS and "nonce" not in body:
                body["nonce"] = self._next_nonce()
            msg_id, payload = wire.make_request(op, **body)
            ch = self._channel()
            ch.send_frame(KIND_OBJECT, payload)
            buf = ch.recv_frame(KIND_OBJECT)
        try:
            return wire.check_reply(buf, msg_id, self.max_bytes)
        except wire.WireError as exc:
            raise ServiceError(exc.code, exc.message) from None

    def close(self) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
