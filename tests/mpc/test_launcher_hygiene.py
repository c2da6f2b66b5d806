"""``run_parties`` leaves no keys behind: its throw-away CA goes when the run ends, however it ends.

The party program that raises lives here (module level, so the party processes import it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mpc import launcher
from mpc.launcher import PartyError, run_parties
from tests.helpers import parties

ROOT = Path(__file__).resolve().parents[2]


def raise_in_party(party):
    raise RuntimeError(f"party {party.rank} fails on purpose")


@pytest.fixture
def made(monkeypatch):
    """The key directories run_parties creates, recorded as they are made."""
    paths: list[str] = []
    real = launcher._make_keys

    def spy(keep_ca_key):
        paths.append(real(keep_ca_key))
        return paths[-1]

    monkeypatch.setattr(launcher, "_make_keys", spy)
    return paths


def _assert_private(d: str) -> None:
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for name in os.listdir(d):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600, name


def test_a_run_removes_its_keys_after_success_and_after_a_failure(made):
    seen = []

    def look(addr):  # called mid-run, while the parties hold their keys
        _assert_private(made[-1])
        seen.append(sorted(os.listdir(made[-1])))
        return addr

    res = run_parties(parties.multiply_batch, 10, relay=look)
    assert len(res.values[0]) == 10
    with pytest.raises(PartyError, match="on purpose"):
        run_parties(raise_in_party, relay=look)
    assert len(made) == 2
    assert "ca.key" not in seen[0] and "server0.key" in seen[0]  # no CA key: nothing can mint more
    for d in made:
        assert not os.path.exists(d)


def test_an_interrupted_run_removes_its_keys_and_its_processes(made):
    def interrupt(addr):
        raise KeyboardInterrupt

    # a session this worker keeps for other modules (tests/conftest.py) is not this run's
    before = {p.pid for p in mp.active_children()}
    with pytest.raises(KeyboardInterrupt):
        run_parties(parties.multiply_batch, 10, relay=interrupt)
    assert len(made) == 1 and not os.path.exists(made[0])
    assert not [p for p in mp.active_children()
                if p.name in ("dealer", "party0", "party1") and p.pid not in before]


_SCRIPT = """
import os, sys, tempfile
from mpc.launcher import PartyError, ephemeral_keys, run_parties
from tests.helpers import parties
from tests.mpc.test_launcher_hygiene import _assert_private, raise_in_party

assert tempfile.gettempdir() == sys.argv[1]
run_parties(parties.multiply_batch, 10)
try:
    run_parties(raise_in_party)
except PartyError:
    pass
assert not [n for n in os.listdir(sys.argv[1]) if n.startswith("starfish-keys-")]
d = ephemeral_keys()  # cached for the process: goes at exit
assert ephemeral_keys() == d and os.path.exists(os.path.join(d, "ca.key"))
_assert_private(d)
print(d)
"""


def test_a_process_leaves_no_key_directory_in_its_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    cached = out.stdout.strip().splitlines()[-1]
    assert cached.startswith(str(tmp)) and not os.path.exists(cached)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("starfish-keys-")]
