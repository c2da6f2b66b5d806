"""Round selection (SecRS, Starfish Alg. 1): the rounds where the target mattered most.

The target's contribution to round i is the cosine similarity between its update g_i^t
and the global step M_i - M_{i-1}:

    tau_i = u_i / v_i,  u_i = <g_i^t, M_i - M_{i-1}>,  v_i = ||g_i^t|| * ||M_i - M_{i-1}||.

The model difference is public, so u_i is a local inner product of shared and public
data, and v_i needs no secure square root because the client reported ||g_i^t|| itself.
The T' = ceil(sigma*T) rounds with the largest tau are found by a secure top-k, either

* Method 1 ("ratio"): compare pairs without dividing, (u_a, v_a) >= (u_b, v_b) iff
  u_a v_b >= u_b v_a (v > 0), i.e. ``protocols.sort.ratio_comparator``; or
* Method 2 ("divide"): tau_i = SecDiv(u_i, v_i) first, then ordinary comparisons.

Only the selected round indices are revealed, and they are processed in chronological
order. Method 1 costs two multiplications per comparison, Method 2 one division per
round; the cheaper one depends on T (switching threshold T_delta, DESIGN.md 3).

Several targets: their FedAvg-weighted sum of updates g_i = sum_c w_c g_i^c stands for
the target set. Its norm is not among the clients' reports, so for that case the keys
are (u|u|, ||g||^2 ||dM||^2): x -> x|x| is increasing, so sorting by u|u|/(||g||^2 ||dM||^2)
equals sorting by tau, and ||g||^2 = <g, g> needs no square root (the squared comparison
of the paper's Appendix C, with the sign kept by |u|).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from .backend import is_secret, weighted_sum
from .switching import default_t_delta

__all__ = ["num_selected", "selection_keys", "select_rounds", "combine_targets",
           "choose_method", "DEFAULT_T_DELTA"]

Method = Literal["ratio", "divide", "auto"]

#: Switching threshold for ``method="auto"``: Method 1 (ratio) while T < DEFAULT_T_DELTA.
#: Derived from this project's measured costs on the LAN profile
#: (``starfish bench rs-switch --write-default``; see ``switching.py``), overridable everywhere.
DEFAULT_T_DELTA = default_t_delta("lan")


def num_selected(num_rounds: int, sigma: float) -> int:
    """T' = ceil(sigma * T), at least 1 and at most T."""
    if not 0.0 < sigma <= 1.0:
        raise ValueError("sigma must be in (0, 1]")
    # round() first so that e.g. 0.6 * 40 = 24.000000000000004 does not become 25
    return max(1, min(num_rounds, math.ceil(round(sigma * num_rounds, 9))))


def choose_method(num_rounds: int, method: Method = "auto",
                  t_delta: int = DEFAULT_T_DELTA) -> Literal["ratio", "divide"]:
    if method == "auto":
        return "ratio" if num_rounds < t_delta else "divide"
    if method not in ("ratio", "divide"):
        raise ValueError(f"unknown method {method!r}")
    return method


def combine_targets(updates: Sequence[Any], weights: Sequence[float]) -> Any:
    """sum_c w_c g^c for several targets (public weights, shared or plain updates)."""
    return weighted_sum(updates, weights)


def selection_keys(target_updates: Any, model_deltas: torch.Tensor,
                   target_norms: Any | None = None) -> tuple[Any, Any]:
    """Keys (u, v) with u/v ordered like the cosine similarity, one pair per round.

    ``target_updates``: (T, m) shared or plain; ``model_deltas``: (T, m) public
    M_i - M_{i-1}; ``target_norms``: (T,) the reported ||g_i^t||, or None for a combined
    multi-target update (then the squared keys described in the module docstring).
    A round whose global step is exactly zero gets ||dM|| := 1 (u is 0 there anyway),
    so v never vanishes because of public data.
    """
    from protocols.inner_product import inner  # noqa: PLC0415

    dm = model_deltas
    if not is_secret(target_updates):
        dm = dm.to(torch.as_tensor(target_updates).dtype)
    dnorm = dm.norm(dim=-1)
    dnorm = torch.where(dnorm > 0, dnorm, torch.ones_like(dnorm))
    u = inner(target_updates, dm, dim=-1)
    if target_norms is not None:
        return u, target_norms * dnorm
    sq = inner(target_updates, target_updates, dim=-1)
    return u * u.abs(), sq * (dnorm * dnorm)


def select_rounds(u: Any, v: Any, k: int, method: Method = "auto",
                  t_delta: int = DEFAULT_T_DELTA, rounds: Sequence[int] | None = None) -> list[int]:
    """The k rounds with the largest u/v, revealed and returned in chronological order.

    ``rounds`` names the rounds (default 1..T). Method 1 sorts the pairs with the
    division-free comparator; Method 2 divides first.
    """
    from protocols.sort import ratio_comparator, top_k  # noqa: PLC0415

    T = int(u.shape[0])
    if not 1 <= k <= T:
        raise ValueError(f"k must be in 1..{T}")
    ids = torch.as_tensor(list(rounds) if rounds is not None else range(1, T + 1),
                          dtype=torch.int64)
    if choose_method(T, method, t_delta) == "ratio":
        chosen = top_k((u, v), ids, k, descending=True, comparator=ratio_comparator)
    else:
        from protocols.division import divide  # noqa: PLC0415

        chosen = top_k(divide(u, v), ids, k, descending=True)
    chosen = torch.as_tensor(chosen).reshape(-1)
    return sorted(int(round(float(c))) for c in chosen)
