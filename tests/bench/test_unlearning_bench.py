"""The cost benchmarks end to end on the tiny configuration (two processes, TLS, dealer)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import scaling, step_check, steps, synthetic, unlearning


def test_unlearning_benchmark_tiny_with_an_emulated_link(tmp_path, capsys):
    from protocols.starfish import StarfishParams, run_stage2

    out = tmp_path / "u.json"
    rc = unlearning.main(["--config", "tiny", "--profile", "custom", "--latency-ms", "1", "--bandwidth-mbps", "200",
                          "--shaping", "emulate", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "applied by: link-emulation" in text and "analytic online s" in text
    res = json.loads(out.read_text())
    assert res["servers_agree"] and res["mismatches"] == []
    twin = res["plaintext_twin"]   # the benchmark's own check against run_stage2 in the clear
    assert twin["selected_rounds_equal"] and twin["flags_equal"] and twin["max_abs_diff"] <= 1e-3
    assert 0 < twin["largest_estimate"] < twin["sectc_domain"] == 2**14 and "largest |g_hat|" in text
    names = [r["step"] for r in res["steps"]]
    assert names[:6] == ["TD", "RS", "UE", "TC", "pairs", "aggregate"]
    tot = res["totals"]
    assert tot["online_bytes"] > 0 and tot["offline_bytes"] > 0 and tot["analytic_online_s"] > 0
    for r in res["steps"]:
        if r["step"] in ("UE", "TC"):
            # material came before the step (UE's reused-mask products are fetched by the replay
            # right before it, metered as its offline part)
            assert r["offline_bytes"] > 0 and r["inline_offline_bytes"] == 0
    assert res["wire"]["online"]["socket_bytes"] >= res["wire"]["online"]["metered_bytes"]
    assert all(p > 0 for p in res["peak_rss_bytes"])
    # the 2PC run makes the same public decisions as the plaintext twin on the same history
    cfg = synthetic.config("tiny")
    h = synthetic.SyntheticHistory(cfg, synthetic.load_data(synthetic.prepare(cfg, tmp_path / "cache")), None)
    plain = run_stage2(None, h, [0], StarfishParams(method=res["round_selection"]), synthetic.SyntheticClients(h))
    assert res["stage2"]["selected_rounds"] == plain.selected_rounds
    assert res["stage2"]["correction_steps"] == plain.correction_steps
    assert res["stage2"]["flags"] == {str(k): v for k, v in plain.flags.items()}
    # a WAN estimate from this run's steps needs no processes
    est = tmp_path / "e.json"
    assert unlearning.main(["--config", "tiny", "--profile", "wan", "--estimate-from", str(out), "--out", str(est)]) == 0
    e = json.loads(est.read_text())
    ue = next(r for r in e["steps"] if r["step"] == "UE")
    assert ue["online_s"] == pytest.approx(ue["rounds"] * 0.036 + ue["bytes_per_direction"] * 8 / 1e8 + ue["compute_s"])


def test_steps_benchmark_tiny_on_loopback(tmp_path):
    out = tmp_path / "s.json"
    rc = steps.main(["--config", "tiny", "--profile", "none", "--steps", "TD1,TD2,UE,TC", "--td1-samples", "1,2",
                     "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = {r["step"]: r for r in res["rows"]}
    assert set(rows) >= {"TD1", "TD2", "UE", "TC", "TD1 sample of 20", "TD1 sample of 40"}
    assert rows["TD1"]["extrapolated"] and rows["TD1"]["rounds"] > rows["TD1 sample of 40"]["rounds"]
    # mpc/table_compare.py: |d| (a sign test of 8 rounds and a product), the opening, 7 gates of
    # ripple, the AND tree over the row's 2m bits (ceil(log2(words)) levels, then 6 within a word)
    # and the opened bit; the truncation of UE's raw estimates is local
    words = -(-2 * synthetic.config("tiny").num_params // 64)
    assert rows["TC"]["rounds"] == 9 + 1 + 7 + (words - 1).bit_length() + 6 + 1
    # the paper measured the MNIST shapes only: a tiny run is not set beside its figures
    assert "paper" not in rows["TC"] and "ratio_online_gb" not in rows["UE"]
    md = out.with_suffix(".md").read_text()
    assert md.count("|") > 20 and "paper online GB" not in md
    assert out.with_suffix(".png").stat().st_size > 0


def test_scaling_plot_and_fit(tmp_path):
    def row(n, m, T):
        st = {k: {"online_bytes": 48 * (n - 1) * m + 100 if k == "UE" else 448 * (n - 1) * m,
                  "rounds": 5, "online_s": 0.1} for k in ("UE", "TC", "aggregate", "TD2", "RS1")}
        return {"clients": n, "params": m, "rounds": T, "steps": st}

    rows = [("clients", row(3, 100, 4)), ("clients", row(5, 100, 4)), ("params", row(3, 400, 4)),
            ("rounds", row(3, 100, 8))]
    a, b = scaling.fit_per_client_coordinate([r for _, r in rows], "UE")
    assert a == pytest.approx(48) and b == pytest.approx(100, abs=1e-6)
    scaling.plot(rows, tmp_path / "p.png", "test")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_scaling_measures_each_link_profile(tmp_path):
    out = tmp_path / "scaling.json"
    assert scaling.main(["--clients", "3", "--params", "300", "--rounds", "4", "--base-params", "300",
                         "--base-rounds", "4", "--small-clients", "3", "--small-params", "300",
                         "--profiles", "wan", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    point = data["points"][0]
    wan = point["links"]["wan"]
    # the emulated WAN link delays every round by at least its one-way latency (36 ms)
    round_rounds = sum(point["steps"][k]["rounds"] for k in scaling.ROUND_STEPS)
    assert wan["round_s"] >= round_rounds * 0.036
    assert wan["round_s"] == pytest.approx(wan["round_analytic_s"], rel=0.25)
    assert data["link_profiles"][0]["shaping"]["method"] == "link-emulation"
    assert "round s wan" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_unlearning_benchmark_on_two_workers_per_server_equals_the_twin(tmp_path):
    """``bench unlearning --workers 2`` (each server a coordinator and 2 Ray workers in its own
    cluster) on a BRACE-made history, replayed with BRACE's vote, each shard's by its pair (the
    twin replays it with the same rule): both servers' models equal, and the run's public
    decisions and model equal the plaintext Stage II here; each worker reports its memory and
    traffic. (A FedAvg history's job on the daemon's workers, one killed mid-job, and the
    daemon's next run: ``tests/servers/test_service_workers.py``; a FedSECA history's job on the
    daemon's workers: ``tests/servers/test_robust_unlearning.py``.)"""
    aggregator = "brace-sign"
    pytest.importorskip("ray")
    from protocols.starfish import StarfishParams, run_stage2
    from protocols.starfish.robust_replay import RuleCombine

    out = tmp_path / "w.json"
    assert unlearning.main(["--config", "tiny", "--workers", "2", "--profile", "none", "--offline", "dealer",
                            "--aggregator", aggregator, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["result"]
    assert doc["correct"] and res["servers_agree"] and res["workers"] == 2
    twin = res["plaintext_twin"]
    assert twin["selected_rounds_equal"] and twin["flags_equal"] and twin["max_abs_diff"] <= 1e-3
    cfg = synthetic.config("tiny").with_(aggregator=aggregator)
    h = synthetic.SyntheticHistory(cfg, synthetic.load_data(synthetic.prepare(cfg, tmp_path / "cache")), None)
    combine = None if aggregator == "fedavg" else RuleCombine(synthetic.rule_of(aggregator))
    plain = run_stage2(None, h, list(cfg.targets), StarfishParams(method=doc["round_selection"]),
                       synthetic.SyntheticClients(h), combine=combine)
    assert res["selected_rounds"] == plain.selected_rounds
    assert res["flags"] == {str(k): v for k, v in plain.flags.items()}
    for server in res["servers"]:
        assert len(server["workers"]) == 2
        assert all(w["online"] > 0 and w["peak_rss_mib"] > 0 for w in server["workers"])
        # the vote's sign tests ran at the workers, none at the coordinator
        assert not any(step.endswith("signs") for step in server["coordinator"]["steps"])


@settings(max_examples=50, deadline=None)
@given(K=st.integers(1, 4), D=st.integers(1, 40), bits=st.sampled_from([12, 16]), data=st.data())
def test_step_records_reconstruct_every_value_of_the_rules_domain_from_two_64_bit_shares(K, D, bits, data):
    # oracle: the value itself; any share pair of a ring integer below 2**31 in magnitude
    ints = st.integers(-(2**31), 2**31 - 1)
    value = np.array(data.draw(st.lists(ints, min_size=K * D, max_size=K * D)), dtype=np.int64).reshape(K, D)
    s0 = np.array(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=K * D, max_size=K * D)),
                  dtype=np.int64).reshape(K, D)
    s1 = (value.astype(np.uint64) - s0.astype(np.uint64)).astype(np.int64)   # wraps mod 2**64
    opened = np.linspace(-1, 1, D)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / "a", Path(tmp) / "b"]
        for d, share, o in zip(dirs, (s0, s1), (opened, None)):
            d.mkdir()
            step_check.ShareRecorder.write(d, 0, 7, "fedseca", bits, share, o)
        rec = step_check.StepRecords(*dirs)
        got = rec.load(0)
    assert len(rec) == 1 and got.t == 7 and got.aggregator == "fedseca"
    np.testing.assert_array_equal(got.rows, value / 2.0**bits)
    np.testing.assert_array_equal(got.opened, opened)


