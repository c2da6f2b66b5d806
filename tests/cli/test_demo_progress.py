"""`starfish demo`: the clients' log lines become bars (FL rounds, the unlearning job, FL after)."""

from __future__ import annotations

import io
import sys

from starfish.demo import ClientsProgress, _follow


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# lines as clients/simulator.py writes them
LOG = """clients: round 1: 4 uploads (0.3s, 2s total)
clients: round 2: 4 uploads (0.3s, 2s total)
clients: round 3: 4 uploads (0.3s, 3s total)
client 0: requested unlearning of its data (job unlearn-0-abc)
clients: job unlearn-0-abc: running 40% (3 correction uploads so far)
clients: job unlearn-0-abc: running 80% (6 correction uploads so far)
client 0: job unlearn-0-abc adopted as round 4; erasure receipt: rounds [1, 2, 3] erased at both servers
clients: round 5: 3 uploads (0.3s, 9s total)
"""


def _run(tmp_path, quiet: bool) -> tuple[str, str]:
    """Follow the log as the demo does: it grows while the demo polls it."""
    log = tmp_path / "clients.log"
    log.write_text("")
    shown = ClientsProgress(rounds=3, after=2, quiet=quiet)
    shown.start()
    offset = 0
    try:
        for line in LOG.splitlines(keepends=True):
            with open(log, "a") as f:
                f.write(line)
            offset = _follow(log, offset, shown)
    finally:
        shown.close()
    return sys.stdout.getvalue(), sys.stderr.getvalue()


def test_progress_lines_become_bars_and_events_stay_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", Terminal())
    out, err = _run(tmp_path, quiet=False)
    assert "requested unlearning" in out and "adopted as round 4" in out
    assert "clients: round" not in out and "running 40%" not in out
    assert "FL rounds" in err and "3/3" in err
    assert "unlearning job (2PC)" in err and "80/100" in err and "running" in err
    assert "FL rounds after the adoption" in err and "1/2" in err


def test_quiet_demo_draws_no_bars_but_keeps_the_events(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", Terminal())
    out, err = _run(tmp_path, quiet=True)
    assert err == ""
    assert "requested unlearning" in out and "clients: round" not in out
