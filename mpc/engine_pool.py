"""Two-party engines that outlive sessions: one per peer pair for a server daemon's life.

Starting an engine (a process importing jax and SPU, the link's TLS handshakes, CHEETAH's OT
set-up) took most of an FL round's range check in two-party mode (about 10 s), so a daemon keeps
its engines here (``mpc.session.shared_engine_pool``) and each session borrows one after both
servers agreed, over the session's authenticated channel, that they hold the two ends of the
same link (``docs/protocols.md``, "Two-party mode").
"""

from __future__ import annotations

import threading
import time

from common.wire import pack, unpack_bounded
from net.channel import KIND_OBJECT, Channel
from net.link import NO_LINK, LinkProfile
from net.metering import Meter
from .spu_engine import EngineError, SpuEngine

__all__ = ["EnginePool"]

#: a pooled engine's link waits this long for a peer inside a call (its parent notices a dead
#: peer sooner); one-off engines keep the session's timeout
_POOL_LINK_TIMEOUT = 3600.0
#: a pooled engine is replaced after this many seconds: its session certificate is valid a day
_POOL_MAX_AGE = 12 * 3600.0
#: seconds a pooled engine's link stays up after its last answer when its daemon stops: a call
#: ends on one side with a send the library makes asynchronously, and killing the engine at once
#: lost it (the peer's last call of that session then failed; seen on CI as the engine pool's flake)
_POOL_LINGER = 3.0


class EnginePool:
    """Engines that outlive sessions: one per peer pair (this rank, the two hosts, the emulated
    link), for the life of a server daemon (``mpc.session.shared_engine_pool``).

    ``engine(...)`` is called by both parties at the same point of a session, over its
    authenticated channel. Each offers the link id of the engine it holds, if that engine is
    alive and idle and younger than ``max_age``; when both offer the same id and a barrier
    crosses the link, the session borrows it (``SpuEngine.close`` gives it back). Otherwise both
    drop what they hold and make a fresh engine (the certificate exchange of ``SpuEngine``), which
    the pool keeps. An engine busy with another session is not offered, and the session gets an
    engine of its own that is shut down after it.
    """

    def __init__(self, *, max_age: float = _POOL_MAX_AGE):
        self.max_age = max_age
        self._lock = threading.Lock()
        self._engines: dict[tuple, SpuEngine] = {}
        self.started = 0           # engines made (tests and reports: how often a start was paid)
        self._closed = False

    def engine(self, rank: int, channel: Channel, meter: Meter, *, link: LinkProfile = NO_LINK,
               timeout: float = 120.0) -> SpuEngine:
        key = (rank, tuple(channel.hosts), link)
        stale = None
        with self._lock:
            if self._closed:
                raise EngineError("the engine pool is closed")
            held = self._engines.get(key)
            if held is not None and held.in_use:
                held = None      # another session's: not offered, not touched
            elif held is not None:
                if held.alive() and time.monotonic() - held.started < self.max_age:
                    held.in_use = True
                else:
                    stale, held = self._engines.pop(key), None
        if stale is not None:
            stale.shutdown(graceful=False)
        offer = held.link_id if held is not None else ""
        try:
            channel.send_frame(KIND_OBJECT, pack({"engine": offer}))
            peer = unpack_bounded(channel.recv_frame(KIND_OBJECT), max_bin_len=0, max_str_len=256,
                                  max_map_len=2)
            if not isinstance(peer, dict) or not isinstance(peer.get("engine"), str):
                raise EngineError("malformed engine offer from the peer")
            if held is not None and peer["engine"] == offer:
                held.bind(channel, meter, timeout)
                ok = held.probe()
                channel.send_frame(KIND_OBJECT, pack({"probe": ok}))
                peer_ok = unpack_bounded(channel.recv_frame(KIND_OBJECT), max_bin_len=0, max_map_len=2)
                if ok and isinstance(peer_ok, dict) and peer_ok.get("probe") is True:
                    return held
        except BaseException:
            if held is not None:
                self._drop(key, held)
            raise
        if held is not None:   # not reused: the peer holds another engine, or the probe failed
            self._drop(key, held)
        engine = SpuEngine(rank, channel, meter, link=link, timeout=timeout, link_timeout=_POOL_LINK_TIMEOUT)
        with self._lock:
            self.started += 1
            if key not in self._engines and not self._closed:
                self._engines[key] = engine
                engine._pool = self
                engine.in_use = True
        return engine

    def _drop(self, key: tuple, engine: SpuEngine) -> None:
        with self._lock:
            if self._engines.get(key) is engine:
                del self._engines[key]
        engine._pool = None
        engine.shutdown(graceful=False)

    def release(self, engine: SpuEngine) -> bool:
        """A session is done with ``engine``: True if the pool keeps it (sound), else False (the
        caller shuts it down)."""
        with self._lock:
            keep = engine.alive() and not self._closed and engine in self._engines.values()
            if keep:
                engine.in_use = False
                engine.bind(None, None, engine._timeout)
                return True
            for k, e in list(self._engines.items()):
                if e is engine:
                    del self._engines[k]
            engine._pool = None
            return False

    def close(self) -> None:
        """End every engine (a daemon stopping): without a barrier (no peer meets them there), a
        sound one ``_POOL_LINGER`` seconds after its last answer at the earliest."""
        with self._lock:
            self._closed = True
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e._pool = None
            e.shutdown(graceful=False, linger=_POOL_LINGER)
