"""Keys and revocation (``net/tls.py``, ``net/ca.py``): real TLS 1.3 handshakes on loopback.

A revoked certificate is refused inside the handshake by contexts built before the
revocation (no rebuilding, no restart), for a client peer and a server peer alike; the CA's
private key never sits in a key directory a daemon reads; lifetimes and file modes.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509

from net import ca, tls
from common.service_config import SCRATCH_CA_DIR, write_scratch_deployment


@pytest.fixture
def dirs(tmp_path):
    """A deployment layout: ``keys`` as the daemons read it, the CA apart in ``ca``."""
    keys, ca_dir = tmp_path / "keys", tmp_path / "ca"
    tls.init_keys(keys, clients=2, ca_dir=ca_dir)
    return keys, ca_dir


def _ctx(keys, name, server=False):
    ident = tls.identity(keys, name)
    return tls.server_context(ident) if server else tls.client_context(ident)


def _handshake(server_ctx, client_ctx, server_name):
    """One connection over loopback sockets; each side's outcome: the peer's name or the error."""
    out = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve():
            conn, _ = listener.accept()
            conn.settimeout(10)
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as s:
                    out["server"] = tls.peer_name(s.getpeercert())
                    s.sendall(b"k")
            except (ssl.SSLError, OSError) as exc:
                out["server"] = exc
            finally:
                conn.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=server_name) as c:
                    # TLS 1.3: the client is done before the server judged its certificate;
                    # reading surfaces the server's refusal here
                    assert c.recv(1) == b"k"
                    out["client"] = tls.peer_name(c.getpeercert())
        except (ssl.SSLError, OSError) as exc:
            out["client"] = exc
        t.join(10)
    return out


def _refused_as_revoked(outcome):
    return isinstance(outcome, ssl.SSLError) and "revoked" in str(outcome)


def _revoke(ca_dir, keys, name):
    ca.revoke(ca_dir, name=name)
    ca.publish(ca_dir, keys)


def test_a_revoked_client_is_refused_by_a_running_context_while_another_works(dirs):
    keys, ca_dir = dirs
    server = _ctx(keys, "server0", server=True)  # built once, as a daemon does at start
    clients = {n: _ctx(keys, n) for n in ("client-0", "client-1")}
    for n, c in clients.items():
        assert _handshake(server, c, "server0") == {"server": n, "client": "server0"}
    _revoke(ca_dir, keys, "client-0")
    refused = _handshake(server, clients["client-0"], "server0")
    assert _refused_as_revoked(refused["server"]), refused
    assert isinstance(refused["client"], ssl.SSLError)  # it learns of it through the alert
    assert _handshake(server, clients["client-1"], "server0")["server"] == "client-1"
    assert tls.is_revoked(keys, (keys / "client-0.pem").read_bytes())
    assert not tls.is_revoked(keys, (keys / "client-1.pem").read_bytes())


def test_a_revoked_server_is_refused_by_its_clients(dirs):
    keys, ca_dir = dirs
    server, client = _ctx(keys, "server1", server=True), _ctx(keys, "server0")
    assert _handshake(server, client, "server1")["client"] == "server1"
    _revoke(ca_dir, keys, "server1")
    out = _handshake(server, client, "server1")
    assert _refused_as_revoked(out["client"]), out


def test_the_memory_bio_path_of_the_channels_follows_the_list_too(dirs):
    """``net.channel`` wraps with ``wrap_bio``; the same context refuses after a revocation."""
    keys, ca_dir = dirs
    server = _ctx(keys, "dealer", server=True)
    client = _ctx(keys, "server0")

    def handshake():
        s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
        srv = server.wrap_bio(s_in, s_out, server_side=True)
        cli = client.wrap_bio(c_in, c_out, server_hostname="dealer")
        done = set()
        for _ in range(10):
            for obj in (cli, srv):
                if obj not in done:
                    try:
                        obj.do_handshake()
                        done.add(obj)
                    except ssl.SSLWantReadError:
                        pass
            s_in.write(c_out.read())
            c_in.write(s_out.read())
        return tls.peer_name(srv.getpeercert())

    assert handshake() == "server0"
    _revoke(ca_dir, keys, "server0")
    with pytest.raises(ssl.SSLCertVerificationError, match="revoked"):
        handshake()


def test_a_broken_list_refuses_everyone_and_an_older_one_does_not_unrevoke(dirs, tmp_path):
    keys, ca_dir = dirs
    server = _ctx(keys, "server0", server=True)
    client0, client1 = _ctx(keys, "client-0"), _ctx(keys, "client-1")
    first = (keys / ca.CRL_FILE).read_bytes()
    (keys / ca.CRL_FILE).write_bytes(b"not a CRL")  # fail closed, not open
    assert isinstance(_handshake(server, client1, "server0")["server"], ssl.SSLError)
    other = tmp_path / "other"  # a list signed by another CA is as good as none
    tls.init_keys(other / "keys", ca_dir=other / "ca")
    shutil.copy(other / "keys" / ca.CRL_FILE, keys / ca.CRL_FILE)
    assert isinstance(_handshake(server, client1, "server0")["server"], ssl.SSLError)
    _revoke(ca_dir, keys, "client-0")
    assert _handshake(server, client1, "server0")["server"] == "client-1"  # recovered
    (keys / ca.CRL_FILE).write_bytes(first)  # a rollback to the list before the revocation
    assert _refused_as_revoked(_handshake(server, client0, "server0")["server"])
    assert _handshake(server, client1, "server0")["server"] == "client-1"


def _lifetime(path):
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)


def test_lifetimes_default_by_role_and_can_be_chosen(dirs):
    keys, ca_dir = dirs
    for name, days in (("server0", 365), ("dealer", 365), ("admin", 90), ("client-1", 90)):
        assert abs(_lifetime(keys / f"{name}.pem") - dt.timedelta(days=days)) < dt.timedelta(minutes=1)
    tls.issue(keys, "client-7", ca_dir=ca_dir, days=7)
    assert abs(_lifetime(keys / "client-7.pem") - dt.timedelta(days=7)) < dt.timedelta(minutes=1)
    with pytest.raises(FileExistsError, match="--replace"):
        tls.issue(keys, "client-7", ca_dir=ca_dir)
    with pytest.raises(ValueError, match="outlive the CA"):
        tls.issue(keys, "client-8", ca_dir=ca_dir, days=3000)
    assert [r.name for r in ca.issued(ca_dir)][-1] == "client-7"


def _assert_private(d):
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for p in d.iterdir():
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


def test_the_ca_key_stays_out_of_the_key_directory_and_everything_is_private(tmp_path):
    cfg = write_scratch_deployment(tmp_path / "dep", clients=2)
    keys, ca_dir = cfg.parent / "keys", cfg.parent / SCRATCH_CA_DIR
    assert not (keys / ca.CA_KEY_FILE).exists() and (ca_dir / ca.CA_KEY_FILE).exists()
    assert sorted(p.name for p in keys.iterdir()) == sorted(
        ["ca.pem", "crl.pem"] + [f"{n}.{e}" for n in ("server0", "server1", "dealer", "admin",
                                                      "client-0", "client-1") for e in ("pem", "key")])
    _assert_private(keys)
    _assert_private(ca_dir)
    assert tls.check_key_dir(keys) == []


def test_check_key_dir_refuses_the_ca_key_under_any_name_or_place(dirs, tmp_path):
    keys, ca_dir = dirs
    test_only = tmp_path / "test-only"
    tls.init_keys(test_only)  # the run_parties layout: CA key beside the certificates
    with pytest.raises(tls.KeyDirError, match="CA's private key"):
        tls.check_key_dir(test_only)
    for where in (keys / "backup.key", keys / "old" / "ca.key"):
        where.parent.mkdir(exist_ok=True)
        shutil.copy(ca_dir / ca.CA_KEY_FILE, where)
        with pytest.raises(tls.KeyDirError, match=str(where)):
            tls.check_key_dir(keys)
        where.unlink()
    assert tls.check_key_dir(keys) == []
    (keys / ca.CRL_FILE).unlink()
    with pytest.raises(tls.KeyDirError, match="crl.pem"):
        tls.check_key_dir(keys)


def test_check_key_dir_warns_of_open_modes_and_expiring_certificates(dirs):
    keys, ca_dir = dirs
    tls.issue(keys, "client-5", ca_dir=ca_dir, days=3)
    os.chmod(keys / "client-1.key", 0o644)
    warnings = "\n".join(tls.check_key_dir(keys))
    assert "client-1.key is readable" in warnings and "client-5.pem expires in 2 days" in warnings


def test_identity_needs_the_revocation_list(dirs):
    keys, _ = dirs
    (keys / ca.CRL_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="crl.pem"):
        tls.identity(keys, "server0")
