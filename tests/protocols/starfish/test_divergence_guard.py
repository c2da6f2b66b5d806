"""The replay's divergence guard (``protocols.starfish.replay``, ``StarfishParams.guard``).

Oracle: the clients themselves. An estimated round whose opened step eta * G_hat is longer than
R x the history's longest step must be redone with every present client's exact update on the
current M_hat, so the step applied there equals FedAvg of those exact updates, computed here
independently by training the clients (``LocalClient.train``) on the model the replay held.
Divergence is provoked with an inverse of W scaled by k (``inverse``), which makes the L-BFGS
estimates as large as a broken secant model makes them on the paper's CNN; k = 1 is the real
estimate, where a healthy run must be untouched (bit for bit the guard-off result).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bench.lab as lab_cli
from common.starfish_params import StarfishParams
from lab.fl import run_federated
from lab.recovery.base import ClientPool, PoolClients
from protocols.starfish.ports import remaining_clients
from protocols.starfish.replay import Replay
from protocols.starfish.stage2 import run_stage2

torch.set_num_threads(1)


def _lab(seed: int, model: str, clients: int, rounds: int):
    parser = argparse.ArgumentParser()
    lab_cli.add_arguments(parser)
    args = parser.parse_args(["--dataset", "digits", "--model", model, "--clients", str(clients),
                              "--rounds", str(rounds), "--train-limit", str(40 * clients),
                              "--test-limit", "50", "--seed", str(seed), "--quiet"])
    setup = lab_cli.build_setup(args)
    history = run_federated(setup.participants, setup.m0, rounds, setup.cfg.get("lr"),
                            trainer=setup.trainer)
    return setup, history


class _WarmupOnly:
    """Exact updates only while a buffer is not full; no threshold check, so that the guard is
    the only thing that can replace an estimate."""

    def exact_now(self, step, round_index, replay):
        return not replay.buffers.all_full(replay.present)

    def rejected(self, step, round_index, estimates, replay):
        return []


def _scaled_inverse(k: float):
    return lambda W: k * torch.linalg.inv(W)


def _longest_step(history) -> float:
    return max(float((history.model(i - 1).double() - history.model(i).double()).norm())
               for i in range(1, history.num_rounds + 1))


def _replay_trace(setup, history, guard: float, k: float):
    """Replay every round with the targets [0] removed; per step (M_hat before, step applied)."""
    rest = remaining_clients(history, [0])
    pool = ClientPool(setup.participants, rest, setup.trainer)
    replay = Replay(history, rest, PoolClients(pool), buffer=2, server_lr=history.server_lr,
                    inverse=_scaled_inverse(k), guard=guard)
    trace = []
    for t in range(1, history.num_rounds + 1):
        before = replay.model.clone()
        replay.replay_round(t, _WarmupOnly())
        trace.append((t, before, before - replay.model))
    return replay, trace, rest


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), model=st.sampled_from(["logreg", "mlp"]),
       clients=st.integers(3, 6), rounds=st.integers(5, 9),
       k=st.sampled_from([1e3, 1e5]), guard=st.sampled_from([1.0, 1.5, 3.0, 10.0]))
def test_a_diverging_round_is_redone_with_the_clients_exact_updates(seed, model, clients, rounds, k, guard):
    setup, history = _lab(seed, model, clients, rounds)
    longest = _longest_step(history)
    replay, trace, rest = _replay_trace(setup, history, guard, k)
    by_id = {p.client_id: p for p in setup.participants}
    for step, (t, before, applied) in enumerate(trace, start=1):
        norm = float(applied.norm())
        if step not in replay.guard_steps:
            assert norm <= guard * longest * (1 + 1e-12), (step, norm, longest)
            continue
        present = [j for j in rest if j in set(history.participants(t))]
        assert sorted(replay.exact_requests[step]) == sorted(present)
        w = history.weights(t)
        wsum = sum(w[j] for j in present)
        exact = sum(w[j] / wsum * by_id[j].train(before.to(history.model(0).dtype), t).update.double()
                    for j in present)
        torch.testing.assert_close(applied, history.server_lr * exact, rtol=1e-6, atol=1e-9)
    assert torch.isfinite(replay.model).all()


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), model=st.sampled_from(["logreg", "mlp"]),
       clients=st.integers(3, 6), rounds=st.integers(5, 9))
def test_a_healthy_replay_is_untouched(seed, model, clients, rounds):
    """Real estimates on the digits never trip the default guard: the guarded run is the
    unguarded one, bit for bit (the guard adds no work where it is not needed)."""
    setup, history = _lab(seed, model, clients, rounds)
    models = {}
    for guard in (0.0, StarfishParams().guard):
        rest = remaining_clients(history, [0])
        pool = ClientPool(setup.participants, rest, setup.trainer)
        res = run_stage2(None, history, [0], StarfishParams(guard=guard), PoolClients(pool))
        assert res.guard_steps == []
        models[guard] = res.model
    assert torch.equal(models[0.0], models[StarfishParams().guard])


def test_without_the_guard_the_provoked_estimate_runs_away():
    """The provocation is real: with the guard off, the same replay takes a step longer than
    three times the history's longest (so the first test's guarded runs are not vacuous)."""
    setup, history = _lab(3, "logreg", 4, 8)
    _replay, trace, _rest = _replay_trace(setup, history, 0.0, 1e5)
    assert max(float(a.norm()) for _t, _b, a in trace) > 3.0 * _longest_step(history)


@pytest.mark.parametrize("bad", [0.5, -1.0, 0.999])
def test_guard_values_between_0_and_1_are_refused(bad):
    with pytest.raises(ValueError, match="guard must be 0"):
        StarfishParams(guard=bad)
