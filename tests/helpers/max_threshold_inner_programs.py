"""Party programs for the property tests of ``max``, ``any_exceeds`` and ``inner``
(module-level: the party processes import them), and the same runner for the plaintext twin.

A case is ``{"op": "max" | "max_error" | "any_exceeds" | "inner", ...}`` with input specs as in
:mod:`tests.helpers.sort_programs` (``("pub", array)``, ``("sh", array, src)``) plus
``("float", value)`` for a python float argument. :func:`evaluate` runs the cases in both
parties and returns the opened results with each call's online cost; :func:`evaluate_plain`
runs them on plaintext tensors (shared inputs replaced by the values of their encodings).
"""

from __future__ import annotations

import torch

from mpc.crypten_compat import crypten
from protocols.inner_product import inner
from protocols.maximum import max as secure_max
from protocols.threshold import any_exceeds

from .sort_programs import _online_cost, make_plain, make_shared, opened


def _make(make, spec):
    if spec[0] == "float":
        return float(spec[1])
    return make(spec)


def run_case(case: dict, make, party=None) -> dict:
    op = case["op"]
    if op == "max_error":  # raises before any communication: both parties stay in step
        try:
            secure_max(_make(make, case["x"]), dim=case.get("dim", -1))
        except (ValueError, IndexError, RuntimeError) as exc:
            return {"error": type(exc).__name__}
        return {"error": None}
    if op == "max":
        fn = lambda: secure_max(_make(make, case["x"]), dim=case["dim"],  # noqa: E731
                                keepdim=case["keepdim"])
    elif op == "any_exceeds":
        fn = lambda: any_exceeds(_make(make, case["x"]), _make(make, case["d"]))  # noqa: E731
    elif op == "inner":
        fn = lambda: inner(_make(make, case["x"]), _make(make, case["y"]),  # noqa: E731
                           dim=case["dim"])
    else:
        raise ValueError(f"unknown op {op!r}")
    if party is None:
        return {"value": opened(fn()), "cost": None}
    step = f"{party.metering.open_steps()[-1]}/{op}"
    with party.meter(op):
        res = fn()
    cost = _online_cost(party, step)
    return {"value": opened(res), "cost": cost}


def evaluate(party, cases: list) -> list:
    out = []
    for i, case in enumerate(cases):
        with party.meter(f"case{i}"):
            out.append(run_case(case, make_shared, party))
    return out


def evaluate_plain(cases: list) -> list:
    return [run_case(case, make_plain) for case in cases]


def max_empty_batch(party, shape: tuple):
    x = crypten.cryptensor(torch.zeros(shape, dtype=torch.float64), src=0)
    return tuple(secure_max(x).shape)


def inner_empty_batch(party, shape: tuple):
    x = crypten.cryptensor(torch.zeros(shape, dtype=torch.float64), src=0)
    return tuple(inner(x, x).shape)


def inner_rows_ways(party, x, Y, k: int) -> dict:
    """``inner_rows`` of party 0's shared ``x`` (T, m) with the public rows of ``Y``: in one
    session, and with ``x``'s rows on ``k`` coordinate slices (``tests.helpers.shard_slices``:
    the workers' path, ``ShardVector.inner_raw``); each opened as its 2**-16 encodings. Also
    how many rows of Y the slices held at most at once, and what they hold after."""
    from protocols import backend as B
    from protocols.inner_product import inner_rows
    from protocols.starfish.on_shards import ShardSpace
    from tests.helpers.shard_slices import SliceShards

    def encodings(v) -> list[int]:
        assert B.bits_of(v) == 16
        return [int(a) for a in v.reveal().reshape(-1)]   # the ring values (a float32 decode rounds)

    xs = crypten.cryptensor(torch.as_tensor(x, dtype=torch.float64), src=0)
    Yt = torch.as_tensor(Y, dtype=torch.float64)
    out = {"whole": encodings(inner_rows(xs, lambda r: Yt[r]))}
    if k and len(x):
        slices = SliceShards(party, Yt.shape[-1], k)
        space = ShardSpace(slices, Yt.shape[-1])
        rows = B.stack([space.put(xs[r]) for r in range(len(x))])
        peak = [0]

        def row(r: int) -> torch.Tensor:
            public = sum(n.startswith("p") for n in slices.slots[0].shares)
            peak[0] = max(peak[0], public)
            return Yt[r].clone()     # a fresh tensor, as round selection's unit steps are

        out["sharded"] = encodings(inner_rows(rows, row))
        out["public_rows_held"] = peak[0]
        del rows
        space.close()
        out["held_after"] = slices.held()
    return out
