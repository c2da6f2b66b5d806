"""Unlearning a robustly aggregated history in the service: the servers' 2PC job replays each
round with the rule that made it (``protocols.starfish.robust_replay``), so the remaining
attackers, whom the rule outvoted in FL, stay out of the unlearned model.

6 clients on the digits, 8 FL rounds under ``[fl] aggregator``; clients 0, 1, 2 carry the same
backdoor; client 0 asks to be forgotten after the last round, leaving 2 attackers among the 5
remaining clients (the lab's FedAvg replay of such a history: BA-ASR 99%, docs/unlearning.md).
Oracles: the plaintext Stage II on the clients' twin history with the lab's replay rule (same
selected rounds and flags; the model within the rule's accuracy: the same opened directions up
to a few coordinates a round, docs/unlearning.md), and plaintext retraining under the same rule
(BA-ASR within 5 points), and the plaintext FedAvg replay (what the servers did before: the
attackers' backdoor back in the model). FedSECA in dealer mode and BRACE in two-party mode (no
dealer: the engine's sign tests), and FedSECA with 2 workers per server (Stage II on shards);
about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from clients.metrics import Evaluator
from clients.simulator import build_federation
from common import wire
from lab.aggregators import replay_rule
from lab.history import NpzHistory
from lab.recovery import Retrain
from protocols.starfish import run_stage2
from protocols.starfish.ports import history_prefix
from servers.secure.unlearning_jobs import starfish_params
from starfish.demo_baselines import lab_rule
from starfish.service_commands import federation_spec
from tests.helpers.service_harness import Deployment

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(900)
N, FL_ROUNDS, ATTACKERS = 6, 8, "0,1,2"


def _run(root, aggregator: str, offline: str, workers: int = 1) -> dict:
    dep = Deployment(root, clients=N, offline=offline, workers=workers,
                     overrides={"fl": {"rounds": FL_ROUNDS, "aggregator": aggregator}})
    try:
        if offline == "dealer":
            dep.start("dealer", ["dealer"])
        dep.start_server(1)
        dep.start_server(0)
        dep.wait_ready()
        clients = dep.start("clients", ["clients", "--n", str(N), "--backdoor", ATTACKERS,
                                        "--unlearn", f"0@{FL_ROUNDS}", "--twin-dir", str(dep.root / "twin"),
                                        "--summary", str(dep.root / "summary.json"), "--max-seconds", "780"])
        assert clients.wait(840) == 0, dep.log("clients") + dep.log("server0") + dep.log("server1")
        summary = json.loads((dep.root / "summary.json").read_text())
        job = next(iter(summary["jobs"]))
        recs = []
        for p in (0, 1):
            with dep.client("admin", p) as c:
                recs.append(c.call("job_status", job=job, with_model=True))
    finally:
        dep.close()
    return {"dep": dep, "summary": summary, "recs": recs}


def _model(rec) -> np.ndarray:
    return wire.decode_tensor(rec["model"], "model", ("<f8",), tuple(rec["model"]["shape"]))


def _check(run: dict) -> dict:
    dep, summary, recs = run["dep"], run["summary"], run["recs"]
    assert [r["state"] for r in recs] == ["done", "done"]
    assert np.array_equal(_model(recs[0]), _model(recs[1]))
    res = recs[0]["result"]
    assert set(res["replay_rules"].values()) == {dep.cfg.fl.aggregator}
    args = argparse.Namespace(dataset=None, data_dir=None, n=N, seed=None, backdoor=ATTACKERS,
                              epochs=None, lr=None, train_limit=None)
    spec = federation_spec(dep.cfg, args)
    fed = build_federation(spec)

    class Plain:
        def exact_updates(self, r, model, ids):
            return {j: fed.clients[j].train(model, r).update.to(torch.float64) for j in ids}

    twin = history_prefix(NpzHistory(summary["twin_dir"]), res["rounds"])
    plain = run_stage2(None, twin, [0], starfish_params(dep.cfg), Plain(), combine=replay_rule(lab_rule(dep.cfg.fl)))
    assert res["selected_rounds"] == plain.selected_rounds
    assert {int(k): v for k, v in res["flags"].items()} == plain.flags
    fedavg_replay = run_stage2(None, twin, [0], starfish_params(dep.cfg), Plain())   # before #28
    retrained, _ = Retrain(aggregator=lab_rule(dep.cfg.fl)).unlearn(twin, [0], fed.clients)
    tc = fed.clients[0]
    evaluate = Evaluator(fed.factory, fed.data.x_test, fed.data.y_test, tc.clean_x, tc.clean_y,
                         fed.trigger, spec.target_label)
    served = torch.from_numpy(_model(recs[0]))
    out = {"served": evaluate(served), "twin": evaluate(plain.model.to(torch.float64)),
           "retrain": evaluate(retrained.to(torch.float64)),
           "before": evaluate(twin.model(twin.num_rounds).to(torch.float64)),
           "fedavg_replay": evaluate(fedavg_replay.model.to(torch.float64)),
           "diff": (served - plain.model.to(torch.float64)).abs(),
           "l2_twin": float((served - plain.model.to(torch.float64)).norm()),
           "l2_retrain": float((served - retrained.to(torch.float64)).norm()),
           "meters": res["meters"]["steps"]}
    print({k: v for k, v in out.items() if k not in ("diff", "meters")},
          "max diff", float(out["diff"].max()), "differing", int((out["diff"] > 1e-3).sum()))
    assert out["fedavg_replay"]["ba_asr"] > 0.5      # what the FedAvg replay let back in
    assert abs(out["served"]["ba_asr"] - out["retrain"]["ba_asr"]) <= 0.05
    assert abs(out["served"]["ba_asr"] - out["twin"]["ba_asr"]) <= 0.05
    if dep.cfg.fl.aggregator == "brace-sign":
        # the votes are exact functions of the encoded rows: a coordinate differs only where an
        # estimate lies within its fixed-point error of 0 (measured: none)
        assert float((out["diff"] > 1e-9).double().mean()) <= 0.01
    else:
        # FedSECA's fixed-point bound per round (clip factors, truncations), as the FedAvg job's
        assert float(out["diff"].max()) <= 1e-3
    return out


# Each rule once and each mode once (the suite's time, issue 24): the replay above the share
# backend is the same code in both modes, and both rules' 2PC is checked against the twin in
# both modes in tests/protocols/test_robust_aggregation.py. The other two pairs pass the same
# checks too, measured: BRACE in dealer mode (39 s in the suite before it left it) and FedSECA in
# two-party mode (113 s here: BA-ASR 0.5% served, twin and retrain, max difference to the twin
# 2.0e-5; docs/unlearning.md).
# The third case: the same FedSECA job with each server a coordinator and 2 Ray workers (issue
# 30): its replayed rounds' quantile search, CRISE and clip norms from the pairs' per-shard sums.
@pytest.mark.parametrize("aggregator,offline,workers", [("fedseca", "dealer", 1), ("brace-sign", "two-party", 1),
                                                        ("fedseca", "dealer", 2)])
def test_a_robust_history_is_unlearned_with_its_rule_in_2pc(tmp_path, aggregator, offline, workers):
    if workers > 1:
        pytest.importorskip("ray")
    run = _run(tmp_path, aggregator, offline, workers)
    out = _check(run)
    steps = out["meters"]
    assert any(name.startswith("aggregate/") for name in steps)
    if workers > 1:
        res = run["recs"][0]["result"]
        assert len(res["worker_meters"]) == workers, res.keys()
        assert all(m["total"].get("online_bytes_sent", 0) > 0 for m in res["worker_meters"])
