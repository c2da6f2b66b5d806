"""The `starfish` command line: help, key generation, the runtime demo."""

import os
import stat
import subprocess
import sys

import pytest
from cryptography import x509

from starfish.cli import main

STARFISH = [sys.executable, "-m", "starfish.cli"]


def test_help_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("keys", "demo", "bench", "server", "dealer", "clients", "unlearn", "status"):
        assert cmd in out


def test_keys_init_writes_a_ca_and_private_keys_and_refuses_to_overwrite(tmp_path, capsys):
    d = tmp_path / "keys"
    assert main(["keys", "init", str(d), "--clients", "2"]) == 0
    for name in ("server0", "server1", "dealer", "admin", "client-0", "client-1"):
        cert = x509.load_pem_x509_certificate((d / f"{name}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [name]
        assert stat.S_IMODE(os.stat(d / f"{name}.key").st_mode) == 0o600
    assert not (d / "ca.key").exists()  # the CA key goes beside, never where daemons read
    assert stat.S_IMODE(os.stat(tmp_path / "ca-offline" / "ca.key").st_mode) == 0o600
    before = (d / "ca.pem").read_bytes()
    assert main(["keys", "init", str(d)]) == 2
    assert "refusing" in capsys.readouterr().err
    assert (d / "ca.pem").read_bytes() == before


def test_runtime_demo_runs_two_parties_and_matches_numpy():
    proc = subprocess.run(STARFISH + ["demo", "--runtime"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "result matches numpy: yes" in proc.stdout
    assert "x>=y" in proc.stdout and "offline bytes" in proc.stdout


def test_service_demo_small_run_reports_and_stops_everything(tmp_path):
    """`starfish demo` with 4 clients, 5 rounds and 1 after the adoption: the report, then no
    process left behind."""
    work = tmp_path / "demo"
    proc = subprocess.run(STARFISH + ["demo", "--clients", "4", "--rounds", "5", "--after", "1",
                                      "--workdir", str(work)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for needle in ("Starfish, 2PC (the servers)", "retrain, plaintext", "FedRecover, plaintext",
                   "selected rounds (2PC)", "both servers published the same model", "online bytes",
                   "wall time"):
        assert needle in out, needle
    pids = [int(json_pid) for json_pid in _pids(work)]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"process {pid} still runs"


def _pids(work):
    import json

    for p in (0, 1):
        yield json.loads((work / "data" / f"server{p}" / "ready.json").read_text())["pid"]


def _is_zombie(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("attackers, clients", [(-1, 20), (19, 20), (3, 4), (1, 2)])
def test_demo_refuses_attackers_outside_0_to_clients_minus_2_in_one_line_before_starting(tmp_path, attackers,
                                                                                         clients):
    work = tmp_path / "demo"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--attackers", str(attackers), "--clients", str(clients), "--workdir", str(work)])
    msg = str(exc.value)
    assert "\n" not in msg and f"--attackers {attackers} is outside 0..{clients - 2}" in msg
    assert not work.exists()       # refused before any key, config or process
