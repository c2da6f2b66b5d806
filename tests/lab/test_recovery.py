"""Unlearning methods against independent oracles on tiny problems."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from clients.datasets import load_digits_dataset
from clients.models import build_model, flatten_params
from clients.partition import iid_split
from clients.training import LocalClient
from lab.fl import run_federated
from protocols.starfish.ports import RoundRecord
from lab.history import InMemoryHistory, NpzHistory
from lab.metrics import arp
from lab.recovery import FedEraser, FedRecover, RandomSelection, Retrain, Starfish
from tests.helpers.toy_clients import ToyUpdate

torch.set_num_threads(1)


@dataclass
class ToyClient:
    """Client whose update on M is epochs * grad f_j(M) for a closed-form f_j."""

    client_id: int
    grad: object
    num_samples: int = 1
    epochs: float = 1.0

    def train(self, model_vec, round_idx, epochs=None):
        e = self.epochs if epochs is None else epochs
        g = (e * self.grad(model_vec.to(torch.float64))).to(torch.float32)
        return ToyUpdate(g, float(g.norm()), float(g.abs().max()), self.num_samples)


def quad_client(j, center, a=1.0):
    c = torch.tensor(center, dtype=torch.float64)
    return ToyClient(j, lambda m: a * (m - c))


# ------------------------------------------------------------------ retrain
def digits_clients(n=4, limit=160, epochs=1):
    ds = load_digits_dataset().subset_train(limit)
    fac = build_model("logreg", ds.input_shape)
    parts = iid_split(ds.y_train, n, seed=0)
    clients = [LocalClient(j, ds.x_train[torch.as_tensor(p)], ds.y_train[torch.as_tensor(p)], fac,
                           epochs=epochs, lr=0.2, batch_size=16) for j, p in enumerate(parts)]
    torch.manual_seed(0)
    return clients, flatten_params(fac())


def test_retrain_equals_fl_without_target():
    clients, m0 = digits_clients()
    hist = run_federated(clients, m0, 3, server_lr=0.2)
    model, cost = Retrain().unlearn(hist, [1], clients)
    plain = run_federated([c for c in clients if c.client_id != 1], m0, 3, server_lr=0.2)
    assert torch.equal(model, plain.model(3))  # bit for bit
    assert not torch.equal(model, hist.model(3))
    assert cost.client_computations == {0: 3, 2: 3, 3: 3} and arp(cost) == 0.0


# ------------------------------------------------------------------ FedEraser
def toy_history(clients, rounds, lr):
    m0 = torch.zeros(len(clients[0].grad(torch.zeros(2, dtype=torch.float64))))
    return run_federated(clients, m0.to(torch.float32), rounds, server_lr=lr)


def test_federaser_matches_hand_computation():
    clients = [quad_client(0, [4.0, 0.0]), quad_client(1, [0.0, 2.0]), quad_client(2, [2.0, 2.0])]
    hist = toy_history(clients, 3, 0.5)
    # FL by hand: M1 = (1, 2/3), M2 = (1.5, 1), M3 = (1.75, 7/6)
    assert torch.allclose(hist.model(3), torch.tensor([1.75, 7 / 6]), atol=1e-6)
    model, cost = FedEraser(interval=2, epoch_ratio=0.5).unlearn(hist, [0], clients)
    # Round 1 on M~ = 0: new = 0.5 * old, so U~ = old: U~1 = (0,-1), U~2 = (-1,-1) after norm
    #   calibration: |new1| = 1, dir(old1) = (0,-1); |new2| = sqrt2, dir(old2) = (-1,-1)/sqrt2
    #   M~ = 0 - 0.5 * (0.5 (0,-1) + 0.5 (-1,-1)) = (0.25, 0.5)
    # Round 3: old1 = M2 - c1 = (1.5,-1), old2 = M2 - c2 = (-0.5,-1)
    #   new1 = 0.5 ((0.25,0.5) - (0,2)) = (0.125,-0.75), new2 = (-0.875,-0.75)
    n1 = math.sqrt(0.125**2 + 0.75**2)
    n2 = math.sqrt(0.875**2 + 0.75**2)
    u1 = [n1 * 1.5 / math.sqrt(3.25), n1 * -1.0 / math.sqrt(3.25)]
    u2 = [n2 * -0.5 / math.sqrt(1.25), n2 * -1.0 / math.sqrt(1.25)]
    expected = [0.25 - 0.5 * 0.5 * (u1[0] + u2[0]), 0.5 - 0.5 * 0.5 * (u1[1] + u2[1])]
    assert torch.allclose(model.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert cost.client_computations == {1: 2, 2: 2} and cost.client_epochs == {1: 1.0, 2: 1.0}
    assert arp(cost) == pytest.approx(100 * (3 - 2) / 3)


# ------------------------------------------------------------------ FedRecover
def cubic_client(j, c):
    """1-D non-quadratic loss: f'(M) = (M - c) + 0.1 (M - c)^3."""
    return ToyClient(j, lambda m: (m - c) + 0.1 * (m - c) ** 3)