def test_unlearning_benchmark_holds_a_robust_replay_to_the_twin_step_by_step(tmp_path, capsys):
    out, cache = tmp_path / "r.json", tmp_path / "cache"
    argv = ["--config", "tiny", "--profile", "none", "--aggregator", "brace-sign", "--cache-dir", str(cache),
            "--out", str(out), "--quiet"]
    assert unlearning.main(argv) == 0
    res = json.loads(out.read_text())
    chk = res["step_check"]
    assert chk["met"] and chk["rule_held"] and chk["robust_rounds"] == chk["recorded_rounds"] > 0
    assert chk["rows_max_diff"] <= 1e-3 and chk["flags_equal"] and chk["selected_rounds_equal"]
    assert all(s["aggregator"] == "brace-sign" and s["twin_decision_differs"] <= 1 for s in chk["steps"])
    assert "step check (the twin in lockstep" in capsys.readouterr().out
    # planted: the servers open one vote that their rows do not give; the cached run is re-checked
    party0 = Path(res["stage2"]["step_records"])
    first = party0 / "00000.npz"
    rec = dict(np.load(first))
    rec["opened"] = rec["opened"].copy()
    rec["opened"][0] += 2.0
    np.savez(first, **rec)
    assert unlearning.main(argv) == 1
    bad = json.loads(out.read_text())["step_check"]
    assert not bad["met"] and not bad["rule_held"] and bad["steps"][0]["rule_excess"] == 2.0
    # planted: one row of party 0's share off by 2**-6 (2**10 units): the rows check fails
    rec["opened"][0] -= 2.0
    rec["low"] = rec["low"].copy()
    rec["low"][0, 0] += np.uint32(2**10)
    np.savez(first, **rec)
    assert unlearning.main(argv) == 1
    bad = json.loads(out.read_text())["step_check"]
    assert not bad["met"] and bad["steps"][0]["rows_max_diff"] >= 2.0**-6 - 2e-5
