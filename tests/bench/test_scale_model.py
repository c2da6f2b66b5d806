"""``starfish bench scale``: the cost model recovers known coefficients and predicts a held-out run.

Oracle: runs made from known coefficients (the model's own form), so the fit must return them and
predict a run left out of the fit; mixed offline modes and a --check outside the runs are refused.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import scale
from protocols.starfish.shard_steps import BLOCK

TRUE = {"bytes_per_estimated_coordinate": 2.0, "bytes_per_checked_coordinate": 30.0,
        "coordinator_bytes_per_estimated_row": 2_000.0, "coordinator_bytes_per_checked_row": 900.0,
        "worker_base_mib": 300.0, "worker_mib_per_held_coordinate": 1.5e-4, "worker_mib_per_batch_value": 2e-4,
        "seconds_per_estimated_coordinate": 2e-8, "seconds_per_checked_coordinate": 5e-8,
        "seconds_per_replayed_coordinate": 7e-8, "seconds_per_rounds_coordinate": 1e-8,
        "coordinator_seconds_per_round": 0.4, "fixed_seconds": 3.0, "coordinator_base_mib": 700.0,
        "coordinator_mib_per_round_coordinate": 1.6e-5, "coordinator_mib_per_worker": 90.0}
#: (D, N, T, K): T of 10, 20 and 40 give different ratios of estimated to checked rows
SHAPES = [(256, 3, 10, 1), (10_000, 6, 10, 1), (10_000, 6, 10, 2), (582_026, 20, 40, 1), (582_026, 20, 40, 2),
          (100_000, 10, 20, 4)]
STEPS = {"estimated": "UE", "checked": "TC", "replayed": "aggregate", "rounds": "RS"}


def _run(tmp_path, D, N, T, K, coef, offline="dealer", cores=2, name=None):
    work = scale.replay_work(N, T)
    est, chk = work["estimated"], work["checked"]
    p = max(1.0, min(K, cores / 2))
    units = {"estimated": est, "checked": chk, "replayed": work["replayed"], "rounds": T}
    steps = {STEPS[g]: {"seconds": coef[f"seconds_per_{g}_coordinate"] * units[g] * D / p} for g in STEPS}
    job = sum(v["seconds"] for v in steps.values()) + coef["coordinator_seconds_per_round"] * work["replayed"] \
        + coef["fixed_seconds"]
    pair = (coef["bytes_per_estimated_coordinate"] * est + coef["bytes_per_checked_coordinate"] * chk) * D / K
    worker = {"online": pair * 0.75, "offline": pair * 0.25, "rounds": 1,
              "peak_rss_mib": coef["worker_base_mib"] + coef["worker_mib_per_held_coordinate"] * N * D / K
              + coef["worker_mib_per_batch_value"] * min(BLOCK, N * D / K)}
    coord = {"online": coef["coordinator_bytes_per_estimated_row"] * est + coef["coordinator_bytes_per_checked_row"] * chk,
             "offline": 0, "rounds": 1, "steps": steps,
             "peak_rss_mib": coef["coordinator_base_mib"] + coef["coordinator_mib_per_round_coordinate"] * T * D
             + coef["coordinator_mib_per_worker"] * K}
    doc = {"benchmark": "unlearning --workers", "machine": {"cpu_count": cores},
           "config": {"num_params": D, "clients": N, "rounds": T, "sigma": 0.6, "beta": 0.1, "buffer": 2, "targets": [0]},
           "result": {"workers": K, "offline": offline,
                      "servers": [{"job_s": job, "coordinator": coord, "workers": [worker] * K}] * 2}}
    path = tmp_path / (name or f"run-{D}-{N}-{K}-{offline}.json")
    path.write_text(json.dumps(doc))
    return str(path)


@settings(max_examples=20, deadline=None)
@given(scale_by=st.floats(0.2, 5.0), held=st.integers(0, len(SHAPES) - 1))
def test_fit_recovers_the_coefficients_and_predicts_a_held_out_run(tmp_path_factory, scale_by, held):
    tmp = tmp_path_factory.mktemp("scale")
    coef = {k: v * scale_by for k, v in TRUE.items()}
    paths = [_run(tmp, *shape, coef) for shape in SHAPES]
    runs = [scale.load_run(p) for p in paths]
    got = scale.fit(runs)
    for k, v in coef.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    rest = scale.fit([r for i, r in enumerate(runs) if i != held])
    D, N, T, K = SHAPES[held]
    pr = scale.predict(rest, D, N, K, T=T, cores_per_server=1.0)
    assert pr["coordinator_gb"] * 1e9 == pytest.approx(runs[held]["coordinator_bytes"], rel=1e-6)
    assert pr["seconds"] == pytest.approx(runs[held]["job_s"], rel=1e-6)
    assert pr["pair_gb"] * 1e9 == pytest.approx(runs[held]["pair_bytes"], rel=1e-6)
    assert pr["worker_peak_gib"] * 1024 == pytest.approx(runs[held]["worker_peak_mib"], rel=1e-6)
    assert pr["coordinator_peak_gib"] * 1024 == pytest.approx(runs[held]["coordinator_peak_mib"], rel=1e-6)


def test_cli_writes_json_and_png_and_refuses_mixed_modes(tmp_path, capsys):
    paths = [_run(tmp_path, *shape, TRUE) for shape in SHAPES]
    out = tmp_path / "scale.json"
    assert scale.main(paths + ["--check", paths[-1], "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["check"]["predicted"]["seconds"] == pytest.approx(doc["check"]["measured"]["seconds"], rel=1e-6)
    assert out.with_suffix(".png").stat().st_size > 0
    assert max(g["D"] for g in doc["grid"]) == 100_000_000 and max(g["N"] for g in doc["grid"]) == 1_000
    other = _run(tmp_path, 10_000, 6, 10, 1, TRUE, offline="two-party")
    assert scale.main(paths + [other, "--out", str(tmp_path / "x.json")]) == 2
    assert "one offline mode" in capsys.readouterr().err


class _Exact:
    """The toy clients' exact updates (Stage II's ``CorrectionClients`` port)."""

    def __init__(self, clients):
        self._by_id = {c.client_id: c for c in clients}

    def exact_updates(self, round_index, model, client_ids):
        return {j: self._by_id[j].train(model, round_index).update for j in client_ids}


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 6), T=st.integers(1, 30), sigma=st.sampled_from([0.2, 0.5, 0.6, 1.0]),
       beta=st.sampled_from([0.05, 0.1, 0.3, 1.0]), buffer=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_replay_work_counts_what_a_plaintext_stage2_does(n, T, sigma, beta, buffer, seed):
    """The model's work counts against the replay itself: a plaintext ``run_stage2`` on a history
    of every client in every round estimates ``estimated`` rows and checks ``checked`` rows (the
    remaining clients at each of its correction steps), after ``warmup`` steps of B + 1."""
    import numpy as np
    import torch

    from protocols.starfish import StarfishParams, run_stage2
    from tests.protocols.starfish.partial_programs import ToyClient, build_history

    rng = np.random.default_rng(seed)
    d = 5
    clients = [ToyClient(j, rng.normal(size=d), rng.uniform(0.5, 1.5, size=d), bend=0.2) for j in range(n)]
    history = build_history(clients, [list(range(n))] * T, rng.normal(size=d), 0.3)
    res = run_stage2(None, history, [0], StarfishParams(sigma=sigma, beta=beta, buffer=buffer), _Exact(clients))
    work = scale.replay_work(n, T, sigma=sigma, beta=beta, buffer=buffer)
    assert work["replayed"] == len(res.selected_rounds)
    assert res.warmup_steps == min(work["replayed"], buffer + 1)
    assert work["estimated"] == res.estimated_updates
    assert work["checked"] == (n - 1) * len(res.correction_steps)
    assert torch.isfinite(res.model).all()
