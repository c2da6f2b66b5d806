"""Round selection (SecRS, Starfish Alg. 1): the rounds where the target mattered most.

The target's contribution to round i is the cosine similarity between its update g_i^t
and the global update, the aggregated update G_i = sum_j w_j g_i^j = (M_{i-1} - M_i) / eta:

    tau_i = u_i / v_i,  u_i = <g_i^t, M_{i-1} - M_i>,  v_i = ||g_i^t|| * ||M_{i-1} - M_i||.

(The paper writes M_i - M_{i-1}; with updates that are subtracted from the model, as here and
in the paper, that sign would rank the target's *least* aligned rounds first.)

The model difference is public, so u_i is a local inner product of shared and public
data, and v_i needs no secure square root because the client reported ||g_i^t|| itself.
The T' = ceil(sigma*T) rounds with the largest tau are found by a secure top-k, either

* Method 1 ("ratio"): compare pairs without dividing, (u_a, v_a) >= (u_b, v_b) iff
  u_a v_b >= u_b v_a (v > 0), i.e. ``protocols.sort.ratio_comparator``; or
* Method 2 ("divide"): tau_i = SecDiv(u_i, v_i) first, then ordinary comparisons.

Only the selected round indices are revealed, and they are processed in chronological
order. Method 1 costs two multiplications per comparison, Method 2 one division per
round; the cheaper one depends on T (switching threshold T_delta, docs/design.md 3).

Several targets: their FedAvg-weighted sum of updates g_i = sum_c w_c g_i^c stands for
the target set. Its norm is not among the clients' reports, so for that case the keys
are (u|u|, ||g||^2): x -> x|x| is increasing, so sorting by u|u|/||g||^2 equals sorting by
tau, and ||g||^2 = <g, g> needs no square root (the squared comparison of the paper's
Appendix C, with the sign kept by |u|).

Keeping the keys inside the primitives' domains (the caller's job, not the primitives'):

* the public step is normalised first, u_i = <g_i, dM_i / ||dM_i||> (local), so the keys do
  not carry the scale of the global step;
* then :func:`normalize_keys` divides both keys of a round by the same secret power of two
  2**t, t = floor(log2 v) + 1, found with one batched comparison of v against 2**-16..2**43:
  afterwards v is in [1/2, 1) and |u| <= 1, inside the domain of ``divide`` (|v| in
  [2**-16, 2**16)) and of the ratio comparator (|u1 v2| < 2**30 / n) whatever the norms were.
  The ratio u/v is unchanged (up to one unit of 2**-16 in u). Valid for 2**-16 <= v < 2**44
  (||g|| below 2**22 for several targets; a reported norm below 2**44 for one). A round with
  v < 2**-16 (the targets' update is numerically zero) gets the keys (0, 1), i.e. similarity 0,
  in 2PC and in the plaintext twin alike.

Partial participation (docs/unlearning.md): only the candidate rounds C (a remaining client took
part) are ranked, T' = ceil(sigma |C|); a round of C where no target took part has the public
similarity 0 (keys (0, 1) for Method 1, tau = 0 for Method 2, spliced in as public zeros, so ties
among such rounds break alike in 2PC and plaintext: the earlier round first); several targets combine only those present in the round, their
weights renormalised over them (the squared keys are kept whenever more than one target is
unlearned, so that all rounds are ranked on one scale).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from mpc.exact_truncation import truncate_exact
from protocols import backend as B
from protocols.compare import ge, select
from protocols.division import divide
from protocols.inner_product import inner, inner_rows
from protocols.sort import ratio_comparator, top_k

from protocols.backend import is_shared, stack, to_compute, weighted_sum
from .params import Method, StarfishParams
from .ports import History, candidate_rounds, present_clients, remaining_clients

__all__ = ["num_selected", "selection_keys", "keys_from_steps", "unit_rows", "normalize_keys", "select_rounds",
           "combine_targets", "starfish_select",
           "choose_method", "default_t_delta", "t_delta_from", "predicted_seconds",
           "T_DELTA_TABLE", "LINK_PROFILES", "DEFAULT_T_DELTA"]

# ---------------------------------------------------------------- the method switch (T_delta)
# Method 1 costs one more round per sorting layer and two multiplications per comparison;
# Method 2 one secure division per round. Which is cheaper depends on T and on the link.
# ``starfish bench rs-switch`` measures both under 2PC; with ``--write-default`` it stores
# rounds, bytes and compute seconds per T in T_DELTA_TABLE (package data). Each method's
# time on a link is predicted as
#     rounds x one-way latency + bytes per direction x 8 / bandwidth + compute seconds
# and T_delta is the smallest measured T from which Method 2 is predicted faster by more
# than SWITCH_MARGIN (10%): at about equal cost Method 1 is preferred, as in the paper,
# because secure division adds fixed-point error and 2% is within our timing noise.

T_DELTA_TABLE = Path(__file__).with_name("data") / "t_delta.json"
SWITCH_MARGIN = 0.10

#: The paper's link settings: round-trip 0.17 ms / 72 ms (one way is half), 1 Gbit/s / 100 Mbit/s.
LINK_PROFILES: dict[str, tuple[float, float]] = {
    "lan": (0.17e-3 / 2, 1e9),
    "wan": (72e-3 / 2, 100e6),
}


def predicted_seconds(row: dict, latency: float, bandwidth_bps: float) -> float:
    return row["rounds"] * latency + (row["online_bytes"] / 2) * 8 / bandwidth_bps + row["seconds"]


def t_delta_from(rows: list[dict], latency: float, bandwidth_bps: float) -> int | None:
    """Smallest measured T where Method 2 ("divide") beats Method 1 ("ratio") by the margin, else None."""
    by_t: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_t.setdefault(int(r["T"]), {})[r["method"]] = r
    for T in sorted(by_t):
        m = by_t[T]
        if "ratio" in m and "divide" in m and (
            predicted_seconds(m["divide"], latency, bandwidth_bps)
            < (1.0 - SWITCH_MARGIN) * predicted_seconds(m["ratio"], latency, bandwidth_bps)
        ):
            return T
    return None


def default_t_delta(profile: str = "lan", path: Path = T_DELTA_TABLE) -> int:
    """T_delta for ``method="auto"`` on ``profile``.

    If Method 1 won at every measured T, twice the largest measured T (no evidence that
    Method 2 ever wins). Without a measurement table, 64.
    """
    if not path.exists():
        return 64
    rows = json.loads(path.read_text())["rows"]
    found = t_delta_from(rows, *LINK_PROFILES[profile])
    if found is None:
        return 2 * max(int(r["T"]) for r in rows)
    return found


#: Switching threshold for ``method="auto"`` (LAN), overridable per run (StarfishParams.t_delta).
DEFAULT_T_DELTA = default_t_delta("lan")


# ---------------------------------------------------------------- keys and selection
def num_selected(num_rounds: int, sigma: float) -> int:
    """T' = ceil(sigma * T), at least 1 and at most T (``StarfishParams.num_selected``)."""
    return StarfishParams(sigma=sigma).num_selected(num_rounds)


