"""Party programs for ``mpc.table_compare`` (module-level: the party processes import them)."""

from __future__ import annotations

import numpy as np

from mpc import table_compare


def flags(party, cases):
    """rows_exceed per case ``((x0, x1), drop, (d0, d1) or public d, shared)``; with the online bytes."""
    out = []
    for i, ((x0, x1), drop, d, shared) in enumerate(cases):
        x = x0 if party.rank == 0 else x1
        dd = (d[0] if party.rank == 0 else d[1]) if shared else d
        with party.meter(f"tc{i}"):
            key = party.metering.open_steps()[-1]
            got = table_compare.rows_exceed(np.ascontiguousarray(x), drop, np.ascontiguousarray(dd), d_shared=shared)
        step = party.meters()["steps"][key]
        out.append((got, step["online_bytes_sent"] + step["online_bytes_received"], step["online_rounds"]))
    return out


def supported(party):
    return table_compare.supported()


def negatives(party, cases):
    """negative_bounded per case ``(x0, x1)`` (int64 ring shares), opened; with the online bytes
    and rounds. The last output is the shares themselves, to check they are 0/1 ring integers."""
    import torch

    from mpc.crypten_compat import crypten

    out = []
    for i, (x0, x1) in enumerate(cases):
        share = torch.from_numpy(np.ascontiguousarray(x0 if party.rank == 0 else x1, dtype=np.int64))
        x = crypten.mpc.MPCTensor.from_shares(share, precision=16)
        with party.meter(f"nb{i}"):
            key = party.metering.open_steps()[-1]
            bit = table_compare.negative_bounded(x)
        step = party.meters()["steps"][key]
        out.append((bit.reveal().numpy(), tuple(bit.share.shape),
                    step["online_bytes_sent"] + step["online_bytes_received"], step["online_rounds"]))
    return out
