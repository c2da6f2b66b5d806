"""Oblivious bitonic sort (SecSrt) and top-k selection with revealed payloads.

Network. We use the bitonic network in which every comparator puts the "first" element at the
lower index (each merge starts with a *flip* stage comparing ``i`` with its mirror in the
block, then half-cleaners). For ``n`` not a power of two we pad, conceptually, to
``N = 2**ceil(log2 n)`` with sentinels that sort after every real entry at positions
``n..N-1``. In this network a comparator ``(i, j)``, ``i < j``, with ``j >= n`` always meets a
sentinel at ``j`` that must stay there, so sentinels never move: their comparators are no-ops
and are simply omitted, and nothing is ever materialised or removed. The network's shape
depends only on ``n`` (public), never on data.

Rounds. ``log2(N) * (log2(N) + 1) / 2`` layers; per layer exactly one comparator call for all
pairs of the layer (and all leading batch dimensions), plus one Beaver multiplication round
that moves keys, tie ranks and all payloads together. With the default comparator a layer is
one CrypTen comparison (8 rounds) + one multiplication round; the ratio comparator adds one
multiplication round for the cross products. Comparisons per layer <= N/2, about
``N log2(N)^2 / 4`` in total.

Ties (``stable=True``, default). Equal keys are ordered by original position (stable), in
2PC and in the plaintext twin alike, so both return the same permutation. Each entry carries a
tie rank ``t`` (its original index, reversed for descending order); the 2PC comparator compares
``key_enc * n + t`` (for ratio keys ``u_a_enc*v_b_enc*n + t_a``), which is exact and costs no
extra round, and the plaintext twin compares ``(key, t)`` lexicographically. Range cost: keys
must satisfy ``|key| < 2**46 / n`` (ratio keys ``|u v| < 2**30 / n``). Custom comparators get
a generic fallback: one call on ``(a, b)`` and ``(b, a)`` batched together, a comparison of the
ranks, and two multiplications. With ``stable=False`` ties are left where the network leaves
them (still deterministic given identical comparison bits).

Leakage. ``bitonic_sort`` reveals nothing (outputs are fresh shares). ``top_k`` opens exactly
the payloads of the ``k`` selected entries, in rank order (best first), as in line 21 of the
paper's Algorithm 1; nothing about the other entries or the keys is opened.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Optional, Union

import torch

from . import backend as B
from .backend import Tensor
from .compare import compare_exchange, ge, ge_ratio, lex_ge, lex_ge_ratio

__all__ = [
    "bitonic_sort",
    "top_k",
    "ge_comparator",
    "ratio_comparator",
    "network",
    "num_layers",
]

Keys = Union[Tensor, tuple]
Comparator = Callable[[tuple, tuple], Tensor]


def ge_comparator(a: tuple, b: tuple) -> Tensor:
    """Default comparator on single keys: ``a[0] >= b[0]`` (SecGE)."""
    return ge(a[0], b[0])


def ratio_comparator(a: tuple, b: tuple) -> Tensor:
    """Comparator on ``(u, v)`` keys: ``u_a / v_a >= u_b / v_b`` (SecGE2), ``v > 0``."""
    return ge_ratio(a[0], a[1], b[0], b[1])


# Tie-broken versions of the built-in comparators; see the module docstring.
_LEX = {
    ge_comparator: lambda a, b, ta, tb, n: lex_ge(a[0], b[0], ta, tb, n),
    ratio_comparator: lambda a, b, ta, tb, n: lex_ge_ratio(a, b, ta, tb, n),
}


def _generic_lex(cmp: Comparator, a: tuple, b: tuple, ta: Tensor, tb: Tensor) -> Tensor:
    """``a`` before-or-equal ``b`` broken by rank for an arbitrary comparator."""
    p = a[0].shape[-1]
    both = cmp(tuple(B.cat([x, y], dim=-1) for x, y in zip(a, b)),
               tuple(B.cat([y, x], dim=-1) for x, y in zip(a, b)))
    c_ab = both[..., :p]
    c_ba = both[..., p:]
    tie = c_ab * c_ba
    rank_wins = ge(ta, tb)
    return c_ab - tie * (1 - rank_wins)


@lru_cache(maxsize=64)
def network(n: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Layers ``(I, J)`` of comparator index pairs (``I < J``) that sort ``n`` entries."""
    if n <= 1:
        return ()
    size_n = 1 << math.ceil(math.log2(n))
    layers = []

    def add(pairs: list) -> None:
        pairs = [(i, j) for i, j in pairs if j < n]
        if pairs:
            ii, jj = zip(*pairs)
            layers.append((torch.tensor(ii, dtype=torch.long), torch.tensor(jj, dtype=torch.long)))

    size = 2
    while size <= size_n:
        add([(start + off, start + size - 1 - off)
             for start in range(0, size_n, size) for off in range(size // 2)])
        stride = size // 4
        while stride >= 1:
            add([(i, i + stride) for i in range(size_n) if (i // stride) % 2 == 0])
            stride //= 2
        size *= 2
    return tuple(layers)


def num_layers(n: int) -> int:
    """Comparator rounds of :func:`bitonic_sort` on ``n`` entries (log2 N (log2 N + 1) / 2)."""
    return len(network(n))


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _scatter(c: Tensor, rest: torch.Tensor, inv: torch.Tensor, na: Tensor, nb: Tensor) -> Tensor:
    parts = [na, nb]
    if rest.numel():
        parts.append(c[..., rest])
    return B.cat(parts, dim=-1)[..., inv]


def bitonic_sort(keys: Keys, payloads: Any = None, descending: bool = False,
                 comparator: Optional[Comparator] = None, stable: bool = True
                 ) -> tuple[Keys, Any]:
    """SecSrt: sort along the last dimension; payloads follow their keys.

    ``keys``: tensor ``(..., n)`` or tuple of such tensors (e.g. ``(u, v)`` for
    :func:`ratio_comparator`); ``payloads``: None, a tensor or a tuple of tensors of the same
    shape. ``comparator(keys_a, keys_b)`` returns 0/1 "a >= b" elementwise on tuples of
    ``(..., p)`` tensors; default :func:`ge_comparator` on a single key (tuples need an explicit
    comparator). Returns ``(sorted_keys, sorted_payloads)`` in the input's structure; shared
    inputs give shared outputs (fresh shares; public payloads become shared when the keys are
    shared, and so do public components of tuple keys when another component is shared).
    Rounds: :func:`num_layers` comparator calls, see the module docstring.
    """
    key_t = _as_tuple(keys)
    pay_t = _as_tuple(payloads)
    if not key_t:
        raise ValueError("bitonic_sort needs at least one key tensor")
    if comparator is None:
        if isinstance(keys, (tuple, list)) and len(key_t) != 1:
            raise ValueError("tuple keys need an explicit comparator (e.g. ratio_comparator)")
        comparator = ge_comparator
    shape = tuple(key_t[0].shape)
    for t in key_t + pay_t:
        if tuple(t.shape) != shape:
            raise ValueError(f"keys and payloads must share one shape, got {tuple(t.shape)} "
                             f"and {shape}")
    n = shape[-1]
    if B.any_shared(*key_t):
        # A public component of shared keys (e.g. a public v of (u, v)) is shared once, up
        # front: every layer then compares the same (truncated) encoding -- the first layer's
        # local products used to encode it round-to-nearest and the later layers, after the
        # exchange had shared it, truncated, which left off-grid mixes unsorted -- and every key
        # component leaves shared, also when no layer runs (n <= 1). No communication.
        key_t = tuple(B.to_shared_like(k) for k in key_t)
    comps = list(key_t)
    nk = len(key_t)
    if stable:
        idx = torch.arange(n, dtype=torch.long)
        rank = (n - 1 - idx) if descending else idx
        rank = rank.expand(shape)
        if B.any_shared(*key_t):
            # Ring integer = rank: scale 2**F, value rank / 2**F (exact in float64).
            rank = B.share_public(rank.to(torch.float64) / B.scale())
        comps.append(rank)
    if B.any_shared(*key_t):
        # The order is secret, so every payload leaves shared (also when no layer runs).
        pay_t = tuple(B.to_shared_like(p) for p in pay_t)
    comps.extend(pay_t)
    lex = _LEX.get(comparator)

    for ii, jj in network(n):
        a = [c[..., ii] for c in comps]
        b = [c[..., jj] for c in comps]
        ka, kb = tuple(a[:nk]), tuple(b[:nk])
        if stable:
            if lex is not None:
                a_first = lex(ka, kb, a[nk], b[nk], n)
            else:
                a_first = _generic_lex(comparator, ka, kb, a[nk], b[nk])
            # Strict order: ascending swaps when a > b, descending when b > a.
            swap = (1 - a_first) if descending else a_first
        else:
            swap = (1 - comparator(ka, kb)) if descending else (1 - comparator(kb, ka))
        na, nb = compare_exchange(swap, a, b)
        touched = torch.cat([ii, jj])
        mask = torch.ones(n, dtype=torch.bool)
        mask[touched] = False
        rest = torch.nonzero(mask).flatten()
        inv = torch.argsort(torch.cat([touched, rest]))
        comps = [_scatter(c, rest, inv, x, y) for c, x, y in zip(comps, na, nb)]

    out_keys = tuple(comps[:nk])
    out_pay = tuple(comps[nk + (1 if stable else 0):])
    sorted_keys = out_keys if isinstance(keys, (tuple, list)) else out_keys[0]
    if payloads is None:
        return sorted_keys, None
    sorted_pay = out_pay if isinstance(payloads, (tuple, list)) else out_pay[0]
    return sorted_keys, sorted_pay


def top_k(keys: Keys, payloads: Any, k: int, descending: bool = True,
          comparator: Optional[Comparator] = None, stable: bool = True) -> Any:
    """Public payloads of the ``k`` best entries (largest first when ``descending``).

    Sorts obliviously with :func:`bitonic_sort` and opens only ``payloads[..., :k]`` of the
    sorted order, in one round. ``payloads=None`` means the original indices ``0..n-1``
    (returned as int64): the usual use, e.g. selecting round indices. Ties go to the earlier
    original index (``stable=True``). Reveals the k payloads and their rank order, nothing
    else. Returns a tensor ``(..., k)`` or a tuple of them mirroring ``payloads``: public
    payloads in their own dtype (on the fixed-point grid when the keys are shared, exactly as
    given when they are public), shared ones as float64.
    """
    key_t = _as_tuple(keys)
    shape = tuple(key_t[0].shape)
    n = shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if payloads is None:
        pay_in: Any = torch.arange(n, dtype=torch.long).expand(shape)
    else:
        pay_in = payloads
    pay_t = _as_tuple(pay_in)
    if k == 0:
        # nothing to open: no sort, no communication (an empty opening is not a message)
        empty = [torch.zeros(*p.shape[:-1], 0, dtype=torch.float64 if B.is_shared(p) else p.dtype)
                 for p in pay_t]
        return tuple(empty) if isinstance(pay_in, (tuple, list)) else empty[0]
    _, sorted_pay = bitonic_sort(keys, pay_in, descending=descending, comparator=comparator,
                                 stable=stable)
    sp = _as_tuple(sorted_pay)
    heads = [p[..., :k] for p in sp]
    # One opening for the shared heads; public ones (public keys) are known as they are: opening
    # them too would round them to the fixed-point grid (and int64 beyond 2**53 through float64).
    shared = [i for i, h in enumerate(heads) if B.is_shared(h)]
    if shared:
        opened = B.reveal(B.stack([heads[i] for i in shared]))
        for j, i in enumerate(shared):
            heads[i] = opened[j]
    out = []
    for i, (orig, h) in enumerate(zip(pay_t, heads)):
        if i in shared and not B.is_shared(orig):  # a public payload comes back in its dtype
            h = torch.as_tensor(h, dtype=torch.float64)
            h = h.to(orig.dtype) if orig.is_floating_point() else torch.round(h).to(orig.dtype)
        out.append(h)
    if isinstance(pay_in, (tuple, list)):
        return tuple(out)
    return out[0]