def choose_method(num_rounds: int, method: Method = "auto",
                  t_delta: int | None = None) -> Literal["ratio", "divide"]:
    if t_delta is None:
        t_delta = DEFAULT_T_DELTA
    if method == "auto":
        return "ratio" if num_rounds < t_delta else "divide"
    if method not in ("ratio", "divide"):
        raise ValueError(f"unknown method {method!r}")
    return method


def combine_targets(updates: Sequence[Any], weights: Sequence[float]) -> Any:
    """sum_c w_c g^c for several targets (public weights, shared or plain updates), at F bits."""
    return B.rescale(weighted_sum(updates, weights))


def selection_keys(target_updates: Any, model_deltas: torch.Tensor,
                   target_norms: Any | None = None, *, unit_steps: bool = False) -> tuple[Any, Any]:
    """Keys (u, v) with u/v ordered like the cosine similarity, one pair per round.

    ``target_updates``: (T, m) shared or plain; ``model_deltas``: (T, m) public
    M_i - M_{i-1}; ``target_norms``: (T,) the reported ||g_i^t||, or None for a combined
    multi-target update (then the squared keys described in the module docstring). The
    public step enters as a unit vector (a round whose step is exactly zero keeps its zero
    vector: u is 0 there). Not yet normalised: see :func:`normalize_keys`. ``unit_steps``: the
    rows of ``model_deltas`` are those unit vectors already (:func:`unit_rows`).
    """
    if unit_steps:
        return keys_from_steps(target_updates, lambda k: model_deltas[k], target_norms)
    return keys_from_steps(target_updates, lambda k: _unit(model_deltas[k].to(torch.float64)), target_norms)


