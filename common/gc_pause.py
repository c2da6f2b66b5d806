"""The cyclic garbage collector paused while a process imports its libraries.

Why: importing torch, CrypTen and our packages allocates hundreds of thousands of objects that
live as long as the process, and the collector runs again and again over them while they are
being made, finding nothing to free: about a third of a server daemon's start on this machine
(2.1 s of CPU with the collector, 1.3-1.6 s without, ``python -c "import
servers.daemon.server_daemon, torch"``). Every command that starts a process of ours (a daemon,
the dealer, the clients, a lab or bench run) and the two-party engine's process import under it.
The collector is switched back on afterwards (when it was on), so the process's own work is
collected as before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
