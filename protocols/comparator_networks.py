"""Data-independent comparator networks on either backend, and the batched sign tests they use.

Why a module of its own: a network's shape (Batcher's odd-even merge sort, pruned to what a
median or a median partition needs) is combinatorics on n alone, and running it is one
comparison call and one exchange multiplication per layer, whatever rule uses it; the robust
aggregation rules (:mod:`protocols.robust_aggregation`) take medians of K values per
coordinate with it. Plaintext torch tensors run the same layers with ``>=``/``<``.
"""

from __future__ import annotations

import functools
import math
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from mpc.nonnegative import nonnegative
from mpc.table_compare import negative_bounded

from . import backend as B
from .backend import Tensor
from .compare import compare_exchange

__all__ = ["MAX_BATCH", "median_network", "partition_network", "batcher_layers", "run_network",
           "batched", "ge", "negative"]

#: elements per comparison call: larger calls are split, so a party's memory stays bounded
#: (about 150 bytes of masks, planes and triples per compared element) at 8 rounds per piece
MAX_BATCH = 1 << 22


# --------------------------------------------------------------------------------- networks
@lru_cache(maxsize=64)
def batcher_layers(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Batcher's odd-even merge sort of n entries, min to the lower index of each pair.

    Padded conceptually to a power of two with +inf sentinels after the n entries: a comparator
    (i, j), i < j, that reaches a sentinel has it at j (or at both ends) and never moves it, so
    those comparators are dropped.
    """
    size = 1 << max(1, math.ceil(math.log2(max(n, 2))))
    layers = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            layer = []
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        a, b = i + j, i + j + k
                        if b < n:
                            layer.append((a, b))
            if layer:
                layers.append(tuple(layer))
            k //= 2
        p *= 2
    return tuple(layers)


@lru_cache(maxsize=64)
def median_network(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Layers of comparators after which position (n-1)//2 holds the lower median.

    Batcher's sorting network with every comparator removed whose outputs cannot reach that
    position (a backward pass). Data-independent: the layers depend on n only.
    """
    need = {(n - 1) // 2}
    kept = []
    for layer in reversed(batcher_layers(n)):
        keep = tuple(c for c in layer if c[0] in need or c[1] in need)
        for i, j in keep:
            need.update((i, j))
        if keep:
            kept.append(keep)
    return tuple(reversed(kept))


#: up to this many wires, :func:`partition_network` drops every comparator whose removal leaves all
#: 2**n 0/1 inputs partitioned (0.2 s at n = 20 on one core; 4x per two more wires)
EXHAUSTIVE_WIRES = 20


def _partitions_every_zero_one_input(n: int, comparators: Sequence[tuple[int, int]],
                                     wires: list) -> bool:
    """Does the network leave every 0/1 input partitioned around m = (n-1)//2?

    ``wires[i]``: bit i of every input 0 .. 2**n - 1, packed (numpy uint8). For 0/1 values the
    partition property reads: no 1 below m where m holds a 0, no 0 above m where m holds a 1;
    it implies that m holds the median. A comparator network commutes with monotone maps, so
    this decides the property for every input (the 0-1 principle).
    """
    m = (n - 1) // 2
    w = list(wires)
    for a, b in comparators:
        w[a], w[b] = w[a] & w[b], w[a] | w[b]
    below = functools.reduce(np.bitwise_or, w[:m], np.zeros_like(w[0]))
    above_zero = functools.reduce(np.bitwise_or, [~x for x in w[m + 1:]], np.zeros_like(w[0]))
    return not bool((below & ~w[m]).any() or (above_zero & w[m]).any())


def _zero_one_wires(n: int) -> list:
    inputs = np.arange(1 << n, dtype=np.uint64)
    return [np.packbits(((inputs >> np.uint64(i)) & np.uint64(1)).astype(np.uint8), bitorder="little")
            for i in range(n)]


@lru_cache(maxsize=64)
def partition_network(n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Layers after which position m = (n-1)//2 holds the lower median, positions < m values
    <= it and positions > m values >= it.

    From Batcher's sorting network, repeatedly drop a comparator that is the last one on both of
    its wires when both lie below m or both above m: it only reorders values inside one group,
    and nothing after it looks at them. What is left keeps the groups (as multisets) and the
    median of the full sort. Up to :data:`EXHAUSTIVE_WIRES` wires, then every comparator whose
    removal keeps all 2**n 0/1 inputs partitioned is dropped too (from the last to the first,
    until none can go): 71 comparators for n = 20 where the structural pruning leaves 84. The
    layers stay Batcher's, so the depth does not grow.
    """
    m = (n - 1) // 2

    def group(i: int) -> int:
        return (i > m) - (i < m)

    layers = [list(layer) for layer in batcher_layers(n)]
    changed = True
    while changed:
        changed = False
        for li in range(len(layers) - 1, -1, -1):
            for c in list(layers[li]):
                i, j = c
                if group(i) != group(j) or group(i) == 0:
                    continue
                later = any(i in p or j in p for layer in layers[li + 1:] for p in layer)
                if not later:
                    layers[li].remove(c)
                    changed = True
    if 2 <= n <= EXHAUSTIVE_WIRES:
        wires = _zero_one_wires(n)
        flat = [(li, c) for li, layer in enumerate(layers) for c in layer]
        changed = True
        while changed:
            changed = False
            for k in range(len(flat) - 1, -1, -1):
                trial = flat[:k] + flat[k + 1:]
                if _partitions_every_zero_one_input(n, [c for _, c in trial], wires):
                    flat, changed = trial, True
        layers = [[c for li, c in flat if li == i] for i in range(len(layers))]
    return tuple(tuple(layer) for layer in layers if layer)


def run_network(layers, keys: list, payloads: Sequence[list] = (), bounded: bool = False
                 ) -> tuple[list, list]:
    """Apply comparator layers to rows: ``keys[i]`` are tensors of one shape, payload rows move
    with their keys. Per layer one comparison call and one exchange multiplication.
    ``bounded``: every difference of two keys lies in [-2**31, 2**31) as ring integers, so the
    32-bit sign test (:func:`negative`) decides the swaps; otherwise the 64-bit one.

    Shared components are relabelled to one fixed-point label (ring integers unchanged) so that
    the exchange, which stacks all components, does not rescale integers or bits: the exchange
    is exact integer arithmetic on the ring whatever the label says.
    """
    keys = list(keys)
    pays = [list(p) for p in payloads]
    bits = {}
    if any(B.is_shared(k) for k in keys):
        F = B.frac_bits()
        bits = {"k": B.bits_of(keys[0]), "p": [B.bits_of(p[0]) for p in pays]}
        keys = [B.relabel(k, F) for k in keys]
        pays = [[B.relabel(v, F) for v in p] for p in pays]
    for layer in layers:
        lo = [i for i, _ in layer]
        hi = [j for _, j in layer]
        a = B.stack([keys[i] for i in lo])
        b = B.stack([keys[j] for j in hi])
        swap = negative(b - a) if bounded else 1 - ge(b, a)   # the larger value moves up
        pa = [B.stack([p[i] for i in lo]) for p in pays]
        pb = [B.stack([p[j] for j in hi]) for p in pays]
        na, nb = compare_exchange(swap, [a] + pa, [b] + pb)
        for idx, (i, j) in enumerate(layer):
            keys[i], keys[j] = na[0][idx], nb[0][idx]
            for c, p in enumerate(pays):
                p[i], p[j] = na[c + 1][idx], nb[c + 1][idx]
    if bits:
        keys = [B.relabel(k, bits["k"]) for k in keys]
        pays = [[B.relabel(v, pb) for v in p] for p, pb in zip(pays, bits["p"])]
    return keys, pays


def batched(test, x: Any) -> Any:
    """``test`` (a shared-bit protocol) on ``x`` in calls of at most :data:`MAX_BATCH` elements."""
    n = math.prod(tuple(x.shape))
    if n <= MAX_BATCH:
        return test(x)
    shape = tuple(x.shape)
    flat = x.reshape(-1)
    parts = [test(flat[i:i + MAX_BATCH]) for i in range(0, n, MAX_BATCH)]
    return B.cat(parts).reshape(shape)


def ge(x: Tensor, y: Tensor) -> Tensor:
    """[x >= y] (:func:`protocols.compare.ge`'s sign test of x - y, in bounded batches)."""
    if not B.any_shared(x, y):
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        return (x >= y).to(B.float_dtype(x, y))
    diff = x - y if B.is_shared(x) else (-y) + x
    return batched(nonnegative, diff)


def negative(x: Tensor) -> Tensor:
    """[x < 0] for a value whose *ring integer* (its encoding) lies in [-2**31, 2**31): the
    32-bit table-driven sign test of :func:`mpc.table_compare.negative_bounded` (dealer mode;
    the 64-bit test otherwise), exact there. Callers keep to that domain by construction."""
    if not B.is_shared(x):
        x = torch.as_tensor(x)
        return (x < 0).to(B.float_dtype(x, x))
    return batched(negative_bounded, x)
