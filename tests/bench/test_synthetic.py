"""The synthetic history of the cost benchmarks: values, shares, and a plaintext Stage II on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import synthetic
from common.encoding import decode, encode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = synthetic.config("tiny")
    path = synthetic.prepare(cfg, tmp_path_factory.mktemp("cache"))
    assert synthetic.prepare(cfg, path.parent) == path          # cached, not regenerated
    return cfg, synthetic.load_data(path)


def test_mnist_config_is_the_papers():
    cfg = synthetic.config("mnist")
    assert (cfg.num_params, cfg.clients, cfg.rounds, cfg.sigma, cfg.alpha, cfg.beta, cfg.buffer) == \
        (582_026, 20, 40, 0.6, 0.4, 0.1, 2)
    assert cfg.model == "cnn" and cfg.remaining == list(range(1, 20))
    assert cfg.key() != cfg.with_(seed=1).key() and cfg.key() == cfg.with_(note="x").key()


def test_values_prefix_norms_thresholds_and_models(tiny):
    cfg, data = tiny
    g = synthetic.update_values(cfg, 3, 1)
    assert np.array_equal(synthetic.update_values(cfg, 3, 1, count=17), g[:17])
    assert 0.5 * cfg.update_scale < g.std() < 2 * cfg.update_scale
    assert data["norms"][2, 1] == pytest.approx(np.linalg.norm(g))
    d = data["deltas"][2, 1]
    assert int((np.abs(g) > d).sum()) == int(np.floor(cfg.alpha * cfg.num_params))
    w = data["weights"]
    assert w.sum() == pytest.approx(1.0)
    step = sum(w[j] * synthetic.update_values(cfg, 3, j) for j in range(cfg.clients))
    assert np.allclose(data["models"][3], data["models"][2] - cfg.server_lr * step, atol=1e-6)


@pytest.mark.parametrize("kind", ["update", "norm", "delta"])
def test_the_two_shares_add_up_to_the_encoding(tiny, kind):
    cfg, data = tiny
    h0, h1, hp = (synthetic.SyntheticHistory(cfg, data, r) for r in (0, 1, None))
    s0, s1 = getattr(h0, kind)(4, 2), getattr(h1, kind)(4, 2)
    assert s0.dtype == np.int64 and s0.shape == s1.shape
    plain = getattr(hp, kind)(4, 2).numpy()
    assert np.array_equal(s0 + s1, encode(plain))
    assert not np.array_equal(s0, encode(plain))                     # a share is not the value
    if kind == "update":
        assert np.allclose(decode(h0.update_prefix(4, 2, 5) + h1.update_prefix(4, 2, 5)), plain[:5], atol=2e-5)


def test_exact_updates_are_shared_consistently_and_follow_the_curvature(tiny):
    cfg, data = tiny
    hs = [synthetic.SyntheticHistory(cfg, data, r) for r in (0, 1, None)]
    cs = [synthetic.SyntheticClients(h) for h in hs]
    model = torch.from_numpy(data["models"][2]) + 1e-3
    out = [c.exact_updates(3, model, [1, 2]) for c in cs]
    plain = out[2][1].numpy()
    assert np.allclose(decode(out[0][1] + out[1][1]), plain, atol=2e-5)
    expected = synthetic.update_values(cfg, 3, 1) + cfg.curvature * (model.double().numpy() - data["models"][2])
    assert np.allclose(plain, expected, atol=1e-4)
    again = [c.exact_updates(3, model, [1]) for c in cs[:2]]           # second request: a new PRG stream
    assert not np.array_equal(again[0][1], out[0][1])
    assert cs[2].computations == {1: 1, 2: 1}


def test_plaintext_stage2_runs_on_the_synthetic_history(tiny):
    from protocols.starfish import StarfishParams, run_stage2

    cfg, data = tiny
    h = synthetic.SyntheticHistory(cfg, data, None)
    res = run_stage2(None, h, list(cfg.targets), StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer),
                     synthetic.SyntheticClients(h))
    assert len(res.selected_rounds) == 6 and res.estimated_updates > 0 and res.correction_steps
    assert torch.isfinite(res.model).all()


def test_a_brace_history_is_made_by_the_brace_vote(tmp_path):
    """Oracle: numpy's BRACE (eq. 1) with the step of FL round t: M_t = M_{t-1} - lr 0.5 / sqrt(t)
    * (+1 where sum_k sgn(g_t^k) > floor(5 K / 100), else -1); FedAvg histories keep their key."""
    cfg = synthetic.config("tiny").with_(aggregator="brace-sign")
    assert synthetic.config("tiny").key() != cfg.key()
    data = synthetic.load_data(synthetic.prepare(cfg, tmp_path))
    for t in range(1, cfg.rounds + 1):
        G = np.stack([synthetic.update_values(cfg, t, j) for j in range(cfg.clients)])
        vote = np.where(np.sign(G).sum(0) > np.floor(5.0 * cfg.clients / 100), 1.0, -1.0)
        want = data["models"][t - 1].astype(np.float64) - cfg.server_lr * 0.5 / np.sqrt(t) * vote
        np.testing.assert_allclose(data["models"][t], want, atol=1e-6)
