"""Byzantine attacks (clients.attacks) and the FL loop's aggregator hook (lab.aggregators).

Oracles: hand computations on toy clients with fixed or closed-form updates, numpy for ALIE's
statistics, a hand-rolled FL loop, and today's FedAvg path itself (bit for bit).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.attacks import ALIE_JITTER, AlieClient, ScalingClient, SignFlipClient
from clients.datasets import load_digits_dataset
from clients.models import build_model, flatten_params
from clients.partition import iid_split
from clients.training import LocalClient, tolerance_threshold
from protocols.robust_aggregation import fedseca
from lab.aggregators import AGGREGATORS, BraceSign, FedAvg, FedSECA, build_aggregator
from lab.fl import run_federated
from lab.recovery import Retrain
from tests.helpers.toy_clients import ToyUpdate

torch.set_num_threads(1)


@dataclass
class FixedClient:
    """Uploads ``g(round)`` whatever the model; records how often it was asked."""

    client_id: int
    g: object
    num_samples: int = 1
    alpha: float = 0.4
    epochs: float = 1.0
    x: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    calls: int = 0

    def train(self, model_vec, round_idx, epochs=None):
        self.calls += 1
        g = torch.as_tensor(self.g(round_idx) if callable(self.g) else self.g, dtype=torch.float64)
        return ToyUpdate(g, float(g.norm()), 0.0, self.num_samples)


@dataclass
class QuadClient:
    """Update on M is a * (M - c): the gradient of a/2 ||M - c||^2."""

    client_id: int
    center: list
    num_samples: int = 1
    a: float = 1.0

    def train(self, model_vec, round_idx, epochs=None):
        g = self.a * (model_vec.to(torch.float64) - torch.tensor(self.center, dtype=torch.float64))
        return ToyUpdate(g, float(g.norm()), 0.0, self.num_samples)


G0 = [3.0, -1.0, 4.0, -1.5, 2.0]
NORM0 = math.sqrt(9 + 1 + 16 + 2.25 + 4)  # ||G0||


# ------------------------------------------------------------------ attacks
def test_sign_flip_upload_by_hand():
    up = SignFlipClient(FixedClient(3, G0)).train(torch.zeros(5), 1)
    assert up.update.tolist() == [-3.0, 1.0, -4.0, 1.5, -2.0]
    assert up.norm == pytest.approx(NORM0)
    # alpha 0.4 of 5 coordinates: k = 2 exceed delta, so delta is the 3rd largest |g| = 2
    assert up.delta == 2.0
    assert up.num_samples == 1


def test_scaling_upload_by_hand():
    up = ScalingClient(FixedClient(3, G0, num_samples=7), scale=10.0).train(torch.zeros(5), 1)
    assert up.update.tolist() == [30.0, -10.0, 40.0, -15.0, 20.0]
    assert up.norm == pytest.approx(10 * NORM0)
    assert up.delta == 20.0 and up.num_samples == 7


def test_scaling_default_is_fedseca_epsilon_10():
    assert ScalingClient(FixedClient(0, G0)).scale == 10.0


@settings(max_examples=25)
@given(st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=12),
       st.floats(-20, 20, allow_nan=False), st.sampled_from([0.0, 0.1, 0.4, 0.9, 1.0]))
def test_forged_uploads_are_consistent_like_an_honest_clients(g, s, alpha):
    g = torch.tensor(g, dtype=torch.float64)
    for attacker in (SignFlipClient(FixedClient(0, g, alpha=alpha)),
                     ScalingClient(FixedClient(0, g, alpha=alpha), scale=s)):
        up = attacker.train(torch.zeros(len(g)), 1)
        assert up.norm == pytest.approx(float(up.update.norm()))
        assert up.delta == tolerance_threshold(up.update, alpha)
        # delta's definition: at most floor(alpha m) coordinates strictly above it
        assert int((up.update.abs() > up.delta).sum()) <= math.floor(alpha * len(g))


def test_alie_against_numpy_on_the_honest_uploads():
    honest = {1: [1.0, 2.0], 2: [3.0, 2.0], 3: [5.0, 8.0]}
    others = {j: ToyUpdate(torch.tensor(v, dtype=torch.float64), 0.0, 0.0, 1) for j, v in honest.items()}
    inner = FixedClient(0, [100.0, 100.0])
    up = AlieClient(inner, z_max=1.0, jitter=0.0).train_omniscient(torch.zeros(2), 4, others)
    h = np.array(list(honest.values()))
    want = h.mean(axis=0) - 1.0 * h.std(axis=0)  # numpy's default std is the population one
    np.testing.assert_allclose(up.update.numpy(), want, rtol=1e-12)
    assert up.norm == pytest.approx(float(np.linalg.norm(want)))
    assert up.delta == tolerance_threshold(up.update, inner.alpha)
    assert inner.calls == 0  # the forged upload needs no local training


def test_alie_jitter_is_within_the_papers_band_and_reproducible():
    a, b = AlieClient(FixedClient(0, G0), seed=5), AlieClient(FixedClient(1, G0), seed=5)
    zs = [a.z(i) for i in range(1, 41)]
    assert all(1.0 - ALIE_JITTER <= z < 1.0 + ALIE_JITTER for z in zs)
    assert len(set(zs)) == 40                      # a new z every round
    assert zs == [AlieClient(FixedClient(0, G0), seed=5).z(i) for i in range(1, 41)]
    assert a.z(3) != b.z(3)                         # and per attacker


def test_alie_without_a_view_uploads_its_own_update():
    up = AlieClient(FixedClient(0, G0)).train(torch.zeros(5), 2)
    assert up.update.tolist() == G0


def test_wrappers_read_through_to_the_wrapped_client():
    inner = FixedClient(9, G0, num_samples=4, epochs=2.5)
    w = SignFlipClient(inner)
    assert (w.client_id, w.num_samples, w.epochs, w.alpha) == (9, 4, 2.5, 0.4)
    assert w.x is inner.x
    assert not callable(getattr(w, "train_omniscient", None))


def test_attack_parameters_are_checked():
    class NoAlpha:
        client_id, num_samples = 0, 1

        def train(self, m, i, epochs=None):
            raise AssertionError

    with pytest.raises(ValueError, match="alpha"):
        SignFlipClient(NoAlpha())
    with pytest.raises(ValueError, match="jitter"):
        AlieClient(FixedClient(0, G0), jitter=-0.1)
    with pytest.raises(ValueError, match="scale"):
        ScalingClient(FixedClient(0, G0), scale=float("inf"))


# ------------------------------------------------------------------ the omniscient hook
def test_fl_hands_the_omniscient_attacker_the_honest_uploads_of_its_round():
    honest = [FixedClient(j, (lambda j: lambda i: [float(i + j), float(i * j)])(j)) for j in (1, 2, 3)]
    attacker = AlieClient(FixedClient(0, [0.0, 0.0]), jitter=0.0)
    hist = run_federated([attacker, *honest], torch.zeros(2, dtype=torch.float64), 3, 0.5)
    for i in (1, 2, 3):
        h = np.array([[i + j, i * j] for j in (1, 2, 3)], dtype=float)
        np.testing.assert_allclose(hist.update(i, 0).numpy(), h.mean(0) - h.std(0), rtol=1e-12)
        assert hist.participants(i) == (0, 1, 2, 3)


# ------------------------------------------------------------------ aggregators
def digits_clients(n=4, limit=160):
    ds = load_digits_dataset().subset_train(limit)
    fac = build_model("logreg", ds.input_shape)
    parts = iid_split(ds.y_train, n, seed=0)
    clients = [LocalClient(j, ds.x_train[torch.as_tensor(p)], ds.y_train[torch.as_tensor(p)], fac,
                           epochs=1, lr=0.2, batch_size=16) for j, p in enumerate(parts)]
    torch.manual_seed(0)
    return clients, flatten_params(fac())


def test_fedavg_aggregator_is_todays_path_bit_for_bit():
    clients, m0 = digits_clients()
    plain = run_federated(clients, m0, 3, server_lr=0.2)
    hooked = run_federated(clients, m0, 3, server_lr=0.2, aggregator=FedAvg())
    for i in range(4):
        assert torch.equal(plain.model(i), hooked.model(i))
    # and today's path is M_i = M_{i-1} - lr sum_j w_j g_j in client order
    m = m0.clone()
    w = {c.client_id: c.num_samples / sum(d.num_samples for d in clients) for c in clients}
    for i in range(1, 4):
        m = m - 0.2 * sum(plain.update(i, c.client_id) * w[c.client_id] for c in clients)
        assert torch.allclose(m, plain.model(i), atol=1e-6)


class MeanAggregator:
    """Unweighted mean: differs from FedAvg when the clients' data sizes differ."""

    name = "mean"

    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1

    def direction(self, updates, weights):
        return torch.stack([updates[j] for j in sorted(updates)]).mean(0)


