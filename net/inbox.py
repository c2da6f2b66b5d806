"""A channel's inbox: frames its reader has finished and the consumer has not taken yet,
followed, once the connection is gone, by how it ended.

Why a class: each frame holds budget bytes (``net.frames.BufferBudget``) until the consumer
takes it, so every way out must give them back: taking a frame, and closing the channel
with frames still waiting (also when a frame lands just after ``close``). The end marker
stays queued, so every later receive fails fast with the same cause.
"""

from __future__ import annotations

import queue
import time
from typing import Callable

from net.channel_errors import without_tracebacks

__all__ = ["Ended", "Inbox"]


class Ended:
    """The end of a channel, queued after its last frame; ``cause`` carries no traceback (it
    would pin the failed thread's frames, and with them a partial payload)."""

    def __init__(self, cause: BaseException | None) -> None:
        self.cause = cause


class Inbox:
    def __init__(self, release: Callable[[int], None]) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._release = release  # gives reserved budget bytes back
        self._closed = False

    def put(self, kind: int, payload: bytearray, first_byte_at: float, reserved: int) -> None:
        self._queue.put((kind, payload, first_byte_at, time.monotonic(), reserved))
        if self._closed:
            self._drop()  # close() ran while the reader finished this frame: nobody will take it

    def end(self, cause: BaseException) -> None:
        self._queue.put(Ended(without_tracebacks(cause)))
        if self._closed:
            self._drop()

    def take(self, timeout: float) -> tuple[int, bytearray, float, float] | Ended:
        """The next frame as ``(kind, payload, first_byte_at, arrived)``, or the end; raises
        ``queue.Empty`` after ``timeout`` seconds."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, Ended):
            self._queue.put(item)  # later receives fail fast too
            return item
        self._release(item[4])  # handed over: from here its memory is the caller's business
        return item[:4]

    def close(self) -> None:
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        ended = None
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Ended):
                ended = item
            else:
                self._release(item[4])
        if ended is not None:
            self._queue.put(ended)
