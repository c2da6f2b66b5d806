"""``starfish bench aggregation`` on a small round: it runs both rules in 2PC, meters every step and
compares the opened aggregate with the plaintext twin."""

from __future__ import annotations

import json

from starfish.cli import main


def test_bench_aggregation_meters_each_step_and_agrees_with_the_twin(tmp_path, capsys):
    out = tmp_path / "fedseca.json"
    rc = main(["bench", "aggregation", "--clients", "4", "--dim", "300", "--aggregator", "fedseca",
               "--check-thresholds", "--profile", "none", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    steps = {r["step"]: r for r in res["steps"]}
    for name in ("check", "signs", "crise", "clip", "clamp", "divide", "open"):
        assert steps[name]["rounds"] > 0 and steps[name]["online_bytes"] > 0
    assert res["twin_within_bound"] is True and res["thresholds_accepted"] == 4
    # the opening of the aggregate: D ring elements each way, 8 bytes each
    assert steps["open"]["online_bytes"] >= 2 * 8 * 300
    out = tmp_path / "brace.json"
    assert main(["bench", "aggregation", "--clients", "3", "--dim", "200", "--aggregator", "brace-sign",
                 "--profile", "none",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["twin_equal"] is True
    assert "brace-sign, K = 3, D = 200" in capsys.readouterr().out
