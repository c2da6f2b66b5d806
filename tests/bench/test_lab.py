"""``starfish lab`` end to end on the embedded digits, small configuration."""

from __future__ import annotations

import json

import pytest
import torch

from bench.lab import main
from lab.experiment import DATASET_DEFAULTS

torch.set_num_threads(1)


def test_lab_runs_all_methods_on_digits(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--dataset", "digits", "--clients", "5", "--rounds", "6", "--epochs", "1",
               "--train-limit", "300", "--test-limit", "120", "--targets", "0",
               "--method", "retrain,federaser,fedrecover,starfish,random",
               "--out", str(out), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    for name in ("original (with target)", "retrain", "federaser", "fedrecover", "starfish",
                 "random", "BA-ASR%", "ARP%"):
        assert name in table
    result = json.loads((out / "lab.json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == {"original (with target)", "retrain", "federaser", "fedrecover",
                         "starfish", "random"}
    assert rows["retrain"]["l2_to_retrain"] == 0.0 and rows["retrain"]["arp"] == 0.0
    assert rows["starfish"]["arp"] > 0 and rows["starfish"]["rounds_used"] == 4  # ceil(0.6*6)
    for r in rows.values():
        assert 0.0 <= r["ter"] <= 1.0 and 0.0 <= r["ba_asr"] <= 1.0
    assert result["costs"]["starfish"]["selected_rounds"] == sorted(
        result["costs"]["starfish"]["selected_rounds"])
    assert (out / "lab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["config"]["lr"] == DATASET_DEFAULTS["digits"]["lr"]


def test_lab_reports_missing_dataset_directory(tmp_path, capsys):
    rc = main(["--dataset", "mnist", "--data-dir", str(tmp_path), "--quiet"])
    assert rc == 2
    assert "train-images-idx3-ubyte" in capsys.readouterr().err


def test_lab_rejects_unknown_method(capsys):
    assert main(["--method", "magic", "--quiet"]) == 2
    assert "magic" in capsys.readouterr().err


# ------------------------------------------------------------------ --secure: 2PC vs plaintext
_SMALL = ["--dataset", "digits", "--clients", "4", "--rounds", "6", "--epochs", "1",
          "--train-limit", "160", "--test-limit", "60", "--targets", "0", "--quiet"]


def _plaintext_as_secure(perturb):
    """A stand-in for bench.secure_lab.run_secure_starfish: the plaintext Stage II, then ``perturb``."""
    def fake(lab_args, history, targets, params, link=None, offline="dealer", quiet=True):
        from lab.experiment import build_setup
        from protocols.starfish import run_stage2
        from protocols.starfish.ports import remaining_clients
        from lab.recovery.base import ClientPool, PoolClients

        setup = build_setup(lab_args)
        pool = ClientPool(setup.participants, remaining_clients(history, targets))
        res = run_stage2(None, history, targets, params, PoolClients(pool))
        v = res.to_json()
        v["model"] = res.model.double().numpy().copy()
        v["meters"] = {"steps": {}}
        v["client_computations"] = dict(pool.computations)
        perturb(v)
        return {"values": [v, dict(v)], "seconds": 0.5}
    return fake


def _shift_selection(v):
    v["selected_rounds"] = sorted(set(range(1, 7)) - set(v["selected_rounds"]))[:1] + v["selected_rounds"][1:]


def _flip_flag(v):
    step = str(max(int(s) for s in v["flags"])) if v["flags"] else "1"
    v["flags"][step] = [] if v["flags"].get(step) else [3]


def _shift_model(v):
    v["model"][5] += 0.05


@pytest.mark.parametrize("perturb, expect", [
    (_shift_selection, "selected rounds differ: 2PC"),
    (_flip_flag, "correction flags differ: step"),
    (_shift_model, "models differ: max |2PC - plaintext| = 5.000e-02 > tolerance 0.01"),
])
def test_lab_secure_exits_non_zero_when_2pc_and_plaintext_disagree(monkeypatch, capsys, tmp_path,
                                                                     perturb, expect):
    from bench import lab

    monkeypatch.setattr(lab, "run_secure_starfish", _plaintext_as_secure(perturb))
    rc = main(_SMALL + ["--method", "starfish", "--secure", "--out", str(tmp_path)])
    assert rc == lab.EXIT_DISAGREE == 1
    cap = capsys.readouterr()
    assert "2PC and plaintext Starfish DISAGREE:" in cap.out and expect in cap.out
    assert "2PC Starfish disagrees with plaintext Starfish" in cap.err and expect in cap.err
    sec = json.loads((tmp_path / "lab.json").read_text())["secure"]  # written even on disagreement
    assert sec["agree"] is False and any(expect in d for d in sec["disagreements"])
    if perturb is _shift_selection:
        assert sec["selected_rounds_equal"] is False and sec["flags_equal"] is True
        assert sec["selected_rounds"]["secure"] != sec["selected_rounds"]["plaintext"]
    if perturb is _flip_flag:
        assert sec["flags_equal"] is False and sec["selected_rounds_equal"] is True
        assert sec["flags"]["secure"] != sec["flags"]["plaintext"]
    if perturb is _shift_model:
        assert abs(sec["max_abs_diff_to_plaintext"] - 0.05) < 1e-6


def test_lab_secure_tolerance_is_configurable(monkeypatch, capsys):
    from bench import lab

    def small_shift(v):
        v["model"][0] += 5e-3

    monkeypatch.setattr(lab, "run_secure_starfish", _plaintext_as_secure(small_shift))
    assert main(_SMALL + ["--method", "starfish", "--secure"]) == 0          # default 1e-2
    assert "tolerance 0.01" in capsys.readouterr().out
    assert main(_SMALL + ["--method", "starfish", "--secure", "--secure-tolerance", "1e-3"]) == 1
    assert "models differ: max |2PC - plaintext| = 5.000e-03 > tolerance 0.001" in capsys.readouterr().out
    assert main(_SMALL + ["--secure", "--secure-tolerance", "-1"]) == 2
    assert "--secure-tolerance" in capsys.readouterr().err


def test_lab_secure_agreeing_run_exits_zero_and_adds_plaintext_starfish(tmp_path, capsys):
    """The real 2PC run (two server processes, dealer); --method without starfish still compares."""
    rc = main(_SMALL + ["--method", "retrain", "--secure", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert "DISAGREE" not in cap.out
    result = json.loads((tmp_path / "lab.json").read_text())
    assert {r["method"] for r in result["results"]} == {"original (with target)", "retrain", "starfish",
                                                        "starfish (2PC)"}
    sec = result["secure"]
    assert sec["agree"] is True and sec["disagreements"] == []
    assert sec["selected_rounds_equal"] and sec["flags_equal"]
    assert sec["max_abs_diff_to_plaintext"] <= sec["tolerance"] == 0.01
    assert sec["flags"]["secure"] == sec["flags"]["plaintext"]
    assert result["costs"]["starfish"]["extra"]["flags"] == result["costs"]["starfish (2PC)"]["extra"]["flags"]
    assert "selected rounds equal to plaintext: True; flags equal: True" in cap.out


def test_compare_secure_names_every_difference():
    from bench.lab import compare_secure
    from lab.recovery import CostRecord

    plain = CostRecord("starfish", 6, selected_rounds=[2, 4, 5, 6], extra={"flags": {3: [1, 2], 4: [1]}})
    same = CostRecord("starfish (2PC)", 6, selected_rounds=[2, 4, 5, 6], extra={"flags": {3: [2, 1], 4: [1]}})
    m = torch.zeros(4)
    ok = compare_secure(m, plain, m + 1e-3, same)
    assert ok["agree"] and ok["disagreements"] == [] and ok["flags_equal"]
    other = CostRecord("starfish (2PC)", 6, selected_rounds=[1, 4, 5, 6], extra={"flags": {3: [1, 2]}})
    bad = compare_secure(m, plain, m + float("nan"), other, servers_differ=["models"])
    assert not bad["agree"]
    assert bad["disagreements"] == [
        "the two servers revealed different models",
        "selected rounds differ: 2PC [1, 4, 5, 6], plaintext [2, 4, 5, 6] (only 2PC: [1], only plaintext: [2])",
        "correction flags differ: step 4: 2PC -, plaintext [1]",
        "models differ: max |2PC - plaintext| = nan > tolerance 0.01",
    ]


def test_model_defaults_sit_between_the_command_line_and_the_dataset():
    import argparse

    from bench.lab import add_arguments
    from lab.experiment import LabConfig, MODEL_DEFAULTS, starfish_params
    from protocols.starfish.params import PAPER

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def cfg(*argv):
        return LabConfig(parser.parse_args(list(argv)))

    logreg = cfg()
    assert (logreg.get("model"), logreg.get("lr"), logreg.get("sigma")) == ("logreg", 0.3, PAPER.sigma)
    cnn = cfg("--model", "cnn")
    assert cnn.get("lr") == MODEL_DEFAULTS[("digits", "cnn")]["lr"] != DATASET_DEFAULTS["digits"]["lr"]
    assert cnn.get("sigma") == PAPER.sigma and cnn.get("batch_size") == DATASET_DEFAULTS["digits"]["batch_size"]
    assert cfg("--model", "mlp").get("sigma") == 0.8 and cfg("--model", "mlp").get("lr") == 0.3
    assert cfg("--model", "cnn", "--lr", "0.02", "--sigma", "0.5").get("lr") == 0.02
    assert starfish_params(parser.parse_args(["--model", "cnn", "--sigma", "0.5"])).sigma == 0.5
    assert starfish_params(parser.parse_args(["--model", "mlp"])).sigma == 0.8
    assert starfish_params(parser.parse_args([])).sigma == PAPER.sigma
    # the MNIST CNN keeps the paper's values: the digits' overrides do not leak to other datasets
    mnist = cfg("--dataset", "mnist")
    assert (mnist.get("lr"), mnist.get("sigma")) == (0.005, PAPER.sigma)


def test_lab_reports_what_each_method_keeps_of_the_history(tmp_path, capsys):
    out = tmp_path / "out"
    clients, rounds = 5, 6
    rc = main(["--dataset", "digits", "--clients", str(clients), "--rounds", str(rounds),
               "--epochs", "1", "--train-limit", "300", "--test-limit", "120", "--targets", "0",
               "--method", "retrain,crab,fedadp,starfish", "--out", str(out), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "stored" in table and "DP eps" in table
    result = json.loads((out / "lab.json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    m = result["config"]["num_params"]
    # the whole recorded history: T + 1 float32 models and every client's update of every round
    full = 4 * m * (rounds + 1 + rounds * clients)
    assert rows["starfish"]["stored"] == {"rounds": rounds, "updates": rounds * clients,
                                          "models": rounds + 1, "bytes": full}
    assert rows["retrain"]["stored"]["bytes"] == 0
    for name in ("crab", "fedadp"):
        s = rows[name]["stored"]
        assert s["bytes"] == 4 * m * (s["updates"] + s["models"]) and 0 < s["bytes"] <= full
        assert s["rounds"] <= rounds and s["updates"] <= rounds * clients
    eps = rows["fedadp"]["epsilon"]
    assert eps == result["costs"]["fedadp"]["extra"]["epsilon"] and eps > 0
    assert rows["starfish"]["epsilon"] is None


def test_a_method_whose_model_blows_up_is_marked_diverged(monkeypatch, tmp_path, capsys):
    import bench.lab as lab
    from lab.recovery import CostRecord

    class Blowup:
        def unlearn(self, history, targets, participants, progress=None):
            model = history.model(history.num_rounds).clone()
            model[0] = float("nan")
            return model, CostRecord("starfish", history.num_rounds)

    real = lab._make_method
    monkeypatch.setattr(lab, "_make_method",
                        lambda name, args: Blowup() if name == "starfish" else real(name, args))
    rc = main(["--clients", "4", "--rounds", "3", "--epochs", "1", "--train-limit", "200",
               "--test-limit", "80", "--method", "retrain,starfish", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    assert "starfish (diverged)" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads((tmp_path / "lab.json").read_text())["results"]}
    assert rows["starfish"]["diverged"] is True and rows["retrain"]["diverged"] is False


def test_a_lab_stopped_part_way_keeps_the_methods_it_finished(monkeypatch, tmp_path):
    """``lab.partial.json`` holds FL's row and every method that ended before the crash, with the
    scores the finished table would show; a finished lab removes it."""
    import bench.lab as lab

    class Crash:
        def unlearn(self, history, targets, participants, progress=None):
            raise KeyboardInterrupt("stopped by the operator")

    real = lab._make_method
    monkeypatch.setattr(lab, "_make_method",
                        lambda name, args: Crash() if name == "random" else real(name, args))
    argv = ["--clients", "4", "--rounds", "3", "--epochs", "1", "--train-limit", "200",
            "--test-limit", "80", "--out", str(tmp_path), "--quiet"]
    with pytest.raises(KeyboardInterrupt):
        main(argv + ["--method", "retrain,starfish,random"])
    partial = json.loads((tmp_path / "lab.partial.json").read_text())["results"]
    assert [r["method"] for r in partial] == ["original (with target)", "retrain", "starfish"]
    assert not (tmp_path / "lab.json").exists()

    monkeypatch.setattr(lab, "_make_method", real)
    assert main(argv + ["--method", "retrain,starfish"]) == 0
    finished = {r["method"]: r for r in json.loads((tmp_path / "lab.json").read_text())["results"]}
    for r in partial[1:]:
        for key in ("ter", "ba_asr", "mia_asr", "rounds_used"):
            assert finished[r["method"]][key] == r[key]
    assert not (tmp_path / "lab.partial.json").exists()
