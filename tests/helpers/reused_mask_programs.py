"""Party programs for ``mpc.reused_masks`` (module-level: the party processes import them).

Inputs are raw int64 ring shares: party 0 uses ``share0``, party 1 ``share1``."""

from __future__ import annotations

import numpy as np
import torch

from mpc import reused_masks


def _mine(party, share0, share1) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(share0 if party.rank == 0 else share1))


def _bytes(party, key, kind="online") -> int:
    step = party.meters()["steps"][key]
    return step[f"{kind}_bytes_sent"] + step[f"{kind}_bytes_received"]


def _metered(party, name, fn, kind="online"):
    with party.meter(name):
        key = party.metering.open_steps()[-1]   # nested under this call's "call-N": its own row
        out = fn()
    return out, _bytes(party, key, kind)


def reuse(party, case, prefetch=False):
    """Open the columns once, then one product per z; returns (products, bytes of the opening,
    bytes of each product, the opened e's, the squared norms' shares)."""
    (x0, x1), zs = case                       # x: (rows, K, *size) shares; zs: [(z0, z1)], each (rows, K)
    x = _mine(party, x0, x1)
    rows, k = x.shape[0], x.shape[1]
    cols, opened_bytes = _metered(party, "open", lambda: reused_masks.open_masks(
        [x[j, i] for j in range(rows) for i in range(k)]))
    columns = [cols[j * k : (j + 1) * k] for j in range(rows)]
    products, product_bytes = [], []
    for i, (z0, z1) in enumerate(zs):
        if prefetch:
            reused_masks.prefetch_matvec(columns)
        out, nbytes = _metered(party, f"product{i}", lambda: reused_masks.matvec(columns, _mine(party, z0, z1)))
        if prefetch:   # nothing came from the dealer during the product itself
            _, dealer_bytes = _metered(party, f"product{i}", lambda: None, "offline")
            assert dealer_bytes == 0
        products.append(out.numpy().copy())
        product_bytes.append(nbytes)
    norms = reused_masks.squared_norms(cols).numpy().copy()
    return products, opened_bytes, product_bytes, [c.e.numpy().copy() for c in cols], norms


def supported(party):
    return reused_masks.supported()
