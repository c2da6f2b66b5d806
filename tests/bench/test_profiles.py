"""Benchmark logic without processes: network profiles, analytic time, netem detection and
fallback, sort-size formulas, extrapolation, step summaries and socket checks."""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess

import pytest
import torch

from bench import common_options, costs, offline, profiles
from protocols.sort import network


# ------------------------------------------------------------------------------- profiles
def test_paper_profiles_read_as_bits_by_default_and_as_bytes_on_request():
    lan = profiles.resolve("lan")
    assert lan.one_way_latency_s == pytest.approx(0.085e-3) and lan.rtt_s == pytest.approx(0.17e-3)
    assert lan.bandwidth_bps == 1e9 and lan.reading == "bits"
    wan = profiles.resolve("wan")
    assert wan.one_way_latency_s == pytest.approx(0.036) and wan.bandwidth_bps == 100e6
    assert profiles.resolve("lan", reading="bytes").bandwidth_bps == 8e9
    assert profiles.resolve("wan", reading="bytes").bandwidth_bps == 800e6
    assert "read as bits" in lan.describe() and "1 Gbit/s" in lan.describe()
    assert "read as bytes" in profiles.resolve("wan", reading="bytes").describe()


def test_custom_and_none_profiles():
    c = profiles.resolve("custom", latency_ms=5, bandwidth_mbps=50)
    assert (c.name, c.one_way_latency_s, c.bandwidth_bps) == ("custom", 0.005, 50e6)
    assert c.link().latency == 0.005 and c.link().bandwidth_bps == 50e6
    none = profiles.resolve("none")
    assert not none.emulated and none.link().latency == 0 and none.link().bandwidth_bps == 0
    assert profiles.resolve("none", latency_ms=1).name == "custom"   # custom flags imply custom
    with pytest.raises(ValueError, match="custom"):
        profiles.resolve("lan", latency_ms=3)
    with pytest.raises(ValueError):
        profiles.resolve("moon")
    with pytest.raises(ValueError):
        profiles.resolve("lan", reading="nibbles")


def test_profile_arguments_parse():
    p = argparse.ArgumentParser()
    common_options.add_profile(p)
    a = p.parse_args(["--profile", "wan", "--bandwidth-reading", "bytes"])
    assert common_options.profile_of(a).bandwidth_bps == 800e6
    a = p.parse_args(["--profile", "custom", "--latency-ms", "10", "--bandwidth-mbps", "20"])
    prof = common_options.profile_of(a)
    assert prof.one_way_latency_s == 0.01 and prof.bandwidth_bps == 20e6


def test_analytic_time_matches_hand_computation():
    wan = profiles.resolve("wan")
    # 100 rounds x 36 ms + 1e6 bytes x 8 / 1e8 + 2 s = 3.6 + 0.08 + 2
    assert profiles.analytic_seconds(100, 1e6, 2.0, wan) == pytest.approx(5.68)
    lan = profiles.resolve("lan")
    # 18 rounds x 0.085 ms + 2.5e9 x 8 / 1e9 + 65 s
    assert profiles.analytic_seconds(18, 2.5e9, 65.0, lan) == pytest.approx(18 * 0.085e-3 + 20.0 + 65.0)
    unlimited = profiles.resolve("custom", latency_ms=1, bandwidth_mbps=0)
    assert profiles.analytic_seconds(10, 1e12, 0.5, unlimited) == pytest.approx(0.51)
    # overlap bound: latency + max(compute, transfer)
    assert profiles.analytic_overlap_seconds(100, 1e6, 2.0, wan) == pytest.approx(3.6 + 2.0)
    assert profiles.analytic_overlap_seconds(18, 2.5e9, 65.0, lan) == pytest.approx(18 * 0.085e-3 + 65.0)
    assert profiles.analytic_overlap_seconds(18, 2.5e9, 5.0, wan) == pytest.approx(18 * 0.036 + 200.0)
    assert profiles.relative_difference(12.0, 10.0) == pytest.approx(0.2)
    assert profiles.relative_difference(1.0, 0.0) is None


def test_shaping_prefers_netem_and_falls_back_to_link_emulation():
    lan = profiles.resolve("lan")
    no = lambda: (False, "tc netem unavailable: Error: Specified qdisc kind is unknown.")  # noqa: E731
    yes = lambda: (True, "tc netem works")  # noqa: E731
    s = profiles.choose_shaping(lan, "auto", probe=no)
    assert s.method == "link-emulation" and "qdisc kind is unknown" in s.reason
    assert profiles.choose_shaping(lan, "auto", probe=yes).method == "netem"
    assert profiles.choose_shaping(lan, "emulate", probe=yes).method == "link-emulation"
    with pytest.raises(RuntimeError, match="netem"):
        profiles.choose_shaping(lan, "netem", probe=no)
    assert profiles.choose_shaping(profiles.resolve("none"), "auto", probe=yes).method == "none"
    assert profiles.effective_link(lan, s) == lan.link()


