"""Who may hold a connection on a listening port, counted per stage.

Why stages: a connection costs a thread (and later a TLS reader) from the moment it is
accepted, but it only says who it is at the end of the TLS handshake. Counting every accepted
socket against one cap let anyone without a certificate hold all the slots with idle TCP
connections (issue 14). So:

1. *Handshakes* (unauthenticated): at most ``max_handshakes`` at once, each cut off
   ``handshake_timeout`` seconds after it was accepted, whatever it sends. When the pool is
   full a pending handshake is dropped to make room: the oldest of the source address that
   holds the most, an address that has authenticated before only while no stranger's
   handshake is pending (``net.source_limits``). Dropping the oldest overall let one address churning connections
   push every real client's handshake out (issue 25, finding 7); now it pushes out its own.
   An address that never authenticated gets a thread for at most ``source_rate`` connections
   a second (``source_burst`` at once): the flood's threads were what slowed everyone's
   handshakes. The rest wait, without a thread, in a room as small as the pool (``_wait``).
   Authenticated connections are never counted here.
2. *Connections* (authenticated, after TLS and the hello): at most ``max_per_identity`` per
   certificate name and ``max_connections`` in all. A connection over a cap is refused with
   ``Refused`` (the caller may tell the peer why); it stays counted as a handshake until it is
   closed, so refused connections are bounded and time-limited too.

``accept_loop`` (``net.listening``) runs stage 1 for every accepted socket; the handler calls
``connection(sock, identity)`` after its handshake. ``channel_options()`` are the keyword
arguments the handler passes to ``Channel.wrap_accepted`` (the handshake deadline and the
port's ``BufferBudget``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from net.channel_errors import ChannelError
from net.frames import KIND_OBJECT, BufferBudget
from net.source_limits import KnownSources, PendingBySource, SourceRates, source_key

__all__ = ["Admission", "Refused", "refuse"]

log = logging.getLogger("starfish.admission")
_LOG_EVERY = 10.0  # seconds between summaries of dropped handshakes (a flood must not flood the log)


class Refused(ConnectionError):
    """An authenticated connection over a cap; ``str()`` is the reason, fit to show the peer.
    ``code``: ``too_many_connections``, or ``handshake_timeout`` (its handshake slot was taken
    back, at the deadline or for a newer connection: its socket is already shut down)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def refuse(ch: Any, reply: bytes, *, wait: float, kind: int = KIND_OBJECT) -> None:
    """Tell a refused peer why, then close ``ch``. The reply goes out at once, and the channel
    stays open until the peer's first frame arrives (at most ``wait`` seconds): a client that
    sends its request right after connecting then reads the refusal as the answer to it,
    instead of a connection reset caused by closing with its request unread."""
    try:
        ch.send_frame(kind, reply)
        ch.timeout = wait
        ch.recv_frame(kind)
    except ChannelError:
        pass  # it hung up or sent something else: either way it is done with us
    finally:
        ch.close()


