"""``starfish lab`` end to end on the embedded digits, small configuration."""

from __future__ import annotations

import json

import torch

from bench.lab import main
from bench.lab_setup import DATASET_DEFAULTS

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
