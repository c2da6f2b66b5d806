"""``starfish clients --device``: where the simulated clients train; uploads stay on the CPU."""

from __future__ import annotations

import pytest
import torch

from clients.simulator import FederationSpec, build_federation
from clients.training import resolve_device

torch.set_num_threads(1)


def test_clients_train_where_the_spec_says_and_upload_from_the_cpu():
    fed = build_federation(FederationSpec(n=3, device="auto", train_limit=90))
    expected = str(resolve_device("auto"))
    assert all(str(c.device) == expected for c in fed.clients)
    m0 = torch.zeros(650, dtype=torch.float64)
    up = fed.clients[1].train(m0, 1)
    assert up.update.device.type == "cpu" and up.update.dtype == torch.float64
    # the same client on the CPU computes the same update (bit for bit when auto is the CPU)
    cpu = build_federation(FederationSpec(n=3, device="cpu", train_limit=90)).clients[1].train(m0, 1)
    assert torch.allclose(up.update, cpu.update, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="no CUDA"):
        build_federation(FederationSpec(n=2, device="cuda", train_limit=20))
