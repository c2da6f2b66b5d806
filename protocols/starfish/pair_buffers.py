"""Per-client L-BFGS pair buffers shared by FedRecover and Starfish.

Each remaining client j has its own buffer of the last B pairs
(s = M_hat - M_{t-1}, y^j = gbar^j - g_t^j), refreshed whenever j sends an exact update.
s is public; y is shared in the secure servers.

Which pairs are kept (the L-BFGS safeguard; without it the estimate can be meaningless):

* a pair with s = 0 (the first replayed round when it is round 1) holds no curvature
  information and would make sigma = 0/0: skipped; whether s = 0 is public;
* a pair whose secant y is nearly orthogonal to s, or points against it (non-convex losses:
  an MLP's ReLUs), makes the compact L-BFGS matrix ill-conditioned: estimates 30 to 1000
  times the client's update were measured, which neither fixed point nor the plaintext
  follow. A pair is kept only if y^T s > 0 and (y^T s)^2 >= c^2 (y^T y)(s^T s), i.e.
  cos(y, s) >= c with c = ``MIN_COSINE`` (0.01). In 2PC this is one batched test per
  correction step; **the accept bit of each new pair is opened** (both servers learn whether
  client j's secant satisfied the condition: one bit about its exact update per correction),
  since the buffers' contents decide which values later steps multiply.

Warm-up lasts until every buffer holds B pairs (with partial participation: every buffer of
the clients present in the round being replayed), so a client whose pairs keep failing keeps
sending exact updates (correct, only less saving).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpc import reused_masks
from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.compare import ge
from protocols.inner_product import inner

from protocols.backend import is_shared, reveal, stack
from protocols.sharded import is_sharded

from .update_estimation import unit_scales

__all__ = ["PairBuffers", "MIN_COSINE", "curvature_ok", "curvature_sums", "curvature_decide"]

MIN_COSINE = 0.01


def curvature_sums(s: torch.Tensor, ys: Sequence[Any], masked: Sequence[Any] | None = None) -> tuple[float, Any, Any]:
    """s^T s (public), and per secant y in ``ys``: y^T s and y^T y (shared or plain, (k,)).

    Sums over coordinates: a coordinate shard's sums are its part of the whole (issue 30).
    2PC: y^T s (shared x public) and y^T y (shared x shared) as inner products; ``masked``
    (dealer mode): the ys with their Beaver masks opened (``mpc.reused_masks``), which give
    y^T y with no further opening."""
    ss = float((s.double() * s.double()).sum())
    if not any(is_shared(y) for y in ys):
        ys = [torch.as_tensor(y, dtype=torch.float64) for y in ys]
        return (ss, torch.stack([(y * s.double()).sum() for y in ys]),
                torch.stack([(y * y).sum() for y in ys]))
    Y = stack([B.to_shared_like(y) for y in ys])
    u = inner(Y, s.to(torch.float64), dim=-1)          # (k,) at F bits
    if masked is not None:   # sum (e + a)^2 from the opened masks, then one truncation
        raw = crypten.mpc.MPCTensor.from_shares(reused_masks.squared_norms(masked), precision=0)
        yy = B.rescale(B.relabel(raw, 2 * B.frac_bits()))
    else:
        yy = inner(Y, Y, dim=-1)                        # (k,) at F bits
    return ss, u, yy


def curvature_decide(ss: float, u: Any, yy: Any, min_cos: float = MIN_COSINE) -> list[bool]:
    """Per pair, whether y^T s > 0 and (y^T s)^2 >= min_cos^2 (y^T y)(s^T s), from the sums.

    2PC: the squared test on raw products (no truncation of the small values), two sign tests
    and their AND (one product of bits); opens only the accept bits.

    The test is decided for the pair scaled to unit length, (c s, c y) with c a public power of
    two near 1 / ||s|| (``update_estimation.unit_scales``): cos(y, s) does not change, but the
    squared test's ring values do: the test needs |y^T s| < 2**11 (below, the lifted ring stays
    under 2**62), which a robust rule's long pairs leave (BRACE on the MNIST shapes: s^T s up to
    1.5e5); scaled, y^T s is about cos ||y|| / ||s|| whatever the length."""
    c2 = float(unit_scales(torch.tensor(ss))) ** 2
    ss = ss * c2
    both = B.mul_public(B.stack([u, yy]), torch.tensor(c2, dtype=torch.float64))  # one truncation
    u, yy = both[0], both[1]
    c2ss = min_cos * min_cos * ss
    if not B.any_shared(u, yy):
        return [bool(a > 0 and a * a >= c2ss * b) for a, b in zip(u.tolist(), yy.tolist())]
    u2 = B.relabel(B.raw_mul(u, u), 2 * B.frac_bits())  # (y^T s)^2 at 2F bits
    e = min(int(B.public_exponent(torch.tensor(c2ss))), 24)  # keeps the lifted ring below 2**62 for |y^T s| < 2**11
    rhs = B.relabel(B.relabel(yy, 0) * int(round(c2ss * 2.0 ** e)), B.frac_bits() + e)
    top = max(B.bits_of(u2), B.bits_of(rhs))
    diff = B.lift(u2, top) - B.lift(rhs, top)
    bits = ge(B.stack([B.relabel(u, 0), B.relabel(diff, 0)]), 0.0)  # signs of the ring values
    both = bits[0] * bits[1]
    strictly = reveal(both)
    # u = 0 passes the sign test; the plaintext rule wants u > 0: a zero u with a passing square
    # test needs y^T y s^T s = 0, i.e. y = 0, which the twin rejects too (0 > 0 is false)
    return [bool(v > 0.5) for v in strictly]


def curvature_ok(s: torch.Tensor, ys: Sequence[Any], min_cos: float = MIN_COSINE,
                 masked: Sequence[Any] | None = None) -> list[bool]:
    """Per secant y in ``ys`` (shared or plain), whether y^T s > 0 and cos(y, s) >= min_cos:
    :func:`curvature_decide` on :func:`curvature_sums`."""
    if not ys:
        return []
    if is_sharded(ys[0]):     # on coordinate shards: sums per shard, the decision here
        return ys[0].curvature(s, list(ys), min_cos)
    return curvature_decide(*curvature_sums(s, ys, masked), min_cos)


class PairBuffers:
    def __init__(self, clients: Sequence[int], size: int, min_cos: float = MIN_COSINE) -> None:
        if size < 1:
            raise ValueError("buffer size B must be >= 1")
        self.size = size
        self.min_cos = min_cos
        self._s: dict[int, list[torch.Tensor]] = {j: [] for j in clients}
        self._y: dict[int, list[Any]] = {j: [] for j in clients}
        # beside each shared y: its Beaver mask once opened (dealer mode), None before a product needs it
        self._masks: dict[int, list[Any]] = {j: [] for j in clients}

    def push_many(self, clients: Sequence[int], s: torch.Tensor, ys: Sequence[Any]) -> list[bool]:
        """Offer one pair (s, y_j) per client; keep those that pass (module docstring)."""
        if float(s.norm()) == 0.0:
            return [False] * len(clients)
        ys = list(ys)
        # dealer mode: each new column's mask is opened here, once; it gives the curvature test's
        # y^T y and then serves every estimate's product while the column stays in the buffer
        masked = None
        if ys and all(is_shared(y) and not is_sharded(y) for y in ys) and reused_masks.supported():
            masked = reused_masks.open_masks([y.share for y in ys])
        accepted = curvature_ok(s, ys, self.min_cos, masked)
        for k, (j, y, ok) in enumerate(zip(clients, ys, accepted)):
            if ok:
                self._s[j].append(s)
                self._y[j].append(y)
                self._masks[j].append(masked[k] if masked is not None else None)
                if len(self._s[j]) > self.size:
                    self._s[j].pop(0)
                    self._y[j].pop(0)
                    self._masks[j].pop(0)
        return accepted

    def push(self, client: int, s: torch.Tensor, y: Any) -> bool:
        """One pair; False if it was skipped."""
        return self.push_many([client], s, [y])[0]

    def all_full(self, clients: Sequence[int] | None = None) -> bool:
        """Whether every buffer (or those of ``clients``) holds B pairs."""
        if clients is None:
            return all(len(v) >= self.size for v in self._s.values())
        return all(len(self._s[j]) >= self.size for j in clients)

    def masked_columns(self, clients: Sequence[int]) -> list[list[Any]] | None:
        """Per client of ``clients``, its y columns with their Beaver masks opened
        (``mpc.reused_masks``), oldest first; None where there is nothing to reuse (plaintext, or a
        provider without reusable masks). Columns are opened when they enter the buffer
        (``push_many``); one that has not been (pushed by other code) is opened here, one round for
        all, and then serves every product until it leaves the buffer."""
        ys = [y for j in clients for y in self._y[j]]
        if not any(is_shared(y) for y in ys) or any(is_sharded(y) for y in ys) or not reused_masks.supported():
            return None
        missing = [(j, k) for j in clients for k, m in enumerate(self._masks[j]) if m is None]
        opened = reused_masks.open_masks([self._y[j][k].share for j, k in missing])
        for (j, k), m in zip(missing, opened):
            self._masks[j][k] = m
        return [list(self._masks[j]) for j in clients]

    def stacked(self, clients: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """S (n, m, B) public and Y (n, m, B), oldest pair first. With Y on coordinate shards, S
        stays as its columns (``Y.public_columns``): the workers keep each public s once instead of
        the coordinator forming and sending n x m x B values for every estimate."""
        Y = stack([stack(self._y[j], dim=-1) for j in clients])
        if is_sharded(Y):
            return Y.public_columns([list(self._s[j]) for j in clients]), Y
        S = torch.stack([torch.stack(self._s[j], dim=-1) for j in clients])
        return S, Y
