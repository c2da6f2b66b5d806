"""Party programs for tests/protocols/test_robust_aggregation.py (module-level: the party
processes import them). Each call runs many cases; inputs are float64 arrays on the 16-bit
grid, the updates contributed by party 0 and the thresholds by party 1 (as uploads would be).
Everything is opened here only to compare it with the plaintext twin.
"""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols import comparator_networks
from protocols.robust_aggregation import (brace_sign, check_thresholds, fedseca_checked, fedseca_elected_signs,
                                          fedseca_parts)


def _shared(a: np.ndarray, src: int):
    return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)), src=src)


def _open(x) -> np.ndarray:
    return B.reveal(x).numpy().copy()


def fedseca_cases(party, cases: list, max_batch: int | None = None) -> list:
    """``max_batch`` splits the comparison calls into pieces of that many elements."""
    if max_batch is not None:
        comparator_networks.MAX_BATCH = max_batch
    out = []
    for case in cases:
        g = _shared(case["g"], 0)
        lam = _shared(case["lam"], 1)
        parts = fedseca_parts(g, gamma=case["gamma"], thresholds=lam)
        res = {name: _open(val) for name, val in parts._asdict().items()}
        res["elected"] = _open(fedseca_elected_signs(g))
        res["brace"] = _open(brace_sign(g, lam=case["brace_lam"]))
        out.append(res)
    return out


def check_cases(party, cases: list) -> list:
    return [check_thresholds(_shared(c["g"], 0), _shared(c["lam"], 1), c["gamma"]).numpy()
            for c in cases]


def checked_cases(party, cases: list) -> list:
    """The servers' round (``fedseca_checked``): (accepted bits, opened aggregate or None)."""
    out = []
    for c in cases:
        ok, agg = fedseca_checked(_shared(c["g"], 0), _shared(c["lam"], 1), gamma=c["gamma"])
        out.append((ok.numpy(), None if agg is None else _open(agg)))
    return out


def missing_thresholds(party) -> str:
    try:
        fedseca_parts(_shared(np.ones((2, 3)), 0))
    except ValueError as exc:
        return str(exc)
    return "no error"


def fedseca_once(party, g: np.ndarray, lam: np.ndarray) -> None:
    """One aggregation, nothing opened (for round counts)."""
    fedseca_parts(_shared(g, 0), thresholds=_shared(lam, 1))


def quantile_cases(party, cases: list, step_bits: int | None = None) -> list:
    """``secure_quantile_thresholds`` on party 0's updates, opened for the comparison."""
    from protocols.secure_quantile import secure_quantile_thresholds
    return [_open(secure_quantile_thresholds(_shared(c["g"], 0), c["gamma"], step_bits=step_bits))
            for c in cases]


def replay_combine_rounds(party, rounds: list, rules: dict) -> list:
    """One ``RuleCombine`` over replayed rounds: each round's rows are shared by party 0, those
    marked ``wide`` at 32 fractional bits (as Stage II's estimates are). Returns the opened
    directions (the only values a replay opens)."""
    from protocols.starfish.robust_replay import RoundRule, RuleCombine
    combine = RuleCombine(lambda t: RoundRule(**rules[t]))
    out = []
    for rnd in rounds:
        rows = []
        for g, wide in zip(rnd["rows"], rnd["wide"]):
            x = _shared(g, 0)
            rows.append(B.lift(x, 32) if wide else x)
        w = [1.0 / len(rows)] * len(rows)
        out.append(combine(rows, w, list(range(len(rows))), rnd["t"]).numpy().copy())
    return out


def replay_combine_rounds_on_shards(party, rounds: list, rules: dict, k: int, block: int) -> list:
    """As :func:`replay_combine_rounds`, each round's rows put on ``k`` coordinate slices
    (``tests.helpers.shard_slices``) as a server's workers hold them, ``block`` values per
    batch; a round the shards cannot replay gives its error text. Returns the opened directions
    and what the slices still hold once the rows are released."""
    from protocols.starfish.on_shards import ShardSpace
    from protocols.starfish.robust_replay import RoundRule, RuleCombine
    from tests.helpers.shard_slices import SliceShards

    dim = len(rounds[0]["rows"][0])
    slices = SliceShards(party, dim, k)
    space = ShardSpace(slices, dim, block)
    combine = RuleCombine(lambda t: RoundRule(**rules[t]))
    out = []
    for rnd in rounds:
        rows = [space.put(B.lift(_shared(g, 0), 32) if wide else _shared(g, 0))
                for g, wide in zip(rnd["rows"], rnd["wide"])]
        try:
            out.append(combine(rows, [1.0 / len(rows)] * len(rows), list(range(len(rows))), rnd["t"]).numpy().copy())
        except ValueError as exc:
            out.append(str(exc))
        del rows
    space.close()
    return [out, slices.held()]


def checked_cases_on_shards(party, cases: list, ks: list) -> list:
    """``fedseca_checked`` with its coordinate-wise work on ``ks[i]`` coordinate slices
    (``protocols.fedseca_shards``; ``tests.helpers.shard_slices`` stands for the workers, the
    coordinators' steps run in the same session): (accepted bits, opened aggregate or None) per
    case, and what the slices still hold at the end."""
    from protocols.backend import share_of
    from protocols.fedseca_shards import fedseca_on_shards
    from tests.helpers.shard_slices import SliceShards

    out, held = [], 0
    for c, k in zip(cases, ks):
        g, lam = _shared(c["g"], 0), _shared(c["lam"], 1)
        K, D = c["g"].shape
        slices = SliceShards(party, D, min(k, D))
        names = [f"g{i}" for i in range(K)]
        for i, n in enumerate(names):
            slices.scatter(n, share_of(g[i])[0])
        lam_share, bits = share_of(lam)
        ok, agg = fedseca_on_shards(slices, party, names, lam_share, D, gamma=c["gamma"], precision=bits)
        out.append((ok.numpy(), agg))
        slices.drop(names)
        held += slices.held()
    return [out, held]
