"""The dealer: a third, non-colluding party that produces correlated randomness.

Protocol (msgpack control frames over mutually authenticated TLS; see
``mpc.correlations`` for the mathematics):

1. Each server connects with its own certificate (``server0``/``server1``) and says
   ``{"op": "hello", "session": <16 bytes>, "rank": r}``. The two servers agreed on the
   session id over their own link. The dealer answers with that rank's 16-byte seed.
   A rank's seed is handed out once per session, and only to the certificate of that
   rank: server 1 can never obtain seed 0.
2. Server 0 is then done. Server 1 asks ``{"op": "get", "index": i, "request": req}``
   (one correction tensor back) or ``{"op": "prefill", "start": i, "requests": [...]}``
   (one correction tensor per request, streamed before the online phase).
3. ``{"op": "bye"}`` ends the session.

The dealer never receives data: requests are sizes and op names only.

Admission (``net.admission``): only ``server0`` and ``server1`` have any business here, so the
caps are tiny (``DEALER_CAPS``): a few handshakes at once, each cut off after
``handshake_timeout`` (5 s; it used to be the 3,600 s request timeout), a few connections
per server. A server over its cap gets ``{"op": "error"}`` with the reason.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mpc import correlations
from net import tls
from net.admission import Admission, Refused, refuse
from net.channel import KIND_OBJECT, KIND_TENSOR, Channel, ChannelError, accept_loop, listen
from common.prg import new_seed
from common.wire import pack, unpack_bounded

log = logging.getLogger("starfish.dealer")
MAX_PREFILL = 1 << 20  # requests in one prefill message


def unpack(buf: bytes) -> dict:
    """A dealer control message; malformed msgpack raises msgpack's error (mostly ValueError)."""
    msg = unpack_bounded(buf, max_bin_len=1 << 24, max_array_len=MAX_PREFILL, max_str_len=1 << 16,
                         max_map_len=64)
    if not isinstance(msg, dict) or "op" not in msg:
        raise correlations.RequestError("dealer message must be a map with an 'op'")
    return msg


SESSION_TTL = 24 * 3600.0  # a session whose party 1 never finished is forgotten after this
#: Two legitimate identities, one session per job (a failed attempt may briefly leave a second):
#: a handful of handshakes and connections is plenty, and bounds the threads a flood can cost.
DEALER_CAPS = {"max_handshakes": 8, "max_connections": 8, "max_per_identity": 4}


@dataclass
class _Session:
    seeds: tuple[bytes, bytes] = field(default_factory=lambda: (new_seed(), new_seed()))
    handed: set = field(default_factory=set)
    created: float = field(default_factory=time.monotonic)
    pair: int | None = None      # None: the two servers; k: worker pair k (issue 30)


