"""Frames on the wire, and reassembling them from a byte stream without trusting their headers.

A frame is ``kind (1 byte) | length (8 bytes, little endian) | payload``. The length is the
sender's claim: a stranger (or a broken peer) can declare 1 GiB and send nothing more. So a
payload buffer is never allocated at its declared length up front. It starts at most
``FIRST_ALLOCATION`` bytes and doubles (capped at the declared length) each time the bytes
that arrived fill it, so memory follows what was actually received: at most about twice that,
plus the first allocation. Growth is in place where the allocator can (a large ``bytearray``
is ``realloc``-ed, which on Linux remaps pages instead of copying them), and decrypted bytes
are still written straight into the final buffer, so a 90 MB tensor is not copied more than
it was before.

``BufferBudget`` bounds the bytes that frames being received or waiting for their consumer
hold, in total and per peer identity, for the channels of one listening port.
"""

from __future__ import annotations

import struct
import threading
import time

HEADER = struct.Struct("<BQ")
HEADER_BYTES = HEADER.size
KIND_TENSOR = 1
KIND_OBJECT = 2
KIND_HELLO = 3
KIND_TICKET = 4  # session matching (net.peer_accept)
MAX_FRAME = 1 << 36  # default per-frame bound (64 GiB): a corrupt length cannot allocate wildly
FIRST_ALLOCATION = 1 << 20  # a payload buffer's size before any of its bytes arrived
_ZEROS = memoryview(bytes(1 << 20))  # source for growing a bytearray without a temporary


class FrameRefused(Exception):
    """A frame the receiver will not buffer; the channel reports it as a ``ProtocolError``."""


class FrameTooLarge(FrameRefused):
    """A header declared more than the channel accepts."""


class BudgetExhausted(FrameRefused):
    """Receiving this frame would exceed the bytes its port may buffer."""


class BufferBudget:
    """Bytes that in-flight frames may hold: ``total`` over all channels sharing the budget,
    ``per_key`` for one key (the peer's identity). ``None`` means no bound."""

    def __init__(self, total: int | None, per_key: int | None = None) -> None:
        self.total = total
        self.per_key = per_key
        self._lock = threading.Lock()
        self._used = 0
        self._by_key: dict[str, int] = {}

    def reserve(self, key: str, n: int) -> None:
        """Take ``n`` bytes for ``key`` or raise ``BudgetExhausted`` (taking nothing)."""
        with self._lock:
            mine = self._by_key.get(key, 0)
            if self.per_key is not None and mine + n > self.per_key:
                raise BudgetExhausted(f"{key} would hold {mine + n} bytes of frames in flight "
                                      f"(limit {self.per_key} per identity)")
            if self.total is not None and self._used + n > self.total:
                raise BudgetExhausted(f"frames in flight would hold {self._used + n} bytes "
                                      f"(limit {self.total} for this port)")
            self._used += n
            self._by_key[key] = mine + n

    def release(self, key: str, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self._used -= n
            left = self._by_key.get(key, 0) - n
            if left > 0:
                self._by_key[key] = left
            else:
                self._by_key.pop(key, None)

    def used(self, key: str | None = None) -> int:
        with self._lock:
            return self._used if key is None else self._by_key.get(key, 0)


class FrameAssembler:
    """Turns a byte stream into frames; the reader asks ``space()`` where the next bytes go,
    writes into it, and reports them with ``advance(n)``, which returns a finished frame.

    Owns at most one partial payload; ``discard()`` drops it (and its budget) at once, so
    nothing of it outlives a failed connection.
    """

    def __init__(self, max_frame: int, *, budget: BufferBudget | None = None, key: str = "",
                 first_allocation: int = FIRST_ALLOCATION) -> None:
        self.max_frame = max_frame
        self.budget = budget
        self.key = key
        self.first_allocation = first_allocation
        self._header = bytearray(HEADER_BYTES)
        self._payload: bytearray | None = None
        self._kind = 0
        self._length = 0
        self._filled = 0
        self._reserved = 0  # budget held by the partial payload
        self.first_byte_at = 0.0

    def space(self) -> memoryview:
        """Where the next bytes go (never past the current frame). The caller must release
        the view before calling ``advance`` (a bytearray cannot grow while it is exported)."""
        if self._payload is None:
            return memoryview(self._header)[self._filled:]
        if self._filled == len(self._payload):
            self._grow()
        return memoryview(self._payload)[self._filled:]

    def advance(self, n: int) -> tuple[int, bytearray, float, int] | None:
        """``n`` bytes were written into ``space()``; returns ``(kind, payload, first_byte_at,
        reserved)`` when a frame is complete. ``reserved`` budget bytes now belong to the frame:
        whoever consumes it must ``budget.release(key, reserved)``."""
        self._filled += n
        if self._payload is None:
            if self._filled < HEADER_BYTES:
                return None
            self._kind, self._length = HEADER.unpack(self._header)
            self.first_byte_at = time.monotonic()
            if self._length > self.max_frame:
                raise FrameTooLarge(f"frame of {self._length} bytes exceeds the limit of "
                                    f"{self.max_frame} bytes")
            self._filled = 0
            self._payload = self._allocate(min(self._length, self.first_allocation))
        if self._filled < self._length:
            return None
        frame = (self._kind, self._payload, self.first_byte_at, self._reserved)
        self._payload, self._filled, self._reserved = None, 0, 0
        return frame

    def remaining(self) -> int:
        """Payload bytes still expected of the current frame (0 between frames)."""
        return 0 if self._payload is None else self._length - self._filled

    def release(self, n: int) -> None:
        """Give back ``n`` budget bytes of a frame this assembler finished."""
        if self.budget is not None:
            self.budget.release(self.key, n)

    def discard(self) -> None:
        """Drop the partial frame and give its budget back."""
        self._payload = None
        self._filled = 0
        if self.budget is not None:
            self.budget.release(self.key, self._reserved)
        self._reserved = 0

    # ------------------------------------------------------------------ buffers
    def _allocate(self, n: int) -> bytearray:
        self._charge(n)
        return bytearray(n)

    def _grow(self) -> None:
        assert self._payload is not None
        old = len(self._payload)
        new = min(self._length, max(2 * old, self.first_allocation))
        self._charge(new - old)
        while len(self._payload) < new:  # in slices of a shared zero buffer: no temporary copy
            self._payload += _ZEROS[: min(len(_ZEROS), new - len(self._payload))]

    def _charge(self, n: int) -> None:
        if self.budget is not None and n > 0:
            self.budget.reserve(self.key, n)
        self._reserved += n
