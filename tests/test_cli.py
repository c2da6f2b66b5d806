"""The `starfish` command line: help, key generation, the runtime demo."""

import os
import stat
import subprocess
import sys

from cryptography import x509

from starfish.cli import main

STARFISH = [sys.executable, "-m", "starfish.cli"]


def test_help_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("keys", "demo", "bench"):
        assert cmd in out


def test_keys_init_writes_a_ca_and_private_keys_and_refuses_to_overwrite(tmp_path, capsys):
    d = tmp_path / "keys"
    assert main(["keys", "init", str(d), "--clients", "2"]) == 0
    for name in ("server0", "server1", "dealer", "admin", "client-0", "client-1"):
        cert = x509.load_pem_x509_certificate((d / f"{name}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [name]
        assert stat.S_IMODE(os.stat(d / f"{name}.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    before = (d / "ca.pem").read_bytes()
    assert main(["keys", "init", str(d)]) == 2
    assert "refusing" in capsys.readouterr().err
    assert (d / "ca.pem").read_bytes() == before


def test_demo_runs_two_parties_and_matches_numpy():
    proc = subprocess.run(STARFISH + ["demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "result matches numpy: yes" in proc.stdout
    assert "x>=y" in proc.stdout and "offline bytes" in proc.stdout