class DealerServer:
    """Serves any number of concurrent two-party sessions, one thread per connection."""

    def __init__(self, ident: tls.Identity, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0,
                 max_frame: int | None = None, *, handshake_timeout: float = 5.0,
                 max_buffered: int | None = None, max_buffered_per_identity: int | None = None):
        """``timeout``: how long an authenticated server may stay silent between requests;
        ``handshake_timeout``: how long anyone may take for TLS and the hello."""
        self._ctx = tls.server_context(ident)
        self._max_frame = max_frame
        self.admission = Admission("dealer", handshake_timeout=handshake_timeout, max_buffered=max_buffered,
                                   max_buffered_per_identity=max_buffered_per_identity, **DEALER_CAPS)
        self._listener = listen(host, port, backlog=128)  # a burst of strangers must not fill it
        self._timeout = timeout
        self._sessions: dict[bytes, _Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def serve_forever(self) -> None:
        accept_loop(self._listener, self._serve_connection, self._stop, name="dealer-session",
                    admission=self.admission)

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()

    def _serve_connection(self, sock: socket.socket) -> None:
        limit = {} if self._max_frame is None else {"max_frame": self._max_frame}
        try:
            ch = Channel.wrap_accepted(sock, self._ctx, _serves, kind="offline",
                                       timeout=self._timeout, **limit, **self.admission.channel_options())
        except ChannelError as exc:
            self.admission.handshake_failed(exc)  # anyone can cause this: rate-limited, not a warning
            return
        try:
            slot = self.admission.connection(sock, ch.peer)
        except Refused as exc:
            log.warning("refused a dealer connection of %s: %s", ch.peer, exc)
            refuse(ch, pack({"op": "error", "message": str(exc)}), wait=self.admission.handshake_timeout)
            return
        try:
            self._serve(ch)
        except (ChannelError, correlations.RequestError, KeyError, ValueError, TypeError) as exc:
            log.warning("dealer session with %s ended: %s", ch.peer, exc)
            try:
                ch.send_frame(KIND_OBJECT, pack({"op": "error", "message": str(exc)[:500]}))
            except ChannelError:
                pass
        finally:
            ch.close()
            slot.close()

    def _serve(self, ch: Channel) -> None:
        hello = unpack(ch.recv_frame(KIND_OBJECT))
        rank = hello.get("rank")
        sid = hello.get("session")
        if hello["op"] != "hello" or rank not in (0, 1) or not isinstance(sid, bytes) or len(sid) != 16:
            raise correlations.RequestError("expected hello with a 16-byte session id and rank 0/1")
        pair = _pair_of(ch.peer, rank)
        with self._lock:
            now = time.monotonic()
            for stale in [k for k, v in self._sessions.items() if now - v.created > SESSION_TTL]:
                del self._sessions[stale]  # a long-running dealer must not keep dead sessions
            sess = self._sessions.setdefault(sid, _Session(pair=pair))
            if sess.pair != pair:   # a session's two seeds go to one pair: server0-w1 with server1-w1
                raise correlations.RequestError(f"{ch.peer} may not join a session of another pair")
            if rank in sess.handed:
                raise correlations.RequestError(f"seed of rank {rank} already handed out for this session")
            sess.handed.add(rank)
        ch.send_frame(KIND_OBJECT, pack({"op": "seed", "seed": sess.seeds[rank]}))
        if rank == 0:
            return
        s0, s1 = sess.seeds
        masks = correlations.MaskRegistry()

        def answer(raw, index: int) -> None:
            req = correlations.validate(raw)
            masks.admit(req, index)
            ch.send_frame(KIND_TENSOR, _bytes(correlations.correction(req, s0, s1, index, masks)))
        try:
            while True:
                msg = unpack(ch.recv_frame(KIND_OBJECT))
                if msg["op"] == "get":
                    answer(msg["request"], int(msg["index"]))
                elif msg["op"] == "prefill":
                    start = int(msg["start"])
                    for k, raw in enumerate(msg["requests"]):
                        answer(raw, start + k)
                elif msg["op"] == "bye":
                    return
                else:
                    raise correlations.RequestError(f"unknown dealer op {msg['op']!r}")
        finally:
            with self._lock:
                self._sessions.pop(sid, None)


def _serves(name: str) -> bool:
    """The dealer serves the two servers and their workers (``net.tls.party_name``)."""
    return name in tls.PARTY_NAMES or tls.worker_of(name) is not None


def _pair_of(peer: str, rank: int) -> int | None:
    """The pair a hello's certificate belongs to (None: the servers themselves, k: workers k),
    refusing a certificate that may not act as ``rank``."""
    worker = tls.worker_of(peer)
    if peer != tls.PARTY_NAMES[rank] and (worker is None or worker[0] != rank):
        raise correlations.RequestError(f"{peer} may not act as rank {rank}")
    return None if worker is None else worker[1]


def _bytes(t) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).numpy()).cast("B")  # flat: a 2-D empty view cannot be cast


class DealerLink:
    """A server's side of the dealer protocol."""

    def __init__(self, channel: Channel, rank: int, session: bytes):
        self.channel = channel
        self.rank = rank
        channel.send_frame(KIND_OBJECT, pack({"op": "hello", "session": session, "rank": rank}))
        reply = self._reply()
        self.seed: bytes = reply["seed"]

    def _reply(self) -> dict:
        msg = unpack(self.channel.recv_frame(KIND_OBJECT))
        if msg["op"] == "error":
            raise correlations.RequestError(f"dealer refused: {msg.get('message')}")
        return msg

    def _tensor(self, shape):
        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        buf = self.channel.recv_frame(KIND_TENSOR, 8 * n)
        return torch.from_numpy(np.frombuffer(buf, dtype=np.int64)).reshape(shape)

    def get(self, index: int, req: tuple):
        self.channel.send_frame(KIND_OBJECT, pack({"op": "get", "index": index, "request": req}))
        return self._tensor(correlations.correction_shape(req))

    def prefill(self, start: int, reqs: list[tuple]) -> list:
        out = []
        for off in range(0, len(reqs), MAX_PREFILL):
            chunk = reqs[off : off + MAX_PREFILL]
            self.channel.send_frame(
                KIND_OBJECT, pack({"op": "prefill", "start": start + off, "requests": chunk})
            )
            out.extend(self._tensor(correlations.correction_shape(r)) for r in chunk)
        return out

    def close(self) -> None:
        try:
            if self.rank == 1:
                self.channel.send_frame(KIND_OBJECT, pack({"op": "bye"}))
        except ChannelError:
            pass
        self.channel.close()
