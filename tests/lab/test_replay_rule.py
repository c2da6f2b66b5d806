"""Starfish's replay with the rule that made the history (``--starfish-replay aggregator``).

Oracle: when every replayed step asks the remaining clients for exact updates (sigma = 1, a
correction at every step, every client flagged), the replay is FL without the target under the
same rule, which ``Retrain`` computes through ``run_federated`` (an independent loop).
"""

from __future__ import annotations

import pytest
import torch

from protocols.starfish.params import StarfishParams
from lab.aggregators import BraceSign, FedAvg, FedSECA, replay_rule
from lab.fl import run_federated
from lab.recovery import Retrain, Starfish
from tests.lab.test_recovery import digits_clients

torch.set_num_threads(1)

EVERY_STEP_EXACT = StarfishParams(sigma=1.0, alpha=0.95, beta=0.01, buffer=2)


@pytest.mark.parametrize("rule", [FedSECA, BraceSign, FedAvg])
def test_an_all_exact_replay_under_the_history_rule_is_retraining_under_it(rule):
    clients, m0 = digits_clients(n=4, limit=160)
    hist = run_federated(clients, m0, 5, 0.2, aggregator=rule())
    want, _ = Retrain(aggregator=rule()).unlearn(hist, [0], clients)
    got, cost = Starfish(EVERY_STEP_EXACT, aggregator=rule()).unlearn(hist, [0], clients)
    assert cost.estimated_updates == 0 or all(
        sorted(ids) == [1, 2, 3] for ids in cost.extra["flags"].values())
    assert cost.extra["replay_rule"] == rule.name
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-5)


def test_the_fedavg_replay_of_a_robust_history_is_not_robust_retraining():
    clients, m0 = digits_clients(n=4, limit=160)
    hist = run_federated(clients, m0, 5, 0.2, aggregator=FedSECA())
    robust, _ = Retrain(aggregator=FedSECA()).unlearn(hist, [0], clients)
    fedavg_replay, _ = Starfish(EVERY_STEP_EXACT).unlearn(hist, [0], clients)
    assert float((fedavg_replay.double() - robust.double()).abs().max()) > 1e-3


def test_replay_rule_is_none_for_fedavg_and_brace_steps_by_the_replayed_round():
    assert replay_rule(None) is None and replay_rule(FedAvg()) is None
    brace = BraceSign(lam=0.0, scale=0.5, decay=0.5)
    step = replay_rule(brace)
    rows = [torch.tensor([1.0, -2.0, 0.0]), torch.tensor([3.0, -1.0, 0.0])]
    # votes +2, -2, 0 against lambda 0: +1, -1, -1; round 4 steps 0.5 / sqrt(4) = 0.25
    got = step(rows, [0.5, 0.5], [1, 2], 4)
    torch.testing.assert_close(got, torch.tensor([0.25, -0.25, -0.25], dtype=torch.float64))
