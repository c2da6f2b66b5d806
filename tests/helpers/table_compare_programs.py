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