def test_netem_commands():
    cmds = profiles.netem_commands("ns1", profiles.resolve("lan"))
    assert cmds[0] == ["ip", "netns", "add", "ns1"]
    assert cmds[-1][-5:] == ["netem", "delay", "0.085ms", "rate", "1000000000bit"]
    assert cmds[-1][:4] == ["ip", "netns", "exec", "ns1"]
    assert profiles.forwarded_argv(["bench", "steps"], ["--profile", "wan"]) == ["bench", "steps", "--profile", "wan"]


def test_netem_probe_reports_and_cleans_up():
    ok, reason = profiles.probe_netem()
    assert isinstance(ok, bool) and reason
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    assert "starfish-probe" not in listed


# ------------------------------------------------------------------------------- costs
@pytest.mark.parametrize("n", [*range(1, 70), 128, 200, 256, 1000])
def test_sort_comparators_and_layers_count_the_real_network(n):
    layers = network(n)
    assert costs.sort_comparators(n) == sum(int(i.numel()) for i, _ in layers)
    assert costs.sort_layers(n) >= len(layers)          # sentinel-only layers are omitted
    if n & (n - 1) == 0:
        assert costs.sort_layers(n) == len(layers)
        assert costs.sort_comparators(n) == len(layers) * n // 2


def test_sort_formulas_known_values():
    assert costs.sort_layers(64) == 21 and costs.sort_layers(1024) == 55 and costs.sort_layers(1) == 0
    full = 19 * 40 * 582_026
    assert costs.sort_layers(full) == 29 * 30 // 2
    assert costs.sort_comparators(2**29) == 435 * 2**28


def test_extrapolation_recovers_an_exact_model():
    a, b = 3.0, 500.0

    def work(n):
        return a * (n + costs.sort_comparators(n)) + b * (costs.sort_layers(n) + 1)

    pts = [(3040, work(3040)), (12160, work(12160))]
    target = 442_339_760
    assert costs.extrapolate(pts, target) == pytest.approx(work(target), rel=1e-9)
    rpts = [(3040, 9 + 9 * costs.sort_layers(3040)), (12160, 9 + 9 * costs.sort_layers(12160))]
    assert costs.extrapolate(rpts, target, "rounds") == pytest.approx(9 + 9 * 435)
    # a negative fitted coefficient (noisy seconds) is set to 0 and the other one refitted
    per_layer = [(n, 0.01 * (costs.sort_layers(n) + 1)) for n in (100, 400)]
    per_layer[1] = (400, per_layer[1][1] - 1e-6)
    got = costs.extrapolate(per_layer, 1600)
    assert got == pytest.approx(per_layer[1][1] / (costs.sort_layers(400) + 1) * (costs.sort_layers(1600) + 1))
    per_elem = [(n, 1e-4 * (n + costs.sort_comparators(n))) for n in (100, 400)]
    per_elem[0] = (100, per_elem[0][1] - 0.05)
    got = costs.extrapolate(per_elem, 1600)
    assert got == pytest.approx(per_elem[1][1] / (400 + costs.sort_comparators(400)) * (1600 + costs.sort_comparators(1600)))