def test_fedrecover_matches_scalar_secant_oracle():
    """1-D with B = 1: the compact L-BFGS matrix is the secant slope y/s (by hand: sigma = y/s
    and the correction term cancels). So FedRecover is this scalar recursion."""
    centers = {0: 3.0, 1: -1.0, 2: 0.5, 3: 2.0}
    clients = [cubic_client(j, c) for j, c in centers.items()]
    T, lr = 8, 0.3
    hist = run_federated(clients, torch.zeros(1), T, server_lr=lr)
    method = FedRecover(buffer=1, warmup=1, correction_period=3, final_tuning=1,
                        abnormal_alpha=None)
    model, cost = method.unlearn(hist, [0], clients)

    grad = {j: (lambda m, c=c: (m - c) + 0.1 * (m - c) ** 3) for j, c in centers.items()}
    g_hist = {(t, j): float(hist.update(t, j)) for t in range(1, T + 1) for j in (1, 2, 3)}
    m_hat, slope, exact_rounds = 0.0, {}, []
    for t in range(1, T + 1):
        m_old = float(hist.model(t - 1))
        s = m_hat - m_old
        # warm-up: round 1 (s = 0, no pair) and round 2 (first pair); periodic: (t-2) % 3 == 0
        # -> rounds 5, 8; final tuning: round 8
        exact = t in (1, 2, 5, 8)
        used = []
        for j in (1, 2, 3):
            if exact:
                gbar = float(torch.tensor(grad[j](m_hat), dtype=torch.float32))
                if s != 0:
                    slope[j] = (gbar - g_hist[(t, j)]) / s
                used.append(gbar)
            else:
                used.append(g_hist[(t, j)] + slope[j] * s)
        if exact:
            exact_rounds.append(t)
        m_hat -= lr * sum(used) / 3
    assert exact_rounds == [1, 2, 5, 8]
    assert float(model) == pytest.approx(m_hat, abs=1e-5)
    assert cost.client_computations == {1: 4, 2: 4, 3: 4} and cost.estimated_updates == 12
    assert cost.correction_steps == [5, 8]
    # the estimate is not trivially exact here: plain retraining lands elsewhere
    retrained, _ = Retrain().unlearn(hist, [0], clients)
    assert abs(float(retrained) - m_hat) > 1e-4


def test_fedrecover_abnormality_fixing_requests_exact_updates():
    clients = [cubic_client(j, c) for j, c in {0: 3.0, 1: -1.0, 2: 0.5}.items()]
    hist = run_federated(clients, torch.zeros(1), 6, server_lr=0.3)
    _, lenient = FedRecover(buffer=1, warmup=1, correction_period=100, final_tuning=0,
                            abnormal_alpha=None).unlearn(hist, [0], clients)
    _, strict = FedRecover(buffer=1, warmup=1, correction_period=100, final_tuning=0,
                           abnormal_alpha=1.0).unlearn(hist, [0], clients)
    assert lenient.client_computations == {1: 2, 2: 2}        # warm-up only
    assert strict.client_computations == {1: 6, 2: 6}         # tau = 0 flags every estimate
    assert strict.extra["abnormal_fixes"] == 8


