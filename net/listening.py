"""Listening sockets and the loop that hands each accepted connection to a handler thread.

With an ``admission`` (``net.admission.Admission``) every accepted socket is counted as a
pending handshake from the moment it is accepted: the pool is bounded (when it is full, the
source holding the most loses its oldest) and each is cut off at its deadline, which this loop
enforces between accepts; sockets over their source's rate wait without a thread until this
loop hands them one (``take_waiting``). The loop takes everything the kernel has queued at
once, so that a burst of strangers is mostly closed before a thread is started for it:
starting (and then waking) a thread per stranger made draining 1,000 queued sockets take a
second, during which an authenticated client queued behind them waited. Without one the loop
behaves as it always did (``admit`` may refuse a socket before its thread starts).
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, Protocol

__all__ = ["HandshakePool", "ListenError", "accept_loop", "listen"]


class ListenError(OSError):
    """A port could not be opened; the message names the address (the daemons add the config key).

    Why its own type: a bare ``OSError: [Errno 98] Address already in use`` names neither the
    port nor who configured it, and the command line must tell it apart from other failures
    to answer with one line instead of a traceback.
    """

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host = host
        self.port = port
        self.reason = reason


class HandshakePool(Protocol):
    """What ``accept_loop`` needs of an admission (``net.admission.Admission``)."""

    handshake_timeout: float

    def offer_batch(self, socks: list[socket.socket]) -> list[socket.socket]: ...

    def expire(self, now: float | None = None) -> float | None: ...

    def take_waiting(self, now: float | None = None) -> tuple[list[socket.socket], float | None]: ...

    def release(self, sock: socket.socket) -> None: ...

    def drop_pending(self) -> None: ...


def _handle(handle: Callable[[socket.socket], None], sock: socket.socket,
            admission: HandshakePool | None) -> None:
    try:
        handle(sock)
    finally:
        if admission is not None:
            admission.release(sock)  # a handler that never got as far as a connection


_BATCH = 4096  # sockets taken from the kernel's queue at once, before deadlines are checked again


def _queued(listener: socket.socket, poll: float) -> list[socket.socket]:
    """Whatever else the kernel has queued on ``listener`` right now, without waiting."""
    out: list[socket.socket] = []
    try:
        listener.settimeout(0.0)
        while len(out) < _BATCH:
            out.append(listener.accept()[0])
    except OSError:  # BlockingIOError: the queue is empty (a closed listener fails the next wait)
        pass
    try:
        listener.settimeout(poll)
    except OSError:
        pass  # closed meanwhile: the loop's next accept ends it
    return out


def accept_loop(
    listener: socket.socket,
    handle: Callable[[socket.socket], None],
    stop: threading.Event,
    *,
    name: str = "connection",
    admit: Callable[[], bool] = lambda: True,
    poll: float = 0.2,
    admission: HandshakePool | None = None,
) -> None:
    """Accept connections until ``stop`` is set or the listener closes; each accepted socket is
    handled on its own daemon thread (TLS is set up there, so a slow client blocks no one).
    ``admit`` may refuse a connection (e.g. too many open); the socket is then closed.
    ``admission`` bounds and times the handshakes (see the module docstring); the handler then
    calls ``admission.connection(sock, identity)`` once it knows who connected."""
    listener.settimeout(poll)

    def start(socks: list[socket.socket]) -> None:
        for sock in socks:
            threading.Thread(target=_handle, args=(handle, sock, admission), name=name,
                             daemon=True).start()

    wait = poll
    try:
        while not stop.is_set():
            if admission is not None:
                admission.expire()  # at least every ``poll`` seconds, and after every accept
                # parked sockets (over their source's rate) whose turn came; while any is
                # parked, wake as often as its source earns a token, so one is not kept waiting
                ready, again = admission.take_waiting()
                start(ready)
                wait = poll if again is None else min(poll, again)
                try:
                    listener.settimeout(wait)
                except OSError:
                    break   # closed: accept would fail too
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            batch = [sock]
            if admission is not None:
                batch += _queued(listener, wait)  # a burst is handled as one, see offer_batch
            kept = []
            for sock in batch:
                if admit():
                    kept.append(sock)
                else:
                    sock.close()
            batch = kept
            if admission is not None:
                batch = admission.offer_batch(batch)
            start(batch)
    finally:
        if admission is not None:
            admission.drop_pending()  # no one enforces their deadlines any more


def listen(host: str = "127.0.0.1", port: int = 0, backlog: int = 8) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port (read it from getsockname())."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(backlog)
    except OSError as exc:
        s.close()
        raise ListenError(host, port, exc.strerror or str(exc)) from exc
    return s
