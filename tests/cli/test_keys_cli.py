"""``starfish keys init|issue|revoke|list`` and ``starfish init-deployment``'s key layout.

The parser is built from the two command modules alone, as ``starfish/cli.py`` wires them,
so these tests do not depend on the lab and benchmark commands importing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import stat

import pytest
from cryptography import x509

from net import ca, tls
from starfish import key_commands, service_commands


def run(argv):
    parser = argparse.ArgumentParser(prog="starfish")
    sub = parser.add_subparsers(dest="command")
    key_commands.add_commands(sub)
    service_commands.add_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def _days_left(path):
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return (cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).days


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_init_deployment_keeps_the_ca_key_out_of_the_keys_and_warns(tmp_path, capsys):
    d = tmp_path / "dep"
    assert run(["init-deployment", str(d), "--clients", "2", "--rounds", "3"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "ca-offline" in err and "move it off this machine" in err
    assert not (d / "keys" / "ca.key").exists()
    assert _mode(d / "ca-offline") == 0o700 and _mode(d / "ca-offline" / "ca.key") == 0o600
    assert _mode(d / "keys") == 0o700
    assert all(_mode(p) == 0o600 for p in (d / "keys").iterdir())
    assert tls.check_key_dir(d / "keys") == []
    assert run(["init-deployment", str(d)]) == 2
    assert "refusing" in capsys.readouterr().err


def test_issue_revoke_list_round_trip(tmp_path, capsys):
    keys, ca_dir = tmp_path / "keys", tmp_path / "ca-offline"
    assert run(["keys", "init", str(keys), "--clients", "1"]) == 0  # CA beside keys by default
    assert (ca_dir / "ca.key").exists() and not (keys / "ca.key").exists()
    capsys.readouterr()

    assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys),
                "--name", "client-7", "--days", "30"]) == 0
    assert "valid 30 days" in capsys.readouterr().out
    assert _days_left(keys / "client-7.pem") == 29  # 30 days minus the seconds since
    assert _mode(keys / "client-7.key") == 0o600
    assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys), "--name", "client-7"]) == 2
    assert "--replace" in capsys.readouterr().err
    assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys), "--name", "client-07"]) == 2
    assert "leading zeros" in capsys.readouterr().err
    assert run(["keys", "issue", "--ca-dir", str(keys), "--keys-dir", str(keys), "--name", "client-9"]) == 2
    assert "no CA key" in capsys.readouterr().err  # the key directory cannot sign

    old_serial = x509.load_pem_x509_certificate((keys / "client-7.pem").read_bytes()).serial_number
    assert run(["keys", "revoke", "--ca-dir", str(ca_dir), "--keys-dir", str(keys), "--name", "client-7"]) == 0
    out = capsys.readouterr().out
    assert f"revoked client-7 (serial {old_serial:x})" in out and "no restart" in out
    assert tls.is_revoked(keys, (keys / "client-7.pem").read_bytes())
    assert (keys / "crl.pem").read_bytes() == (ca_dir / "crl.pem").read_bytes()

    # re-enrolment: a new key and certificate under the same name is not revoked
    assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys),
                "--name", "client-7", "--replace"]) == 0
    assert _days_left(keys / "client-7.pem") == tls.USER_DAYS - 1
    assert not tls.is_revoked(keys, (keys / "client-7.pem").read_bytes())
    capsys.readouterr()

    assert run(["keys", "list", "--ca-dir", str(ca_dir)]) == 0
    listing = capsys.readouterr().out
    assert "revocation list 2" in listing and "1 revoked" in listing
    rows = [line for line in listing.splitlines() if line.startswith("client-7")]
    assert len(rows) == 2 and "revoked" in rows[0] and "valid" in rows[1]
    assert run(["keys", "list", "--keys-dir", str(keys)]) == 0
    listed = capsys.readouterr()
    assert "server0" in listed.out and listed.err == ""
    (keys / "ca.key").write_bytes((ca_dir / "ca.key").read_bytes())  # the misconfiguration
    assert run(["keys", "list", "--keys-dir", str(keys)]) == 0
    assert "a daemon would refuse it" in capsys.readouterr().err


def test_revoke_needs_something_known(tmp_path, capsys):
    keys, ca_dir = tmp_path / "keys", tmp_path / "ca"
    assert run(["keys", "init", str(keys), "--ca-dir", str(ca_dir)]) == 0
    assert run(["keys", "revoke", "--ca-dir", str(ca_dir), "--name", "client-3"]) == 2
    assert "no certificate was issued" in capsys.readouterr().err
    assert run(["keys", "revoke", "--ca-dir", str(ca_dir)]) == 2
    assert run(["keys", "revoke", "--ca-dir", str(ca_dir), "--cert", str(keys / "admin.pem")]) == 0
    assert tls.is_revoked(ca_dir, (keys / "admin.pem").read_bytes())
    assert not tls.is_revoked(keys, (keys / "admin.pem").read_bytes())  # not copied there yet
    assert ca.crl_number(ca.load_crl(ca_dir / "crl.pem")) == 2


@pytest.mark.parametrize("name,days", [("server1", 365), ("admin", 90)])
def test_default_lifetimes(tmp_path, name, days):
    keys = tmp_path / "keys"
    assert run(["keys", "init", str(keys)]) == 0
    assert _days_left(keys / f"{name}.pem") == days - 1


def test_worker_certificates_from_keys_init_and_keys_issue(tmp_path, capsys):
    """A server's workers (issue 30): ``keys init --workers K`` issues server0-w0..server1-w<K-1>,
    ``keys issue`` takes a worker name (the missing-credential message tells users to run it) and
    refuses a name no worker can have."""
    keys, ca_dir = tmp_path / "keys", tmp_path / "ca-offline"
    assert run(["keys", "init", str(keys), "--workers", "2"]) == 0
    assert "server1-w1" in capsys.readouterr().out
    for name in ("server0-w0", "server0-w1", "server1-w0", "server1-w1"):
        assert tls.identity(keys, name).name == name
        assert _days_left(keys / f"{name}.pem") >= tls.SERVICE_DAYS - 1
    assert not (keys / "server0-w2.pem").exists()
    assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys), "--name", "server0-w2"]) == 0
    assert tls.identity(keys, "server0-w2").name == "server0-w2"
    capsys.readouterr()
    for bad in ("server0-w64", "server2-w0", "server0-w02"):
        assert run(["keys", "issue", "--ca-dir", str(ca_dir), "--keys-dir", str(keys), "--name", bad]) == 2
        assert "server<0|1>-w<k>" in capsys.readouterr().err
