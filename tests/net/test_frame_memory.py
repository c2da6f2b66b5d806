"""Lying frame headers cost almost no memory, and a dead connection's buffer is freed at once.

Issue 14: a header declaring 1 GiB allocated 1 GiB per connection, and a traceback cycle kept
the buffer of a dead connection until the cycle collector ran (4 x 512 MiB stayed resident).
Measured in a fresh process, with the cycle collector *disabled* so that nothing but
reference counting can free memory: 100 authenticated connections each declare a 1 GiB frame
and hang up, then 4 declare 512 MiB, really send 32 MiB of it and die.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADERS = 100
PARTIAL = 4
PARTIAL_MIB = 32


def _rss_mib() -> tuple[float, float]:
    """(resident now, peak) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def memory_program() -> None:
    """Run in a subprocess: a capped server (1 GiB frames, the client API's default) and its
    attackers in one process; prints RSS figures as JSON."""
    import gc
    import threading

    from net import tls
    from net.channel import KIND_OBJECT, Channel, ChannelError, accept_loop, listen
    from net.frames import HEADER
    from mpc.launcher import ephemeral_keys

    gc.disable()
    keys = ephemeral_keys()
    server_ctx = tls.server_context(tls.identity(keys, "server1"))
    client_ctx = tls.client_context(tls.identity(keys, "server0"))
    listener = listen(backlog=128)
    stop = threading.Event()
    ended = threading.Semaphore(0)

    def serve(sock) -> None:
        try:
            ch = Channel.wrap_accepted(sock, server_ctx, "server0", timeout=30, max_frame=1 << 30)
        except ChannelError:
            ended.release()
            return
        try:
            while True:
                ch.recv_frame(KIND_OBJECT)
        except ChannelError:
            pass
        finally:
            ch.close()
            ended.release()

    threading.Thread(target=accept_loop, args=(listener, serve, stop), daemon=True).start()

    def attack(declared: int, send_mib: int) -> None:
        ch = Channel.connect(listener.getsockname(), client_ctx, "server1", timeout=30)
        chunk = memoryview(os.urandom(1 << 20))
        with ch._send_lock:  # a header, then less than it promised
            ch._write(memoryview(HEADER.pack(KIND_OBJECT, declared)))
            for _ in range(send_mib):
                ch._write(chunk)
        ch.close()
        assert ended.acquire(timeout=60), "the server did not notice the connection end"

    for _ in range(3):  # warm up: TLS contexts, threads, allocator arenas
        attack(1 << 10, 0)
    start, _ = _rss_mib()
    for _ in range(HEADERS):
        attack(1 << 30, 0)
    after_headers, peak_headers = _rss_mib()
    for _ in range(PARTIAL):
        attack(512 << 20, PARTIAL_MIB)
    after_partial, peak = _rss_mib()
    stop.set()
    listener.close()
    print(json.dumps({"start": start, "after_headers": after_headers, "peak_headers": peak_headers,
                      "after_partial": after_partial, "peak": peak}))


def test_lying_headers_and_dead_connections_leave_memory_where_it_was():
    out = subprocess.run([sys.executable, "-c", "from tests.net.test_frame_memory import memory_program; "
                          "memory_program()"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nRSS MiB: start {rss['start']:.0f}, after {HEADERS} headers of 1 GiB {rss['after_headers']:.0f} "
          f"(peak {rss['peak_headers']:.0f}), after {PARTIAL} x {PARTIAL_MIB} MiB of 512 MiB frames "
          f"{rss['after_partial']:.0f} (peak {rss['peak']:.0f})")
    assert rss["peak_headers"] - rss["start"] < 100   # before: 1 GiB per header
    assert rss["after_headers"] - rss["start"] < 100
    # the partial payloads grew with what arrived (<= 2 x 32 MiB each), and went at once
    assert rss["after_partial"] - rss["start"] < 100
