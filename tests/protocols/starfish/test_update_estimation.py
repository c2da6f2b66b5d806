"""Compact L-BFGS Hessian-vector product against the dense BFGS recursion (float64)."""

from __future__ import annotations

import pytest
import torch

from protocols.inverse import inverse_masked
from protocols.starfish.update_estimation import compact_hvp, estimate_updates

torch.set_num_threads(1)


def dense_bfgs(S: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """B_0 = sigma I, sigma = y_B's_B / s_B's_B; then the BFGS update, oldest pair first."""
    m, b = S.shape
    sigma = float(Y[:, -1] @ S[:, -1]) / float(S[:, -1] @ S[:, -1])
    Bk = sigma * torch.eye(m, dtype=torch.float64)
    for k in range(b):
        s, y = S[:, k], Y[:, k]
        Bs = Bk @ s
        Bk = Bk - torch.outer(Bs, Bs) / float(s @ Bs) + torch.outer(y, y) / float(y @ s)
    return Bk


def random_pairs(gen: torch.Generator, m: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs from an SPD quadratic plus a small non-symmetric perturbation (y's > 0 kept)."""
    Q = torch.randn(m, m, generator=gen, dtype=torch.float64)
    A = Q @ Q.T + 0.5 * torch.eye(m, dtype=torch.float64)
    S = torch.randn(m, b, generator=gen, dtype=torch.float64)
    Y = A @ S + 0.05 * torch.randn(m, b, generator=gen, dtype=torch.float64)
    assert torch.all((Y * S).sum(0) > 0)
    return S, Y


@pytest.mark.parametrize("m,b", [(3, 1), (6, 2), (9, 3), (12, 4)])
def test_compact_equals_dense_recursion(m, b):
    gen = torch.Generator().manual_seed(100 * m + b)
    for _ in range(5):
        S, Y = random_pairs(gen, m, b)
        v = torch.randn(m, generator=gen, dtype=torch.float64)
        expected = dense_bfgs(S, Y) @ v
        got = compact_hvp(S, Y, v, inverse=inverse_masked)
        assert got.dtype == torch.float64
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_batched_over_clients_and_secant_condition():
    gen = torch.Generator().manual_seed(7)
    pairs = [random_pairs(gen, 8, 2) for _ in range(5)]
    S = torch.stack([p[0] for p in pairs])
    Y = torch.stack([p[1] for p in pairs])
    v = torch.randn(8, generator=gen, dtype=torch.float64)
    got = compact_hvp(S, Y, v)
    for j in range(5):
        assert torch.allclose(got[j], dense_bfgs(S[j], Y[j]) @ v, atol=1e-6)
        # BFGS matrices satisfy the latest secant equation H s_B = y_B
        assert torch.allclose(compact_hvp(S[j], Y[j], S[j][:, -1]), Y[j][:, -1], atol=1e-8)
    g = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    assert torch.allclose(estimate_updates(g, v, S, Y), g + got)


def test_isotropic_quadratic_is_estimated_exactly():
    """y = a s for all pairs => H = a I: the FedRecover estimate is the exact update."""
    gen = torch.Generator().manual_seed(3)
    S = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    v = torch.randn(20, generator=gen, dtype=torch.float64)
    assert torch.allclose(compact_hvp(S, 2.5 * S, v), 2.5 * v, atol=1e-10)
