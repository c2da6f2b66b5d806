"""Beaver products whose one operand keeps its mask: the mask of x is opened once, then serves
every later product of x with a fresh shared operand.

Why: Starfish's update estimation multiplies each client's L-BFGS columns y (m values, shared)
by small shared vectors z, once per replayed round, while y changes only when the client sends an
exact update, one column at a time. An ordinary Beaver product opens y - a again for every
product (8 bytes per coordinate each way); here y - a is opened once per column and each product
opens only z - b (a few values per client).

The algebra (one column y with mask a, one product with a fresh z): the dealer gives shares of a
uniform a (``mask``), and per product fresh b and c = a * b (``mask_matvec``, which sums such
products over the columns of a client). With e = y - a and f = z - b opened,

    y * z = e f + e b + a f + c,

linear in the shares of a, b and c, so each party computes its share locally. The same opened e
also gives the squared norm sum y^2 = sum e^2 + 2 sum e a + sum a^2 locally, with the dealer's
share of sum a^2 (the L-BFGS curvature test needs y^T y of each new column).

What is opened, and why it stays uniform: e = y - a once per column, a one-time pad because a is
uniform and masks nothing else (the dealer refuses products naming anything but an earlier mask of
the same size, ``mpc.correlations.MaskRegistry``); f = z - b per product with a fresh b. Reusing a
with several b's reveals nothing more: every later message is f with its own fresh pad, and c is
only ever seen as a share. This is the reuse of a matrix's mask across products of SecureML
(Mohassel and Zhang, 2017), applied per column.

The material comes in one dealer exchange per call (``masks``, ``masked_matvecs``: request
numbers of a stream of their own, since which masks exist depends on the replay's state, so
they cannot be prefetched from a per-step template; ``mpc.dealer_provider``).

Needs a provider with ``masks`` and ``masked_matvecs`` (the dealer's, ``mpc.dealer_provider``);
``supported()`` says whether the session's has them (the two-party engine and the test-only
TFP provider do not: callers then use an ordinary product).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpc.correlations import make_request
from mpc.crypten_compat import crypten

__all__ = ["MaskedShare", "supported", "open_masks", "matvec", "prefetch_matvec", "squared_norms"]


@dataclass(frozen=True)
class MaskedShare:
    """This party's view of a shared x whose mask was opened: e = x - a (public), its share of a,
    its share of sum(a * a), and the dealer's number for a."""

    index: int
    e: torch.Tensor
    a: torch.Tensor
    a_norm2: torch.Tensor


def _context():
    comm = crypten.communicator.get()
    return comm, comm.get_rank(), crypten.mpc.get_default_provider()


def supported() -> bool:
    """Whether the session's provider makes reusable masks (dealer mode)."""
    return hasattr(crypten.mpc.get_default_provider(), "masked_matvecs")


def open_masks(shares: Sequence[torch.Tensor]) -> list[MaskedShare]:
    """Open a fresh mask of each shared x (this party's int64 shares ``shares``): one round for all."""
    if not shares:
        return []
    comm, _, provider = _context()
    masks = provider.masks([tuple(x.shape) for x in shares])
    opened = comm.all_reduce([x - a for x, (_, a, _) in zip(shares, masks)], batched=True)
    return [MaskedShare(index, e, a, n2) for (index, a, n2), e in zip(masks, opened)]


def squared_norms(masked: Sequence[MaskedShare]) -> torch.Tensor:
    """This party's shares (k,) of sum(x * x) for each opened x (ring values, no truncation), with
    no communication: sum (e + a)^2 = sum e^2 + 2 sum e a + sum a^2, the last from the dealer."""
    _, rank, _ = _context()
    out = [2 * (x.e * x.a).sum() + x.a_norm2.reshape(()) + ((x.e * x.e).sum() if rank == 0 else 0)
           for x in masked]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.long)


def prefetch_matvec(columns: Sequence[Sequence[MaskedShare]]) -> None:
    """Fetch the dealer material of the next ``matvec(columns, ...)`` now (ahead of the step)."""
    if not columns:
        return
    size = tuple(columns[0][0].e.shape)
    _, _, provider = _context()
    provider.prefetch_stream([make_request("mask_matvec", tuple(x.index for x in cols), size) for cols in columns])


def matvec(columns: Sequence[Sequence[MaskedShare]], z: torch.Tensor) -> torch.Tensor:
    """This party's share of ``out[j] = sum_k x_{j,k} * z[j, k]`` (ring products, no truncation).

    ``columns[j]``: the opened columns of row j, each of one shape ``size``, the same number K
    for every row; ``z``: this party's int64 shares, shape (rows, K). Returns (rows, *size).
    One round (every row's f is opened together); the dealer sends one ``size`` tensor per row.
    """
    rows = len(columns)
    if rows == 0:
        return torch.zeros((0,), dtype=torch.long)
    k = len(columns[0])
    if any(len(c) != k for c in columns) or tuple(z.shape) != (rows, k):
        raise ValueError(f"matvec needs {rows} rows of equally many columns and z of shape (rows, K), "
                         f"got z {tuple(z.shape)}")
    size = tuple(columns[0][0].e.shape)
    comm, rank, provider = _context()
    material = provider.masked_matvecs([(tuple(x.index for x in cols), size) for cols in columns])
    b = torch.stack([m[0] for m in material])                     # (rows, K)
    f = comm.all_reduce(z - b)                                    # public, fresh pads
    c = torch.stack([m[1] for m in material])
    out = torch.empty((rows, *size), dtype=torch.long)
    for j, cols in enumerate(columns):      # column by column: no (rows, m, K) copies per call
        acc = c[j].clone()
        for i, x in enumerate(cols):
            acc.add_(x.e * (b[j, i] + f[j, i] if rank == 0 else b[j, i])).add_(x.a * f[j, i])
        out[j] = acc
    return out
