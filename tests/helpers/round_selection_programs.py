"""Two-party programs for tests/protocols/starfish/test_round_selection_properties.py.

Module-level so that the party processes of ``tests.conftest.pair`` can import them. Keys are
plain numpy arrays shared by the named parties (u by party 0, v by party 1, as a client's
report and the servers' inner product would be held); results are opened in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols.backend import reveal
from protocols.starfish.round_selection import normalize_keys, select_rounds


def _shared(arr: np.ndarray, src: int):
    return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64)), src=src)


def normalized(party, u: np.ndarray, v: np.ndarray) -> dict:
    nu, nv = normalize_keys(_shared(u, 0), _shared(v, 1))
    return {"u": reveal(nu).numpy(), "v": reveal(nv).numpy()}


def selected(party, u: np.ndarray, v: np.ndarray, ks: list[int], methods: list[str],
             normalize: bool = True, t_delta: int | None = None) -> dict:
    """``select_rounds`` for every (k, method) on one sharing of the keys (normalised first)."""
    su, sv = _shared(u, 0), _shared(v, 1)
    if normalize:
        su, sv = normalize_keys(su, sv)
    return {(k, m): select_rounds(su, sv, k, method=m, t_delta=t_delta) for k in ks for m in methods}
