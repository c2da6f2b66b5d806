"""Party programs for the sort / top-k property tests (module-level: the party processes
import them), and the same case runner for the plaintext twin.

A *case* is a dict::

    {"op": "sort" | "top_k" | "top_k_all" | "top_k_error",
     "keys": spec | [spec, ...],          # a list means tuple keys (e.g. (u, v))
     "payloads": None | spec | [spec, ...],
     "descending": bool, "stable": bool, "comparator": "default" | "ge" | "ratio" | "custom",
     "k": int}                            # top_k / top_k_error

and a *spec* is ``("pub", array)`` (a public torch tensor, any dtype) or ``("sh", array, src)``
(``crypten.cryptensor(array, src=src)``, i.e. the encoding ``trunc(x * 2**16)`` of party
``src``'s float64 input). :func:`evaluate` runs cases in both parties; :func:`evaluate_plain`
runs them on plaintext tensors, with every ``"sh"`` input replaced by the float64 value of its
encoding (what the protocol actually holds), so the two must agree bit for bit.

Results mirror the call's structure; every tensor comes back as ``("sh", ring int64, bits)``
(opened) or ``("pub", array, dtype)``.
"""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.compare import ge
from protocols.sort import bitonic_sort, ge_comparator, ratio_comparator, top_k

from .fixed_point_strategies import SCALE, enc


def custom_ge(a: tuple, b: tuple):
    """Same order as ``ge_comparator`` but not one of the built-ins: the generic tie fallback."""
    return ge(a[0], b[0])


COMPARATORS = {"default": None, "ge": ge_comparator, "ratio": ratio_comparator,
               "custom": custom_ge}


def make_shared(spec):
    if spec[0] == "pub":
        return torch.from_numpy(np.array(spec[1], copy=True))
    return crypten.cryptensor(torch.from_numpy(np.array(spec[1], dtype=np.float64, copy=True)),
                              src=spec[2])


def make_plain(spec):
    if spec[0] == "pub":
        return torch.from_numpy(np.array(spec[1], copy=True))
    return torch.from_numpy(np.asarray(enc(spec[1]).astype(np.float64) / SCALE))


def _build(make, spec):
    if spec is None:
        return None
    if isinstance(spec, list):
        return [make(s) for s in spec]
    return make(spec)


def opened(x):
    if B.is_shared(x):
        return ("sh", x.reveal().numpy().copy(), B.bits_of(x))
    x = torch.as_tensor(x)
    return ("pub", x.numpy().copy(), str(x.dtype))


def _open_tree(x):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return [_open_tree(t) for t in x]
    return opened(x)


def _online_cost(party, step: str) -> dict:
    row = party.meters()["steps"][step]
    return {k: v for k, v in row.items() if k.startswith("online")}


def run_case(case: dict, make, party=None) -> dict:
    """One case on tensors built by ``make``; with ``party`` (2PC) each top_k call is metered."""
    keys = _build(make, case["keys"])
    if isinstance(keys, list):
        keys = tuple(keys)
    pay = _build(make, case.get("payloads"))
    if isinstance(pay, list):
        pay = tuple(pay)
    opts = dict(descending=case.get("descending", True), stable=case.get("stable", True),
                comparator=COMPARATORS[case.get("comparator", "default")])
    op = case["op"]
    if op == "sort":
        cost = None
        if party is not None:
            step = f"{party.metering.open_steps()[-1]}/sort"
            with party.meter("sort"):
                sk, sp = bitonic_sort(keys, pay, **opts)
            cost = _online_cost(party, step)
        else:
            sk, sp = bitonic_sort(keys, pay, **opts)
        return {"keys": _open_tree(sk), "payloads": _open_tree(sp), "cost": cost,
                "keys_tuple": isinstance(sk, tuple), "pay_tuple": isinstance(sp, tuple)}
    if op == "top_k_error":  # raises before any communication, so both parties stay in step
        try:
            top_k(keys, pay, case["k"], **opts)
        except ValueError as exc:
            return {"error": type(exc).__name__}
        return {"error": None}
    ks = [case["k"]] if op == "top_k" else list(range(case["n"] + 1))
    out = {}
    for k in ks:
        cost = None
        if party is not None:
            step = f"{party.metering.open_steps()[-1]}/k{k}"
            with party.meter(f"k{k}"):
                res = top_k(keys, pay, k, **opts)
            cost = _online_cost(party, step)
        else:
            res = top_k(keys, pay, k, **opts)
        out[k] = {"value": _open_tree(res), "tuple": isinstance(res, tuple), "cost": cost}
    return out


def comparison_rounds(party) -> int:
    """Online rounds of one secure comparison (``ge``) in this session."""
    step = f"{party.metering.open_steps()[-1]}/ge_probe"
    x = crypten.cryptensor(torch.tensor([1.0, -2.0], dtype=torch.float64), src=0)
    with party.meter("ge_probe"):
        ge(x, 0.0)
    return _online_cost(party, step)["online_rounds"]


def evaluate(party, cases: list) -> list:
    """Party program: every case in order; opened results (both parties return the same)."""
    out = []
    for i, case in enumerate(cases):
        with party.meter(f"case{i}"):
            out.append(run_case(case, make_shared, party))
    return out


def evaluate_plain(cases: list) -> list:
    """The plaintext twin of :func:`evaluate` (every shared input replaced by its encoding)."""
    return [run_case(case, make_plain) for case in cases]


def open_empty_batch(party, shape: tuple):
    """Share zeros of ``shape`` and open them (empty 2-D tensors used to crash the transport)."""
    x = crypten.cryptensor(torch.zeros(shape, dtype=torch.float64), src=0)
    return tuple(B.reveal(x).shape)


def top_k_empty_batch(party, shape: tuple, k: int):
    x = crypten.cryptensor(torch.zeros(shape, dtype=torch.float64), src=0)
    return tuple(top_k(x, None, k).shape)
