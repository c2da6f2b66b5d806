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