# ------------------------------------------------------------------ Starfish
def test_starfish_on_isotropic_quadratics_replays_selected_rounds_exactly():
    """y = a_j s => the estimate is exact, so Starfish = exact FedAvg steps of the remaining
    clients on the selected rounds; selection = top cosine rounds of the target."""
    gen = torch.Generator().manual_seed(0)
    m = 6
    centers = torch.randn(5, m, generator=gen, dtype=torch.float64)
    scales = [1.0, 0.5, 1.5, 0.8, 1.2]
    clients = [ToyClient(j, (lambda mm, c=centers[j], a=scales[j]: a * (mm - c)),
                         num_samples=j + 1) for j in range(5)]
    T, lr = 10, 0.2
    hist = run_federated(clients, torch.zeros(m), T, server_lr=lr)
    method = Starfish(sigma=0.6, beta=0.1, buffer=2)
    model, cost = method.unlearn(hist, [0], clients)

    # the aggregated update of round i is M_{i-1} - M_i (updates are subtracted from the model)
    cos = [float(torch.nn.functional.cosine_similarity(
        hist.update(i, 0).double(), -hist.model_delta(i).double(), dim=0)) for i in range(1, T + 1)]
    best = sorted(sorted(range(T), key=lambda i: (-cos[i], i))[:6])
    assert cost.selected_rounds == [i + 1 for i in best]
    w = torch.tensor([2.0, 3.0, 4.0, 5.0]) / 14.0
    m_hat = torch.zeros(m, dtype=torch.float64)
    for _ in cost.selected_rounds:
        m_hat = m_hat - lr * sum(float(w[k]) * scales[j] * (m_hat - centers[j])
                                 for k, j in enumerate(range(1, 5)))
    assert torch.allclose(model.double(), m_hat, atol=1e-4)
    # warm-up until buffers hold B=2 pairs; T_c = 1 -> a check every replayed round
    assert cost.extra["warmup_steps"] in (2, 3)
    assert arp(cost) > 0


def test_random_selection_and_multiple_targets_run():
    gen = torch.Generator().manual_seed(1)
    centers = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    clients = [ToyClient(j, (lambda mm, c=centers[j]: mm - c)) for j in range(5)]
    hist = run_federated(clients, torch.zeros(4), 10, server_lr=0.3)
    _, c1 = RandomSelection(seed=3, sigma=0.5).unlearn(hist, [0], clients)
    _, c2 = RandomSelection(seed=3, sigma=0.5).unlearn(hist, [0], clients)
    assert c1.selected_rounds == c2.selected_rounds and len(c1.selected_rounds) == 5
    model, c3 = Starfish(sigma=0.5).unlearn(hist, [0, 3], clients)
    assert sorted(c3.client_computations) == [1, 2, 4] and len(c3.selected_rounds) == 5
    assert torch.isfinite(model).all()


# ------------------------------------------------------------------ history store
def test_npz_history_roundtrip(tmp_path):
    clients = [quad_client(j, [float(j), 1.0]) for j in range(3)]
    mem = toy_history(clients, 2, 0.5)
    disk = NpzHistory(tmp_path / "h", mem.model(0), mem.server_lr)
    for i in range(1, 3):
        disk.append_round(RoundRecord(mem.model(i), mem.participants(i), mem.weights(i),
                                      {j: mem.update(i, j) for j in mem.participants(i)},
                                      {j: mem.norm(i, j) for j in mem.participants(i)},
                                      {j: mem.delta(i, j) for j in mem.participants(i)}))
    again = NpzHistory(tmp_path / "h")
    assert again.num_rounds == 2 and again.server_lr == 0.5
    assert torch.equal(again.model(2), mem.model(2)) and torch.equal(again.update(2, 1), mem.update(2, 1))
    assert float(again.delta(1, 2)) == pytest.approx(float(mem.delta(1, 2)))
    with pytest.raises(ValueError, match="sum to 1"):
        mem.append_round(RoundRecord(mem.model(2), (0,), {0: 0.5}, {0: mem.update(1, 0)},
                                     {0: torch.tensor(1.0)}, {0: torch.tensor(1.0)}))
    assert isinstance(mem, InMemoryHistory)


def test_federaser_keeps_only_the_rounds_it_calibrates():
    hist = InMemoryHistory(torch.zeros(3), 0.5)
    for i in range(1, 6):
        hist.append_round(RoundRecord(model=torch.full((3,), float(i)), participants=(0, 1, 2),
                                      weights={0: 1 / 3, 1: 1 / 3, 2: 1 / 3},
                                      updates={j: torch.ones(3) * (j + i) for j in range(3)},
                                      norms={j: torch.tensor(1.0) for j in range(3)},
                                      deltas={j: torch.tensor(0.5) for j in range(3)}))
    clients = [quad_client(j, [0.0, 0.0, 0.0]) for j in range(3)]
    _model, cost = FedEraser(interval=2).unlearn(hist, [0], clients)
    # rounds 1, 3, 5 with all three participants' updates, plus M_0: 10 float32 vectors of 3
    assert cost.selected_rounds == [1, 3, 5]
    assert cost.stored == {"rounds": 3, "updates": 9, "models": 1, "bytes": 4 * 3 * 10}