def keys_from_steps(target_updates: Any, unit_step: Callable[[int], torch.Tensor],
                    target_norms: Any | None = None) -> tuple[Any, Any]:
    """:func:`selection_keys` with round k's unit step given by ``unit_step(k)`` (read twice,
    ``inner_product.inner_rows``): the T x m public steps are never held at once."""
    u = inner_rows(target_updates, unit_step)
    if target_norms is not None:
        return u, target_norms
    sq = inner(target_updates, target_updates, dim=-1)
    if not is_shared(u):
        return u * u.abs(), sq
    square = u * u
    return select(ge(u, 0.0), square, -square), sq


def _unit(step: torch.Tensor) -> torch.Tensor:
    norm = step.norm()
    return step / norm if norm > 0 else step


#: v is compared with 2**j for these j; t = j + 1 for the j with 2**j <= v < 2**(j+1)
_KEY_EXPONENTS = torch.arange(-16, 44)
_KEY_SHIFT = 44  # u, v times 2**(44 - t) keep |ring value| <= 2**62 while |u| <= 4 v


def normalize_keys(u: Any, v: Any) -> tuple[Any, Any]:
    """(u, v) / 2**t with t = floor(log2 v) + 1, per round; (0, 1) where v < 2**-16.

    2PC: one batched comparison (T x 60 elements), one multiplication round, one exact
    truncation (:mod:`mpc.exact_truncation`) of 2T elements. Requires v < 2**44 and |u| <= v
    up to rounding (true for cosine keys by Cauchy-Schwarz). Opens nothing.
    """
    if not (is_shared(u) or is_shared(v)):
        u = torch.as_tensor(u, dtype=torch.float64)
        v = torch.as_tensor(v, dtype=torch.float64)
        inside = v >= 2.0 ** int(_KEY_EXPONENTS[0])
        # frexp's exponent is floor(log2 v) + 1 exactly (log2 rounds up just below a power of 2)
        t = torch.frexp(torch.where(inside, v, torch.ones_like(v))).exponent.to(torch.float64)
        scale = torch.pow(2.0, -t.clamp(max=float(_KEY_EXPONENTS[-1]) + 1))
        return (torch.where(inside, u * scale, torch.zeros_like(u)),
                torch.where(inside, v * scale, torch.ones_like(v)))
    u, v = B.to_shared_like(u), B.to_shared_like(v)
    bits = ge(v.unsqueeze(-1), torch.pow(2.0, _KEY_EXPONENTS.to(torch.float64)))
    onehot = bits - B.cat([bits[..., 1:], bits[..., :1] * 0], dim=-1)   # [2**j <= v < 2**(j+1)]
    weights = torch.pow(2, _KEY_SHIFT - (_KEY_EXPONENTS + 1)).to(torch.long)
    mult = (onehot * weights).sum(-1)                                   # 2**(44 - t), scale 1
    both = B.relabel(B.stack([u, v]), 0) * B.stack([mult, mult])
    scaled = B.relabel(truncate_exact(both, _KEY_SHIFT), B.frac_bits())
    below = -bits[..., 0] + 1                                           # 1 where v < 2**-16
    one = B.relabel(below * (1 << B.frac_bits()), B.frac_bits())        # 1.0 there, else 0
    return scaled[0], scaled[1] + one