def test_run_federated_with_a_mean_aggregator_equals_a_hand_rolled_loop():
    clients = [QuadClient(0, [4.0, 0.0], num_samples=1), QuadClient(1, [0.0, 2.0], num_samples=3),
               QuadClient(2, [2.0, 2.0], num_samples=6, a=2.0)]
    agg = MeanAggregator()
    hist = run_federated(clients, torch.zeros(2, dtype=torch.float64), 5, 0.3, aggregator=agg)
    m = np.zeros(2)
    for i in range(1, 6):
        g = [c.a * (m - np.array(c.center)) for c in clients]
        m = m - 0.3 * (g[0] + g[1] + g[2]) / 3
        np.testing.assert_allclose(hist.model(i).numpy(), m, rtol=1e-12)
    assert agg.resets == 1
    fedavg = run_federated(clients, torch.zeros(2, dtype=torch.float64), 5, 0.3)
    assert not torch.allclose(fedavg.model(5), hist.model(5))


def test_fedseca_momentum_across_rounds_by_hand():
    """direction_t = beta d_{t-1} + (1 - beta) g~_t with d_0 = 0, on fixed per-round updates."""
    rounds = {1: [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.2, 1.0], [1.5, -3.0, -0.4, 2.0]],
              2: [[-1.0, 2.0, 0.5, 1.0], [-2.0, 1.0, 0.3, 2.0], [-1.5, 0.5, 0.1, -1.0]],
              3: [[0.5, 0.5, -2.0, 1.0], [0.4, 0.6, -1.0, 1.5], [0.3, -0.7, -3.0, 2.5]]}
    clients = [FixedClient(k, (lambda k: lambda i: rounds[i][k])(k)) for k in range(3)]
    beta, lr = 0.5, 0.1
    agg = FedSECA(gamma=0.5, beta=beta)
    hist = run_federated(clients, torch.zeros(4, dtype=torch.float64), 3, lr, aggregator=agg)
    d, m = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for i in (1, 2, 3):
        g_tilde = fedseca(torch.tensor(rounds[i], dtype=torch.float64), gamma=0.5)
        d = beta * d + (1 - beta) * g_tilde
        m = m - lr * d
        assert torch.allclose(hist.model(i), m, atol=1e-12)
    assert torch.allclose(agg.buffer, d, atol=1e-12)
    # a second run starts from an empty buffer again
    again = run_federated(clients, torch.zeros(4, dtype=torch.float64), 3, lr, aggregator=agg)
    assert torch.equal(again.model(3), hist.model(3))


