"""SecMI: inverse of a secret-shared square matrix, two ways. Batched over ``(..., k, k)``.

``inverse_masked`` -- the paper's Algorithm 7 (mask, open, invert publicly, unmask)
-----------------------------------------------------------------------------------
1. ``[R]``: a random matrix that neither server knows. Each server draws its own matrix ``R_i``
   with entries uniform in ``[-mask_scale, mask_scale]`` from the OS CSPRNG (``os.urandom``) and
   contributes it as its additive share, so ``R = R_0 + R_1`` (no communication; the dealer is
   not involved in this first version). A real random matrix is invertible with probability 1.
2. ``N = open([A] @ [R])``: one Beaver matrix-multiplication round and one opening round. We
   open the *untruncated* ring product ``A_enc R_enc`` (scale ``2**-32``), so ``N`` is exact for
   the encoded ``A`` and ``R`` (the truncation noise it would otherwise carry hid nothing).
3. ``N^-1`` in float64 by both servers; ``[A^-1] = [R] @ N^-1``: a public right factor, kept
   at 36 significant bits per matrix as ring integers, then one batched wrap-free truncation
   (split into limbs when ``k * mask_scale`` is so large that the ring sum would reach
   ``2**62``, see ``_times_public_matrix``).

Rounds: 3 (multiplication + opening + the truncation of ``R N^-1``), ``~3 k^2`` ring elements each way per matrix
(the paper's ``6 m^2 l_q`` bits total), plus 2 per retry pass: a matrix whose ``N`` is
numerically singular (``cond(N) > max_cond``, default ``1e8``: an unlucky mask or a singular
``A``) is re-masked, up to ``retries`` times, which opens one more ``A R'`` for it. For
invertible ``A`` retries are rare (the mask alone has ``cond(R) > t`` with probability
about ``k / t``).

What it reveals (fixed-point reals, unlike the paper's field version). Over a finite field
with ``R`` uniform on GL_k(F_q), ``N = A R`` is independent of ``A``. Over the reals with a
*bounded* mask distribution it is not:

* scale: every entry of ``N`` is a combination of ``A``'s rows with weights of known
  distribution, so ``||N||`` reveals ``||A||`` up to a random factor of known law (e.g.
  ``E ||N||_F^2 = ||A||_F^2 * k * E[r^2]``); tiny and huge ``A`` are distinguishable;
* determinant and conditioning: ``|det N| = |det A| |det R|`` and the singular values of ``N``
  are those of ``A`` mixed by ``R``, so ``log|det A|`` leaks up to the spread of
  ``log|det R|``, and an ill-conditioned ``A`` gives a visibly ill-conditioned ``N``;
* structure: the column space of ``N`` equals that of ``A``; a singular ``A`` reveals its left
  null space exactly (``y^T A = 0  =>  y^T N = 0``);
* retries: which matrices needed a fresh mask is visible (a function of the opened ``N``), and
  each retry opens another ``A R'``, i.e. one more sample of the above.

What stays hidden: the individual entries of ``A`` beyond these norms/spectral summaries (each
row of ``N`` is the row of ``A`` rotated/scaled by the same unknown ``R``).
Use :func:`inverse_newton` when this is not acceptable.

Precision: exact ``N`` and a 36-bit ``N^-1`` leave the output's own grid as the error: a few
units of ``2**-16`` per entry of ``A^-1`` (measured: relative error ~3e-5 median, 1.2e-4 max
over 6250 random 4 x 4 matrices, against the inverse of the *encoded* ``A``; relative to the
real ``A`` add ``cond(A) * 2**-16``, the encoding error of the input). Range:
``|A| * mask_scale * k < 2**29`` (the opened ring product must not wrap). ``refine`` Newton
steps (2 rounds each, nothing revealed) are available but rarely needed.

``inverse_newton`` -- Newton-Schulz iteration, reveals nothing
---------------------------------------------------------------
``X <- X (2I - A X)`` converges from ``X_0 = alpha A^T`` iff ``0 < alpha < 2 / sigma_max(A)^2``,
with initial residual ``1 - alpha sigma_min^2``. At 16 fractional bits ``alpha A^T`` cannot hold
the small singular directions of an ill-conditioned ``A`` (for ``diag(100, 0.1)``,
``alpha * 0.1 = 6e-6`` is below the grid, so that direction of the inverse never appears), and
CrypTen's local truncation fails with probability ``|ring value| / 2**63`` per element, which
many iterations on wide values make likely. So the iteration runs on a normalised matrix at
higher precision, with exact truncations (:mod:`mpc.exact_truncation`):

1. ``f = ||A||_F^2`` (one square round; exact ring value), the bits ``[f >= 2**j]`` for
   ``j = -16..15`` (one batched comparison) and from them, as exact integer combinations of
   one-hot bits, ``e = ceil((j + 1) / 2)`` for the ``j`` with ``2**j <= f < 2**(j+1)``;
2. ``A' = 2**-e A`` (so ``||A'||_F^2 < 1``) and ``X_0 = A'^T``, both held at 24 fractional
   bits: the ring integers of ``A`` times the shared power of two ``2**(8 - e)`` (one
   multiplication round; ``A'`` keeps every bit of ``A``, and X_0's smallest singular
   direction, ``>= 1 / (2 sqrt(k) cond)``, has thousands of units);
3. each iteration: ``E = 2I - A'X`` (ring product at 48 bits, exactly rounded to 16) and
   ``X <- X E`` (40 bits, exactly rounded to 24; a floor would leave a one-sided residual of
   up to one unit of ``2**-16`` per entry of ``I - A'X``): every ring value stays below ``2**62``
   because ``A'X`` has eigenvalues in ``(0, 1]`` and ``|X| <= 1/sigma_min(A') <= 2 sqrt(k) cond``;
   all truncations are by powers of two, where the exact truncation needs one comparison circuit;
4. ``A^-1 = 2**-e X``: ``X`` times the same ``2**(8 - e)``, exactly truncated by 16 bits.

With ``X_0 = A'^T`` the initial residual is at most ``1 - 1/(4 k cond^2)``; ``iters`` iterations
reach ``2**-20`` when ``2**iters >= 56 k cond^2``: default ``ceil(log2(56 k)) + 20`` covers
``cond(A) <= 1000``. Domain: ``2**-16 <= ||A||_F^2 < 2**16``, ``cond(A) <= 1000``, ``k <= 16``
(``|X| < 2**15``). Outside it the result is wrong (``||A||_F^2 < 2**-16`` gives 0); the secure
run cannot tell without revealing, so callers must stay inside it. With ``scale`` (a public
bound on ``sigma_max(A)^2`` in ``[2**-16, 2**16]``) ``e`` is public and step 1 is skipped.
Rounds: 1 + 8 + 1 (setup; 0 with ``scale``), 18 per iteration (two matrix products, two exact
truncations), 9 at the end: 523 for 4 x 4. Nothing is opened but the one-time pads of the
sub-protocols.

Plaintext twins: ``inverse_masked`` returns ``torch.linalg.inv`` (float64); ``inverse_newton``
runs the same iteration (same alpha rule, same ``iters``) in float64.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

from mpc.crypten_compat import crypten

from mpc.exact_truncation import truncate_exact

from . import backend as B
from .backend import Tensor
from .compare import ge

__all__ = ["inverse_masked", "inverse_newton", "default_newton_iters"]

_ALPHA_EXPONENTS = torch.arange(-16, 16, dtype=torch.float64)  # j in f >= 2**j tests


def _csprng_uniform(shape: tuple, bound: float) -> torch.Tensor:
    """Uniform in [-bound, bound) from os.urandom (53 random bits per entry)."""
    numel = math.prod(shape)
    raw = torch.frombuffer(bytearray(os.urandom(8 * numel)), dtype=torch.int64).clone()
    u = (raw >> 11).to(torch.float64) * (2.0 ** -53)
    return ((2.0 * u - 1.0) * bound).reshape(shape)


def _shared_random_matrix(shape: tuple, bound: float) -> Tensor:
    """``[R]`` with ``R = R_0 + R_1``; party i knows only ``R_i`` (its own CSPRNG draw)."""
    rank = crypten.comm.get().get_rank()
    own = _csprng_uniform(shape, bound)
    zeros = torch.zeros(shape, dtype=torch.float64)
    r0 = crypten.cryptensor(own if rank == 0 else zeros, src=0)
    r1 = crypten.cryptensor(own if rank == 1 else zeros, src=1)
    return r0 + r1


def _times_public_matrix(x: Tensor, p: torch.Tensor, x_bound: float, bits: int = 36) -> Tensor:
    """``[x] @ P`` for public float64 ``P`` (..., k, k) with ``bits`` significant bits of each
    matrix ``P``, given a public bound ``|x| <= x_bound``; one truncation round.

    CrypTen would encode ``P`` on the fixed ``2**-16`` grid, losing small inverses. Each matrix
    is encoded as integers at a per-matrix exponent (``bits`` significant bits of its largest
    entry), multiplied exactly in the ring and truncated once by that exponent (a wrap-free
    truncation with per-element exponents). The truncation needs ``|ring| < 2**62``; the ring
    sum is at most ``k x_bound 2**F 2**bits``, which for a large ``x_bound`` (mask scale) or
    ``k`` exceeds that: then the integers are split into ``L`` limbs of at most ``room`` bits
    each (``k x_bound 2**F 2**room <= 2**61``), every limb product is truncated by its own
    exponent in the same batched truncation (still one round) and the limbs are summed, which
    costs one unit of ``2**-F`` per limb instead of one in all. A matrix whose entries are so
    large that an exponent is negative is lifted by that power of two instead (exact, local).
    """
    k = p.shape[-1]
    room = 61 - math.ceil(math.log2(k * x_bound * B.scale()))
    if room < 1:
        raise ValueError(f"|x| <= {x_bound} with k = {k} leaves no room in the ring")
    limbs = math.ceil(bits / room)
    width = math.ceil(bits / limbs)
    peak = p.abs().amax(dim=(-1, -2), keepdim=True)
    top = torch.ceil(torch.log2(torch.where(peak > 0, peak, torch.ones_like(peak)))).to(torch.long)
    ring = B.relabel(x, 0)
    residual = p
    terms, shifts = [], []
    for i in range(limbs):
        ei = ((i + 1) * width - top).clamp(max=60)            # |limb i| <= 2**width
        part = torch.round(residual * torch.pow(2.0, ei.to(torch.float64)))
        residual = residual - part * torch.pow(2.0, -ei.to(torch.float64))
        # scale-1 view: CrypTen multiplies the ring integers by the integer limb as they are
        term = ring.matmul(part.to(torch.long))
        lift = torch.pow(2, (-ei).clamp(min=0))
        if bool((lift > 1).any()):
            term = term * lift.expand(tuple(term.shape)).contiguous()
        terms.append(term)
        shifts.append(ei.clamp(min=0).expand(tuple(term.shape)))
    stacked = B.relabel(B.stack(terms), B.frac_bits())
    cut = stacked.div(torch.pow(2, torch.stack(shifts)).contiguous())
    return B.relabel(cut.sum(0), B.frac_bits())


def _open_product(a: Tensor, r: Tensor) -> torch.Tensor:
    """Open ``N = A R`` exactly: the untruncated ring product ``A_enc R_enc`` (scale 2**-32).

    Opening the product before truncation costs nothing extra and removes the truncation
    noise (which hid nothing: ``N`` is opened anyway), so ``N`` is exact for the encoded A, R.
    """
    raw = B.raw_matmul(a, r)
    return raw.reveal().to(torch.float64) / float(B.scale()) ** 2


def inverse_masked(a: Tensor, mask_scale: float = 1.0, refine: int = 0,
                   max_cond: float = 1e8, retries: int = 3) -> Tensor:
    """SecMI by masking (Algorithm 7); see the module docstring for what ``N = A R`` reveals.

    ``refine`` Newton-Schulz steps (2 multiplication rounds each, reveal nothing) square the
    relative error each; rarely needed since ``N`` is opened exactly.
    Matrices whose opened ``N`` is numerically singular (``cond(N) > max_cond``: an unlucky
    mask, or a singular ``A``) get a fresh mask, up to ``retries`` times (2 rounds per retry
    pass, batched); each retry opens one more masked product of that matrix, and which
    matrices were retried is visible to both servers (it is a function of the opened ``N``).
    """
    if not B.is_shared(a):
        a = torch.as_tensor(a)
        return torch.linalg.inv(a.to(torch.float64)).to(B.float_dtype(a))
    shape = tuple(a.shape)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"inverse needs square matrices (..., k, k), got {shape}")
    k = shape[-1]
    flat = a.reshape(-1, k, k)
    r = _shared_random_matrix(tuple(flat.shape), mask_scale)
    n_pub = _open_product(flat, r)
    for _ in range(retries):
        bad = torch.nonzero(torch.linalg.cond(n_pub) > max_cond).flatten()
        if bad.numel() == 0:
            break
        r_new = _shared_random_matrix((bad.numel(), k, k), mask_scale)
        n_new = _open_product(flat[bad], r_new)
        r[bad] = r_new
        n_pub[bad] = n_new
    n_inv = torch.linalg.inv(n_pub)
    x = _times_public_matrix(r, n_inv, 2.0 * mask_scale)  # |R| <= |R_0| + |R_1|
    eye2 = 2.0 * torch.eye(k, dtype=torch.float64)
    for _ in range(refine):
        x = x.matmul((-flat.matmul(x)) + eye2)
    return x.reshape(shape)


def default_newton_iters(k: int) -> int:
    """Iterations reaching a ``2**-20`` residual for ``cond(A) <= 1000`` (see docstring)."""
    return math.ceil(math.log2(56 * k)) + 20


def _transpose(a: Tensor) -> Tensor:
    return a.transpose(-1, -2)


def _exponent(j: torch.Tensor) -> torch.Tensor:
    """e = ceil((j + 1) / 2) for f in [2**j, 2**(j+1)): then 2**(-2e) f < 1."""
    return torch.div(j + 2, 2, rounding_mode="floor")


def _public_exponent(scale: float) -> int:
    if not 2.0 ** -16 <= scale <= 2.0 ** 16:
        raise ValueError(f"scale must be in [2**-16, 2**16], got {scale}")
    e = int(_exponent(torch.tensor(math.frexp(scale)[1] - 1)))  # frexp: floor(log2), exact
    # scale = 2**16 would give e = 9, one more than the 24-bit layout allows (2**(8 - e) must be
    # an integer); e = 8 suffices there: sigma_max^2 <= ||A||_F^2 < 2**16 (the domain), so
    # sigma_max(2**-8 A)^2 < 1
    return min(e, _SHIFT)


def _newton_plain(a: torch.Tensor, iters: int, scale: Optional[float]) -> torch.Tensor:
    """The twin: the same normalisation and iteration in float64."""
    if scale is not None:
        e = torch.full(a.shape[:-2], float(_public_exponent(scale)), dtype=torch.float64)
        inside = torch.ones(a.shape[:-2], dtype=torch.bool)
    else:
        f = (a * a).sum((-1, -2))
        inside = f >= 2.0 ** _ALPHA_EXPONENTS[0]
        # floor(log2 f) exactly (a float log2 rounds up just below a power of two, where the
        # 2PC comparisons do not)
        j = (torch.frexp(torch.where(inside, f, torch.ones_like(f)))[1] - 1).to(torch.float64)
        e = _exponent(j.clamp(max=float(_ALPHA_EXPONENTS[-1])))
    beta = torch.pow(2.0, -e)[..., None, None]
    a1 = a * beta
    x = _transpose(a1)
    eye2 = 2.0 * torch.eye(a.shape[-1], dtype=torch.float64)
    for _ in range(iters):
        x = x @ (eye2 - a1 @ x)
    return torch.where(inside[..., None, None], x * beta, torch.zeros_like(x))


# fractional bits of A' = 2**-e A and of X, and of E = 2I - A'X (docstring, steps 2-3)
_AX_BITS, _E_BITS = 24, 16
_SHIFT = 8  # A' and X_0 are A's ring integers times 2**(_SHIFT - e), e in [-7, 8]


def _power_of_two(a: Tensor, scale: Optional[float]) -> Any:
    """2**(_SHIFT - e) per matrix: shared (from one batched comparison) or public."""
    if scale is not None:
        return torch.tensor(1 << (_SHIFT - _public_exponent(scale)), dtype=torch.long)
    f_raw = B.raw_square(a).sum((-1, -2))  # ring: ||A_enc||^2, read at scale 2**F as f 2**F
    thresholds = torch.pow(2.0, _ALPHA_EXPONENTS + B.frac_bits())
    bits = ge(f_raw.unsqueeze(-1), thresholds)  # (..., J) scale-1 bits [f >= 2**j]
    onehot = bits - B.cat([bits[..., 1:], bits[..., :1] * 0], dim=-1)  # b_j - b_{j+1}
    e = _exponent(_ALPHA_EXPONENTS.to(torch.long))
    return (onehot * torch.pow(2, _SHIFT - e).to(torch.long)).sum(-1)


def _ring_matmul_truncated(x: Tensor, y: Tensor, drop: int) -> Tensor:
    """``round(x_ring @ y_ring / 2**drop)``, exactly (scale-1 result): half a unit is added
    before the exact floor. With a floor, ``E = 2I - A'X`` is rounded up, the iteration stops
    with a one-sided residual ``I - A'X`` of up to one unit of ``2**-16`` per entry, and ``X``
    keeps a relative error up to ``k 2**-16`` (3.3e-5 measured on a 4 x 4); rounding centres it.
    """
    raw = B.relabel(B.raw_matmul(x, y), 0) + (1 << (drop - 1))   # scale 1: adds the integer
    return truncate_exact(raw, drop)


def inverse_newton(a: Tensor, iters: Optional[int] = None, scale: Optional[float] = None
                   ) -> Tensor:
    """SecMI by Newton-Schulz iteration; reveals nothing (see the module docstring)."""
    shape = tuple(a.shape)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"inverse needs square matrices (..., k, k), got {shape}")
    k = shape[-1]
    iters = default_newton_iters(k) if iters is None else int(iters)
    if not B.is_shared(a):
        a = torch.as_tensor(a)
        return _newton_plain(a.to(torch.float64), iters, scale).to(B.float_dtype(a))
    F = B.frac_bits()
    if F + _SHIFT != _AX_BITS:
        raise ValueError(f"inverse_newton is laid out for {_AX_BITS - _SHIFT} fractional bits, not {F}")
    m = _power_of_two(a, scale)
    if B.is_shared(m):
        m = m.unsqueeze(-1).unsqueeze(-1)
    a1 = B.relabel(a, 0) * m                 # A' at 24 bits (ring product, no truncation)
    x = _transpose(a1)
    two = torch.eye(k, dtype=torch.long) * (2 << _E_BITS)
    for _ in range(iters):
        prod = _ring_matmul_truncated(a1, x, 2 * _AX_BITS - _E_BITS)
        e_mat = -B.relabel(prod, 0) + two
        x = B.relabel(_ring_matmul_truncated(x, e_mat, _E_BITS), 0)
    out = truncate_exact(x * m, _AX_BITS - F + _SHIFT)  # X 2**(8-e) / 2**16 = 2**-e X at F bits
    return B.relabel(out, F)
