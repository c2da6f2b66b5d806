"""The service end to end: dealer, two servers and simulated clients as separate processes.

FL rounds on shares must publish plaintext FedAvg of the clients' updates; the 2PC
unlearning job must give the model, selected rounds and correction flags of the plaintext
Stage II run on the twin history the simulator recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from clients.simulator import build_federation
from mpc import wire
from servers.lab.history import NpzHistory
from servers.share_store import ShareStore
from protocols.starfish import run_stage2
from servers.unlearning_jobs import starfish_params
from tests.helpers.service_harness import Deployment
from starfish.service_commands import federation_spec

torch.set_num_threads(1)
N, ROUNDS = 4, 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("e2e"), clients=N, overrides={"fl": {"rounds": ROUNDS}})
    try:
        dep.start("dealer", ["dealer"])
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        clients = dep.start("clients", ["clients", "--n", str(N), "--backdoor", "0", "--unlearn", "0",
                                        "--twin-dir", str(dep.root / "twin"),
                                        "--summary", str(dep.root / "summary.json"),
                                        "--max-seconds", "200"])
        assert clients.wait(240) == 0, dep.log("clients") + dep.log("server0") + dep.log("server1")
        summary = json.loads((dep.root / "summary.json").read_text())
        job = next(iter(summary["jobs"]))
        results = []
        for p in (0, 1):
            with dep.client("admin", p) as c:
                results.append(c.call("job_status", job=job, with_model=True))
        status = subprocess.run([sys.executable, "-m", "starfish.cli", "status", "--config",
                                 str(dep.config_path), "--job", job, "--save-model",
                                 str(dep.root / "unlearned.npy")], capture_output=True, text=True,
                                timeout=60)
    finally:
        dep.close()   # SIGTERM: the daemons close their stores, which the tests then open
    yield dep, summary, results, status


def test_fl_rounds_publish_plaintext_fedavg(run):
    dep, summary, _, _ = run
    assert summary["T"] == ROUNDS and summary["rounds_uploaded"] == ROUNDS
    assert summary["fedavg_max_abs_error"] < 1e-4    # fixed-point encoding only
    assert all(parts == list(range(N)) for parts in summary["participants"].values())
    # both stores: identical public rounds, nothing corrupt
    models = []
    for p in (0, 1):
        with ShareStore(dep.cfg.data_dir(p) / "store", party=p) as st:
            assert st.num_rounds == ROUNDS and st.verify() == []
            models.append([st.model(i) for i in range(ROUNDS + 1)])
    assert all(np.array_equal(a, b) for a, b in zip(*models))


def test_unlearned_model_matches_the_plaintext_twin(run):
    dep, summary, results, _ = run
    assert [r["state"] for r in results] == ["done", "done"]
    m0 = wire.decode_tensor(results[0]["model"], "model", ("<f8",), tuple(results[0]["model"]["shape"]))
    m1 = wire.decode_tensor(results[1]["model"], "model", ("<f8",), tuple(results[1]["model"]["shape"]))
    assert np.array_equal(m0, m1)

    args = argparse.Namespace(dataset=None, data_dir=None, n=N, seed=None, backdoor="0",
                              epochs=None, lr=None, train_limit=None)
    fed = build_federation(federation_spec(dep.cfg, args))

    class Plain:
        def exact_updates(self, r, model, ids):
            return {j: fed.clients[j].train(model, r).update.to(torch.float64) for j in ids}

    plain = run_stage2(None, NpzHistory(summary["twin_dir"]), [0], starfish_params(dep.cfg), Plain())
    res = results[0]["result"]
    assert res["selected_rounds"] == plain.selected_rounds
    assert {int(k): v for k, v in res["flags"].items()} == plain.flags
    assert np.abs(m0 - plain.model.numpy()).max() < 1e-3
    assert set(res["client_exact_updates"]) == {"1", "2", "3"}   # the target is never asked
    assert res["meters"]["steps"]["RS"]["online_rounds"] > 0


def test_status_command_shows_the_job_and_saves_its_model(run):
    dep, _, results, status = run
    assert status.returncode == 0, status.stderr
    assert f"job {results[0]['job']}: done 100%" in status.stdout
    assert "selected rounds" in status.stdout
    saved = np.load(dep.root / "unlearned.npy")
    m0 = wire.decode_tensor(results[0]["model"], "model", ("<f8",), tuple(results[0]["model"]["shape"]))
    assert np.array_equal(saved, m0)
