"""SecTC's per-row test in a 32-bit ring, with sign tests read from dealer-made tables.

The question, per row r of x (rows, m): does some |y_k| reach |d_r|, with y = x / 2**drop? Only
that one bit per row is opened (as by ``protocols.threshold.any_exceeds``, which squares and
compares in the 64-bit ring: about 91 bytes per coordinate; this costs about 24).

Why 32 bits: SecTC's values are small. With the bias 2**62 and the shares read unsigned,
floor(x' / 2**k) = (x0 >> k) + (x1 >> k) + carry - w 2**(64 - k); mod 2**32 the wrap term and the
bias's 2**(62 - k) vanish for k <= 30, so each party shifts its own share and keeps 32 bits: y is
the floor or one less (the carry is left out), with no communication. Domain: |y| and |d| below
2**30 encoded (2**14 at 16 fractional bits), so that y - |d| and -y - |d| are read correctly as
signed 32-bit values; outside it a wrap can hide a flag (``docs/protocols.md``, "Threshold check").

The sign test of u (32-bit, shared): the parties open c = u + r mod 2**32 for a dealer's random r
(4 bytes each way: c is uniform). Then u = c - r and msb(u) = c_31 XOR r_31 XOR [c' < r'] with
c', r' the low 31 bits. The dealer cuts r' into 4-bit chunks r_j and gives XOR shares of a table
per chunk, [v < r_j] for every v (``mpc.correlations.comparison_tables``); the public chunk c_j
picks the entry, and [c_j == r_j] = [c_j - 1 < r_j] XOR [c_j < r_j] is a second entry of the
same table, so the chunk comparisons cost nothing online. They are joined from the
lowest chunk up, lt = lt_j XOR (eq_j AND lt): 7 AND gates (7 rounds) per sign test. Then, per row,
"no coordinate exceeds" is the AND of the 2m bits [y - |d| < 0] and [-y - |d| < 0]: an AND tree
over words of 64 bits (about one gate per bit, log2 of the row's words + 6 rounds), and its one bit
is opened. |d| is taken once per row in the 64-bit ring (a sign test and a product: rows values).

Per coordinate, both directions: 2 x 8 bytes (two openings of c) + 2 x 7 x 4 bits (ripple) + about
2 x 4 bits (tree) = about 24 bytes online; offline 2 x 16 bytes of tables to server 1 (r's share
comes from the seeds) and the binary triples. What is opened: c (uniform), the AND gates' masked
inputs (one-time pads), and the per-row answer.

``negative_bounded(x)``: the same sign test as a general primitive, [x < 0] as an arithmetic 0/1
share (an MPCTensor at scale 1, like ``mpc.nonnegative.nonnegative``'s) for a shared x whose ring
value lies in [-2**31, 2**31) (at 16 fractional bits: -2**15 <= x < 2**15). Each party reduces
its 64-bit share mod 2**32 with no communication: (x0 + x1) mod 2**32 = x mod 2**32, and on that
domain x mod 2**32 read as a signed 32-bit value is x itself, so the bit is exactly the 64-bit
sign test's. Outside the domain the bit is the sign of x mod 2**32 read signed (wrong for some
x, never revealing: only c, a one-time-padded value, is opened). Then the XOR-shared bit becomes
an arithmetic one by ``mpc.nonnegative.plane_to_arith`` (a 1-bit edabit, 2 bits opened). Per
element, both directions: 8 bytes (c) + 7 AND gates (3.5 bytes) + 0.25 bytes (conversion) =
11.75 bytes and 9 rounds (below 64 elements the planes are squeezed to their used bits), against
75.25 bytes and 8 rounds for the 64-bit test. Dealer mode only (``supported()``); in two-party
mode it falls back to the 64-bit test, same bit on the domain.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed import ReduceOp

from mpc.correlations import TABLE_CHUNKS, words_as_tables
from mpc.crypten_compat import crypten
from mpc.nonnegative import and_gates, nonnegative, plane_to_arith

__all__ = ["supported", "rows_exceed", "rows_exceed_shares", "negative_bounded", "MAX_DROP", "BOUND"]

MAX_DROP = 30          # the local truncation into 32 bits is exact up to its carry for drop <= 30
_LOW31 = np.uint32(0x7FFFFFFF)
#: negative_bounded is exact for ring values in [-BOUND, BOUND)
BOUND = 1 << 31


def _context():
    comm = crypten.communicator.get()
    return comm, comm.get_rank(), crypten.mpc.get_default_provider()


def supported() -> bool:
    """Whether the session's provider makes comparison tables (dealer mode)."""
    return hasattr(crypten.mpc.get_default_provider(), "compare_tables")


