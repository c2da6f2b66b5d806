"""Crash-test seam of the server daemon: ``STARFISH_CRASH_AT=name[:n]``.

The process SIGKILLs itself the n-th time (default the first) it passes the named
checkpoint. The daemon's own checkpoints are ``upload-staged`` (``servers.daemon.client_api``),
``leader-before-commit`` and ``follower-before-commit`` (``servers.daemon.round_coordinator``),
``job-step-<step>`` on entering each metered Stage II step of a job (``TD``, ``RS``, ``UE``,
``TC``, ``correction``, ``pairs``, ``aggregate``; ``servers.secure.unlearning_jobs``) and
``leader-after-peer-adopted`` (``servers.daemon.job_scheduler``), and
``job-shard-program`` before each program a job runs on the workers
(``servers.workers.server_workers``), where the planned pass SIGKILLs the server's last
worker instead of the server (its pair's session open, its shares held);
:func:`install_crash_points` also hooks the history store's (``servers.store.share_store`` and
``servers.store.blobs``: ``round-*``, ``staged-*``, ``blob-*``), so a crash test can name any point
of the write path.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from servers.store import blobs as _blobs
from servers.store import share_store as _ss

__all__ = ["checkpoint", "install_crash_points", "planned"]

log = logging.getLogger("starfish.server")

_crash_plan: dict[str, int] = {}
_crash_counts: dict[str, int] = {}


def planned(name: str) -> bool:
    """Whether a crash is planned at ``name`` (a caller that must set a seam up first asks)."""
    return name in _crash_plan


def checkpoint(name: str, victim: Callable[[], tuple[str, int]] | None = None) -> None:
    """Named point in the daemon's write path; SIGKILLs the process when planned (tests).

    ``victim``: (name, pid) of the process killed instead of this one (a worker's), asked only
    when the crash is due."""
    if name in _crash_plan:
        _crash_counts[name] = _crash_counts.get(name, 0) + 1
        if _crash_counts[name] == _crash_plan[name]:
            if victim is not None:
                who, pid = victim()
                log.warning("crash-test seam: SIGKILL of %s at %s (pass %d)", who, name, _crash_counts[name])
                os.kill(pid, signal.SIGKILL)
                return
            log.warning("crash-test seam: SIGKILL at %s (pass %d)", name, _crash_counts[name])
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


def install_crash_points(spec: str | None) -> None:
    """Parse ``name[:n],name2[:n2]`` and hook the history store's checkpoints too."""
    _crash_plan.clear()
    _crash_counts.clear()
    if not spec:
        return
    for item in spec.split(","):
        name, _, hit = item.strip().partition(":")
        _crash_plan[name] = int(hit or 1)
    _ss._checkpoint = checkpoint
    _blobs._checkpoint = checkpoint
