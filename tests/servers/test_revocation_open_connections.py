"""Revoking a client closes its open connections within seconds (issue 25, finding 6).

Against a real server pair on loopback: client 1 holds two open connections to server 0. Before,
the CRL was checked inside new handshakes only, and a revoked client's open connection was still
served 151 s after ``keys revoke`` (its upload was committed). Now the client API watches
``crl.pem`` (``net.tls.RevocationWatch``): the idle connection is closed by the server within
``REVOCATION_POLL`` (1 s) of the file changing, a request on a connection still open is refused
(``unauthorized``) and that connection closed, and the next connection (an upload) fails in the
TLS handshake. Another client's open connection is untouched.
"""

from __future__ import annotations

import time

import pytest

from clients.service_client import ServiceError
from common.service_config import SCRATCH_CA_DIR
from net import ca, tls
from net.channel import KIND_OBJECT, Channel, ChannelError
from servers.daemon.client_api import REVOCATION_POLL
from tests.helpers.service_harness import Deployment
from tests.servers.test_service_abuse import _upload

LIMIT = 3 * REVOCATION_POLL + 1.0   # seconds from the CRL's change to the closed connection


def test_a_revoked_clients_open_connection_is_closed_and_its_next_upload_refused(tmp_path):
    dep = Deployment(tmp_path, clients=3, overrides={"fl": {"range_check": False, "clients_expected": 2}})
    try:
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        keys, addr = dep.cfg.keys_dir, dep.cfg.server0.api().address
        ctx = tls.client_context(tls.identity(keys, "client-1"))
        idle = Channel.connect(addr, ctx, "server0", kind="online", timeout=60.0)
        busy = dep.client("client-1", 0)
        other = dep.client("client-2", 0)
        dim = busy.call("state")["dim"]
        other.call("state")

        ca.revoke(tmp_path / SCRATCH_CA_DIR, name="client-1")
        ca.publish(tmp_path / SCRATCH_CA_DIR, keys)
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as e:     # a request on the open connection: refused
            _upload(busy, 0, 1, 10, dim)
        assert e.value.code == "unauthorized" and "revoked" in e.value.message
        with pytest.raises(ChannelError):          # the server waits for no request: it closes
            idle.recv_frame(KIND_OBJECT)
        closed_after = time.monotonic() - t0
        print(f"\nrevoked client's idle connection closed {closed_after:.2f} s after the CRL changed")
        assert closed_after < LIMIT
        with pytest.raises(ChannelError):          # the next upload: refused in the handshake
            _upload(busy, 0, 1, 10, dim)
        assert other.call("state")["party"] == 0   # another client's connection stays
        assert "revoked" in dep.log("server0", 200)
        idle.close()
        busy.close()
        other.close()
    finally:
        dep.close()
