"""Frames are reassembled from whatever pieces arrive, into buffers that grow with the data.

Issue 14: a header declaring 1 GiB allocated 1 GiB at once. Here the assembler is fed streams
of frames cut at arbitrary points (hypothesis over sizes and cuts), and a real TLS channel
receives frames that trickle in; the content is exact, the buffer never runs far ahead of the
bytes received, and the budget is given back.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from net import tls
from net.channel import KIND_OBJECT, KIND_TENSOR, Channel, ProtocolError, listen
from net.frames import HEADER, BudgetExhausted, BufferBudget, FrameAssembler, FrameTooLarge
from mpc.launcher import ephemeral_keys

FIRST = 64  # a tiny first allocation, so that small frames already cross growth boundaries


def _feed(asm: FrameAssembler, data: bytes, cuts: list[int], watch=None) -> list[tuple[int, bytes]]:
    """Push ``data`` through ``asm`` in the pieces ``cuts`` delimits; returns the frames."""
    out, pos = [], 0
    bounds = sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]
    for end in bounds:
        while pos < end:
            dest = asm.space()
            n = min(len(dest), end - pos)
            dest[:n] = data[pos:pos + n]
            dest.release()
            pos += n
            frame = asm.advance(n)
            if watch is not None:
                watch(asm)
            if frame is not None:
                kind, payload, _, reserved = frame
                out.append((kind, bytes(payload)))
                if asm.budget is not None:
                    asm.budget.release(asm.key, reserved)
    return out


def _stream(frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(HEADER.pack(k, len(p)) + p for k, p in frames)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6), data=st.data())
def test_any_cut_of_a_stream_gives_back_the_same_frames(sizes, data):
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    frames = [(1 + i % 4, rng.randbytes(n)) for i, n in enumerate(sizes)]
    stream = _stream(frames)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    budget = BufferBudget(total=1 << 20, per_key=1 << 20)
    asm = FrameAssembler(1 << 20, budget=budget, key="client-1", first_allocation=FIRST)

    def watch(a: FrameAssembler) -> None:
        # memory follows the data: at most twice what arrived of this payload, or the first block
        if a._payload is not None:
            assert len(a._payload) <= max(FIRST, 2 * a._filled)

    assert _feed(asm, stream, cuts, watch) == frames
    assert budget.used() == 0 and not asm.remaining()


def test_a_lying_header_costs_only_the_first_block():
    asm = FrameAssembler(1 << 30, first_allocation=1 << 16)
    assert _feed(asm, HEADER.pack(KIND_OBJECT, 1 << 30) + b"x" * 10, []) == []
    assert len(asm._payload) == 1 << 16  # not 1 GiB
    asm.discard()
    assert asm._payload is None


def test_limits_are_enforced_and_give_their_budget_back():
    with pytest.raises(FrameTooLarge, match="exceeds the limit of 100"):
        _feed(FrameAssembler(100), HEADER.pack(KIND_OBJECT, 101), [])
    budget = BufferBudget(total=10_000, per_key=4_000)
    a = FrameAssembler(1 << 20, budget=budget, key="client-7", first_allocation=1_000)
    with pytest.raises(BudgetExhausted, match="per identity"):
        _feed(a, HEADER.pack(KIND_OBJECT, 5_000) + b"y" * 4_500, [])
    a.discard()
    assert budget.used() == 0
    # another identity's frames are not blocked by this one's
    b = FrameAssembler(1 << 20, budget=budget, key="client-8", first_allocation=1_000)
    assert _feed(b, _stream([(KIND_OBJECT, b"z" * 3_000)]), [17, 500]) == [(KIND_OBJECT, b"z" * 3_000)]


# ------------------------------------------------------------------ a real TLS channel
@pytest.fixture(scope="module")
def pair():
    keys = ephemeral_keys()
    lst = listen()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("ch", Channel.accept(
        lst, tls.server_context(tls.identity(keys, "server1")), "server0", timeout=20)), daemon=True)
    t.start()
    a = Channel.connect(lst.getsockname(), tls.client_context(tls.identity(keys, "server0")), "server1",
                        timeout=20)
    t.join(10)
    b = box["ch"]
    b._asm.first_allocation = 4096  # so that these frames cross several growth steps
    yield a, b
    a.close()
    b.close()
    lst.close()


def _trickle(ch: Channel, kind: int, payload: bytes, pieces: list[int], pause: float) -> None:
    """Send one frame as TLS records cut at ``pieces``, pausing between them (a slow link)."""
    raw = HEADER.pack(kind, len(payload)) + payload
    bounds = sorted(set(p for p in pieces if 0 < p < len(raw))) + [len(raw)]
    start = 0
    with ch._send_lock:
        for end in bounds:
            ch._write(memoryview(raw)[start:end])
            start = end
            time.sleep(pause)


def test_a_frame_that_trickles_in_is_read_exactly(pair):
    a, b = pair
    payload = random.Random(1).randbytes(300_000)
    cuts = [1, 5, 9, 10, 4095, 4097, 8200, 100_000, 299_999]  # inside the header, at growth steps
    t = threading.Thread(target=_trickle, args=(a, KIND_TENSOR, payload, cuts, 0.02))
    t.start()
    got = b.recv_frame(KIND_TENSOR, len(payload))
    t.join(10)
    assert bytes(got) == payload


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 200_000), seed=st.integers(0, 2**32), ncuts=st.integers(0, 12))
def test_trickled_frames_of_any_size_arrive_intact(pair, size, seed, ncuts):
    a, b = pair
    rng = random.Random(seed)
    payload = rng.randbytes(size)
    cuts = [rng.randrange(1, size + 10) for _ in range(ncuts)]
    t = threading.Thread(target=_trickle, args=(a, KIND_OBJECT, payload, cuts, 0.002))
    t.start()
    got = b.recv_frame(KIND_OBJECT)
    t.join(10)
    assert bytes(got) == payload


def test_an_oversized_header_ends_only_that_channel_with_a_protocol_error():
    keys = ephemeral_keys()
    lst = listen()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("ch", Channel.accept(
        lst, tls.server_context(tls.identity(keys, "server1")), "server0", timeout=5, max_frame=1 << 20)),
        daemon=True)
    t.start()
    a = Channel.connect(lst.getsockname(), tls.client_context(tls.identity(keys, "server0")), "server1",
                        timeout=5)
    t.join(10)
    b = box["ch"]
    with a._send_lock:
        a._write(memoryview(HEADER.pack(KIND_OBJECT, 1 << 30)))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        b.recv_frame(KIND_OBJECT)
    # the stored failure keeps no traceback (which would pin the reader's frame and its buffer)
    assert b._closed.cause.__traceback__ is None
    a.close()
    b.close()
    lst.close()


def test_a_port_budget_bounds_frames_a_handler_has_not_taken_yet():
    keys = ephemeral_keys()
    lst = listen()
    budget = BufferBudget(total=1 << 20, per_key=600_000)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("ch", Channel.accept(
        lst, tls.server_context(tls.identity(keys, "server1")), "server0", timeout=5, budget=budget)),
        daemon=True)
    t.start()
    a = Channel.connect(lst.getsockname(), tls.client_context(tls.identity(keys, "server0")), "server1",
                        timeout=5)
    t.join(10)
    b = box["ch"]
    # taken one at a time, frames give their bytes back
    for _ in range(3):
        a.send_frame(KIND_OBJECT, b"q" * 250_000)
        assert len(b.recv_frame(KIND_OBJECT)) == 250_000
    assert budget.used() == 0
    # pipelined without being taken: the third would hold 750,000 bytes for server0
    for _ in range(3):
        a.send_frame(KIND_OBJECT, b"p" * 250_000)
    deadline = time.monotonic() + 5
    while not b.peer_closed:  # nothing is taken until the reader gave up on the third
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(b.recv_frame(KIND_OBJECT)) == 250_000  # frames received before it still count
    assert len(b.recv_frame(KIND_OBJECT)) == 250_000
    with pytest.raises(ProtocolError, match="per identity"):
        b.recv_frame(KIND_OBJECT)
    a.close()
    b.close()
    assert budget.used() == 0  # nothing leaks, whatever was in flight
    lst.close()
