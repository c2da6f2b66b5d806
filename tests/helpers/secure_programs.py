"""Two-party programs for tests/protocols/starfish/test_stage2_2pc.py (importable by the party processes)."""

from __future__ import annotations

import torch

from mpc.crypten_compat import crypten
from protocols.backend import reveal
from protocols.starfish import (check_thresholds, combine_targets, determine_thresholds, estimate_updates,
                                select_rounds, selection_keys)


def _shared(x: torch.Tensor):
    return crypten.cryptensor(x.double(), src=0)


def sub_protocols(party, inp: dict) -> dict:
    out: dict = {}
    with party.meter("TD"):
        out["thresholds"] = reveal(determine_thresholds(_shared(inp["deltas"]))).numpy()
    with party.meter("RS"):
        u, v = selection_keys(_shared(inp["g"]), inp["dm"], _shared(inp["norms"]))
        out["selected"] = {m: select_rounds(u, v, inp["k"], method=m) for m in ("ratio", "divide")}
    with party.meter("RS-multi"):
        both = combine_targets([_shared(inp["g"]), _shared(inp["g2"])], [0.25, 0.75])
        u2, v2 = selection_keys(both, inp["dm"], None)
        out["selected_multi"] = {m: select_rounds(u2, v2, inp["k"], method=m) for m in ("ratio", "divide")}
    with party.meter("UE"):
        est = estimate_updates(_shared(inp["stored"]), inp["s"], inp["S"], _shared(inp["Y"]))
        out["estimates"] = reveal(est).numpy()
    with party.meter("TC"):
        out["flags"] = check_thresholds(_shared(inp["est_for_tc"]), _shared(inp["thr_for_tc"])).numpy()
    return out


def big_model_estimate(party, m: int, seed: int) -> dict:
    """UE on an m-parameter model for 2 clients: an m x m matrix would not fit in memory."""
    gen = torch.Generator().manual_seed(seed)
    n, B = 2, 2
    S = torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 0.01
    Y = S * 0.5 + torch.randn(n, m, B, generator=gen, dtype=torch.float64) * 1e-4
    stored = torch.randn(n, m, generator=gen, dtype=torch.float64) * 0.01
    s = torch.randn(m, generator=gen, dtype=torch.float64) * 0.01
    est = estimate_updates(_shared(stored), s, S, _shared(Y))
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"est": reveal(est).numpy(), "peak_rss_gib": peak_kib / 2**20}


def estimates_of(party, cases: list[dict]) -> list:
    """UE (``estimate_updates``) on each case: stored rows and Y shared by party 0; opened."""
    return [reveal(estimate_updates(_shared(c["stored"]), c["v"], c["S"], _shared(c["Y"]))).numpy()
            for c in cases]


def curvature_of(party, cases: list[dict]) -> list:
    """The curvature test (``pair_buffers.curvature_ok``) of each case's secants (rows of Y,
    shared by party 0) against its public s; the opened accept bits."""
    from protocols.starfish.pair_buffers import curvature_ok

    return [curvature_ok(c["s"], [_shared(y) for y in c["Y"]]) for c in cases]
