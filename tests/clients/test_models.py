"""Models, local training, assistive information and the backdoor client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.backdoor import BackdoorClient, Trigger, default_trigger, poison
from clients.models import build_model, flatten_params, load_params, num_params
from clients.training import LocalClient, local_update, tolerance_threshold
from lab.fl import run_federated

torch.set_num_threads(1)


def test_paper_parameter_counts():
    assert num_params(build_model("cnn", (1, 28, 28))()) == 582_026
    assert num_params(build_model("cnn", (3, 32, 32))()) == 878_538
    assert num_params(build_model("cnn-extra-fc", (1, 28, 28))()) == 643_850
    assert num_params(build_model("logreg", (1, 8, 8))()) == 650
    out = build_model("cnn", (3, 32, 32))()(torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_flatten_and_load_are_inverse():
    model = build_model("mlp", (1, 8, 8))()
    v = torch.randn(num_params(model))
    load_params(model, v)
    assert torch.equal(flatten_params(model), v)
    # order is parameters() order: the first block is the first layer's weight
    first = next(model.parameters())
    assert torch.equal(first.reshape(-1), v[:first.numel()])
    with pytest.raises(ValueError, match="parameters"):
        load_params(model, v[:-1])


def test_tolerance_threshold_quantile_convention():
    g = torch.tensor([0.5, -3.0, 2.0, -1.0, 4.0, 0.1, -0.2, 6.0, 7.0, -8.0])
    for alpha in (0.0, 0.1, 0.25, 0.4, 0.99):
        d = tolerance_threshold(g, alpha)
        k = int(np.floor(alpha * g.numel()))
        assert int((g.abs() > d).sum()) == k  # exactly floor(alpha m) strictly exceed
        assert d in g.abs().tolist()
    assert tolerance_threshold(g, 1.0) == 0.0


def test_local_update_is_the_gradient_for_one_full_batch_step():
    torch.manual_seed(0)
    x = torch.rand(9, 1, 8, 8)
    y = torch.randint(0, 10, (9,))
    model = build_model("logreg", (1, 8, 8), l2=0.01)()
    start = torch.randn(650, dtype=torch.float32) * 0.1
    g = local_update(model, start, x, y, epochs=1, lr=0.5, batch_size=9, seed=0)
    # independent oracle: softmax regression gradient, by hand in numpy (float64)
    W = start[:640].double().numpy().reshape(10, 64)
    b = start[640:].double().numpy()
    X = x.reshape(9, 64).double().numpy()
    logits = X @ W.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(9), y.numpy()] -= 1.0
    gW = p.T @ X / 9 + 0.01 * W
    gb = p.mean(0) + 0.01 * b
    assert np.allclose(g.double().numpy(), np.concatenate([gW.ravel(), gb]), atol=2e-5)


def test_fedavg_convention_matches_average_of_local_models():
    torch.manual_seed(0)
    fac = build_model("logreg", (1, 8, 8))
    clients = [LocalClient(j, torch.rand(10 + 5 * j, 1, 8, 8), torch.randint(0, 10, (10 + 5 * j,)),
                           fac, epochs=2, lr=0.2, batch_size=4) for j in range(3)]
    m0 = flatten_params(fac())
    hist = run_federated(clients, m0, 1, server_lr=0.2)
    locals_ = [m0 - 0.2 * c.train(m0, 1).update for c in clients]
    sizes = torch.tensor([10.0, 15.0, 20.0])
    expected = sum(w * m for w, m in zip(sizes / sizes.sum(), locals_))
    assert torch.allclose(hist.model(1), expected, atol=1e-6)
    u = hist.update(1, 2)
    assert float(hist.norm(1, 2)) == pytest.approx(float(u.norm()))
    assert float(hist.delta(1, 2)) == tolerance_threshold(u, 0.4)


def test_backdoor_poisons_a_fraction_and_boosts():
    x = torch.zeros(10, 1, 8, 8)
    y = torch.arange(10)
    trig = default_trigger((1, 8, 8))
    x2, y2, mask = poison(x, y, trig, target_label=0, fraction=0.3, seed=1)
    assert int(mask.sum()) == 3 and torch.all(y2[mask] == 0)
    assert torch.all(x2[mask][:, 0, 2:6, 0] == 1.0) and float(x2[~mask].abs().sum()) == 0.0
    assert Trigger(0, 0, 1, 1, 0.5).apply(x)[0, 0, 0, 0] == 0.5
    fac = build_model("logreg", (1, 8, 8))
    base = LocalClient(0, torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,)), fac, lr=0.1)
    bd = BackdoorClient.from_clean(base, trig, 3, 0.5, boost=4.0)
    m0 = flatten_params(fac())
    honest_on_poison = LocalClient(0, bd.x, bd.y, fac, lr=0.1).train(m0, 1).update
    assert torch.allclose(bd.train(m0, 1).update, 4.0 * honest_on_poison)
    assert torch.equal(bd.clean_x, base.x)
