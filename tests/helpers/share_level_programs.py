"""Party programs for the property tests of the ring-level primitives (``mpc.nonnegative``,
``mpc.exact_truncation``). Inputs are raw int64 ring shares: party 0 uses ``share0``, party 1
``share1`` (both are passed; each party picks its own by rank)."""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from mpc.exact_truncation import truncate_exact
from mpc.nonnegative import nonnegative


def _ring(party, share0, share1, precision=0):
    mine = share0 if party.rank == 0 else share1
    return crypten.mpc.MPCTensor.from_shares(torch.from_numpy(np.ascontiguousarray(mine)),
                                             precision=precision)


def _open(x) -> np.ndarray:
    """The opened ring integers (int64); empty sharings are not exchanged."""
    if x.share.numel() == 0:
        return np.zeros(tuple(x.share.shape), dtype=np.int64)
    return x.reveal().numpy().copy()


def _metered(party, name, fn):
    with party.meter(name):
        key = party.metering.open_steps()[-1]   # nested under the pair's "call-N"
        out = fn()
    return out, party.meters()["steps"][key]


def sign_tests(party, cases, crypten_too=True):
    """``[x >= 0]`` of each ``(share0, share1)`` by ``nonnegative`` (and by CrypTen's own
    comparison when ``crypten_too``): per case (bits, scale, online rounds, CrypTen's bits)."""
    out = []
    for i, (share0, share1) in enumerate(cases):
        x = _ring(party, share0, share1)
        bit, step = _metered(party, f"sign-{i}", lambda: nonnegative(x))
        own = None
        if crypten_too and x.share.numel():
            own = _open(x >= 0)
        out.append((_open(bit), int(bit.encoder.scale), step["online_rounds"], own))
    return out


def truncations(party, cases):
    """``truncate_exact`` of each ``(share0, share1, precision, d)``: per case (opened ring
    integers, the result's encoder scale, online rounds), or the name of the raised error."""
    out = []
    for i, (share0, share1, precision, d) in enumerate(cases):
        x = _ring(party, share0, share1, precision)
        try:
            y, step = _metered(party, f"trunc-{i}", lambda: truncate_exact(x, d))
        except ValueError:   # raised before any exchange, identically in both parties
            out.append("ValueError")
            continue
        out.append((_open(y), int(y.encoder.scale), step["online_rounds"]))
    return out