def test_brace_sign_step_by_hand():
    g = [[1.0, -1.0, 2.0], [1.0, 1.0, -2.0], [1.0, -1.0, -3.0]]  # net signs 3, -1, -1
    clients = [FixedClient(k, g[k]) for k in range(3)]
    hist = run_federated(clients, torch.zeros(3, dtype=torch.float64), 1, 0.5,
                         aggregator=BraceSign(lam=0.0, scale=0.2))
    # +1 where the net sign exceeds lambda = 0, else -1; the model moves lr * scale
    assert hist.model(1).tolist() == pytest.approx([-0.1, 0.1, 0.1])
    hist = run_federated(clients, torch.zeros(3, dtype=torch.float64), 1, 0.5,
                         aggregator=BraceSign(lam=3.0, scale=0.2))
    assert hist.model(1).tolist() == pytest.approx([0.1, 0.1, 0.1])  # 3 > 3 fails too


def test_brace_step_shrinks_like_one_over_sqrt_t_and_restarts_every_run():
    clients = [FixedClient(k, [1.0, -1.0]) for k in range(3)]   # vote +1, -1 every round
    agg = BraceSign(lam=0.0, scale=0.4, decay=0.5)
    for _run in range(2):
        hist = run_federated(clients, torch.zeros(2, dtype=torch.float64), 4, 0.5, aggregator=agg)
        moved = sum(0.5 * 0.4 / math.sqrt(t) for t in range(1, 5))
        assert hist.model(4).tolist() == pytest.approx([-moved, moved])
    fixed = run_federated(clients, torch.zeros(2, dtype=torch.float64), 4, 0.5,
                          aggregator=BraceSign(lam=0.0, scale=0.4, decay=0.0))
    assert fixed.model(4).tolist() == pytest.approx([-0.8, 0.8])


@pytest.mark.parametrize("k, ups, want", [(20, 11, 1.0), (20, 10, -1.0),     # lambda 1: sum 2 > 1, 0 is not
                                           (100, 53, 1.0), (100, 52, -1.0)])  # lambda 5: 6 > 5, 4 is not
def test_brace_default_lambda_is_the_papers_5_per_100_clients(k, ups, want):
    updates = {j: torch.tensor([1.0 if j < ups else -1.0]) for j in range(k)}
    d = BraceSign(scale=1.0, decay=0.0).direction(updates, {})
    assert d.tolist() == [want]


