"""The lab on histories with partial participation, erased clients and unlearning rounds: the
histories store and round-trip them, and the recovery methods follow the rules of
docs/unlearning.md ("Partial participation, erased clients and unlearning rounds"), each
against an oracle computed here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols.starfish.ports import RoundRecord, candidate_rounds
from lab.fl import run_federated
from lab.history import InMemoryHistory, NpzHistory, NpzTwinRecorder
from lab.recovery import FedEraser, FedRecover, RandomSelection, Retrain, Starfish
from tests.protocols.starfish.partial_programs import ToyClient, build_history

torch.set_num_threads(1)

#: 1: everyone; 2: client 3 missed; 3: an unlearning round; 4: the target (0) and client 3
#: missed; 5: everyone; 6: clients 1 and 3; 7: everyone; 8: client 1 missed; 9: targets only
PATTERN = [(0, 1, 2, 3), (0, 1, 2), (), (1, 2), (0, 1, 2, 3), (1, 3), (0, 1, 2, 3), (0, 2, 3), (0,)]
CANDIDATES = [1, 2, 4, 5, 6, 7, 8]


def scalar_clients():
    """1-D convex non-quadratic losses: g(M) = (M - c) + tanh(M - c)."""
    centers = {0: 3.0, 1: -1.0, 2: 0.5, 3: 2.0}
    return [ToyClient(j, np.array([c]), np.array([1.0]), bend=1.0, num_samples=j + 1)
            for j, c in centers.items()]


def scalar_history(clients):
    return build_history(clients, PATTERN, np.zeros(1), 0.3, {3: np.array([0.4])})


# ------------------------------------------------------------------ histories
def test_histories_round_trip_an_unlearning_round(tmp_path):
    clients = scalar_clients()
    mem = scalar_history(clients)
    assert mem.participants(3) == () and mem.weights(3) == {}
    assert float(mem.model(3)) == pytest.approx(0.4)
    disk = NpzHistory(tmp_path / "h", mem.model(0), mem.server_lr)
    twin = NpzTwinRecorder(tmp_path / "twin")
    twin.start(mem.model(0).numpy(), mem.server_lr)
    for i in range(1, mem.num_rounds + 1):
        parts = mem.participants(i)
        rec = RoundRecord(mem.model(i), parts, mem.weights(i), {j: mem.update(i, j) for j in parts},
                          {j: mem.norm(i, j) for j in parts}, {j: mem.delta(i, j) for j in parts})
        disk.append_round(rec)
        twin.round(mem.model(i).numpy(), parts, dict(mem.weights(i)),
                   {j: mem.update(i, j).numpy() for j in parts}, {j: float(mem.norm(i, j)) for j in parts},
                   {j: float(mem.delta(i, j)) for j in parts})
    for again in (NpzHistory(tmp_path / "h"), NpzHistory(tmp_path / "twin")):
        assert again.num_rounds == len(PATTERN)
        for i in range(1, len(PATTERN) + 1):
            assert again.participants(i) == PATTERN[i - 1]
            assert torch.equal(again.model(i), mem.model(i))
            assert dict(again.weights(i)) == pytest.approx(dict(mem.weights(i)))
            for j in PATTERN[i - 1]:
                assert torch.equal(torch.as_tensor(again.update(i, j)), mem.update(i, j))
        assert again.weights(3) == {}
        assert candidate_rounds(again, [1, 2, 3]) == CANDIDATES
    # an unlearning round with entries is malformed
    with pytest.raises(ValueError, match="one entry per participant"):
        mem.append_round(RoundRecord(mem.model(9), (), {0: 1.0}, {}, {}, {}))


# ------------------------------------------------------------------ FedRecover
def test_fedrecover_on_a_partial_history_matches_the_scalar_secant_oracle():
    """1-D with B = 1 the estimate is g + (y/s) s' (the secant slope of the last pair). The
    replay runs over C only; per step only the present remaining clients, weights renormalised;
    warm-up while a *present* client has no pair; periodic/final counted in replayed rounds."""
    clients = scalar_clients()
    hist = scalar_history(clients)
    method = FedRecover(buffer=1, warmup=1, correction_period=2, final_tuning=1, abnormal_alpha=None)
    model, cost = method.unlearn(hist, [0], clients)

    grad = {c.client_id: c.gradient for c in clients}
    rest = [1, 2, 3]
    C = CANDIDATES
    m_hat, slope, warm, exact_steps, periodic = np.zeros(1), {}, 0, [], []
    asked = {j: 0 for j in rest}
    for step, t in enumerate(C, 1):
        present = [j for j in rest if j in PATTERN[t - 1]]
        s = m_hat - hist.model(t - 1).numpy()
        in_warmup = warm < 1 or any(j not in slope for j in present)
        is_periodic = not in_warmup and warm > 0 and (step - warm) % 2 == 0
        final = step > len(C) - 1
        if in_warmup:
            warm = step
        elif is_periodic or final:
            periodic.append(step)
        exact = in_warmup or is_periodic or final
        used = {}
        for j in present:
            g_old = hist.update(t, j).numpy()
            if exact:
                gbar = grad[j](m_hat)
                asked[j] += 1
                if float(s[0]) != 0.0:
                    slope[j] = (gbar - g_old) / s
                used[j] = gbar
            else:
                used[j] = g_old + slope[j] * s
        if exact:
            exact_steps.append(step)
        w = hist.weights(t)
        wsum = sum(w[j] for j in present)
        m_hat = m_hat - 0.3 * sum(w[j] / wsum * used[j] for j in present)
    # the design: steps 1 (round 1, s = 0) and 2 warm up; step 3 (round 4) is estimated
    # although client 3, absent, has no pair yet; step 4 (round 5, client 3 back) warms up
    # again; then a periodic correction every 2 *replayed* rounds (step 6 = round 7, not round
    # 6) and final tuning in the last replayed round (step 7 = round 8; round 9 is targets only)
    assert exact_steps == [1, 2, 4, 6, 7] and periodic == [6, 7]
    assert cost.correction_steps == periodic and cost.extra["warmup_rounds"] == 4
    assert cost.estimated_updates == 2 + 2
    assert cost.selected_rounds == C and cost.rounds_used == len(C) and cost.history_rounds == 9
    assert cost.client_computations == asked
    assert float(model) == pytest.approx(float(m_hat[0]), abs=1e-9)


# ------------------------------------------------------------------ FedEraser
def test_federaser_calibrates_every_interval_th_candidate_round_with_the_present_clients():
    clients = scalar_clients()
    hist = scalar_history(clients)
    model, cost = FedEraser(interval=2, epoch_ratio=0.5).unlearn(hist, [0], clients)
    rounds = CANDIDATES[::2]                       # 1, 5, 7, 8
    assert cost.selected_rounds == rounds
    m = np.zeros(1)
    asked = {1: 0, 2: 0, 3: 0}
    for t in rounds:
        present = [j for j in (1, 2, 3) if j in PATTERN[t - 1]]
        total = sum(j + 1 for j in present)
        agg = np.zeros(1)
        for j in present:
            new = 0.5 * clients[j].gradient(m)            # epochs 0.5 of the client's 1.0
            old = hist.update(t, j).numpy()
            agg += (j + 1) / total * old * (np.linalg.norm(new) / np.linalg.norm(old))
            asked[j] += 1
        m = m - 0.3 * agg
    assert cost.client_computations == asked
    assert float(model) == pytest.approx(float(m[0]), abs=1e-9)


# ------------------------------------------------------------------ retrain
def test_retrain_follows_the_participation_of_the_remaining_clients():
    clients = scalar_clients()
    hist = scalar_history(clients)
    model, cost = Retrain().unlearn(hist, [0], clients)
    pattern = [[j for j in PATTERN[t - 1] if j != 0] for t in CANDIDATES]
    again = run_federated([c for c in clients if c.client_id != 0], hist.model(0), len(CANDIDATES),
                          hist.server_lr, participation=pattern)
    assert torch.equal(model, again.model(len(CANDIDATES)))
    assert cost.rounds_used == len(CANDIDATES)
    assert cost.client_computations == {j: sum(j in p for p in pattern) for j in (1, 2, 3)} \
        == {1: 6, 2: 6, 3: 5}
    # FedAvg by hand over the first retrained round (everyone but the target)
    m1 = -0.3 * sum((j + 1) / 9 * clients[j].gradient(np.zeros(1)) for j in (1, 2, 3))
    assert float(again.model(1)) == pytest.approx(float(m1[0]), abs=1e-12)
    # with a number of rounds, every remaining client trains in each
    _, fixed = Retrain(rounds=3).unlearn(hist, [0], clients)
    assert fixed.client_computations == {1: 3, 2: 3, 3: 3}


def test_run_federated_refuses_an_empty_round():
    clients = scalar_clients()
    with pytest.raises(ValueError, match="round 2"):
        run_federated(clients, torch.zeros(1, dtype=torch.float64), 2, 0.3, participation=[[0], [9]])


# ------------------------------------------------------------------ Starfish and random selection
def test_starfish_and_random_selection_stay_within_the_candidate_rounds():
    clients = scalar_clients()
    hist = scalar_history(clients)
    model, cost = Starfish(sigma=0.5, beta=0.2, buffer=1).unlearn(hist, [0], clients)
    assert cost.extra["candidate_rounds"] == CANDIDATES
    assert len(cost.selected_rounds) == 4 and set(cost.selected_rounds) <= set(CANDIDATES)
    assert cost.extra["correction_interval"] == 2          # ceil(0.2 * |C|) = ceil(1.4)
    assert torch.isfinite(model).all()
    for seed in range(5):
        _, rand = RandomSelection(seed=seed, sigma=0.5).unlearn(hist, [0], clients)
        assert len(rand.selected_rounds) == 4 and set(rand.selected_rounds) <= set(CANDIDATES)
