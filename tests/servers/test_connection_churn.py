"""Connection churn at a real server daemon's client API (issue 25, finding 7).

One address (127.0.0.2; Linux routes all of 127/8 to lo) opens 2,000 TCP connections a second
for 3 s, each held 0.5 s and never finishing TLS (half silent, half inside a ClientHello). Before
the fix the handshake pool dropped its oldest pending handshake whenever it was full, which was
usually a real client's: with this flood on a loaded 2-core machine, 9-18 of 30 real connects
failed at 2,000 a second and 0-5 at 1,000 (three runs each; the figures of the issue's closing
note), and this test failed with 2 and 12 of its 24. Now a full pool drops the oldest handshake
of the address that holds the most, addresses that authenticated before are kept over
strangers, and a stranger's address gets a thread for at most
``limits.handshake_rate_per_source`` connections a second.

Only server 0 runs: its client API is the same with or without server 1, and starting one
daemon keeps the test short. Meanwhile real clients connect, one TLS connection and one
``state`` call each: half from 127.0.0.1, which authenticated before the flood, and half each
from an address never seen before (127.0.1.x), so the rules for strangers are what let them in.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import socket
import time
from collections import deque
from pathlib import Path

import pytest

from tests.helpers.service_harness import Deployment

pytestmark = pytest.mark.timeout(120)

FLOOD_RATE = 2000          # connections a second
FLOOD_HOLD = 0.5           # seconds each is held
FLOOD_SECONDS = 3.0
REAL_CONNECTS = 24
ALLOWED_FAILURES = 1       # of REAL_CONNECTS; after the fix none of 360 measured failed
IP_BIND_ADDRESS_NO_PORT = 24   # linux/in.h: pick the port at connect, so 6,000 binds do not run out


def _flood(addr, source: str, rate: float, hold: float, seconds: float, out) -> None:
    """Non-blocking connects from ``source`` at ``rate`` a second, each closed ``hold`` s later."""
    socks: deque = deque()
    n = 0
    t0 = time.monotonic()
    while (now := time.monotonic()) - t0 < seconds:
        while n < int((now - t0) * rate):
            s = socket.socket()
            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((source, 0))
            s.setblocking(False)
            s.connect_ex(addr)
            if n % 2:
                try:
                    s.send(b"\x16\x03\x01\x02\x00\x01")   # a ClientHello that never ends
                except OSError:
                    pass
            socks.append((now + hold, s))
            n += 1
        while socks and socks[0][0] <= now:
            socks.popleft()[1].close()
        time.sleep(0.001)
    for _, s in socks:
        s.close()
    out.put(n)


def _threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_real_clients_connect_through_2000_churned_connections_a_second(tmp_path, monkeypatch):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, 8192):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    dep = Deployment(tmp_path, clients=2, overrides={"fl": {"range_check": False}})
    flooder = None
    try:
        dep.start_server(0)           # its client API serves ``state`` without server 1
        dep.wait_ready(parties=(0,))  # admin from 127.0.0.1: that address has authenticated
        addr = dep.cfg.server(0).api().address
        pid = dep.procs.procs["server0"].pid
        threads_before = _threads_of(pid)

        source = ["127.0.0.1"]
        plain = socket.create_connection
        monkeypatch.setattr(socket, "create_connection",
                            lambda a, timeout=None, source_address=None: plain(a, timeout, (source[0], 0)))
        ctx = mp.get_context("fork")
        flooded = ctx.Queue()
        flooder = ctx.Process(target=_flood, args=(addr, "127.0.0.2", FLOOD_RATE, FLOOD_HOLD, FLOOD_SECONDS,
                                                   flooded), daemon=True)
        flooder.start()
        time.sleep(FLOOD_HOLD)        # the flood at full strength: ~1,000 of its sockets open
        failures, took, peak = [], [], threads_before
        gap = (FLOOD_SECONDS - FLOOD_HOLD - 0.3) / REAL_CONNECTS
        for i in range(REAL_CONNECTS):
            source[0] = "127.0.0.1" if i % 2 else f"127.0.1.{i + 1}"   # returning, or never seen
            t0 = time.monotonic()
            try:
                with dep.client("client-0", 0, connect_timeout=5.0, timeout=10.0) as c:
                    assert c.call("state")["party"] == 0
            except Exception as exc:  # noqa: BLE001 - every kind of failure is what we count
                failures.append(f"{source[0]}: {type(exc).__name__}: {str(exc)[:120]}")
            took.append(time.monotonic() - t0)
            peak = max(peak, _threads_of(pid))
            time.sleep(max(0.0, gap - (time.monotonic() - t0)))
        opened = flooded.get(timeout=30)
        flooder.join(10)
        took.sort()
        print(f"\n{opened} churned connections from 127.0.0.2 in {FLOOD_SECONDS:.0f} s; real connects: "
              f"{len(failures)} of {REAL_CONNECTS} failed, median {took[len(took) // 2] * 1000:.0f} ms, "
              f"max {took[-1] * 1000:.0f} ms; server 0's threads {threads_before} -> at most {peak}")
        assert opened >= 0.9 * FLOOD_RATE * FLOOD_SECONDS
        assert len(failures) <= ALLOWED_FAILURES, "\n".join(failures)
        # the flood's address gets a handshake thread for at most its rate (plus its burst)
        assert peak - threads_before <= dep.cfg.limits.handshake_burst_per_source + 16, peak
        log = dep.log("server0", 200)
        assert "the last from 127.0.0.2" in log, log   # the summary names the churning address
    finally:
        if flooder is not None and flooder.is_alive():
            flooder.kill()
        # its graceful stop (waiting for server 1, which never came) adds seconds and shows nothing
        server0 = dep.procs.procs.get("server0")
        if server0 is not None:
            server0.kill()
        dep.close()
