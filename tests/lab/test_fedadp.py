"""FedADP against hand computations and numpy recomputations on tiny closed-form clients."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.dp_accounting import epsilon_spent, rdp_epsilon, composed_mu
from protocols.starfish.ports import RoundRecord
from lab.fl import run_federated
from lab.history import InMemoryHistory
from lab.recovery import METHODS, FedADP
from lab.recovery.fedadp import (
    budget_schedule,
    classical_multiplier,
    clip_update,
    project,
    select_rounds,
    select_updates,
    stages,
)
from tests.helpers.toy_clients import ToyUpdate

torch.set_num_threads(1)
SQ = math.sqrt(2 * math.log(1.25 / 1e-5))  # sqrt(2 ln(1.25/delta)) at the default delta


@dataclass
class QuadClient:
    """f_j(M) = a/2 ||M - c||^2; its update on M is the gradient a (M - c), its loss f_j(M)."""

    client_id: int
    center: torch.Tensor
    a: float = 1.0
    num_samples: int = 1

    def train(self, model_vec, round_idx, epochs=None):
        g = (self.a * (model_vec.to(torch.float64) - self.center)).to(torch.float32)
        return ToyUpdate(g, float(g.norm()), float(g.abs().max()), self.num_samples)

    def training_loss(self, model_vec):
        return 0.5 * self.a * float(((model_vec.to(torch.float64) - self.center) ** 2).sum())


def quad(j, center, a=1.0, n=1):
    return QuadClient(j, torch.tensor(center, dtype=torch.float64), a, n)


def np_noise(seed, t, j, m):
    return np.random.default_rng([seed, t, j]).standard_normal(m)


# ------------------------------------------------------------------ the pieces
def test_clipping_is_exact():
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)             # ||g|| = 5
    assert torch.equal(clip_update(g, 1.0), torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(clip_update(g, 2.5), torch.tensor([1.5, 2.0], dtype=torch.float64))
    assert torch.equal(clip_update(g, 5.0), g) and torch.equal(clip_update(g, 7.0), g)
    with pytest.raises(ValueError):
        clip_update(g, 0.0)


def test_noise_multiplier_and_budget_schedule_by_hand():
    assert classical_multiplier(3.0, 1e-5) == pytest.approx(math.sqrt(2 * math.log(125000.0)) / 3)
    # eps_{t+1} = clamp(eps_t e^{|L_{t-1} - L_t|}); losses L(M_0..M_3) = 2.0, 1.5, 1.4, 1.4
    sched = budget_schedule([2.0, 1.5, 1.4, 1.4], eps0=1.0, eps_min=0.5, eps_max=3.0)
    e2 = math.exp(0.5)
    assert sched == pytest.approx([1.0, e2, e2 * math.exp(0.1), e2 * math.exp(0.1)])
    # a loss jump (up or down) of 2 multiplies by e^2 = 7.39, capped at eps_max; eps0 below
    # eps_min starts at eps_min
    assert budget_schedule([1.0, 3.0, 1.0], 0.1, 0.5, 3.0) == pytest.approx([0.5, 3.0, 3.0])
    with pytest.raises(ValueError):
        budget_schedule([1.0], 1.0, 2.0, 1.0)


def test_stages_and_round_selection_by_hand():
    # beta = 0.1: round 2 (1.7 <= 0.9 * 2.0) closes stage 1, round 4 (1.5 <= 0.9 * 1.7),
    # round 5 (1.45 > 0.9 * 1.5) stays in the final stage
    losses = {1: 2.0, 2: 1.7, 3: 1.6, 4: 1.5, 5: 1.45}
    assert stages([1, 2, 3, 4, 5], losses, 2.0, 0.1) == [[1, 2], [3, 4], [5]]
    align = {1: 0.9, 2: 0.5, 3: 0.5, 4: 0.2, 5: 0.1, 6: 0.5}
    # ceil(0.6 * 3) = 2 of [1, 2, 3] (2 and 3 tie at 0.5, both taken); ceil(0.6 * 2) = 2 of [4, 5]
    assert select_rounds([[1, 2, 3], [4, 5]], align, 0.6) == [2, 3, 4, 5]
    # ceil(0.3 * 3) = 1: the tie 2/3 goes to the earlier round; ceil(0.3 * 3) = 1 of [4, 5, 6] is 5
    assert select_rounds([[1, 2, 3], [4, 5, 6]], align, 0.3) == [2, 5]


def test_update_selection_by_hand_with_ties():
    scores = {3: 0.5, 1: 0.9, 2: 0.5, 0: 0.1}
    assert select_updates(scores, 0.5) == [1, 2]          # k = 2, tie 2/3 -> smaller id
    assert select_updates(scores, 0.7) == [1, 2, 3]       # k = ceil(2.8) = 3
    assert select_updates(scores, 1.0) == [0, 1, 2, 3]
    assert select_updates({5: -0.2}, 0.1) == [5]          # at least one


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=3),
       st.lists(st.floats(-5, 5), min_size=3, max_size=3))
def test_projection_equals_the_papers_cosine_form(stored, fresh):
    s = np.asarray(stored)
    f = np.asarray(fresh)
    got = project(torch.tensor(s), torch.tensor(f)).numpy()
    if np.linalg.norm(f) < 1e-6 or np.linalg.norm(s) < 1e-6:
        if np.linalg.norm(f) == 0.0:
            assert np.all(got == 0.0)
        return
    cos = s @ f / (np.linalg.norm(s) * np.linalg.norm(f))
    want = cos * np.linalg.norm(s) / np.linalg.norm(f) * f      # eq. 11 as printed
    assert np.allclose(got, want, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ the method
def test_dual_selection_on_a_hand_made_history():
    """Models at angles 0, 10, 100, 110, 200, 20 degrees: d_t = ReLU(cos(step angle)) =
    cos 10, cos 90, cos 10, cos 90, ReLU(cos 180) = .98, 0, .98, 0, 0. A constant loss never
    drops by beta, so all five rounds form one stage; ceil(0.5 * 5) = 3 rounds with the least
    d are 2, 4, 5. Every round's updates are (1,0), (0,1), (1,1) for clients 0, 1, 2: with
    equal weights G = (2/3, 2/3), cosines .71, .71, 1, and ceil(0.5 * 3) = 2 keeps 2 and 0."""
    angles = [0, 10, 100, 110, 200, 20]
    models = [torch.tensor([math.cos(math.radians(a)), math.sin(math.radians(a))]) for a in angles]
    hist = InMemoryHistory(models[0], 0.1)
    ups = {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 1.0]), 2: torch.tensor([1.0, 1.0])}
    for t in range(1, 6):
        hist.append_round(RoundRecord(models[t], (0, 1, 2), {j: 1 / 3 for j in ups}, ups,
                                      {j: ups[j].norm() for j in ups}, {j: torch.tensor(1.0) for j in ups}))
    clients = three_clients()
    model, cost = FedADP(lam=0.5, gamma=0.5, dp=False, loss_fn=lambda v: 1.0).unlearn(
        hist, [2], clients)
    assert cost.extra["stages"] == [[1, 5]]
    assert cost.extra["stored_rounds"] == [2, 4, 5]
    assert cost.extra["stored_updates"] == {2: [0, 2], 4: [0, 2], 5: [0, 2]}
    # client 0 alone remains in each stored round: fresh = M^ - (4, 0), U = its projection
    want = models[0].double()
    for _ in range(3):
        fresh = want - torch.tensor([4.0, 0.0], dtype=torch.float64)
        want = want - 0.1 * project(ups[0].double(), fresh)
    assert torch.allclose(model.double(), want, atol=1e-6)
    assert cost.client_computations == {0: 3, 1: 0}


def three_clients():
    return [quad(0, [4.0, 0.0]), quad(1, [0.0, 2.0]), quad(2, [2.0, 2.0])]


def test_without_dp_and_selection_is_the_deterministic_projection_replay():
    clients = three_clients()
    hist = run_federated(clients, torch.zeros(2), 2, server_lr=0.5)
    model, cost = FedADP(lam=1.0, gamma=1.0, dp=False).unlearn(hist, [0], clients)
    # round 1 from M^ = 0: fresh = stored, so U = 0.5 (0,-2) + 0.5 (-2,-2) = (-1,-2), M^ = (0.5, 1)
    # round 2: stored g1 = M1 - c1 = (1, -4/3), g2 = (-1, -4/3); fresh (0.5,-1), (-1.5,-1)
    #   P1 = (11/6)/1.25 (0.5,-1) = (11/15, -22/15), P2 = (17/6)/3.25 (-1.5,-1) = (-17/13, -34/39)
    #   M^ = (0.5, 1) - 0.5 * 0.5 (P1 + P2) = (0.5 + 28/195, 1 + 114/195)
    assert torch.allclose(model.double(), torch.tensor([0.5 + 28 / 195, 1 + 114 / 195],
                                                       dtype=torch.float64), atol=1e-6)
    assert cost.client_computations == {1: 2, 2: 2} and cost.rounds_used == 2
    assert cost.extra["epsilon"] is None and cost.extra["noise_multipliers"] == [0.0, 0.0]


def numpy_fedadp(hist, clients, targets, *, lam, gamma, beta, eps0, eps_min, eps_max, delta,
                 clip, seed):
    """FedADP recomputed with numpy from the paper's equations (the oracle)."""
    T, lr = hist.num_rounds, hist.server_lr
    M = [hist.model(t).double().numpy() for t in range(T + 1)]
    w = {j: c.num_samples for j, c in enumerate(clients)}
    wsum = sum(w.values())
    L = [sum(w[j] / wsum * 0.5 * c.a * np.sum((M[t] - c.center.numpy()) ** 2)
             for j, c in enumerate(clients)) for t in range(T + 1)]
    eps = [max(min(eps0, eps_max), eps_min)]
    for t in range(1, T):
        eps.append(min(max(eps[-1] * math.exp(abs(L[t - 1] - L[t])), eps_min), eps_max))
    z = [math.sqrt(2 * math.log(1.25 / delta)) / e for e in eps]
    d = {t: max(0.0, M[t] @ M[t - 1] / (np.linalg.norm(M[t]) * np.linalg.norm(M[t - 1])))
         for t in range(1, T + 1)}
    stage_list, cur, prev = [], [], L[0]
    for t in range(1, T + 1):
        cur.append(t)
        if L[t] <= (1 - beta) * prev:
            stage_list.append(cur)
            cur, prev = [], L[t]
    if cur:
        stage_list.append(cur)
    kept_rounds = sorted(t for s in stage_list
                         for t in sorted(s, key=lambda r: (d[r], r))[:math.ceil(lam * len(s) - 1e-9)])
    model = M[0].copy()
    stored = {}
    for t in kept_rounds:
        gt = {}
        for j in range(len(clients)):
            g = hist.update(t, j).double().numpy()
            g = g / max(1.0, np.linalg.norm(g) / clip)
            gt[j] = g + z[t - 1] * clip * np_noise(seed, t, j, g.size)
        agg = sum(w[j] / wsum * gt[j] for j in gt)
        s = {j: gt[j] @ agg / (np.linalg.norm(gt[j]) * np.linalg.norm(agg)) for j in gt}
        chosen = sorted(sorted(s, key=lambda j: (-s[j], j))[:math.ceil(gamma * len(s) - 1e-9)])
        stored[t] = chosen
        here = [j for j in chosen if j not in targets]
        if not here:
            continue
        tot = sum(w[j] for j in here)
        step = np.zeros_like(model)
        for j in here:
            fresh = clients[j].a * (model.astype(np.float32).astype(np.float64) - clients[j].center.numpy())
            fresh = fresh.astype(np.float32).astype(np.float64)
            step += w[j] / tot * (gt[j] @ fresh) / (fresh @ fresh) * fresh
        model = model - lr * step
    return model, kept_rounds, stored, z