def test_fedrecover_threshold_plaintext_is_the_global_quantile():
    from clients.training import tolerance_threshold

    g = torch.randn(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tau = costs.fedrecover_threshold(g, 0.4, lambda _name: contextlib.nullcontext())
    assert float(tau) == pytest.approx(tolerance_threshold(g, 0.4))
    assert int((g.abs() > float(tau)).sum()) == math.floor(0.4 * 1000)


def test_formatting_helpers():
    assert costs.fmt(None) == "-" and costs.fmt(1234567) == "1,234,567"
    assert costs.fmt(0.000123456) == "0.0001235" and costs.fmt(3623.81) == "3624"
    assert costs.ratio(1.0, 4.0) == 0.25 and costs.ratio(1.0, 0) is None


# ------------------------------------------------------------------------------- offline
class _FakeChannel:
    def __init__(self):
        self.frames = []

    def send_frame(self, kind, payload):
        self.frames.append(bytes(payload))

    def recv_frame(self, kind, n):
        return bytearray(b"\x01")


class _FakeParty:
    """Just what the proxies use: a request log, nested meters, prefill, a channel."""

    def __init__(self):
        self.recorded_plan = []
        self.opened = []
        self.prefilled = []
        self.channel = _FakeChannel()
        self.rank = 0

    @contextlib.contextmanager
    def meter(self, name):
        self.opened.append(name)
        yield

    def prefill(self, plan):
        self.prefilled.append(list(plan))


def _step(proxy, party, name, requests):
    with proxy.meter(name):
        with proxy.meter("inner"):      # nested steps are not top-level: never prefetched
            party.recorded_plan.extend(requests)


def test_recording_and_prefetching_by_step_template():
    party = _FakeParty()
    rec = offline.instrument(party, None)
    _step(rec, party, "UE", [("triple", 1), ("triple", 2)])
    _step(rec, party, "TC", [("square", 3)])
    _step(rec, party, "UE", [("triple", 1), ("triple", 2)])
    _step(rec, party, "RS", [("b2a_rng", 4)])
    _step(rec, party, "RS", [("b2a_rng", 5)])           # differs: variable, never prefetched
    rep = offline.party_report(rec)
    assert rep["templates"]["UE"] == [("triple", 1), ("triple", 2)] and rep["variable"] == ["RS"]
    sched = offline.Schedule(rep["templates"], set(rep["variable"]))
    assert sched.num_requests == 4

    party2 = _FakeParty()
    pre = offline.instrument(party2, sched)
    _step(pre, party2, "UE", [("triple", 1), ("triple", 2)])
    _step(pre, party2, "TC", [("square", 9)])           # not what was recorded
    _step(pre, party2, "RS", [("b2a_rng", 6)])
    _step(pre, party2, "aggregate", [])
    assert party2.prefilled == [[("triple", 1), ("triple", 2)], [("square", 3)]]
    assert "offline:UE" in party2.opened and "offline:RS" not in party2.opened
    assert len(party2.channel.frames) == 2               # one barrier per prefetch
    rep2 = offline.party_report(pre)
    assert rep2["prefetched_requests"] == 3
    assert len(rep2["mismatches"]) == 2 and rep2["mismatches"][0].startswith("TC#1")


def test_schedule_rename_save_load(tmp_path):
    s = offline.Schedule({"TD2": [("a", 1)], "RS1": [("b", 2)], "UE": []}, {"RS1"})
    r = s.renamed({"TD": "TD2", "RS": "RS1", "UE": "UE", "TC": "TC"})
    assert r.templates == {"TD": [("a", 1)], "RS": [("b", 2)], "UE": []} and r.variable == {"RS"}
    r.save(tmp_path / "s.pkl")
    back = offline.Schedule.load(tmp_path / "s.pkl")
    assert back.templates == r.templates and back.variable == r.variable


def _meter(on_s, on_r, rounds, secs, off=None, wire=None):
    row = {"online_bytes_sent": on_s, "online_bytes_received": on_r, "online_rounds": rounds,
           "offline_bytes_sent": 0, "offline_bytes_received": 0, "offline_rounds": 0, "seconds": secs, "calls": 1}
    steps = {"UE": row, "UE/inv": dict(row), "setup": dict(row)}
    if off is not None:
        steps["offline:UE"] = {**row, "online_bytes_sent": 10, "online_bytes_received": 10, "online_rounds": 1,
                               "offline_bytes_sent": off[0], "offline_bytes_received": off[1],
                               "offline_rounds": 1, "seconds": off[2]}
    total = {"online_bytes_sent": on_s, "online_bytes_received": on_r, "offline_bytes_sent": 0,
             "offline_bytes_received": off[1] if off else 0}
    return {"steps": steps, "total": total,
            "wire": wire or {"online": {"sent": on_s, "received": on_r}, "offline": {"sent": 0, "received": 0}}}


def test_summarize_steps_and_wire_check():
    m0 = _meter(100, 120, 5, 1.0, off=(50, 0, 0.3))
    m1 = _meter(120, 100, 6, 1.2, off=(60, 800, 0.5),
                wire={"online": {"sent": 121, "received": 101}, "offline": {"sent": 0, "received": 808}})
    s = offline.summarize_steps([m0, m1])
    assert list(s) == ["UE"]                               # nested, setup and offline rows excluded
    ue = s["UE"]
    assert ue["online_bytes"] == 220 and ue["bytes_per_direction"] == 120 and ue["rounds"] == 6
    assert ue["online_s"] == 1.2 and ue["offline_s"] == 0.5
    assert ue["offline_bytes"] == 50 + 60 + 800 and ue["offline_bytes_to_party1"] == 800
    assert ue["offline_rounds"] == 2                       # dealer round trip + barrier
    w = offline.wire_check([m0, m1])
    assert w["online"]["metered_bytes"] == 220 and w["online"]["relative_difference"] == 0
    assert w["offline"]["socket_bytes"] == 808 and w["offline"]["relative_difference"] == pytest.approx(0.01)
