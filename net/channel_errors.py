"""The transport's failures, as the channel reports them (``net.channel`` re-exports them).

Why a module of their own: the accept side (``net.admission``, ``net.peer_accept``) and every
user of a channel catch them without needing the channel's machinery.
"""

from __future__ import annotations

__all__ = ["ChannelError", "PeerDisconnected", "PeerTimeout", "HandshakeError", "ProtocolError",
           "without_tracebacks"]


class ChannelError(ConnectionError):
    """Base class of transport failures."""


class PeerDisconnected(ChannelError):
    """The peer closed the connection or its process died."""


class PeerTimeout(ChannelError, TimeoutError):
    """The peer sent nothing within the timeout."""


class HandshakeError(ChannelError):
    """TLS or identity verification failed; the connection was not established."""


class ProtocolError(ChannelError):
    """The peer sent a frame we did not expect (kind or size)."""


def without_tracebacks(exc: BaseException) -> BaseException:
    """``exc`` with the tracebacks of it and of its causes cleared, for keeping it after the
    failing thread is gone. A traceback holds that thread's frames and so their locals (for a
    channel's reader: the partial payload); stored on the channel it would keep that memory
    alive as long as the channel lives, and through a reference cycle until the cycle
    collector happens to run (issue 14: 4 x 512 MiB stayed resident)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc
