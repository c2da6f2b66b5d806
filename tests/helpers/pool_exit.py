"""A process that ends with an engine still in its shared pool (``mpc.session.shared_engine_pool``),
for ``tests/mpc/test_engine_pool.py``: a stand-in engine, a non-daemon child process that runs until
the pool shuts it down, as a real engine's process does."""

from __future__ import annotations

import multiprocessing as mp
import time


def _engine_process() -> None:
    time.sleep(120)


class _StandInEngine:
    """What ``EnginePool.close`` asks of an engine: ``_pool`` and ``shutdown``."""

    def __init__(self, process) -> None:
        self._pool = None
        self._process = process

    def shutdown(self, graceful: bool = True, linger: float = 0.0) -> None:
        self._process.terminate()


def end_with_an_engine_in_the_pool() -> None:
    from mpc.session import shared_engine_pool

    pool = shared_engine_pool()
    process = mp.get_context("spawn").Process(target=_engine_process)   # not a daemon, as an engine is not
    process.start()
    pool._engines[("peer", 0)] = _StandInEngine(process)
