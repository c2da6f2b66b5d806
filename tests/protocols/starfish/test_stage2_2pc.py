"""Stage II under 2PC (two processes, TLS; with a dealer and without) against its plaintext twin."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tests.helpers import secure_programs
from mpc.launcher import run_parties
from protocols.starfish import check_thresholds, determine_thresholds, estimate_updates, select_rounds, \
    selection_keys

torch.set_num_threads(1)


def _cosine_order(g, dm, k):
    cos = torch.nn.functional.cosine_similarity(g, dm, dim=-1)
    order = sorted(range(len(cos)), key=lambda i: (-round(float(cos[i]), 9), i))  # ties: earlier first
    return sorted(i + 1 for i in order[:k])


def _inputs() -> dict:
    gen = torch.Generator().manual_seed(5)
    T, m, n, B = 9, 24, 3, 2
    g = torch.randn(T, m, generator=gen, dtype=torch.float64)
    dm = torch.randn(T, m, generator=gen, dtype=torch.float64) * 0.1
    dm[2] = 0.2 * g[2]            # cosine +1 ...
    dm[6] = 0.05 * g[6]           # ... and a tie with it
    g[4] = 2.0 * g[4]
    dm[4] = -0.1 * g[4]           # a negative cosine: never selected
    g2 = torch.randn(T, m, generator=gen, dtype=torch.float64)
    deltas = torch.rand(n, T, generator=gen, dtype=torch.float64)
    deltas[1, 3] = deltas[1, 5] = 1.5  # a tie at the maximum
    deltas[2] = 0.0                    # zeros
    S = torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 0.1
    Y = S * 0.8 + torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 0.01
    stored = torch.randn(n, m, generator=gen, dtype=torch.float64)
    s = torch.randn(m, generator=gen, dtype=torch.float64) * 0.1
    est = torch.randn(n, m, generator=gen, dtype=torch.float64) * 0.1
    thr = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    est[1, 7] = -0.75                 # client 1 exceeds its threshold in one coordinate
    est[2, 3] = 0.5                   # client 2 sits exactly on it (>= counts)
    return {"deltas": deltas, "g": g, "g2": g2, "dm": dm, "norms": g.norm(dim=-1), "k": 4, "S": S, "Y": Y,
            "stored": stored, "s": s, "est_for_tc": est, "thr_for_tc": thr}


@pytest.fixture(scope="module", params=["dealer", "two-party"])
def sub_protocol_run(request):
    """The sub-protocols in both offline modes (two-party: no dealer, the SPU engine; its SecTC
    is the engine's batched 32-bit test), each held to the same oracles."""
    inp = _inputs()
    return inp, run_parties(secure_programs.sub_protocols, inp, offline=request.param, timeout=600)


def test_threshold_determination_matches_plaintext(sub_protocol_run):
    inp, res = sub_protocol_run
    plain = determine_thresholds(inp["deltas"]).numpy()
    assert np.allclose(plain, inp["deltas"].max(dim=1).values.numpy())
    assert np.allclose(res.values[0]["thresholds"], plain, atol=2e-4)


@pytest.mark.parametrize("method", ["ratio", "divide"])
def test_round_selection_with_ties_and_a_negative_cosine(sub_protocol_run, method):
    inp, res = sub_protocol_run
    u, v = selection_keys(inp["g"], inp["dm"], inp["norms"])
    plain = select_rounds(u, v, inp["k"], method=method)
    assert plain == _cosine_order(inp["g"], inp["dm"], inp["k"])
    assert 3 in plain and 7 in plain and 5 not in plain  # the tie pair in, the negative cosine out
    assert res.values[0]["selected"][method] == plain == res.values[1]["selected"][method]


@pytest.mark.parametrize("method", ["ratio", "divide"])
def test_round_selection_for_two_targets_uses_their_weighted_sum(sub_protocol_run, method):
    inp, res = sub_protocol_run
    combined = 0.25 * inp["g"] + 0.75 * inp["g2"]
    oracle = _cosine_order(combined, inp["dm"], inp["k"])
    u, v = selection_keys(combined, inp["dm"], None)
    assert select_rounds(u, v, inp["k"], method=method) == oracle
    assert res.values[0]["selected_multi"][method] == oracle


def test_update_estimation_matches_plaintext(sub_protocol_run):
    inp, res = sub_protocol_run
    plain = estimate_updates(inp["stored"], inp["s"], inp["S"], inp["Y"]).numpy()
    assert np.abs(res.values[0]["estimates"] - plain).max() < 5e-3


def test_threshold_check_flags_the_exceeding_client(sub_protocol_run):
    inp, res = sub_protocol_run
    oracle = (inp["est_for_tc"] ** 2 >= inp["thr_for_tc"][:, None] ** 2).any(dim=1).numpy()
    plain = check_thresholds(inp["est_for_tc"], inp["thr_for_tc"]).numpy()
    assert list(oracle.astype(int)) == [0, 1, 1]
    assert np.array_equal(np.asarray(plain).astype(int), oracle.astype(int))
    assert np.array_equal(np.asarray(res.values[0]["flags"]).astype(int), oracle.astype(int))
    steps = res.meters[0]["steps"]
    assert all(steps[s]["online_rounds"] > 0 for s in ("TD", "RS", "UE", "TC"))


def test_update_estimation_never_forms_an_m_by_m_matrix():
    m = 300_000  # an m x m float32 matrix would need 360 GB; this machine has 24 GiB
    res = run_parties(secure_programs.big_model_estimate, m, 3, timeout=600)
    gen = torch.Generator().manual_seed(3)
    n, B = 2, 2
    S = torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 0.01
    Y = S * 0.5 + torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 1e-4
    stored = torch.randn(n, m, generator=gen, dtype=torch.float64) * 0.01
    s = torch.randn(m, generator=gen, dtype=torch.float64) * 0.01
    plain = estimate_updates(stored, s, S, Y).numpy()
    assert np.abs(res.values[0]["est"] - plain).max() < 5e-3
    assert max(v["peak_rss_gib"] for v in res.values) < 8.0


def _lab_args(**over) -> argparse.Namespace:
    from bench import lab

    p = argparse.ArgumentParser()
    lab.add_arguments(p)
    argv = ["--clients", "6", "--rounds", "10", "--targets", "0", "--quiet"]
    for k, v in over.items():
        argv += [f"--{k}", str(v)]
    return p.parse_args(argv)


@pytest.mark.parametrize("offline", ["dealer", "two-party"])
def test_secure_stage2_equals_the_plaintext_twin_end_to_end(session_of, offline):
    """Both modes on the worker's shared session. T_c = 2 leaves estimated rounds no check reads:
    two-party mode forms only their aggregate (``Replay._folds``), the dealer mode every row."""
    from lab import experiment
    from bench import secure_lab
    from lab.fl import run_federated
    from lab.recovery.base import ClientPool, PoolClients
    from protocols.starfish.ports import remaining_clients
    from protocols.starfish import StarfishParams, run_stage2

    args = _lab_args()
    setup = experiment.build_setup(args)
    hist = run_federated(setup.participants, setup.m0, args.rounds, setup.cfg.get("lr"))
    params = StarfishParams(sigma=0.6, beta=0.2, buffer=2)
    pool = ClientPool(setup.participants, remaining_clients(hist, setup.targets))
    plain = run_stage2(None, hist, setup.targets, params, PoolClients(pool))
    out = secure_lab.run_secure_starfish(args, hist, setup.targets, params, pair=session_of(offline))
    v0, v1 = out["values"]
    assert np.array_equal(v0["model"], v1["model"])
    estimated = range(plain.warmup_steps + 1, len(plain.selected_rounds) + 1)
    assert [s for s in estimated if s not in plain.correction_steps]   # some rounds are folded
    diff = np.abs(v0["model"] - plain.model.double().numpy()).max()
    assert diff < 1e-2, diff
    ter_plain = setup.evaluate(plain.model)["ter"]
    ter_secure = setup.evaluate(torch.from_numpy(v0["model"]).to(plain.model.dtype))["ter"]
    assert abs(ter_plain - ter_secure) <= 0.005
    assert v0["selected_rounds"] == plain.selected_rounds
    assert {int(k): v for k, v in v0["flags"].items()} == plain.flags
    assert plain.flags  # the run did check thresholds
    metered = {k.rsplit("/", 1)[-1] for k in v0["meters"]["steps"]}   # on a shared session: "call-N/UE"
    for name in ("TD", "RS", "UE", "TC", "correction", "aggregate"):
        assert name in metered


def test_switching_threshold_follows_the_measured_costs():
    from protocols.starfish.round_selection import t_delta_from

    rows = [  # Method 2 cheaper in rounds only from T = 64; bytes always favour Method 1
        {"T": 32, "method": "ratio", "rounds": 150, "online_bytes": 1e5, "seconds": 0.1},
        {"T": 32, "method": "divide", "rounds": 153, "online_bytes": 1e6, "seconds": 0.1},
        {"T": 64, "method": "ratio", "rounds": 300, "online_bytes": 4e5, "seconds": 0.1},
        {"T": 64, "method": "divide", "rounds": 200, "online_bytes": 2e6, "seconds": 0.1},
    ]
    assert t_delta_from(rows, latency=0.036, bandwidth_bps=100e6) == 64   # WAN: rounds dominate
    assert t_delta_from(rows, latency=1e-6, bandwidth_bps=1e6) is None    # slow link: bytes dominate


def test_two_targets_with_division_select_the_plaintext_rounds():
    """Regression (issue 12): digits, 8 clients, 15 rounds, targets 0 and 3, Method 2. The
    combined targets' keys ||g||^2 ||dM||^2 exceeded divide's 2**16 and the 2PC run selected
    round 1 instead of round 6 (model 0.076 away). Keys are now normalised first."""
    from lab import experiment
    from bench import secure_lab
    from protocols.starfish import StarfishParams, run_stage2
    from protocols.starfish.ports import remaining_clients
    from lab.fl import run_federated
    from lab.recovery.base import ClientPool, PoolClients

    args = _lab_args(clients=8, rounds=15, targets="0,3")
    setup = experiment.build_setup(args)
    hist = run_federated(setup.participants, setup.m0, args.rounds, setup.cfg.get("lr"))
    params = StarfishParams(method="divide")
    pool = ClientPool(setup.participants, remaining_clients(hist, setup.targets))
    plain = run_stage2(None, hist, setup.targets, params, PoolClients(pool))
    out = secure_lab.run_secure_starfish(args, hist, setup.targets, params)
    v0 = out["values"][0]
    assert v0["selected_rounds"] == plain.selected_rounds
    assert {int(k): v for k, v in v0["flags"].items()} == plain.flags
    assert np.abs(v0["model"] - plain.model.double().numpy()).max() < 1e-2
