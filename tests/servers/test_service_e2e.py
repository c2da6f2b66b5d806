"""The service end to end: dealer, two servers and simulated clients as separate processes.

The life of two requests with FL in between: 4 FL rounds; client 0 asks to be forgotten;
the servers unlearn it in 2PC, adopt the model as round 5 and erase client 0; FL goes on
from it (rounds 6, 7); client 1 asks; the second job reads the history the first one left
(client 0 erased, round 5 an unlearning round), is adopted as round 8 and erases client 1;
FL goes on (rounds 9, 10). Two strangers connect to server 1's mpc port first. Oracles: plaintext FedAvg of the clients' updates for every FL
round; the plaintext Stage II on the twin history for each job (same selected rounds and
flags, model within 1e-3); bytes of the forgotten clients' shares, recomputed from their
keys, nowhere under either data directory (while a remaining client's are found).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from clients.share_seeds import disk_traces, find_traces, seeded_shares
from clients.simulator import build_federation
from net import tls
from common import wire
from protocols.starfish import run_stage2
from protocols.starfish.ports import history_prefix, without_clients
from lab.history import NpzHistory
from servers.store.share_store import ShareStore
from servers.secure.unlearning_jobs import starfish_params
from starfish.service_commands import federation_spec
from tests.helpers.service_harness import Deployment

torch.set_num_threads(1)
N, FL_ROUNDS = 4, 8
A_AT, B_AT = 4, 6          # client 0 asks after 4 FL rounds, client 1 after 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("e2e"), clients=N, overrides={"fl": {
        # rounds 9, 10 have the 2 clients left after two erasures: a smaller cohort than the
        # default 3 (issue 25, finding 5), said here so that FL goes on as the docstring says
        "rounds": FL_ROUNDS, "min_clients": 2}})
    try:
        dep.start("dealer", ["dealer"])
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        # strangers on server 1's mpc port: one closed at once, one left open and silent; the
        # jobs' sessions must find their peer anyway (they used to fail with HandshakeError)
        mpc = dep.cfg.server1.mpc().address
        socket.create_connection(mpc, timeout=5).close()
        silent = socket.create_connection(mpc, timeout=5)
        clients = dep.start("clients", ["clients", "--n", str(N), "--backdoor", "0",
                                        "--unlearn", f"0@{A_AT},1@{B_AT}",
                                        "--twin-dir", str(dep.root / "twin"),
                                        "--summary", str(dep.root / "summary.json"),
                                        "--max-seconds", "400"])
        assert clients.wait(460) == 0, dep.log("clients") + dep.log("server0") + dep.log("server1")
        summary = json.loads((dep.root / "summary.json").read_text())
        jobs = sorted(summary["jobs"], key=lambda j: summary["jobs"][j]["order"])
        results = {}
        for job in jobs:
            results[job] = []
            for p in (0, 1):
                with dep.client("admin", p) as c:
                    results[job].append(c.call("job_status", job=job, with_model=True))
        status = subprocess.run([sys.executable, "-m", "starfish.cli", "status", "--config",
                                 str(dep.config_path), "--job", jobs[0], "--save-model",
                                 str(dep.root / "unlearned.npy")], capture_output=True, text=True,
                                timeout=60)
        silent.close()
    finally:
        dep.close()   # SIGTERM: the daemons close their stores, which the tests then open
    yield dep, summary, jobs, results, status


def _model(rec):
    return wire.decode_tensor(rec["model"], "model", ("<f8",), tuple(rec["model"]["shape"]))


def _federation(dep):
    args = argparse.Namespace(dataset=None, data_dir=None, n=N, seed=None, backdoor="0",
                              epochs=None, lr=None, train_limit=None)
    return build_federation(federation_spec(dep.cfg, args))


def test_fl_goes_on_from_each_adopted_model(run):
    dep, summary, jobs, results, _ = run
    T = FL_ROUNDS + 2
    assert summary["T"] == T
    assert summary["fedavg_max_abs_error"] < 1e-4    # fixed-point encoding only
    parts = {int(k): v for k, v in summary["participants"].items()}
    a_round, b_round = A_AT + 1, B_AT + 2
    assert parts[a_round] == [] and parts[b_round] == []
    assert all(parts[i] == list(range(N)) for i in range(1, a_round))
    assert all(parts[i] == [1, 2, 3] for i in range(a_round + 1, b_round))
    assert all(parts[i] == [2, 3] for i in range(b_round + 1, T + 1))
    for job, adopted in zip(jobs, (a_round, b_round)):
        assert [r["state"] for r in results[job]] == ["done", "done"]
        assert np.array_equal(_model(results[job][0]), _model(results[job][1]))
    models = []
    for p in (0, 1):
        with ShareStore(dep.cfg.data_dir(p) / "store", party=p) as st:
            assert st.num_rounds == T and st.fl_rounds == FL_ROUNDS and st.verify() == []
            assert [st.round_kind(i) for i in (a_round, b_round)] == ["unlearning"] * 2
            assert sorted(st.forgotten()) == [0, 1]
            assert st.participants(1) == (2, 3)          # both erased from the early rounds
            for job, adopted in zip(jobs, (a_round, b_round)):
                assert np.array_equal(st.model(adopted), _model(results[job][0]))
            models.append([st.model(i) for i in range(T + 1)])
    assert all(np.array_equal(a, b) for a, b in zip(*models))


def test_each_job_equals_the_plaintext_twin_of_the_history_it_read(run):
    dep, summary, jobs, results, _ = run
    fed = _federation(dep)

    class Plain:
        def exact_updates(self, r, model, ids):
            return {j: fed.clients[j].train(model, r).update.to(torch.float64) for j in ids}

    twin = NpzHistory(summary["twin_dir"])
    erased: list[int] = []
    for job in jobs:
        res = results[job][0]["result"]
        target = summary["jobs"][job]["targets"]
        seen = without_clients(history_prefix(twin, res["rounds"]), erased)
        plain = run_stage2(None, seen, target, starfish_params(dep.cfg), Plain())
        assert res["selected_rounds"] == plain.selected_rounds
        assert {int(k): v for k, v in res["flags"].items()} == plain.flags
        assert np.abs(_model(results[job][0]) - plain.model.numpy()).max() < 1e-3
        assert not set(res["client_exact_updates"]) & {str(t) for t in target + erased}
        erased += target


def test_forgotten_clients_are_refused_and_their_shares_are_gone(run):
    dep, summary, jobs, results, _ = run
    for cid in ("0", "1"):
        assert summary["refused_uploads"][cid].startswith("forgotten")
    twin = NpzHistory(summary["twin_dir"])
    precision = 16
    traces: dict[int, dict[int, list[bytes]]] = {c: {0: [], 1: []} for c in (0, 1, 2)}
    for c in traces:
        key = tls.identity(dep.cfg.keys_dir, f"client-{c}").key.read_bytes()
        for r in range(1, twin.num_rounds + 1):
            if c not in twin.participants(r):
                continue
            values = {"update": twin.update(r, c).numpy(), "norm": twin.norm(r, c).numpy(),
                      "delta": twin.delta(r, c).numpy()}
            for p, t in disk_traces(seeded_shares(key, f"round/{r}", values, precision)).items():
                traces[c][p] += t
    for p in (0, 1):
        root = dep.cfg.data_dir(p)
        assert find_traces(root, traces[2][p]), "the scan must find a remaining client's shares"
        assert find_traces(root, traces[0][p] + traces[1][p]) == []


def test_receipts_name_both_servers_and_the_erased_rounds(run):
    _, summary, jobs, results, _ = run
    expected_rounds = [list(range(1, A_AT + 1)), list(range(1, A_AT + 1)) + list(range(A_AT + 2, B_AT + 2))]
    for job, rounds in zip(jobs, expected_rounds):
        for rec in results[job]:
            receipt = rec["receipt"]
            assert receipt["job"] == job and receipt["clients"] == summary["jobs"][job]["targets"]
            assert receipt["rounds_erased"] == rounds
            assert set(receipt["confirmations"]) == {"server0", "server1"}
            for p, conf in enumerate((receipt["confirmations"]["server0"], receipt["confirmations"]["server1"])):
                assert conf["party"] == p and list(conf["rounds"]) == rounds and conf["share_rows"] == len(rounds)


def test_status_command_shows_the_job_receipt_and_saves_its_model(run):
    dep, _, jobs, results, status = run
    assert status.returncode == 0, status.stderr
    assert f"job {jobs[0]}: done 100%" in status.stdout
    assert "selected rounds" in status.stdout and "erasure receipt" in status.stdout
    assert "client 0 forgotten by job" in status.stdout
    assert np.array_equal(np.load(dep.root / "unlearned.npy"), _model(results[jobs[0]][0]))
