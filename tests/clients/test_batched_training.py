"""Batched local training of many clients against the one-client-at-a-time loop.

Oracle: ``LocalClient.train`` / ``AttackedClient.train`` (the sequential loop, one client after
another, same seeds). Most checks run the models in float64: the two computations then differ
only by summation order (~1e-15), so a tight tolerance catches any difference in the math (a
wrong batch, a padded sample that counts, a client stepping after it finished, a missed L2 term,
a wrong learning rate). In float32, ReLU and max-pooling make multi-step training chaotic: a
1e-7 rounding difference flips a unit near zero and the trajectories part, so the float32 checks
use the production models over one or two steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from clients.attacks import ScalingClient, SignFlipClient
from clients.backdoor import BackdoorClient, default_trigger
from clients.batched_training import ClientTrainer, batchable, train_clients
from clients.models import PaperCNN, build_model, flatten_params
from clients.training import LocalClient, batch_schedule, resolve_device, round_seed, steps_for

torch.set_num_threads(1)


class SmoothMLP(nn.Module):
    """A float64 tanh MLP with L2: smooth, so float64 trajectories agree to rounding."""

    def __init__(self, l2: float = 1e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3))
        self.l2 = l2
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_clients(sizes, batch_sizes, lrs, factory, shape, classes, seed, dtype=torch.float64,
                 epochs=1.0):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [LocalClient(j, torch.rand(n, *shape, generator=gen, dtype=dtype),
                        torch.randint(0, classes, (n,), generator=gen), factory, epochs=epochs,
                        lr=lr, batch_size=bs, alpha=0.3, seed=seed)
            for j, (n, bs, lr) in enumerate(zip(sizes, batch_sizes, lrs))]


def assert_same_uploads(seq, bat, rtol):
    assert list(seq) == list(bat)
    for j in seq:
        a, b = seq[j].update, bat[j].update
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = max(float(a.abs().max()), 1e-12)
        assert float((a - b).abs().max()) <= rtol * scale, (j, float((a - b).abs().max()), scale)
        assert seq[j].num_samples == bat[j].num_samples
        assert math.isclose(seq[j].norm, bat[j].norm, rel_tol=rtol, abs_tol=1e-12)
        assert math.isclose(seq[j].delta, bat[j].delta, rel_tol=10 * rtol, abs_tol=1e-12)


client_sets = st.integers(1, 5).flatmap(lambda k: st.tuples(
    st.lists(st.integers(1, 40), min_size=k, max_size=k),                # ragged data sizes
    st.lists(st.integers(1, 16), min_size=k, max_size=k),                # per-client batch size
    st.lists(st.sampled_from([0.01, 0.05, 0.2]), min_size=k, max_size=k),  # per-client lr
    st.lists(st.sampled_from(["honest", "backdoor", "scaling", "sign-flip"]), min_size=k, max_size=k),
))


@given(clients=client_sets, seed=st.integers(0, 2**16), round_idx=st.integers(1, 50),
       epochs=st.sampled_from([None, 0, 0.5, 1.5, 3, "each"]), own_starts=st.booleans())
def test_batched_equals_sequential_loop(clients, seed, round_idx, epochs, own_starts):
    sizes, batch_sizes, lrs, roles = clients
    cores = make_clients(sizes, batch_sizes, lrs, SmoothMLP, (1, 4, 4), 3, seed, epochs=2.0)
    parts = []
    for c, role in zip(cores, roles):
        if role == "backdoor":
            parts.append(BackdoorClient.from_clean(c, default_trigger((1, 4, 4)), 0, 0.5,
                                                   boost=3.0, seed=seed))
        elif role == "scaling":
            parts.append(ScalingClient(c, scale=4.0))
        elif role == "sign-flip":
            parts.append(SignFlipClient(ScalingClient(c, scale=2.0)))
        else:
            parts.append(c)
    gen = torch.Generator().manual_seed(seed)
    base = flatten_params(SmoothMLP()).to(torch.float64)
    starts = ({p.client_id: base + 0.1 * torch.randn(base.shape, generator=gen, dtype=torch.float64)
               for p in parts} if own_starts else base)

    if epochs == "each":   # per-client epochs (FedEraser's calibration asks for a fraction of each's own)
        epochs = {p.client_id: [0.5, 1.0, 2.5][p.client_id % 3] for p in parts}

    def start(j):
        return starts[j] if own_starts else starts

    def asked(j):
        return epochs[j] if isinstance(epochs, dict) else epochs

    seq = {p.client_id: p.train(start(p.client_id), round_idx, asked(p.client_id)) for p in parts}
    bat = ClientTrainer("batched").train(parts, starts, round_idx, epochs)
    assert_same_uploads(seq, bat, rtol=1e-9)


@given(k=st.integers(2, 3), n=st.integers(3, 20), bs=st.integers(2, 8), seed=st.integers(0, 999))
def test_paper_cnn_topology_batched_in_float64(k, n, bs, seed):
    # the paper CNN's layers (conv, ReLU, max-pool, FC) on 16x16 images, in float64
    def factory():
        return PaperCNN(1, 16, 10, extra_fc=8).double()

    cores = make_clients([n + j for j in range(k)], [bs] * k, [0.05] * k, factory, (1, 16, 16),
                         10, seed, epochs=1.0)
    start = flatten_params(factory())
    seq = {c.client_id: c.train(start, 2) for c in cores}
    assert_same_uploads(seq, train_clients(cores, start, 2, mode="batched"), rtol=1e-9)


class StridedCNN(nn.Module):
    """Convolutions with stride, padding and dilation (the unfolded form must honour them)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 3, 3, stride=2, padding=1), nn.Tanh(),
                                 nn.Conv2d(3, 4, 2, dilation=2, bias=False), nn.Tanh(),
                                 nn.Flatten(), nn.Linear(4 * 2 * 2, 3))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@given(k=st.integers(2, 3), n=st.integers(3, 12), bs=st.integers(2, 5), seed=st.integers(0, 999))