def _shutdown(sock: socket.socket) -> None:
    """Wake whatever thread is blocked on ``sock``; it closes the socket itself. Never
    ``close()`` here: the fd number could be reused under that thread."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


#: bounds of the per-source tables (``net.source_limits``): addresses remembered as having
#: authenticated, and rate buckets of addresses that have not (least recently used go first)
KNOWN_SOURCES = 1024
RATE_BUCKETS = 4096


class Admission:
    """The caps of one listening port; thread-safe. See the module docstring."""

    def __init__(self, name: str, *, max_handshakes: int = 64, handshake_timeout: float = 5.0,
                 max_connections: int = 256, max_per_identity: int = 4,
                 max_buffered: int | None = None, max_buffered_per_identity: int | None = None,
                 source_rate: float = 0.0, source_burst: int = 1) -> None:
        """``source_rate``, ``source_burst``: connections a second (at once) of one address that
        has not authenticated yet that get a handshake thread; 0: no rate. Off by default: the
        internal ports' pools are small and their peers two servers, and the per-address drop
        rule already keeps a flood from pushing out anyone else's handshakes."""
        if max_handshakes < 1 or max_connections < 1 or max_per_identity < 1 or handshake_timeout <= 0:
            raise ValueError("admission caps must be >= 1 and the handshake timeout > 0")
        if source_rate < 0 or source_burst < 1:
            raise ValueError("the per-source rate must be >= 0 and its burst >= 1")
        self.name = name
        self.max_handshakes = max_handshakes
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_per_identity = max_per_identity
        self.budget = (BufferBudget(max_buffered, max_buffered_per_identity)
                       if max_buffered is not None or max_buffered_per_identity is not None else None)
        self._lock = threading.Lock()
        self._pending = PendingBySource()
        self._waiting = PendingBySource()   # over their source's rate: no thread yet (``_wait``)
        self._known = KnownSources(KNOWN_SOURCES)
        self._rates = SourceRates(source_rate, source_burst, RATE_BUCKETS)
        self._by_identity: dict[str, int] = {}
        self._connections = 0
        self._dropped = 0           # handshakes dropped (or closed over the rate) since the last summary
        self._dropped_total = 0
        self._limited_total = 0     # of those, closed without a thread: over their source's rate
        self._logged_at = 0.0
        self._failed = 0            # failed handshakes not yet in a log line
        self._failed_total = 0
        self._failed_logged_at: float | None = None

    @classmethod
    def from_limits(cls, name: str, limits: Any) -> "Admission":
        """The client API's caps: every key of the config's ``[limits]`` section."""
        return cls(name, max_handshakes=limits.max_handshakes, handshake_timeout=limits.handshake_timeout,
                   max_connections=limits.max_connections,
                   max_per_identity=limits.max_connections_per_identity,
                   max_buffered=limits.max_buffered_bytes,
                   max_buffered_per_identity=limits.max_buffered_per_identity,
                   source_rate=limits.handshake_rate_per_source,
                   source_burst=limits.handshake_burst_per_source)

    def channel_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Channel.wrap_accepted`` on this port."""
        return {"handshake_timeout": self.handshake_timeout, "budget": self.budget}

    # ------------------------------------------------------------------ stage 1: handshakes
    def offer(self, sock: socket.socket, deadline: float | None = None) -> None:
        """Count a just-accepted socket as a pending handshake (until ``deadline``, default
        now + ``handshake_timeout``), dropping one (``PendingBySource.victim``) if the pool is
        full. No rate applies here: the caller starts a thread for ``sock`` whatever we say."""
        now = time.monotonic()
        with self._lock:
            for victim in self._admit(sock, source_key(sock), now, deadline):
                _shutdown(victim)

    def offer_batch(self, socks: list[socket.socket]) -> list[socket.socket]:
        """``offer`` for sockets accepted together, oldest first; returns the ones to start a
        thread for, in order. A socket dropped for a later one of the same burst is closed
        here, before any thread is spent on it (a burst of strangers then costs an accept and
        a close each). A socket over its (unknown) source's rate waits, without a thread, for
        ``take_waiting``."""
        now = time.monotonic()
        keys = [source_key(s) for s in socks]   # a syscall each: outside the lock
        with self._lock:
            admitted = []
            for sock, key in zip(socks, keys):
                if key in self._known or self._rates.allow(key, now):
                    admitted.append((sock, key, None))
                else:
                    self._wait(sock, key, now)
            return self._admit_all(admitted, now)

    def _wait(self, sock: socket.socket, key: str, now: float) -> None:
        """Park an over-rate socket (lock held). Why not close it at once: a real client behind
        the flooding address would then be closed too, even the moment after the flood stopped;
        parked, it gets the next token (newest first). The room holds ``max_handshakes``
        sockets and costs no thread; when full, the oldest of the source parking most goes."""
        while len(self._waiting) >= self.max_handshakes:
            victim = self._waiting.victim()
            assert victim is not None, "a full waiting room names a victim"
            self._close_waiting(victim, now)
        self._waiting.add(sock, key, now + self.handshake_timeout, False)

    def _close_waiting(self, sock: socket.socket, now: float) -> None:
        self._note_drop(now, self._waiting.source(sock) or "")
        self._waiting.remove(sock)
        self._limited_total += 1
        sock.close()   # no thread has it: closing is safe, and frees the fd now

    def take_waiting(self, now: float | None = None) -> tuple[list[socket.socket], float | None]:
        """Parked sockets whose source has a token again (or became known), newest first, now
        counted as pending handshakes: start a thread for each. Also returns how soon to ask
        again (``None``: nothing is parked)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not len(self._waiting):
                return [], None
            ready = []
            for sock in reversed(list(self._waiting.deadlines)):
                key = self._waiting.source(sock) or ""
                if key in self._known or self._rates.allow(key, now):
                    ready.append((sock, key, self._waiting.deadlines[sock]))
                    self._waiting.remove(sock)
            out = self._admit_all(ready, now)
            # no sooner than 10 ms: a high rate must not turn the accept loop into a busy loop
            return out, (max(1.0 / self._rates.rate, 0.01) if len(self._waiting) else None)

    def _admit_all(self, socks: list[tuple[socket.socket, str, float | None]], now: float) -> list[socket.socket]:
        """``_admit`` each (lock held); those pushed out by a later one of ``socks`` are closed
        here, since no thread has them yet. Returns the rest, in order."""
        fresh = set()
        for sock, key, deadline in socks:
            fresh.add(sock)
            for victim in self._admit(sock, key, now, deadline):
                if victim in fresh:
                    fresh.discard(victim)
                    victim.close()
                else:
                    _shutdown(victim)
        return [s for s, _, _ in socks if s in fresh]

    def _admit(self, sock: socket.socket, key: str, now: float, deadline: float | None) -> list[socket.socket]:
        """Add ``sock`` to the pool (lock held); returns the handshakes dropped for it."""
        dropped = []
        while len(self._pending) >= self.max_handshakes:
            victim = self._pending.victim()
            assert victim is not None, "a full pool names a victim"
            self._note_drop(now, self._pending.source(victim) or "")
            self._pending.remove(victim)
            dropped.append(victim)
        until = now + self.handshake_timeout if deadline is None else deadline
        self._pending.add(sock, key, until, key in self._known)
        return dropped

    def expire(self, now: float | None = None) -> float | None:
        """Cut off handshakes (and parked sockets) past their deadline; returns the next
        deadline of a pending handshake, if any."""
        now = time.monotonic() if now is None else now
        with self._lock:
            # deadlines are mostly in arrival order; a shorter explicit one is rare, so scan
            late = [s for s, until in self._pending.deadlines.items() if until <= now]
            for sock in late:
                self._pending.remove(sock)
                _shutdown(sock)
            for sock in [s for s, until in self._waiting.deadlines.items() if until <= now]:
                self._close_waiting(sock, now)
            return min(self._pending.deadlines.values(), default=None)

    def release(self, sock: socket.socket) -> None:
        """The handler is done with ``sock`` (a no-op if it became a connection or was dropped)."""
        with self._lock:
            self._pending.remove(sock)

    def drop_pending(self) -> None:
        """Cut off every pending handshake (e.g. the listener is closing)."""
        with self._lock:
            for sock in self._pending.clear():
                _shutdown(sock)
            for sock in self._waiting.clear():
                sock.close()

    def pending(self, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._pending

    def _note_drop(self, now: float, source: str) -> None:
        self._dropped += 1
        self._dropped_total += 1
        if now - self._logged_at >= _LOG_EVERY:
            log.warning("%s port: %d unauthenticated connections dropped (handshake pool of %d full, or "
                        "over their address's rate; the last from %s)",
                        self.name, self._dropped, self.max_handshakes, source or "a local socket")
            self._dropped, self._logged_at = 0, now

    def handshake_failed(self, exc: object, now: float | None = None) -> None:
        """A handshake on this port failed (TLS, certificate, hello, deadline): log it, at
        most one line per ``_LOG_EVERY`` seconds. Anyone who can reach the port can cause
        one, so a line each let a stranger write 0.3 GB of log an hour (issue 25, finding 7).
        The first failure after a quiet interval is logged with its reason at once; the ones
        after it are counted, and the next line says how many there were and the last reason.
        A summary is written when the next failure comes after the interval (a flood that
        stops leaves its last count unwritten; ``counts()["handshake_failures"]`` has it).
        Every reason not in an INFO line goes to DEBUG."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._failed += 1
            self._failed_total += 1
            if self._failed_logged_at is not None and now - self._failed_logged_at < _LOG_EVERY:
                # each reason stays available at DEBUG (off in the daemons) for diagnosis
                log.debug("%s port: a handshake failed: %s", self.name, exc)
                return
            n, since, self._failed = self._failed, self._failed_logged_at, 0
            self._failed_logged_at = now
        if n == 1:
            log.info("%s port: a handshake failed: %s", self.name, exc)
        else:
            log.info("%s port: %d handshakes failed in the last %.0f s (the last: %s)",
                     self.name, n, now - since, exc)

    # ------------------------------------------------------------------ stage 2: connections
    def connection(self, sock: socket.socket | None, identity: str) -> "_Held":
        """Turn ``sock``'s handshake into a connection of ``identity``, or raise ``Refused``.
        Use the result as a context manager (or call ``close()``) to give the slot back.

        ``sock``'s address becomes known (``net.source_limits.KnownSources``) whatever the caps
        say: a certificate of the deployment was shown from it, which is what makes its later
        handshakes worth keeping over strangers'."""
        with self._lock:
            if sock is not None:
                # recorded at accept; a handshake that outlived its slot is looked up (rare)
                key = self._pending.source(sock)
                key = source_key(sock) if key is None else key
                self._known.add(key)
                self._pending.promote(key)
            if sock is not None and sock not in self._pending:
                # its handshake deadline passed (or the pool dropped it) while it finished
                raise Refused("handshake_timeout", f"the handshake outlived its slot on the {self.name} "
                              f"port ({self.handshake_timeout:g}s, {self.max_handshakes} at once)")
            mine = self._by_identity.get(identity, 0)
            if mine >= self.max_per_identity:
                raise Refused("too_many_connections", f"{identity} already has {mine} open "
                              f"connections to the {self.name} port (limit {self.max_per_identity}); "
                              "close one and retry")
            if self._connections >= self.max_connections:
                raise Refused("too_many_connections", f"the {self.name} port has "
                              f"{self._connections} open connections (limit {self.max_connections}); "
                              "retry later")
            if sock is not None:
                self._pending.remove(sock)
            self._by_identity[identity] = mine + 1
            self._connections += 1
        return _Held(self, identity)

    def _leave(self, identity: str) -> None:
        with self._lock:
            self._connections -= 1
            left = self._by_identity.get(identity, 0) - 1
            if left > 0:
                self._by_identity[identity] = left
            else:
                self._by_identity.pop(identity, None)

    def counts(self) -> dict[str, Any]:
        """What is held right now (for tests and status)."""
        with self._lock:
            return {"handshakes": len(self._pending), "connections": self._connections,
                    "by_identity": dict(self._by_identity), "dropped": self._dropped_total,
                    "handshake_failures": self._failed_total, "rate_limited": self._limited_total,
                    "waiting": len(self._waiting),
                    "by_source": self._pending.per_source(), "known_sources": len(self._known)}


class _Held:
    """An admitted connection's slot; given back once, by ``close()`` or leaving ``with``."""

    def __init__(self, admission: Admission, identity: str) -> None:
        self._admission = admission
        self.identity = identity
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._admission._leave(self.identity)

    def __enter__(self) -> "_Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
