"""`starfish demo --aggregator`: the option, and the per-round cost it reads from the servers' logs.

(The full demo under each rule is measured, not tested: docs/service.md, "Robust aggregation".
The service under each rule is tested in tests/servers/test_robust_service.py.)
"""

from __future__ import annotations

import argparse

import pytest

from starfish.demo import _aggregation_costs, add_arguments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_the_option_takes_the_three_rules_and_defaults_to_fedavg(capsys):
    assert _parser().parse_args([]).aggregator == "fedavg"
    assert _parser().parse_args(["--aggregator", "brace-sign"]).aggregator == "brace-sign"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--aggregator", "krum"])
    assert "invalid choice" in capsys.readouterr().err


def _line(r: int, checked: int, kept: int, online: int, offline: int, rounds: int, secs: float) -> str:
    return (f"2026-01-01 00:00:00,000 starfish.server INFO round {r} aggregated by fedseca in 2PC: "
            f"{checked} clients checked, {kept} kept; online_bytes={online} offline_bytes={offline} "
            f"rounds={rounds} seconds={secs:.3f}\n")


def test_costs_are_the_mean_over_rounds_of_each_rounds_last_session(tmp_path):
    # round 2 ran twice (a lost peer): only its last session made the model
    (tmp_path / "server0.log").write_text(
        _line(1, 4, 4, 100, 10, 50, 1.0) + "other line\n" + _line(2, 4, 3, 999, 99, 99, 9.0)
        + _line(2, 4, 3, 300, 30, 70, 3.0))
    (tmp_path / "server1.log").write_text(_line(1, 4, 4, 100, 1000, 50, 1.0) + _line(2, 4, 3, 300, 3000, 70, 3.0))
    costs = _aggregation_costs(tmp_path)
    # online: server 0's count; offline: both servers' dealer links
    assert costs == {"rounds_aggregated": 2, "dropped": 1, "online_bytes": 200.0,
                     "offline_bytes": (10 + 30 + 1000 + 3000) / 2, "online_rounds": 60.0, "seconds": 2.0}
    assert _aggregation_costs(tmp_path / "nowhere") is None
