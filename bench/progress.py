"""Progress bars of the long commands (``starfish bench ...``, ``starfish lab``, ``starfish demo``).

One place decides whether anything is drawn, so every command behaves the same: bars go to
stderr only (stdout carries the tables and JSON that users pipe), and nothing is drawn with
``--quiet`` or when stderr is not a terminal (CI logs and pipes would fill up with carriage
returns). A disabled bar is still a ``tqdm`` object whose methods do nothing, so callers never
branch on it.

Progress hooks that already exist are fed as they are: :func:`callback` turns a bar into the
``progress(done, total, info)`` callback of ``lab.fl.run_federated``, the recovery
methods and ``run_stage2``; :func:`step_hook` follows the top-level metered steps of a party
(``bench.offline.instrument``).

Party processes of ``run_parties`` do the work while the parent only waits, so party 0 draws
its own bar: the parent decides with :func:`party_args` (it knows ``--quiet``), the result goes
to ``run_parties(party_args=...)``. Party 1 never draws: two processes redrawing one terminal
line would garble it.

Work inside one step of a bar (the clients of one FL round, which on real data take minutes):
:func:`within` draws a second bar under it that starts again with every call (local steps done
of all the round's clients, how many clients have finished, the time left in the round). It
appears only when a call lasts long enough to need it (``delay``), so fast runs keep one line.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from tqdm import tqdm

__all__ = ["shown", "progress", "callback", "within", "step_hook", "say", "PartyBar", "party_args"]


class _Bar(tqdm):
    # tqdm's monitor thread only tunes bars updated from tight loops; ours are updated per step,
    # and party processes would each get the thread for nothing
    monitor_interval = 0


# One process draws on a terminal at a time (party 0, or the parent between runs), so a thread
# lock is enough; tqdm's default adds a multiprocessing lock, which in a party process (started
# by forkserver) is a named semaphore left behind at exit ("leaked semaphore objects").
_Bar.set_lock(threading.RLock())


def shown(quiet: bool = False, stream: IO[str] | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default: stderr)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and callable(isatty) and bool(isatty())


@contextlib.contextmanager
def progress(total: int | None, desc: str, *, quiet: bool = False, unit: str = "step",
             stream: IO[str] | None = None, leave: bool = True, delay: float = 0.0) -> Iterator[tqdm]:
    """A bar of ``total`` steps (None: unknown until a :func:`callback` sets it) on stderr.

    Yields the ``tqdm`` bar (``update(n)``, ``set_postfix_str(s)``, ``total``); closed on exit,
    also when the body raises, so a failed run does not leave a half-drawn line behind.
    """
    stream = sys.stderr if stream is None else stream
    bar = _Bar(total=total, desc=desc, unit=unit, file=stream, leave=leave, delay=delay,
               disable=not shown(quiet, stream), dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def callback(bar: tqdm) -> Callable[..., None]:
    """``progress(done, total, info)`` for the existing hooks: moves ``bar`` to ``done`` of ``total``."""

    def report(done: int, total: int, info: str = "") -> None:
        if bar.total != total:
            bar.total = total   # Stage II knows its rounds only after selecting them
        if info:
            bar.set_postfix_str(info, refresh=False)
        bar.update(done - bar.n)

    return report


@contextlib.contextmanager
def within(desc: str, *, quiet: bool = False, unit: str = "step", delay: float = 2.0,
           stream: IO[str] | None = None) -> Iterator[Callable[..., None]]:
    """A ``progress(done, total, info)`` callback drawing a transient second bar for the work
    inside one step of the current bar; a call whose ``done`` goes back (a new round's
    training) restarts it, so its rate and time left are the current round's. Open it inside
    the outer bar's ``with`` so it is drawn under it; it is drawn only after ``delay`` seconds."""
    with progress(None, desc, quiet=quiet, unit=unit, stream=stream, leave=False,
                  delay=delay) as bar:

        def report(done: int, total: int, info: str = "") -> None:
            if done < bar.n or bar.total != total:
                bar.reset(total=total)
            if info:
                bar.set_postfix_str(info, refresh=False)
            bar.update(done - bar.n)

        yield report


def step_hook(bar: tqdm, count: bool = True) -> Callable[[str, bool], None]:
    """``hook(name, finished)`` for a party's top-level steps: shows the step that runs, and
    with ``count`` advances the bar when it ends (``count=False``: rounds drive the bar)."""

    def hook(name: str, finished: bool) -> None:
        if not finished:
            bar.set_postfix_str(name)
        elif count:
            bar.update(1)

    return hook


def say(msg: str, *, quiet: bool = False, stream: IO[str] | None = None) -> None:
    """Print one line (stderr by default) without tearing an active bar; nothing with ``quiet``.

    For the few status lines a long command writes besides its bars (which run starts, how
    long it took); unlike bars these also go to logs, where they are the only sign of life.
    """
    if not quiet:
        stream = sys.stderr if stream is None else stream
        _Bar.write(msg, file=stream)
        stream.flush()


@dataclass(frozen=True)
class PartyBar:
    """What a party process needs to draw a bar (picklable: it travels in ``party_args``)."""

    desc: str
    show: bool = False

    def open(self, total: int | None = None, unit: str = "step") -> contextlib.AbstractContextManager[tqdm]:
        return progress(total, self.desc, quiet=not self.show, unit=unit)


def party_args(desc: str, quiet: bool = False) -> tuple[tuple[PartyBar], tuple[PartyBar]]:
    """``run_parties(party_args=...)`` handing each party its bar: only party 0 draws, and only
    if the parent would (the parties share its stderr)."""
    return (PartyBar(desc, shown(quiet)),), (PartyBar(desc, False),)
