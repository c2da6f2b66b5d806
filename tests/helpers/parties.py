"""Two-party programs used by the tests (module-level so the party processes can import them)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from mpc.crypten_compat import crypten


def reconstruct_client_shares(party, share0, share1, precision):
    mine = share0 if party.rank == 0 else share1
    x = party.wrap_share(mine, precision=precision)
    # the opened ring element, not CrypTen's float32 decoding of it
    return x.reveal().numpy().copy()


def arithmetic_suite(party, a, b, m1, m2):
    """Multiply, compare and open; a/b are party 0's and party 1's inputs."""
    x = crypten.cryptensor(torch.from_numpy(a), src=0)
    y = crypten.cryptensor(torch.from_numpy(b), src=1)
    with party.meter("mul"):
        prod = x * y
    with party.meter("ge"):
        ge = x >= y
    with party.meter("lt"):
        lt = x < y
    with party.meter("matmul"):
        mm = crypten.cryptensor(torch.from_numpy(m1), src=0).matmul(crypten.cryptensor(torch.from_numpy(m2), src=1))
    with party.meter("square"):
        sq = x.square()
    with party.meter("open"):
        out = {k: v.get_plain_text().double().numpy() for k, v in
               {"prod": prod, "ge": ge, "lt": lt, "mm": mm, "sq": sq}.items()}
    return out


def multiply_batch(party, n):
    torch.manual_seed(1)
    x = crypten.cryptensor(torch.randn(n), src=0)
    y = crypten.cryptensor(torch.randn(n), src=1)
    with party.meter("mul"):
        z = x * y
    with party.meter("open"):
        return z.get_plain_text().numpy()


def exchange_rounds(party, k, nbytes_big):
    """k sequential exchanges of one element, then one exchange of ``nbytes_big`` bytes."""
    comm = crypten.communicator.get()
    small = torch.ones(1, dtype=torch.long)
    for _ in range(3):  # align the parties' clocks: each exchange shrinks their skew
        comm.barrier()
    with party.meter("latency"):
        for _ in range(k):
            comm.all_reduce(small)
    big = torch.ones(nbytes_big // 8, dtype=torch.long)
    for _ in range(3):
        comm.barrier()
    with party.meter("bandwidth"):
        comm.all_reduce(big)
    return True


def die_midway(party):
    x = crypten.cryptensor(torch.ones(4), src=0)
    (x * x).get_plain_text()
    if party.rank == 1:
        os._exit(3)  # a crash: no goodbye, sockets closed by the kernel
    t0 = time.monotonic()
    try:
        (x * x).get_plain_text()
    finally:
        party.extras["waited"] = time.monotonic() - t0
    return "unreachable"


def go_silent(party):
    x = crypten.cryptensor(torch.ones(4), src=0)
    if party.rank == 1:
        time.sleep(120)
    return (x * x).get_plain_text().numpy()


def seeded_noise(party, n):
    """Each party's own view of a shared random tensor: its share (for a leakage sanity check)."""
    x = crypten.cryptensor(torch.zeros(n), src=0)
    y = x * x
    return y.share.numpy().copy()


def sign_test_ring(party, share0, share1):
    """[x >= 0] for raw ring elements x = share0 + share1 (mod 2^64), both providers."""
    from mpc.nonnegative import nonnegative

    mine = torch.from_numpy(share0 if party.rank == 0 else share1)
    x = crypten.mpc.MPCTensor.from_shares(mine, precision=0)
    with party.meter("sign"):
        bit = nonnegative(x)
    return bit.reveal().numpy().copy(), list(bit.share.shape)


def pid_and_product(party, a: float, b: float):
    """This party's process id and the opened product a * b (a 2PC multiplication)."""
    x = crypten.cryptensor(torch.tensor([a], dtype=torch.float64), src=0)
    y = crypten.cryptensor(torch.tensor([b], dtype=torch.float64), src=1)
    return os.getpid(), float((x * y).get_plain_text().item())


def fail_in_party_1(party):
    if party.rank == 1:
        raise RuntimeError("on purpose")
    return os.getpid()
