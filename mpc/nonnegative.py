"""Sign test of a shared ring element: [x >= 0] as a shared bit, by masked opening.

Replaces CrypTen's comparison (which converts the whole 64-bit share to binary with a
carry-lookahead adder on one element per int64 word: 432 bytes and 8 rounds per element)
with the masked-opening approach for a dealer setting:

1. the dealer supplies a random ring element r shared twice: additively (r) and bitwise in
   the bit-plane layout (``mpc.bitplanes``: 64 elements per word, so every AND gate sent
   is a useful one); the parties open c = x + r. c is uniform, so it reveals nothing;
2. x = c - r, hence msb(x) = c_63 XOR r_63 XOR [c' < r'] with c', r' the low 63 bits
   (a borrow out of bit 62 flips the top bit). [c' < r'] is a comparison of a *public* c'
   with a *shared* r': per bit, g_i = NOT c_i AND r_i ("r wins here") and
   p_i = NOT(c_i XOR r_i) ("equal here") are local (AND/XOR with public bits), and a
   log-depth prefix combines segments, (g, p) = (g_hi XOR p_hi AND g_lo, p_hi AND p_lo),
   in 6 AND rounds (118 AND gates per element, 1 bit each);
3. [x >= 0] = NOT msb(x); the plane bit is turned into an arithmetic bit with a random
   bit s shared both ways (an edabit of width 1): open e = b XOR s, then b = e + s - 2es.

Per element, both directions: 16 bytes (open c) + 118 x 4 bits (AND openings) + 2 bits
(B2A) = 75.25 bytes, 8 rounds (below 64 elements the plane words are squeezed to their
used bits, so small calls pay per element too); offline 8 bytes (r) + 14.75 bytes (AND triples) + 8 bytes
(s) to server 1. Exact for every ring element (no range assumption beyond the ring's sign
convention), like CrypTen's comparison. Reveals c (uniform), the AND openings (one-time
pads) and e (uniform), i.e. nothing; the result stays shared.

The provider must offer ``edabits`` (our dealer and the test-only TFP do). In two-party mode the
provider offers the whole operation instead (``nonnegative_share``, ``below_power_of_two_share``:
``mpc.two_party_provider``), and these functions hand the shares to it.

``below_power_of_two(x, k)`` reuses the same masked opening for a *window* test, [x < 2**k]
with x read as an unsigned ring element (``protocols.upload_range`` shifts a range
[lo, lo + 2**k) onto it): the borrow of the k low bits and one equality test of the top
64 - k bits, about as cheap as one sign test instead of the two a window costs with it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed import ReduceOp

from mpc import bitplanes
from mpc.crypten_compat import crypten

__all__ = ["nonnegative", "and_gates", "open_xor", "public_less_than_shared", "plane_to_arith",
           "and_reduce", "below_power_of_two"]

_ALL_ONES = -1  # int64 with every bit set


def _context():
    comm = crypten.communicator.get()
    return comm, comm.get_rank(), crypten.mpc.get_default_provider()


def open_xor(t: torch.Tensor, width: int) -> torch.Tensor:
    """Open an XOR sharing of int64 words of which only the low ``width`` bits matter.

    Below 64 the words are squeezed to their ``width`` low bits for the exchange (XOR acts
    bit by bit, so squeezing commutes with it); the other bits come back 0. Planes of fewer
    than 64 elements would otherwise send mostly padding.
    """
    comm = crypten.communicator.get()
    if width >= 64:
        return comm.all_reduce(t, op=ReduceOp.BXOR)
    k = t.numel()
    bits = np.unpackbits(t.reshape(-1).numpy().view(np.uint8), bitorder="little").reshape(k, 64)
    packed = np.packbits(bits[:, :width].reshape(-1), bitorder="little")
    packed = np.pad(packed, (0, -len(packed) % 8)).view(np.int64)
    opened = comm.all_reduce(torch.from_numpy(packed), op=ReduceOp.BXOR)
    flat = np.unpackbits(opened.numpy().view(np.uint8), bitorder="little")[: k * width].reshape(k, width)
    full = np.zeros((k, 64), dtype=np.uint8)
    full[:, :width] = flat
    return torch.from_numpy(np.packbits(full, axis=1, bitorder="little").reshape(-1).view(np.int64).copy()).reshape(t.shape)


def and_gates(x: torch.Tensor, y: torch.Tensor, width: int = 64) -> torch.Tensor:
    """This party's XOR share of ``x AND y`` (bitwise, same shapes); one round.

    ``x``, ``y`` are this party's XOR shares (int64 words; only the low ``width`` bits of
    each are used and sent). Beaver AND with a binary triple (a, b, a AND b) from the
    provider: open d = x ^ a, e = y ^ b.
    """
    _, rank, provider = _context()
    a, b, c = (t.share for t in provider.generate_binary_triple(x.size(), y.size()))
    opened = open_xor(torch.stack([x ^ a, y ^ b]), width)
    d, e = opened[0], opened[1]
    z = c ^ (d & b) ^ (e & a)
    if rank == 0:
        z ^= d & e
    return z


def public_less_than_shared(c_planes: torch.Tensor, r_planes: torch.Tensor, rank: int,
                            width: int, low_level: int | None = None):
    """XOR share (one plane) of [c < r] for public c and shared r given as (k, words) planes,
    plane 0 the least significant bit.

    With ``low_level = L`` also the share of [c mod 2**L' < r mod 2**L'] for L' = 2**L low
    bits, which the prefix circuit computes on the way (the lowest segment after L merges):
    returns ``(full, low)`` then, at no extra cost.
    """
    low = None
    not_c = ~c_planes
    g = not_c & r_planes                    # r_i = 1 and c_i = 0: r is larger from here
    p = r_planes ^ not_c if rank == 0 else r_planes.clone()   # bits equal
    # The lowest segment's p is never used (nothing below it), so it is not computed.
    level = 0
    while g.shape[0] > 1:
        if low_level == level:
            low = g[0].clone()
        k = g.shape[0]
        pairs = k // 2
        g_lo, g_hi = g[0 : 2 * pairs : 2], g[1 : 2 * pairs : 2]
        p_lo, p_hi = p[0 : 2 * pairs : 2], p[1 : 2 * pairs : 2]
        last = k == 2
        left = p_hi if last else torch.cat([p_hi, p_hi[1:]])
        right = g_lo if last else torch.cat([g_lo, p_lo[1:]])
        prod = and_gates(left, right, width)
        new_g = g_hi ^ prod[:pairs]
        new_p = None if last else torch.cat([torch.zeros_like(p_hi[:1]), prod[pairs:]])
        if k % 2:  # the top segment has no partner at this level: carried up unchanged
            new_g = torch.cat([new_g, g[k - 1 :]])
            new_p = torch.cat([new_p, p[k - 1 :]])
        g, p = new_g, new_p
        level += 1
    if low_level is None:
        return g[0]
    if low_level == level:
        low = g[0].clone()
    if low is None:
        raise ValueError(f"no segment of 2**{low_level} bits in a {c_planes.shape[0]}-bit comparison")
    return g[0], low


def plane_to_arith(plane: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """This party's ring share of the n bits XOR-shared in ``plane`` (one plane, (words,)).

    One round: open e = b XOR s for a random bit s shared both ways (a 1-bit edabit), then
    b = e + s - 2 e s, local since e is public. Opens e only (uniform).
    """
    _, rank, provider = _context()
    s, s_plane = provider.edabits((n,), 1)
    e = bitplanes.from_planes(open_xor(plane ^ s_plane[0], width).unsqueeze(0), n)
    bit = s * (1 - 2 * e)
    if rank == 0:
        bit += e
    return bit


def nonnegative(x):
    """Shared bit (CrypTen MPCTensor, scale 1) of ``x >= 0`` for a shared ``x``.

    ``x`` is read as a signed ring element (for a fixed-point value: its sign). Same
    semantics and result encoding as CrypTen's ``x >= 0``.
    """
    comm, rank, provider = _context()
    share = x.share
    shape = share.shape
    flat = share.reshape(-1)
    n = flat.numel()
    if n == 0:  # nothing to compare: no material, no rounds (the dealer refuses empty requests)
        return crypten.mpc.MPCTensor.from_shares(torch.zeros(shape, dtype=torch.long), precision=0)
    if hasattr(provider, "nonnegative_share"):   # two-party mode: the engine compares
        return crypten.mpc.MPCTensor.from_shares(provider.nonnegative_share(share), precision=0)
    r, r_planes = provider.edabits((n,), 64)
    c = comm.all_reduce(flat + r)
    c_planes = bitplanes.to_planes(c)
    width = min(n, 64)  # meaningful bits per plane word
    borrow = public_less_than_shared(c_planes[:63], r_planes[:63], rank, width)
    msb = borrow ^ r_planes[63]
    if rank == 0:
        msb ^= c_planes[63] ^ _ALL_ONES  # public top bit of c, and NOT (nonnegative = not msb)
    bit = plane_to_arith(msb, n, width)
    return crypten.mpc.MPCTensor.from_shares(bit.reshape(shape), precision=0)


def and_reduce(planes: torch.Tensor, width: int) -> torch.Tensor:
    """XOR share (one plane, (words,)) of the AND of the m XOR-shared planes ``(m, words)``.

    A balanced tree: ceil(log2 m) rounds, m - 1 AND gates per element (an odd plane waits a
    level). m = 1 returns the plane itself, without communication.
    """
    while planes.shape[0] > 1:
        k = planes.shape[0]
        pairs = k // 2
        prod = and_gates(planes[0 : 2 * pairs : 2], planes[1 : 2 * pairs : 2], width)
        planes = torch.cat([prod, planes[2 * pairs :]]) if k % 2 else prod
    return planes[0]


def below_power_of_two(x, k: int):
    """Shared bit (MPCTensor, scale 1) of ``x < 2**k`` for ``x`` read as *unsigned* (0..2**64-1).

    Exact for every ring element. Why it holds: with c = x + r opened (r a uniform 64-bit edabit)
    write c = c_hi 2**k + c_lo and r = r_hi 2**k + r_lo (hi parts of m = 64 - k bits). Then
    x = c - r mod 2**64 has top part x_hi = c_hi - r_hi - b mod 2**m with the borrow
    b = [c_lo < r_lo], and x < 2**k iff x_hi = 0 iff r_hi = T := c_hi - b mod 2**m. T's bits are
    those of the public c_hi, flipped where c_hi and c_hi - 1 differ if b = 1: b's XOR share
    times a public mask, local. So: the k-bit prefix comparison of the sign test for b
    (ceil(log2 k) rounds), m XNORs (local) and an AND tree over them (ceil(log2 m) rounds),
    one bit conversion. Per element about 2k + m AND gates (k = 27: 83, against 236 for the
    two sign tests of a window), 16 bytes for c, 8 bytes of edabit and the triples offline.
    Opens c (uniform), AND and conversion openings (one-time pads): nothing. 1 <= k <= 63.
    """
    if not 1 <= k <= 63:
        raise ValueError(f"below_power_of_two needs 1 <= k <= 63, got {k}")
    comm, rank, provider = _context()
    share = x.share
    shape = share.shape
    flat = share.reshape(-1)
    n = flat.numel()
    if n == 0:
        return crypten.mpc.MPCTensor.from_shares(torch.zeros(shape, dtype=torch.long), precision=0)
    if hasattr(provider, "below_power_of_two_share"):   # two-party mode: the engine compares
        return crypten.mpc.MPCTensor.from_shares(provider.below_power_of_two_share(share, k), precision=0)
    r, r_planes = provider.edabits((n,), 64)
    c = comm.all_reduce(flat + r)
    c_planes = bitplanes.to_planes(c)
    width = min(n, 64)
    borrow = public_less_than_shared(c_planes[:k], r_planes[:k], rank, width)
    top = c_planes[k:]
    # c - 2**k has the same low bits and top part c_hi - 1 mod 2**m (torch wraps like the ring)
    flips = top ^ bitplanes.to_planes(c - (1 << k))[k:]
    eq = r_planes[k:] ^ (borrow.unsqueeze(0) & flips)   # r_i XOR (b AND flip_i), XOR-shared
    if rank == 0:
        eq ^= top ^ _ALL_ONES   # XOR the public c_i and negate: eq_i = [r_i == T_i]
    bit = plane_to_arith(and_reduce(eq, width), n, width)
    return crypten.mpc.MPCTensor.from_shares(bit.reshape(shape), precision=0)
