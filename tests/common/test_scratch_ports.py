"""Scratch deployments' ports (``common.service_config.free_loopback_ports``): distinct, free, and
outside the kernel's ephemeral range, where any outgoing connection could take one before the
daemon binds it (a service test failed on CI that way: "address already in use")."""

from __future__ import annotations

import os
import socket
import time

from common.service_config import CLAIM_SECONDS, _claim, _ephemeral_ports, free_loopback_ports


def test_scratch_ports_are_distinct_free_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_ports()
    for _ in range(20):
        ports = free_loopback_ports(7)
        assert len(set(ports)) == 7
        if lo > 20000 + 16 * 7:
            assert all(20000 <= p < lo for p in ports), (ports, lo)
        socks = []
        try:
            for p in ports:           # each can be bound now
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", p))
                socks.append(s)
        finally:
            for s in socks:
                s.close()


def test_a_port_handed_out_is_not_handed_out_again_until_its_claim_is_stale(tmp_path):
    # two workers drawing at once must not get the same port (a CI failure: "address in use")
    assert _claim(25001, tmp_path) and _claim(25002, tmp_path)
    assert not _claim(25001, tmp_path) and not _claim(25002, tmp_path)
    old = time.time() - CLAIM_SECONDS - 1
    os.utime(tmp_path / "25001", (old, old))
    assert _claim(25001, tmp_path) and not _claim(25001, tmp_path)
    assert _claim(25003, tmp_path / "missing" / "deeper")   # no claims folder: no check