def select_rounds(u: Any, v: Any, k: int, method: Method = "auto",
                  t_delta: int | None = None, rounds: Sequence[int] | None = None,
                  zero_rounds: Sequence[int] = ()) -> list[int]:
    """The k rounds with the largest u/v, revealed and returned in chronological order.

    ``rounds`` names the rounds of ``u``, ``v`` (default 1..len(u)). ``zero_rounds``: further
    rounds whose similarity is publicly 0 (no target took part in them); they are ranked with
    the others at key exactly 0 (public zeros spliced in after the division of Method 2, so that
    2PC and plaintext break their ties alike: the earlier round first). Method 1 sorts the pairs
    with the division-free comparator; Method 2 divides first. The method is chosen for the
    number of ranked rounds, len(u) + len(zero_rounds).
    """
    n_keyed = int(u.shape[0]) if u is not None else 0
    names = list(rounds) if rounds is not None else list(range(1, n_keyed + 1))
    if len(names) != n_keyed:
        raise ValueError("need one round name per key")
    zeros = list(zero_rounds)
    ranked = sorted(names + zeros)
    if len(set(ranked)) != len(ranked):
        raise ValueError("a round is named twice")
    T = len(ranked)
    if not 1 <= k <= T:
        raise ValueError(f"k must be in 1..{T}")
    ids = torch.as_tensor(ranked, dtype=torch.int64)
    ratio = choose_method(T, method, t_delta) == "ratio"
    keys: Any = None
    if n_keyed:
        keys = (u, v) if ratio else divide(u, v)
    if zeros:
        pos = {r: n for n, r in enumerate(names)}
        zero = torch.zeros((), dtype=torch.float64)
        one = torch.ones((), dtype=torch.float64)

        def spread(values: Any, fill: torch.Tensor) -> Any:
            return stack([values[pos[r]] if r in pos else fill for r in ranked])

        keys = (spread(u, zero), spread(v, one)) if ratio else spread(keys, zero)
    if ratio:
        chosen = top_k(keys, ids, k, descending=True, comparator=ratio_comparator)
    else:
        chosen = top_k(keys, ids, k, descending=True)
    chosen = torch.as_tensor(chosen).reshape(-1)
    return sorted(int(round(float(c))) for c in chosen)


def starfish_select(history: History, targets: Sequence[int], k: int, params: StarfishParams) -> list[int]:
    """SecRS on a history: the k rounds of C most aligned with the targets, chronological.

    C = the candidate rounds (a remaining client took part; ``ports.candidate_rounds``); other
    rounds are never selected. One target: keys from its update and its reported norm. Several:
    the FedAvg-weighted sum of the updates of the targets *present in the round* (weights
    renormalised over them) and the squared keys (module docstring). A round of C where no
    target took part has similarity exactly 0 (public keys). Participation is public.
    """
    targets = sorted(set(targets))
    rounds = candidate_rounds(history, remaining_clients(history, targets))
    present = {i: present_clients(history, i, targets) for i in rounds}
    keyed = [i for i in rounds if present[i]]
    zero = [i for i in rounds if not present[i]]
    u, v = _target_keys(history, targets, keyed, present) if keyed else (None, None)
    return select_rounds(u, v, k, params.method, params.t_delta, rounds=keyed, zero_rounds=zero)


def _target_keys(history: History, targets: Sequence[int], rounds: Sequence[int],
                 present: dict[int, list[int]]) -> tuple[Any, Any]:
    """Normalised keys of ``rounds`` (each with at least one target present)."""
    # The global update in the clients' convention: M_i = M_{i-1} - eta sum_j w_j g_i^j, so the
    # aggregated update is M_{i-1} - M_i (up to eta > 0). The paper writes M_i - M_{i-1} while
    # calling it "the aggregated gradients"; with that sign a target aligned with the round would
    # score -1 and the rounds where it mattered *least* would be selected.
    def unit_step(k: int) -> torch.Tensor:
        return _unit_step(history, rounds[k])

    if len(targets) == 1:
        t = targets[0]
        g = stack([to_compute(history.update(i, t)) for i in rounds])
        norms = stack([to_compute(history.norm(i, t)) for i in rounds])
        u, v = keys_from_steps(g, unit_step, norms)
    else:
        per_round = []
        for i in rounds:
            w = history.weights(i)
            here = present[i]
            wt = [w[t] for t in here]
            total = sum(wt)
            per_round.append(combine_targets([to_compute(history.update(i, t)) for t in here],
                                             [x / total for x in wt]))
        u, v = keys_from_steps(stack(per_round), unit_step, None)
    return normalize_keys(u, v)


def unit_rows(history: History, rounds: Sequence[int]) -> torch.Tensor:
    """The global steps M_{i-1} - M_i of ``rounds`` (at least one) as the rows of one (T, m)
    float64 matrix, each divided by its norm (a zero step stays zero): what round selection
    reads one row at a time (:func:`keys_from_steps`)."""
    return torch.stack([_unit_step(history, i) for i in rounds])


def _unit_step(history: History, i: int) -> torch.Tensor:
    """Round i's global step M_{i-1} - M_i, float64, divided by its norm (a zero step stays zero)."""
    return _unit(-history.model_delta(i).reshape(-1).to(torch.float64))
