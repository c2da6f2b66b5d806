"""A pooled engine ended without a barrier (its daemon stops) keeps its link up until
``_POOL_LINGER`` seconds after its last answer: the last call of a session ends on one side with
a send the library makes asynchronously (party 1 returned 0.0-3.0 ms after party 0 in 30 of 30
sign tests, measured), and killing party 0's engine at once lost that send, so party 1's last call
failed (the engine pool's flake on CI).

The engine process is a stand-in here (a sleeping process behind a pipe), so that what is
checked is the rule itself: when the kill comes, for any last-answer age and linger."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from mpc.spu_engine import SpuEngine


def _sleep() -> None:
    time.sleep(60)


def _stand_in(answered_ago: float) -> tuple[SpuEngine, mp.Process]:
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_sleep, daemon=True)
    proc.start()
    engine = object.__new__(SpuEngine)
    parent, _child = ctx.Pipe()
    engine._conn, engine._proc, engine._lock = parent, proc, threading.Lock()
    engine._stuck = engine.broken = False
    engine._peer_gone = ctx.Event()
    engine._dir = tempfile.mkdtemp(prefix="starfish-spu-")
    engine.answered = time.monotonic() - answered_ago
    return engine, proc


@settings(max_examples=6, deadline=None)
@given(answered_ago=st.floats(0.0, 2.0), linger=st.floats(0.0, 1.0))
def test_a_stopping_pool_kills_an_engine_no_sooner_than_linger_after_its_last_answer(answered_ago, linger):
    engine, proc = _stand_in(answered_ago)
    t0 = time.monotonic()
    engine.shutdown(graceful=False, linger=linger)
    waited = time.monotonic() - t0
    want = max(0.0, linger - answered_ago)
    assert not proc.is_alive()
    assert want - 0.01 <= waited <= want + 5.0, (want, waited)


def test_a_broken_engine_is_killed_at_once():
    engine, proc = _stand_in(0.0)
    engine.broken = True        # its peer is gone or a call failed: nothing of it is in flight
    t0 = time.monotonic()
    engine.shutdown(graceful=False, linger=3.0)
    assert time.monotonic() - t0 < 2.0
    assert not proc.is_alive()