def test_registry_and_parameter_checks():
    assert set(AGGREGATORS) == {"fedavg", "fedseca", "brace-sign"}
    assert {n: build_aggregator(n).name for n in AGGREGATORS} == {n: n for n in AGGREGATORS}
    with pytest.raises(ValueError, match="unknown aggregator"):
        build_aggregator("krum")
    with pytest.raises(ValueError, match="gamma"):
        FedSECA(gamma=1.0)
    with pytest.raises(ValueError, match="beta"):
        FedSECA(beta=-0.1)
    with pytest.raises(ValueError, match="scale"):
        BraceSign(scale=0.0)
    with pytest.raises(ValueError, match="decay"):
        BraceSign(decay=-1.0)


# ------------------------------------------------------------------ Retrain
def test_retrain_reruns_fl_with_the_same_aggregator_and_a_remaining_omniscient_attacker():
    clients, m0 = digits_clients()
    clients[1] = AlieClient(clients[1], jitter=0.05, seed=3)
    agg = BraceSign(scale=0.05)
    hist = run_federated(clients, m0, 3, server_lr=0.2, aggregator=agg)
    model, cost = Retrain(aggregator=agg).unlearn(hist, [0], clients)
    plain = run_federated(clients[1:], m0, 3, server_lr=0.2, aggregator=BraceSign(scale=0.05))
    assert torch.equal(model, plain.model(3))  # bit for bit, ALIE attacker included
    fedavg_model, _ = Retrain().unlearn(hist, [0], clients)
    assert not torch.equal(model, fedavg_model)
    assert cost.client_computations == {1: 3, 2: 3, 3: 3}
    # the remaining attacker forged from the honest clients 2 and 3 of each retrained round
    g2, g3 = plain.update(1, 2), plain.update(1, 3)
    mu, sd = (g2 + g3) / 2, (g2 - g3).abs() / 2
    z = clients[1].z(1)
    assert torch.allclose(plain.update(1, 1), mu - z * sd, atol=1e-6)


# ------------------------------------------------------------------ the lab
def test_who_attacks():
    from argparse import Namespace

    from lab.experiment import attackers_of

    def ns(**kw):
        return Namespace(**{"clients": 6, "no_backdoor": False, "attack": "backdoor",
                            "attackers": None, **kw})

    assert attackers_of(ns(), [2, 4]) == ("backdoor", (2, 4))          # the lab's old default
    assert attackers_of(ns(attack="alie", attackers=3), [4]) == ("alie", (0, 1, 2))
    assert attackers_of(ns(attackers=0), [0]) == ("none", ())
    assert attackers_of(ns(no_backdoor=True), [0]) == ("none", ())
    assert attackers_of(ns(attack="none", attackers=2), [0]) == ("none", ())
    with pytest.raises(ValueError, match="attackers"):
        attackers_of(ns(attackers=7), [0])
    with pytest.raises(ValueError, match="unknown attack"):
        attackers_of(ns(attack="krum"), [0])


def test_lab_runs_fedseca_against_sign_flip(tmp_path):
    from bench.lab import main

    rc = main(["--dataset", "digits", "--clients", "6", "--rounds", "4", "--train-limit", "300",
               "--aggregator", "fedseca", "--attack", "sign-flip", "--attackers", "2",
               "--method", "retrain", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = json.loads((tmp_path / "lab.json").read_text())
    cfg = out["config"]
    assert cfg["aggregator"] == {"name": "fedseca", "gamma": 0.9, "beta": 0.5}
    assert cfg["rounds"] == 4 and cfg["clients"] == 6
    assert cfg["attack"] == "sign-flip" and cfg["attackers"] == [0, 1] and cfg["targets"] == [0]
    methods = [r["method"] for r in out["results"]]
    assert methods == ["original (with target)", "retrain"]
    for r in out["results"]:
        assert 0.0 <= r["ter"] <= 1.0 and 0.0 <= r["ba_asr"] <= 1.0
    assert out["costs"]["retrain"]["client_computations"] == {str(j): 4 for j in range(1, 6)}


def test_robust_lab_writes_one_cell_per_aggregator_and_attacker_count(tmp_path):
    from bench.robust_lab import main

    rc = main(["--clients", "4", "--rounds", "2", "--train-limit", "200", "--attack", "scaling",
               "--aggregators", "fedavg,brace-sign", "--attacker-counts", "0,1",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    out = json.loads((tmp_path / "robust_lab.json").read_text())
    cells = {(c["aggregator"], c["attackers"]): c for c in out["cells"]}
    assert set(cells) == {("fedavg", 0), ("fedavg", 1), ("brace-sign", 0), ("brace-sign", 1)}
    assert cells[("fedavg", 0)]["attack"] == "none" and cells[("fedavg", 1)]["attacker_ids"] == [0]
    assert cells[("brace-sign", 1)]["aggregator_params"]["scale"] == 0.5
    assert (tmp_path / "robust_lab.png").stat().st_size > 0
    assert main(["--aggregators", "krum", "--quiet"]) == 2