def test_strided_padded_dilated_convolutions_batched(k, n, bs, seed):
    cores = make_clients([n + j for j in range(k)], [bs] * k, [0.1] * k, StridedCNN, (1, 8, 8),
                         3, seed, epochs=2.0)
    start = flatten_params(StridedCNN())
    seq = {c.client_id: c.train(start, 5) for c in cores}
    assert_same_uploads(seq, train_clients(cores, start, 5, mode="batched"), rtol=1e-9)


@pytest.mark.parametrize("name,shape", [("logreg", (1, 8, 8)), ("mlp", (1, 8, 8)),
                                        ("cnn", (1, 28, 28)), ("cnn-extra-fc", (1, 28, 28))])
def test_production_models_float32_one_epoch_of_two_steps(name, shape):
    factory = build_model(name, shape, 10, l2=1e-3)
    cores = make_clients([20, 13, 9], [10, 7, 5], [0.05, 0.1, 0.05], factory, shape, 10, 3,
                         dtype=torch.float32)
    start = flatten_params(factory()).to(torch.float64)   # the lab's models are float64 vectors
    seq = {c.client_id: c.train(start, 1) for c in cores}
    # float32: the loop's and vmap's reductions run in orders that vary from run to run (a CI run
    # on 2026-12-06 gave 3.4e-3 of the largest coordinate for the CNN, where 8 runs alone stayed
    # below 2e-4: a ReLU whose pre-activation is near 0 flips); a wrong gradient, step or weight
    # moves the update by O(1) of it. The float64 tests above check the math at 1e-9.
    assert_same_uploads(seq, train_clients(cores, start, 1, mode="batched"), rtol=1e-2)


def test_unbatchable_model_falls_back_to_the_loop_bit_for_bit():
    assert not batchable(WithBatchNorm()) and batchable(SmoothMLP())
    assert batchable(build_model("cnn-extra-fc", (1, 28, 28))())
    cores = make_clients([12, 7], [4, 4], [0.1, 0.1], WithBatchNorm, (1, 4, 4), 3, 0,
                         dtype=torch.float32)
    start = flatten_params(WithBatchNorm()).double()
    seq = {c.client_id: c.train(start, 1) for c in cores}
    auto = ClientTrainer("auto").train(cores, start, 1)
    assert all(torch.equal(seq[j].update, auto[j].update) for j in seq)
    with pytest.raises(ValueError, match="cannot be batched"):
        ClientTrainer("batched").train(cores, start, 1)


def test_other_participants_train_themselves_and_sequential_mode_is_the_loop():
    class Duck:
        client_id, num_samples, epochs = 9, 4, 1.0

        def train(self, model_vec, round_idx, epochs=None):
            return ("duck", round_idx, epochs)

    cores = make_clients([6, 5], [2, 3], [0.1, 0.1], SmoothMLP, (1, 4, 4), 3, 1)
    start = flatten_params(SmoothMLP())
    out = ClientTrainer("auto").train([cores[1], Duck(), cores[0]], start, 4, 0.5)
    assert list(out) == [1, 9, 0] and out[9] == ("duck", 4, 0.5)
    seq = ClientTrainer("sequential").train(cores, start, 4)
    assert all(torch.equal(seq[c.client_id].update, c.train(start, 4).update) for c in cores)
    with pytest.raises(ValueError, match="cannot be batched"):
        ClientTrainer("batched").train([Duck()], start, 4)


def test_progress_counts_steps_and_finished_clients():
    cores = make_clients([30, 5, 12], [4, 4, 5], [0.1] * 3, SmoothMLP, (1, 4, 4), 3, 2)
    calls = []
    ClientTrainer("batched").train(cores, flatten_params(SmoothMLP()), 1,
                                   progress=lambda d, t, info: calls.append((d, t, info)))
    total = sum(steps_for(c.num_samples, c.batch_size, c.epochs) for c in cores)
    assert calls[-1] == (total, total, "3/3 clients done")
    assert all(d <= t == total for d, t, _ in calls)


def test_batch_schedule_is_one_seeded_permutation_per_epoch():
    # oracle written independently: an explicit epoch loop over torch.randperm
    n, bs, seed = 11, 4, 5
    gen = torch.Generator().manual_seed(seed)
    expected = []
    for _ in range(3):
        perm = torch.randperm(n, generator=gen)
        expected += [perm[0:4], perm[4:8], perm[8:11]]
    got = batch_schedule(n, bs, 2.5, seed)     # 2.5 epochs of 3 batches: round(7.5) = 8 steps
    assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, expected[:8]))
    assert batch_schedule(n, bs, 0, seed) == [] and len(batch_schedule(n, bs, 0.01, seed)) == 1
    assert round_seed(0, 1, 2) != round_seed(0, 2, 1)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_batched_matches_cpu_loop():
    cores = make_clients([20, 9, 14], [4, 3, 5], [0.05] * 3, SmoothMLP, (1, 4, 4), 3, 4)
    start = flatten_params(SmoothMLP())
    seq = {c.client_id: c.train(start, 3) for c in cores}
    for c in cores:
        c.device = "cuda"
    bat = ClientTrainer("batched").train(cores, start, 3)
    assert all(bat[j].update.device.type == "cpu" for j in bat)   # uploads stay on the CPU
    assert_same_uploads(seq, bat, rtol=1e-9)
