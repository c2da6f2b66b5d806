"""Failed handshakes are logged at most once per interval, with a count (issue 25, finding 7).

Anyone who can reach a port can fail a handshake there; one INFO line each let a stranger's
churn write 0.3 GB of log an hour from one process. Now ``Admission.handshake_failed`` writes
the first failure after a quiet interval at once and a summary of the rest at most every
``_LOG_EVERY`` seconds; the client API, the control link, the dealer and the engine's session
ports all go through it.
"""

from __future__ import annotations

import logging
import socket
import time

from net import admission as admission_mod
from net.admission import Admission


def test_two_hundred_failures_in_one_interval_write_one_line_then_a_summary(caplog):
    adm = Admission("client API")
    caplog.set_level(logging.INFO, logger="starfish.admission")
    t0 = 1000.0
    for i in range(200):
        adm.handshake_failed(ConnectionError(f"not TLS #{i}"), now=t0 + i * 0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["client API port: a handshake failed: not TLS #0"]
    adm.handshake_failed(ConnectionError("not TLS #200"), now=t0 + admission_mod._LOG_EVERY + 0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[1].startswith("client API port: 200 handshakes failed in the last 10 s")
    assert lines[1].endswith("(the last: not TLS #200)")
    assert adm.counts()["handshake_failures"] == 201
    # after a quiet interval the next failure is written at once, with its reason
    adm.handshake_failed("late", now=t0 + 3 * admission_mod._LOG_EVERY)
    assert caplog.records[-1].getMessage() == "client API port: a handshake failed: late"


def test_two_hundred_strangers_leave_a_bounded_log_on_a_real_server(tmp_path):
    from tests.helpers.service_harness import Deployment

    dep = Deployment(tmp_path, clients=3, overrides={"fl": {"range_check": False}})
    try:
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        addr = dep.cfg.server(0).api().address
        before = dep.log("server0", 10_000).count("\n")
        t0 = time.monotonic()
        for _ in range(200):      # one at a time: each a failed handshake, none a pool drop
            with socket.create_connection(addr, timeout=10) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    while s.recv(4096):
                        pass
                except OSError:
                    pass          # reset by the server: the handshake failed
        took = time.monotonic() - t0
        time.sleep(1.0)
        with dep.client("client-0", 0) as c:      # the port still serves real clients
            assert c.call("state")["party"] == 0
        log = dep.log("server0", 10_000)
        new = log.splitlines()[before:]
        about = [line for line in new if "handshake" in line]
        print(f"\n200 failed handshakes in {took:.1f} s: {len(new)} new log lines at server 0, "
              f"{len(about)} about handshakes")
        assert 1 <= len(about) <= 2, "\n".join(new[:20])
        assert len(new) <= 10, "\n".join(new[:20])
    finally:
        dep.close()