def _to32(share: np.ndarray, drop: int, rank: int) -> np.ndarray:
    """This party's 32-bit share of floor(x / 2**drop) or one less (module docstring)."""
    u = np.ascontiguousarray(share, dtype=np.int64).view(np.uint64)
    if rank == 0 and drop:
        u = u + np.uint64(1 << 62)
    return (u >> np.uint64(drop)).astype(np.uint32)


def _open32(values: np.ndarray) -> np.ndarray:
    comm = crypten.communicator.get()
    mine = torch.from_numpy(values.view(np.int32))
    return comm.all_reduce(mine).numpy().view(np.uint32)      # int32 addition wraps: mod 2**32


def _negative_bits(u: np.ndarray, rank: int) -> torch.Tensor:
    """XOR share, one bit plane (words(n),), of [u < 0] for the 32-bit shared values ``u`` (n,)."""
    _, _, provider = _context()
    n = u.size
    r, tables = provider.compare_tables((n,))
    t = words_as_tables(tables.numpy())                          # (8, n): one row per chunk
    c = _open32(u + r.numpy().astype(np.uint32))

    def plane(bits: np.ndarray) -> torch.Tensor:
        # element i at bit i % 64 of word i // 64: the layout of ``mpc.bitplanes``
        packed = np.packbits(bits.view(np.uint8), bitorder="little")
        return torch.from_numpy(np.pad(packed, (0, -packed.size % 8)).view(np.int64))

    one = np.uint16(1)
    lt = None
    for j in range(TABLE_CHUNKS):
        cj = ((c >> np.uint32(4 * j)) & np.uint32(7 if j == TABLE_CHUNKS - 1 else 15)).astype(np.uint16)
        below = (t[j] >> cj) & one                                    # [c_j < r_j], XOR-shared
        less = plane(below.astype(np.bool_))
        if lt is None:
            lt = less
            continue
        # [c_j == r_j] = [c_j - 1 < r_j] XOR [c_j < r_j]; [-1 < r_j] = 1 is public: party 0's bit
        before = np.where(cj > 0, (t[j] >> (np.maximum(cj, one) - one)) & one,
                          one if rank == 0 else np.uint16(0))
        equal = plane((before ^ below).astype(np.bool_))
        lt = less ^ and_gates(equal, lt, min(n, 64))
    top = (t[TABLE_CHUNKS - 1] >> np.uint16(15)).astype(np.bool_)   # r_31's share
    if rank == 0:
        top ^= (c >> np.uint32(31)).astype(np.bool_)                 # the public c_31
    return lt ^ plane(top)                                       # msb(u) = c_31 ^ r_31 ^ [c' < r']


def negative_bounded(x):
    """Shared bit (MPCTensor, scale 1) of ``x < 0`` for a shared ``x`` whose ring value lies in
    [-2**31, 2**31) (module docstring); exact there, in dealer mode by a 32-bit table-driven sign
    test, otherwise by ``mpc.nonnegative.nonnegative``."""
    if not supported():
        return 1 - nonnegative(x)
    _, rank, _ = _context()
    share = x.share
    shape = share.shape
    n = share.numel()
    if n == 0:  # no material, no rounds (the dealer refuses empty requests)
        return crypten.mpc.MPCTensor.from_shares(torch.zeros(shape, dtype=torch.long), precision=0)
    # the low 32 bits of each 64-bit share: a 32-bit sharing of x mod 2**32, no communication
    u = share.reshape(-1).numpy().astype(np.uint32)
    bit = plane_to_arith(_negative_bits(u, rank), n, min(n, 64))
    return crypten.mpc.MPCTensor.from_shares(bit.reshape(shape), precision=0)


