"""Two-party programs for tests/protocols/test_inverse_division_properties.py.

Module-level so that the party processes of ``tests.conftest.pair`` can import them. Each takes
plain numpy inputs, shares them from the named party, runs one secure primitive and returns the
opened result (float64 decode) together with the rounds the primitive itself cost.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols.backend import reveal
from protocols.division import divide, reciprocal
from protocols.inverse import inverse_masked, inverse_newton


def _shared(arr: np.ndarray, src: int = 0):
    return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64)), src=src)


def _open(x) -> np.ndarray:
    return reveal(x).numpy()


_calls = itertools.count()


@contextlib.contextmanager
def _metered(party, out: dict):
    """Meter the block as a fresh step; put its online rounds in ``out["rounds"]``."""
    name = f"primitive-{next(_calls)}"
    with party.meter(name):
        yield
    steps = party.meters()["steps"]
    (row,) = [v for key, v in steps.items() if key == name or key.endswith("/" + name)]
    out["rounds"] = int(row["online_rounds"])


def masked_inverse(party, a: np.ndarray, mask_scale: float, max_cond: float, retries: int,
                   refine: int = 0) -> dict:
    x = _shared(a, 0)
    out: dict = {}
    with _metered(party, out):
        inv = inverse_masked(x, mask_scale=mask_scale, max_cond=max_cond, retries=retries,
                             refine=refine)
    out["inv"] = _open(inv)
    return out


def newton_inverse(party, a: np.ndarray, scale: float | None, src: int = 1) -> dict:
    x = _shared(a, src)
    out: dict = {}
    with _metered(party, out):
        inv = inverse_newton(x, scale=scale)
    out["inv"] = _open(inv)
    return out


def reciprocal_program(party, x: np.ndarray, positive: bool, method: str,
                       max_abs: float | None = None) -> dict:
    s = _shared(x, 1)
    out: dict = {}
    with _metered(party, out):
        r = reciprocal(s, positive=positive, method=method, max_abs=max_abs)
    out["out"] = _open(r)
    return out


def divide_program(party, num: np.ndarray, den: np.ndarray, shared_num: bool, shared_den: bool,
                   positive: bool, method: str = "normalized", max_abs: float | None = None) -> dict:
    n = _shared(num, 0) if shared_num else torch.from_numpy(num)
    d = _shared(den, 1) if shared_den else torch.from_numpy(den)
    out: dict = {}
    with _metered(party, out):
        q = divide(n, d, positive=positive, method=method, max_abs=max_abs)
    out["out"] = _open(q)
    return out
