"""The options every benchmark shares (issue 27): wherever a bench runs 2PC or emulates a link it
takes --profile, --offline, --quiet, --out and --seed with the same names, defaults and help
(``bench/common_options.py``), and each option takes effect: a few cheap runs on tiny shapes."""

from __future__ import annotations

import argparse
import json

import pytest

import mpc.launcher
from bench import batched_training, common_options, lab, public_division, primitives, range_check
from bench import robust_aggregation, robust_lab, rs_switch, runtime, truncation
from starfish.cli import build_parser


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every ``starfish bench`` command, ``starfish lab`` and the ``python -m`` benches."""
    root = build_parser()
    top = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices
    bench = next(a for a in top["bench"]._actions if isinstance(a, argparse._SubParsersAction)).choices
    out = dict(bench, lab=top["lab"])
    out["public-division"] = argparse.ArgumentParser()
    public_division.add_arguments(out["public-division"])
    return out


PARSERS = _parsers()
#: the benches that emulate a link; those with --shaping can also re-run themselves under netem
LINKED = {"runtime", "primitives", "steps", "unlearning", "range-check", "aggregation", "public-division", "lab"}
NETEM = {"steps", "unlearning", "range-check"}
#: benches that compare offline modes take a list; its default
SEVERAL = {"runtime": "dealer", "primitives": "dealer", "public-division": "dealer,two-party"}
#: benches that run no 2PC (plaintext training; the store's files): no --profile, no --offline
PLAINTEXT = {"training", "shard-store"}
#: benches that run nothing (a model fitted to other benches' JSON): no seed, no progress bar
ANALYSIS = {"scale"}


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def test_every_bench_is_classified():
    assert set(PARSERS) == LINKED | PLAINTEXT | ANALYSIS | {"rs-switch", "truncation", "scaling"}


def test_an_analysis_bench_writes_json_and_takes_no_run_options():
    for name in ANALYSIS:
        opts = _options(PARSERS[name])
        assert opts["--out"].help.startswith("JSON output (default ")
        assert not {"--seed", "--profile", "--offline"} & set(opts)


@pytest.mark.parametrize("name", sorted(set(PARSERS) - ANALYSIS))
def test_common_options_have_one_name_default_and_help(name):
    opts = _options(PARSERS[name])
    assert opts["--quiet"].help == common_options.QUIET_HELP and opts["--quiet"].default is False
    assert opts["--seed"].default == 0 and opts["--seed"].help.startswith("seed of ")
    assert opts["--seed"].help.endswith("(default 0)")
    if name != "lab":      # the lab's --out is a directory for lab.json and lab.png
        assert opts["--out"].help.startswith("JSON output (default ")
    if name in LINKED:
        p = opts["--profile"]
        assert (p.default, list(p.choices), p.help) == ("lan", list(common_options.PROFILES),
                                                         common_options.PROFILE_HELP)
        assert {"--latency-ms", "--bandwidth-mbps", "--bandwidth-reading"} <= set(opts)
        assert opts["--latency-ms"].default is None and opts["--bandwidth-reading"].default == "bits"
    elif name == "scaling":   # several profiles per run: its own plural, --profile a spelling of it
        assert opts["--profile"] is opts["--profiles"] and "lan" in opts["--profiles"].default.split(",")
    else:
        assert "--profile" not in opts
    assert ("--shaping" in opts) == (name in NETEM)
    if name in PLAINTEXT:
        assert "--offline" not in opts
    elif name in SEVERAL:
        o = opts["--offline"]
        assert o.default == SEVERAL[name] and common_options.MODES_HELP in o.help
        assert o.help.startswith("comma list of where the correlated randomness comes from")
    else:
        o = opts["--offline"]
        assert (o.default, list(o.choices), o.help) == ("dealer", ["dealer", "two-party"],
                                                         common_options.OFFLINE_HELP)


def test_benches_without_an_option_say_why():
    for module in (rs_switch, truncation):
        assert "No ``--profile``" in module.__doc__
    assert "neither ``--profile`` nor ``--offline``" in batched_training.__doc__
    assert "``--offline``, ``--profile``" in robust_lab.__doc__
    with pytest.raises(SystemExit):   # a plaintext runner has no 2PC options to ignore
        robust_lab.main(["--offline", "two-party"])


def test_a_lone_latency_means_custom_and_a_named_profile_with_it_is_refused(capsys):
    p = PARSERS["runtime"]
    prof = common_options.profile_of(p.parse_args(["--latency-ms", "2"]))
    assert (prof.name, prof.one_way_latency_s, prof.bandwidth_bps) == ("custom", 0.002, 0.0)
    assert common_options.profile_of(p.parse_args([])).name == "lan"
    assert runtime.main(["--profile", "wan", "--latency-ms", "2"]) == 2
    assert "--profile custom" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--offline", "dealer,moon"])
    assert p.parse_args(["--offline", "dealer, two-party,tfp"]).offline == ["dealer", "two-party", "tfp"]


def test_rs_switch_refuses_to_store_a_two_party_table(capsys):
    assert rs_switch.main(["--T", "4", "--offline", "two-party", "--write-default"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--offline two-party" in err


# ------------------------------------------------------------------ the options take effect
class _Stop(Exception):
    pass


@pytest.mark.parametrize("module, where, argv", [
    (runtime, runtime, ["--n", "8", "--profile", "none"]),
    (primitives, primitives, ["--primitives", "ge", "--sizes", "8", "--profile", "none"]),
    (rs_switch, rs_switch, ["--T", "4"]),
    (truncation, truncation, ["--config", "tiny"]),
    (public_division, mpc.launcher, ["--n", "8", "--profile", "none"]),     # imports run_parties when it runs
], ids=["runtime", "primitives", "rs-switch", "truncation", "public-division"])
def test_offline_two_party_reaches_run_parties_without_a_dealer_plan(module, where, argv, monkeypatch, tmp_path):
    # the engine's start alone takes longer than these tests may (tests/mpc run it in both modes)
    calls = []

    def recorder(*args, **kw):
        calls.append(kw)
        raise _Stop

    monkeypatch.setattr(where, "run_parties", recorder)
    try:
        module.main(argv + ["--offline", "two-party", "--quiet", "--out", str(tmp_path / "o.json")]
                    + (["--cache-dir", str(tmp_path)] if module is truncation else []))
    except _Stop:
        pass     # primitives records a failing primitive and goes on
    assert calls and calls[0]["offline"] == "two-party" and calls[0].get("plan") is None


def test_runtime_reference_provider_on_a_custom_link_with_a_seed(tmp_path):
    out = tmp_path / "r.json"
    assert runtime.main(["--n", "8", "--offline", "tfp", "--latency-ms", "1", "--seed", "3", "--quiet",
                         "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"]["name"] == "custom" and res["link"] == {"latency": 0.001, "bandwidth_bps": 0.0}
    assert [r["provider"] for r in res["rows"]] == ["tfp"] * len(runtime.OPS)
    # every operation waits for at least one emulated one-way latency
    assert all(r["online_seconds"] >= 0.001 for r in res["rows"])


def test_aggregation_takes_a_custom_profile(tmp_path):
    out = tmp_path / "a.json"
    assert robust_aggregation.main(["--clients", "3", "--dim", "8", "--aggregator", "brace-sign", "--latency-ms", "1",
                                    "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"]["name"] == "custom" and res["link"].startswith("transport emulation")
    assert res["twin_equal"] is True


def test_public_division_writes_json_on_the_chosen_profile(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert public_division.main(["--n", "16", "--offline", "dealer", "--profile", "none", "--quiet",
                                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"]["name"] == "none" and {r["offline"] for r in res["rows"]} == {"dealer"}
    assert len(res["rows"]) == len(public_division.DIVISORS) + 1
    assert "| x / 3 | dealer |" in capsys.readouterr().out


def test_seed_changes_the_synthetic_history_of_range_check(tmp_path):
    out = tmp_path / "rc.json"
    assert range_check.main(["--config", "tiny", "--steps", "range", "--profile", "none", "--seed", "1", "--quiet",
                             "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["seed"] == 1 and res["correct"]


def test_lab_secure_takes_the_profile_and_offline_mode(monkeypatch):
    seen = {}

    def fake(lab_args, history, targets, params, link=None, offline="dealer", quiet=True):
        seen.update(link=link, offline=offline)
        raise ValueError("stop after the 2PC call")   # the lab reports it as a one-line error

    monkeypatch.setattr(lab, "run_secure_starfish", fake)
    argv = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--epochs", "1", "--train-limit", "60",
            "--test-limit", "30", "--method", "starfish", "--secure", "--quiet", "--offline", "two-party",
            "--latency-ms", "2"]
    assert lab.main(argv) == 2
    assert seen["offline"] == "two-party" and (seen["link"].latency, seen["link"].bandwidth_bps) == (0.002, 0.0)
    seen.clear()
    assert lab.main(argv[:-2] + ["--profile", "lan", "--latency-ms", "2"]) == 2 and not seen   # before any FL


@pytest.mark.parametrize("argv, why", [(["--workers", "2"], "--profile none"),
                                       (["--workers", "0", "--profile", "none"], "--workers must be 1..")])
def test_range_check_on_workers_refuses_what_it_cannot_honour_in_one_line(argv, why, capsys):
    assert range_check.main(["--config", "tiny", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err