def _and_rows(bits: np.ndarray, rank: int) -> torch.Tensor:
    """XOR share (rows,) of the AND of each row of XOR-shared bits (rows, k), k >= 1."""
    rows, k = bits.shape
    pad = -k % 64
    if pad:   # AND-neutral padding: a shared 1 (party 0 holds 1, party 1 holds 0)
        bits = np.concatenate([bits, np.full((rows, pad), 1 if rank == 0 else 0, np.uint8)], axis=1)
    words = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int64).copy())
    while words.shape[1] > 1:
        half = words.shape[1] // 2
        prod = and_gates(words[:, :half].contiguous(), words[:, half : 2 * half].contiguous())
        words = torch.cat([prod, words[:, 2 * half :]], dim=1) if words.shape[1] % 2 else prod
    word = words[:, 0]
    for shift in (32, 16, 8, 4, 2, 1):
        low = (1 << shift) - 1
        word = and_gates(word & low, (word >> shift) & low, shift)
    return word & 1


def rows_exceed(x: np.ndarray, drop: int, d: np.ndarray, d_shared: bool = True) -> np.ndarray:
    """Public flags (rows,): does some |x[r, k] / 2**drop| reach |d[r]|?

    ``x``: this party's int64 ring shares (rows, m); ``d``: its shares of the thresholds (rows,)
    at the precision of the truncated x, or (``d_shared=False``) the public encoded thresholds.
    """
    comm, _, _ = _context()
    inside = _inside_rows(x, drop, d, d_shared)
    if inside is None:
        return np.zeros(x.shape[0], dtype=bool)
    opened = comm.all_reduce(inside, op=ReduceOp.BXOR)
    return opened.numpy() == 0


def rows_exceed_shares(x: np.ndarray, drop: int, d: np.ndarray, d_shared: bool = True) -> np.ndarray:
    """This party's ring shares (rows,), scale 1, of the bit :func:`rows_exceed` would open, left
    shared: what a coordinate shard's pair hands its coordinator, which adds the shards' bits and
    opens [sum >= 1] once (``protocols.starfish.on_shards``). One more round than
    :func:`rows_exceed` (the XOR-shared bits become ring shares, ``plane_to_arith``)."""
    _, rank, _ = _context()
    rows = x.shape[0]
    inside = _inside_rows(x, drop, d, d_shared)
    if inside is None:
        return np.zeros(rows, dtype=np.int64)
    outside = inside.numpy().astype(np.uint8) ^ np.uint8(1 if rank == 0 else 0)   # party 0 flips the XOR
    packed = np.packbits(outside, bitorder="little")
    plane = torch.from_numpy(np.pad(packed, (0, -packed.size % 8)).view(np.int64))
    return plane_to_arith(plane, rows, min(rows, 64)).numpy().astype(np.int64)


def _inside_rows(x: np.ndarray, drop: int, d: np.ndarray, d_shared: bool) -> torch.Tensor | None:
    """XOR shares (rows,) of "no |y| in the row reaches |d|" (module docstring); None where no
    row has a coordinate (nothing exceeds, nothing to compute)."""
    _, rank, _ = _context()
    rows, m = x.shape
    if not 0 <= drop <= MAX_DROP:
        raise ValueError(f"rows_exceed drops 0..{MAX_DROP} bits, got {drop}")
    if rows == 0 or m == 0:
        return None
    d = np.ascontiguousarray(d, dtype=np.int64)
    if d_shared:   # |d|: a sign test and one product of rows values
        dm = crypten.mpc.MPCTensor.from_shares(torch.from_numpy(d), precision=0)
        sign = nonnegative(dm) * 2 - 1
        big_d = (dm * sign).share.numpy().astype(np.uint32)
    else:
        big_d = (np.abs(d) if rank == 0 else np.zeros_like(d)).astype(np.uint32)
    y = _to32(x, drop, rank)
    col = big_d[:, None]
    u = np.concatenate([(y - col).reshape(-1), ((np.uint32(0) - y) - col).reshape(-1)])
    negative = _negative_bits(u, rank)                           # [y - D < 0], then [-y - D < 0]
    n = u.size
    flat = np.unpackbits(negative.numpy().view(np.uint8), count=n, bitorder="little")
    per_row = flat.reshape(2, rows, m).transpose(1, 0, 2).reshape(rows, 2 * m)
    return _and_rows(per_row, rank)                              # every |y| < D in the row