def toy_problem(m=3, n=5, T=8, lr=0.4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(n, m, generator=gen, dtype=torch.float64) * 3
    clients = [QuadClient(j, centers[j], a=0.5 + 0.25 * j, num_samples=j + 1) for j in range(n)]
    m0 = torch.randn(m, generator=gen) * 0.1 + 1.0
    return clients, run_federated(clients, m0, T, server_lr=lr)


@pytest.mark.parametrize("lam,gamma,eps_min,eps_max", [(0.6, 0.7, 0.5, 3.0), (1.0, 1.0, 0.2, 3.0),
                                                     (0.5, 0.4, 1.0, 3.0), (0.6, 0.7, 1e-3, 1e3)])
def test_method_equals_numpy_recomputation(lam, gamma, eps_min, eps_max):
    clients, hist = toy_problem()
    kw = dict(lam=lam, gamma=gamma, beta=0.1, eps0=eps_min, eps_min=eps_min, eps_max=eps_max,
              delta=1e-5, clip=1.5, seed=7)
    model, cost = FedADP(**kw).unlearn(hist, [0], clients)
    want, kept_rounds, stored, z = numpy_fedadp(hist, clients, [0], **kw)
    assert cost.extra["stored_rounds"] == kept_rounds
    assert cost.extra["stored_updates"] == stored
    assert cost.extra["noise_multipliers"] == pytest.approx(z, rel=1e-12)
    assert np.allclose(model.double().numpy(), want, atol=1e-5)
    # each remaining client trained once per stored round that kept it
    for j in range(1, 5):
        assert cost.client_computations[j] == sum(j in v for v in stored.values())
    assert cost.selected_rounds == [t for t in kept_rounds if set(stored[t]) - {0}]
    assert cost.rounds_used == len(cost.selected_rounds)


def test_reported_budget_is_the_accountants_on_the_schedule():
    clients, hist = toy_problem()
    for adjacency, sens in (("replace", 2.0), ("zero-out", 1.0)):
        _, cost = FedADP(clip=1.5, adjacency=adjacency, seed=1).unlearn(hist, [0], clients)
        # schedule by hand: eps_1 = eps0 = eps_min = 1, then the paper's eq. 4 on the losses
        losses = [cost.extra["losses"][t] for t in range(hist.num_rounds + 1)]
        eps = budget_schedule(losses[:-1], 1.0, 1.0, 3.0)
        z = [SQ / e for e in eps]
        assert cost.extra["epsilon_per_round"] == pytest.approx(eps)
        assert cost.extra["noise_multipliers"] == pytest.approx(z)
        assert cost.extra["delta"] == 1e-5 and cost.extra["sensitivity"] == sens
        # all 8 releases of every client count, stored or not
        assert cost.extra["epsilon"] == pytest.approx(epsilon_spent(z, 1e-5, sens), rel=1e-12)
        assert cost.extra["epsilon_rdp"] == pytest.approx(
            rdp_epsilon(1e-5, composed_mu(z, sens)), rel=1e-12)
        assert cost.extra["epsilon"] < cost.extra["epsilon_rdp"]


def test_noise_statistics_follow_the_schedule():
    """Residual stored - clip(g) of every client and round: mean 0, std z_t S, independent."""
    m, S = 40_000, 2.0
    clients = [quad(j, [float(j + 1)] * m, a=1.0) for j in range(3)]
    hist = run_federated(clients, torch.zeros(m), 4, server_lr=0.3)
    # the loss is the mean coordinate (0, 0.6, 1.02, ...): four different budgets
    method = FedADP(clip=S, eps_min=0.5, eps_max=3.0, gamma=1.0, seed=11,
                    loss_fn=lambda v: float(v.double().mean()))
    _, cost = method.unlearn(hist, [0], clients)
    z = cost.extra["noise_multipliers"]
    assert len(set(np.round(z, 9))) == 4
    residuals = []
    for t in range(1, 5):
        keep, _ = method.stored_updates(hist, t, S, z[t - 1])
        for j in range(3):
            r = (keep[j] - clip_update(hist.update(t, j).double(), S)).numpy()
            sd = z[t - 1] * S
            assert abs(r.mean()) < 5 * sd / math.sqrt(m)
            assert abs(r.std() / sd - 1) < 5 / math.sqrt(2 * m)
            residuals.append(r / sd)
    corr = np.corrcoef(np.stack(residuals))
    off = corr[~np.eye(len(residuals), dtype=bool)]
    assert np.abs(off).max() < 5 / math.sqrt(m)


def test_seeded_reproducible_and_seed_dependent():
    clients, hist = toy_problem()
    a, ca = FedADP(clip=1.5, seed=3, lam=1.0, gamma=1.0).unlearn(hist, [0], clients)
    b, cb = FedADP(clip=1.5, seed=3, lam=1.0, gamma=1.0).unlearn(hist, [0], clients)
    c, _ = FedADP(clip=1.5, seed=4, lam=1.0, gamma=1.0).unlearn(hist, [0], clients)
    assert torch.equal(a, b) and ca.extra["stored_updates"] == cb.extra["stored_updates"]
    assert not torch.equal(a, c)


def test_default_clip_is_the_median_update_norm():
    clients, hist = toy_problem()
    _, cost = FedADP(seed=0).unlearn(hist, [0], clients)
    norms = [float(hist.norm(t, j)) for t in range(1, 9) for j in range(5)]
    assert cost.extra["clip_norm"] == pytest.approx(float(np.median(norms)))
    assert cost.extra["clip_source"] == "median update norm"


@pytest.mark.parametrize("kw", [dict(lam=0.0), dict(lam=1.1), dict(gamma=0.0), dict(beta=1.0),
                                dict(eps_min=4.0), dict(eps_max=math.inf), dict(eps0=0.0),
                                dict(delta=0.0), dict(clip=-1.0), dict(clip=math.inf),
                                dict(adjacency="add-remove"), dict(server_lr=0.0)])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        FedADP(**kw)


def test_clients_without_a_loss_report_are_refused():
    @dataclass
    class Mute:
        client_id: int
        num_samples: int = 1

        def train(self, model_vec, round_idx, epochs=None):
            g = model_vec - 1.0
            return ToyUpdate(g, float(g.norm()), 0.0, 1)

    clients = [Mute(0), Mute(1)]
    hist = run_federated(clients, torch.zeros(2), 2, server_lr=0.5)
    with pytest.raises(ValueError, match="loss"):
        FedADP().unlearn(hist, [0], clients)
    _, cost = FedADP(loss_fn=lambda v: float(v.sum())).unlearn(hist, [0], clients)
    assert cost.extra["losses"][0] == 0.0


# ------------------------------------------------------------------ the lab
def test_lab_runs_fedadp_on_the_digits(tmp_path):
    from bench.lab import main as lab_main

    assert METHODS["fedadp"] is FedADP
    rc = lab_main(["--dataset", "digits", "--method", "retrain,fedadp", "--rounds", "6",
                   "--clients", "4", "--train-limit", "400", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads((tmp_path / "lab.json").read_text())
    rows = {r["method"]: r for r in out["results"]}
    assert "fedadp" in rows and 0.0 <= rows["fedadp"]["ter"] <= 1.0
    extra = out["costs"]["fedadp"]["extra"]
    assert extra["delta"] == 1e-5 and extra["adjacency"] == "replace"
    assert extra["epsilon"] == pytest.approx(epsilon_spent(extra["noise_multipliers"], 1e-5, 2.0))
    assert len(extra["noise_multipliers"]) == 6 and extra["epsilon"] > 0
    assert out["config"]["fedadp_lambda"] == 0.6 and out["config"]["fedadp_gamma"] == 0.7
