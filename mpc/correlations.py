"""Correlated randomness (Beaver triples and friends) derived from two AES-CTR seeds.

The dealer (docs/design.md 4.3) and the parties run the same derivations. For request
number ``i``, party 0's shares are drawn from PRG(seed0, stream=i) and the freely
chosen part of party 1's shares from PRG(seed1, stream=i); only the dealer knows both
seeds, computes the correlated value (e.g. c = a*b) and sends party 1 the *correction*
share that makes the pair add up. Party 0 therefore never talks to the dealer after
receiving its seed, and party 1 receives one tensor per request (c1, r^2_1, ...).

An ``edabit`` request (size, bits) yields a random r < 2**bits (any ring element for 64)
shared twice: additively in the ring, and bit by bit (XOR) in the bit-plane layout of
``mpc.bitplanes``. Both parties' plane shares come from their seeds; r is what they XOR
to, so party 1 again receives only its arithmetic share.

A ``cmp_tables`` request yields a random r mod 2**32 (shares: the low 32 bits of each party's
seed-derived ring element) and, XOR-shared, less-than tables of its 4-bit chunks
(``comparison_tables``: 16 bytes an element; ``mpc.table_compare`` uses them); only party 1's
table share is sent.

A ``mask`` request is a uniform ring tensor a shared from the two seeds alone (the dealer sends
only a share of sum(a * a)); a ``mask_matvec`` request refers back to masks by their request
numbers and yields fresh b and shares of c = sum_k a_k * b_k, which is how one Beaver mask
serves many products (``mpc.reused_masks``). The dealer rebuilds a mask from the two seeds
when a product names it (keeping recently used ones in a bounded cache for the session), and
records the numbers and sizes of the masks a session asked for (``MaskRegistry``), so that a
product can name nothing else.

Each party's share is a uniform ring element given the other party's view, so neither
server learns the correlated secrets. Requests are plain tuples of ints and strings (no
pickled objects), so they can be sent to the dealer and recorded as a plan.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import numpy as np
import torch

from . import bitplanes
from common.prg import SEED_BYTES, Prg

# Ops for which a party may ask for a Beaver triple c = op(a, b); torch computes them
# on int64 with wrap-around, which is arithmetic mod 2^64.
TRIPLE_OPS = ("mul", "matmul", "conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d")
KINDS = ("triple", "square", "binary_triple", "wrap_rng", "b2a_rng", "edabit", "trunc_pair", "mask",
         "mask_matvec", "cmp_tables")
MAX_MASKS_PER_PRODUCT = 64
MASK_STREAM = 1 << 62   # request numbers of reusable masks and their products (a stream of their own)
MAX_ELEMENTS = 1 << 31  # per tensor in one request; a bound against absurd requests


class RequestError(ValueError):
    """A malformed or unsupported correlated-randomness request."""


def _size(x: Any) -> tuple[int, ...]:
    try:
        size = tuple(int(d) for d in x)
    except TypeError:
        size = (int(x),)
    if any(d < 0 for d in size) or int(np.prod(size, dtype=np.float64)) > MAX_ELEMENTS:
        raise RequestError(f"bad tensor size {size}")
    return size


def _plain(v: Any) -> Any:
    """Canonicalise op arguments to ints/floats/strings/tuples (hashable, msgpack-able)."""
    if isinstance(v, (list, tuple, torch.Size)):
        return tuple(_plain(x) for x in v)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    raise RequestError(f"unsupported argument type {type(v).__name__} in a triple request")


def make_request(kind: str, *args: Any, **kwargs: Any) -> tuple:
    """Canonical request tuple: (kind, sizes..., op, args, sorted kwargs)."""
    if kind == "triple":
        size0, size1, op, *extra = args
        return ("triple", _size(size0), _size(size1), str(op), _plain(tuple(extra)),
                tuple(sorted((str(k), _plain(v)) for k, v in kwargs.items())))
    if kind == "binary_triple":
        return ("binary_triple", _size(args[0]), _size(args[1]))
    if kind in ("square", "wrap_rng", "b2a_rng", "mask", "cmp_tables"):
        return (kind, _size(args[0]))
    if kind == "mask_matvec":
        try:
            masks = tuple(int(i) for i in args[0])
        except TypeError:
            raise RequestError("mask_matvec needs a sequence of mask request numbers") from None
        if not 1 <= len(masks) <= MAX_MASKS_PER_PRODUCT or any(i < 0 for i in masks):
            raise RequestError(f"mask_matvec names 1..{MAX_MASKS_PER_PRODUCT} masks, got {masks!r:.200}")
        return ("mask_matvec", masks, _size(args[1]))
    if kind == "edabit":
        bits = int(args[1])
        if not 1 <= bits <= 64:
            raise RequestError(f"edabit width must be 1..64, got {bits}")
        return ("edabit", _size(args[0]), bits)
    if kind == "trunc_pair":
        lo, hi = int(args[1]), int(args[2])
        if not 1 <= lo <= hi <= 62:
            raise RequestError(f"truncation pairs for 1 <= lo <= hi <= 62 bits, got {lo}..{hi}")
        return ("trunc_pair", _size(args[0]), lo, hi)
    raise RequestError(f"unknown request kind {kind!r}")


def validate(req: Any) -> tuple:
    """Rebuild a request received from the network, rejecting anything unexpected."""
    if not isinstance(req, (list, tuple)) or not req or req[0] not in KINDS:
        raise RequestError(f"malformed request {req!r:.200}")
    if req[0] == "triple":
        if len(req) != 6 or req[3] not in TRIPLE_OPS:
            raise RequestError(f"unsupported triple request {req!r:.200}")
        kwargs = {k: v for k, v in req[5]}
        return make_request("triple", req[1], req[2], req[3], *req[4], **kwargs)
    if req[0] == "binary_triple":
        return make_request("binary_triple", req[1], req[2])
    if req[0] == "edabit":
        if len(req) != 3 or not isinstance(req[2], int):
            raise RequestError(f"malformed edabit request {req!r:.200}")
        return make_request("edabit", req[1], req[2])
    if req[0] == "trunc_pair":
        if len(req) != 4 or not isinstance(req[2], int) or not isinstance(req[3], int):
            raise RequestError(f"malformed trunc_pair request {req!r:.200}")
        return make_request("trunc_pair", req[1], req[2], req[3])
    if req[0] == "mask_matvec":
        if len(req) != 3 or not isinstance(req[1], (list, tuple)):
            raise RequestError(f"malformed mask_matvec request {req!r:.200}")
        return make_request("mask_matvec", req[1], req[2])
    if len(req) != 2:
        raise RequestError(f"malformed {req[0]} request {req!r:.200}")
    return make_request(req[0], req[1])


class MaskRegistry:
    """The dealer's record of one session's masks: request number -> size.

    A ``mask_matvec`` may name only earlier ``mask`` requests of its own size; otherwise a
    server could have the dealer multiply by some other request's secret part (a triple's a).
    Bounded: the oldest masks are forgotten first (a replay keeps only its last B per client).
    """

    def __init__(self, limit: int = 1 << 16, cache_bytes: int = 1 << 28) -> None:
        self._sizes: dict[int, tuple[int, ...]] = {}
        self._limit = limit
        self._cache: dict[int, torch.Tensor] = {}      # recently used mask values, oldest first
        self._cache_bytes = cache_bytes

    def value(self, size: tuple[int, ...], seed0: bytes, seed1: bytes, index: int) -> torch.Tensor:
        """The mask of request ``index``, from the cache (bounded by ``cache_bytes``) or the seeds."""
        a = self._cache.pop(index, None)
        if a is None:
            a = mask_value(size, seed0, seed1, index)
        self._cache[index] = a
        while sum(t.numel() * 8 for t in self._cache.values()) > self._cache_bytes and len(self._cache) > 1:
            del self._cache[next(iter(self._cache))]
        return a

    def admit(self, req: tuple, index: int) -> None:
        if req[0] == "mask":
            self._sizes[index] = req[1]
            if len(self._sizes) > self._limit:
                del self._sizes[next(iter(self._sizes))]
        elif req[0] == "mask_matvec":
            for i in req[1]:
                if i >= index or self._sizes.get(i) != req[2]:
                    raise RequestError(f"request {index} names {i}, which is no earlier mask of size {req[2]}")


def _t(a: np.ndarray) -> torch.Tensor:
    # np.ascontiguousarray makes a 0-d array 1-d: the shares of x.sum() * y.sum() must stay 0-d
    return torch.from_numpy(np.ascontiguousarray(a).reshape(np.shape(a)))


def _op_result_shape(req: tuple) -> tuple[int, ...]:
    _, size0, size1, op, extra, kwargs = req
    # mul and matmul by hand: torch's meta tensors cost a second of warm-up on first use
    if op == "mul":
        return tuple(np.broadcast_shapes(size0, size1))
    if op == "matmul":
        return _matmul_shape(size0, size1)
    a = torch.empty(size0, dtype=torch.long, device="meta")
    b = torch.empty(size1, dtype=torch.long, device="meta")
    return tuple(getattr(torch, op)(a, b, *extra, **dict(kwargs)).shape)


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Result shape of torch.matmul(a, b) (1-D operands are promoted, then squeezed)."""
    if not a or not b:
        raise RequestError("matmul needs operands of at least one dimension")
    a2 = (1, a[0]) if len(a) == 1 else a
    b2 = (b[0], 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise RequestError(f"matmul shapes {a} and {b} do not match")
    out = tuple(np.broadcast_shapes(a2[:-2], b2[:-2])) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _apply(req: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _, _, _, op, extra, kwargs = req
    return getattr(torch, op)(a, b, *extra, **dict(kwargs))


def _wraps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """+1 where x + y overflowed upward, -1 where it overflowed downward (signed int64)."""
    s = x + y
    up = (x > 0) & (y > 0) & (s < 0)
    down = (x < 0) & (y < 0) & (s >= 0)
    return up.long() - down.long()


_DOMAIN = b"starfish/correlation/v2/"


def request_prg(seed: bytes, index: int, req: tuple) -> Prg:
    """The PRG of request number ``index`` for request ``req``: keyed by HMAC-SHA256(seed,
    index || req), so a number asked for again with another request (material fetched ahead
    from a plan that turned out wrong, ``mpc.dealer_provider``) draws unrelated randomness,
    and no share of a mask ever serves two different correlations. ``req`` is canonical
    (``make_request``/``validate``), so the two parties and the dealer key alike."""
    key = hmac.new(seed, _DOMAIN + int(index).to_bytes(8, "big") + repr(req).encode(), hashlib.sha256)
    return Prg(key.digest()[:SEED_BYTES], index)


def party0_shares(req: tuple, seed0: bytes, index: int) -> tuple[torch.Tensor, ...]:
    """Party 0's complete shares for request ``index`` (no dealer message needed)."""
    g = request_prg(seed0, index, req)
    kind = req[0]
    if kind == "triple":
        return _t(g.ring(req[1])), _t(g.ring(req[2])), _t(g.ring(_op_result_shape(req)))
    if kind == "square":
        return _t(g.ring(req[1])), _t(g.ring(req[1]))
    if kind == "binary_triple":
        c_shape = np.broadcast_shapes(req[1], req[2])
        return _t(g.ring(req[1])), _t(g.ring(req[2])), _t(g.ring(tuple(c_shape)))
    if kind == "wrap_rng":
        return _t(g.ring(req[1])), _t(g.ring(req[1]))
    if kind == "b2a_rng":
        return _t(g.ring(req[1])), _t(g.bits(req[1]))  # (arithmetic rA0, binary rB0)
    if kind == "edabit":
        return _t(g.ring(req[1])), _t(g.ring(_plane_shape(req)))  # (arithmetic r0, planes of r, share 0)
    if kind == "trunc_pair":  # shares of r, msb(r), and r >> d for d = lo..hi (stacked)
        return _t(g.ring(req[1])), _t(g.ring(req[1])), _t(g.ring((req[3] - req[2] + 1, *req[1])))
    if kind == "mask":         # share of a, and of sum(a * a) (for squared norms, ``mpc.reused_masks``)
        return _t(g.ring(req[1])), _t(g.ring((1,)))
    if kind == "mask_matvec":  # shares of b (one per mask) and of c = sum_k a_k b_k
        return _t(g.ring((len(req[1]),))), _t(g.ring(req[2]))
    if kind == "cmp_tables":   # share of r (low 32 bits count), XOR share of r's tables
        return _t(g.ring(req[1])), _t(g.ring((TABLE_WORDS, _count(req[1]))))
    raise RequestError(kind)


def party1_free_shares(req: tuple, seed1: bytes, index: int) -> tuple[torch.Tensor, ...]:
    """The part of party 1's shares it can derive alone (everything but the correction)."""
    g = request_prg(seed1, index, req)
    kind = req[0]
    if kind == "triple":
        return _t(g.ring(req[1])), _t(g.ring(req[2]))
    if kind == "square":
        return (_t(g.ring(req[1])),)
    if kind == "binary_triple":
        return _t(g.ring(req[1])), _t(g.ring(req[2]))
    if kind == "wrap_rng":
        return (_t(g.ring(req[1])),)
    if kind == "b2a_rng":
        return (_t(g.bits(req[1])),)  # binary rB1
    if kind == "edabit":
        return (_t(g.ring(_plane_shape(req))),)  # planes of r, share 1
    if kind == "trunc_pair":
        return (_t(g.ring(req[1])),)  # share 1 of r; r itself is whatever the shares add to
    if kind in ("mask", "cmp_tables"):
        return (_t(g.ring(req[1])),)
    if kind == "mask_matvec":
        return (_t(g.ring((len(req[1]),))),)
    raise RequestError(kind)


def correction(req: tuple, seed0: bytes, seed1: bytes, index: int,
               masks: "MaskRegistry | None" = None) -> torch.Tensor:
    """What the dealer sends party 1 for request ``index`` (``masks``: the session's registry,
    whose cache spares rebuilding a mask from the seeds for each product that names it)."""
    p0 = party0_shares(req, seed0, index)
    p1 = party1_free_shares(req, seed1, index)
    kind = req[0]
    if kind == "triple":
        a, b = p0[0] + p1[0], p0[1] + p1[1]
        return _apply(req, a, b) - p0[2]
    if kind == "square":
        r = p0[0] + p1[0]
        return r * r - p0[1]
    if kind == "binary_triple":
        return ((p0[0] ^ p1[0]) & (p0[1] ^ p1[1])) ^ p0[2]
    if kind == "wrap_rng":
        return _wraps(p0[0], p1[0]) - p0[1]
    if kind == "b2a_rng":
        return (p0[1] ^ p1[0]) - p0[0]
    if kind == "edabit":
        # r is whatever the two random plane shares XOR to; only its arithmetic share is sent
        n = int(np.prod(req[1], dtype=np.int64))
        r = bitplanes.from_planes(p0[1] ^ p1[0], n).reshape(req[1])
        return r - p0[0]
    if kind == "trunc_pair":
        r = p0[0] + p1[0]
        top = (r >> 63) & 1
        highs = torch.stack([(r >> d) & ((1 << (64 - d)) - 1)   # logical shifts of the unsigned r
                             for d in range(req[2], req[3] + 1)])
        return torch.cat([(top - p0[1]).unsqueeze(0), highs - p0[2]])
    if kind == "mask":
        a = p0[0] + p1[0]
        return (a * a).sum().reshape(1) - p0[1]
    if kind == "cmp_tables":
        r = (p0[0] + p1[0]).numpy().astype(np.uint32)   # mod 2**32: whatever the shares add to
        return _t(tables_as_words(comparison_tables(r))) ^ p0[1]
    if kind == "mask_matvec":
        b = p0[0] + p1[0]
        c = torch.zeros(req[2], dtype=torch.long)
        for k, i in enumerate(req[1]):
            a = masks.value(req[2], seed0, seed1, i) if masks is not None else mask_value(req[2], seed0, seed1, i)
            c += a * b[k]
        return c - p0[1]
    raise RequestError(kind)


def mask_value(size: tuple[int, ...], seed0: bytes, seed1: bytes, index: int) -> torch.Tensor:
    """The mask of ``mask`` request ``index``: the sum of the two parties' seed-derived shares."""
    req = make_request("mask", size)
    return _t(request_prg(seed0, index, req).ring(req[1])) + _t(request_prg(seed1, index, req).ring(req[1]))


def party1_shares(req: tuple, seed1: bytes, index: int, corr: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Party 1's complete shares, in the same order as ``party0_shares``."""
    free = party1_free_shares(req, seed1, index)
    kind = req[0]
    if kind in ("triple", "binary_triple"):
        return free[0], free[1], corr
    if kind in ("square", "wrap_rng", "mask_matvec", "cmp_tables", "mask"):
        return free[0], corr
    if kind in ("b2a_rng", "edabit"):
        return corr, free[0]
    if kind == "trunc_pair":
        return free[0], corr[0], corr[1:]
    raise RequestError(kind)


def _plane_shape(req: tuple) -> tuple[int, int]:
    """(bits, words) of an edabit request's bit planes (``mpc.bitplanes`` layout)."""
    return (req[2], bitplanes.words(int(np.prod(req[1], dtype=np.int64))))


def correction_shape(req: tuple) -> tuple[int, ...]:
    if req[0] == "triple":
        return _op_result_shape(req)
    if req[0] == "binary_triple":
        return tuple(np.broadcast_shapes(req[1], req[2]))
    if req[0] == "trunc_pair":
        return (req[3] - req[2] + 2, *req[1])
    if req[0] == "mask":
        return (1,)
    if req[0] == "mask_matvec":
        return req[2]
    if req[0] == "cmp_tables":
        return (TABLE_WORDS, _count(req[1]))
    return req[1]


def _count(size: tuple[int, ...]) -> int:
    return int(np.prod(size, dtype=np.int64))


TABLE_CHUNKS = 8      # 4-bit chunks of the 31 low bits of r (the top chunk has 3 bits)
TABLE_WORDS = 2       # int64 words per element that carry its 8 uint16 tables


def comparison_tables(r: np.ndarray) -> np.ndarray:
    """For the elements of ``r`` (uint32, n of them): ``TABLE_CHUNKS`` uint16 tables each, shape
    (8, n) (one contiguous row per chunk: the parties read a chunk's tables as one array).

    Table j describes chunk r_j = bits 4j..4j+3 of r (j = 7: bits 28..30): bit v (v < 16) is
    [v < r_j], so a party holding a public chunk c_j reads its share of [c_j < r_j] at bit c_j
    with no communication. [c_j == r_j] needs no table of its own: [v < r_j] is 1 up to r_j - 1
    and 0 from r_j on, so [c == r_j] = [c - 1 < r_j] XOR [c < r_j], with [-1 < r_j] = 1 (a
    public constant); XOR shares of it are two bits of the same table. Bit 15 of table 7
    (unused by a 3-bit chunk) carries bit 31 of r, which a sign test needs beside the comparison.
    """
    r = np.asarray(r, dtype=np.uint32).reshape(-1)
    out = np.empty((TABLE_CHUNKS, r.size), dtype=np.uint16)
    one = np.uint16(1)
    for j in range(TABLE_CHUNKS):
        chunk = ((r >> np.uint32(4 * j)) & np.uint32(7 if j == TABLE_CHUNKS - 1 else 15)).astype(np.uint16)
        np.left_shift(one, chunk, out=out[j])
        out[j] -= one
    out[TABLE_CHUNKS - 1] |= ((r >> np.uint32(31)) << np.uint32(15)).astype(np.uint16)
    return out


def tables_as_words(tables: np.ndarray) -> np.ndarray:
    """(8, n) uint16 tables as the (2, n) int64 tensor that travels (the same bytes)."""
    return tables.reshape(-1).view(np.int64).reshape(TABLE_WORDS, -1)


def words_as_tables(words: np.ndarray) -> np.ndarray:
    """Inverse of ``tables_as_words``."""
    return np.ascontiguousarray(words).reshape(-1).view(np.uint16).reshape(TABLE_CHUNKS, -1)
