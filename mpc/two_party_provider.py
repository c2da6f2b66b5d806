"""CrypTen tuple provider of the two-party (dealer-free) mode: everything made between the servers.

Where the dealer provider takes correlated randomness from a third party, this one makes each
piece with the other server through the two-party engine (``mpc.spu_engine``, CHEETAH):

* Beaver triples (``mul``, ``matmul``, the convolutions) and squares: each party draws its
  shares of a and b from its own PRG, and the engine computes shares of c = a op b (lattice HE
  for the cross terms; a convolution is one ``matmul`` on the im2col layout, ``mpc.ring_conv``).
  The online protocol that consumes them is unchanged.
* Comparisons (``mpc.nonnegative``: the sign and window tests) are not built from dealer-style
  pieces here (an edabit and 118 AND triples per element would cost far more to make between
  two parties than the operation itself): the engine does the whole operation on the shares
  (``nonnegative_share``, ``below_power_of_two_share``; exact floors ``floor_share``, and
  truncations by per-element exponents, ``truncate_share``).
* Truncation pairs (``mpc.truncation``, one exponent): each party draws its r_i, the engine makes
  the shares of msb(r) and r >> d (three sign tests a pair, ``SpuEngine.truncation_pairs``),
  in batches ahead of need; the online truncation is then the dealer mode's one round.
* CrypTen's random bits (``B2A_rng``, used by ``crypten.rand``): each party's bit is its XOR
  share, and the arithmetic share takes one engine product of the two private bits.
* CrypTen's equality (``eq``, ``ne``) takes two sign tests in the engine (``mpc.crypten_compat``),
  not binary triples.
* What our protocols never ask for in this mode (binary triples, edabits, truncation pairs,
  CrypTen's wrap randomness) is refused with a clear error rather than faked.

Security: nothing leaves a party but what the engine's protocol sends, and each party's PRG seed
is its own; no party, and no third one, knows both shares of anything.
"""

from __future__ import annotations

import numpy as np
import torch

from .crypten_compat import ArithmeticSharedTensor as AST
from .crypten_compat import BinarySharedTensor as BST
from .crypten_compat import TupleProviderBase
from common.prg import Prg, new_seed

from .ring_conv import OPS as _CONVS
from .ring_conv import ring_conv

NAME = "STARFISH_TWO_PARTY"

__all__ = ["TwoPartyProvider", "NAME", "NotInTwoPartyMode"]


class NotInTwoPartyMode(RuntimeError):
    """A correlation that the two-party mode does not make (no protocol of ours needs it)."""


def _shape(size) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in size)
    except TypeError:
        return (int(size),)


_OPS = ("mul", "matmul")   # the products the engine makes (``mpc.spu_engine.PRODUCTS``)
_PAIRS_FIRST = 1 << 10   # truncation pairs made by the first engine call of a session (per exponent)
_PAIRS_MAX = 1 << 16     # the largest batch made ahead of need


class TwoPartyProvider(TupleProviderBase):
    NAME = NAME

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self._seed = b""
        self._index = 0
        self._pairs: dict[int, tuple[np.ndarray, ...]] = {}
        self._pair_batch: dict[int, int] = {}

    def attach(self, engine) -> None:
        self.engine, self._seed, self._index = engine, new_seed(), 0
        self._pairs, self._pair_batch = {}, {}

    def detach(self) -> None:
        self.engine = None

    def _require(self):
        if self.engine is None:
            raise RuntimeError("two-party provider used outside a two-party session")
        return self.engine

    def _random(self, *shapes) -> list[np.ndarray]:
        g = Prg(self._seed, self._index)
        self._index += 1
        return [g.ring(s) for s in shapes]

    # ---------------------------------------------------------------- CrypTen's interface
    def _product(self, op: str, a: np.ndarray, b: np.ndarray, args: tuple, kwargs: dict, kind: str) -> np.ndarray:
        """This party's share of op(a, b) for two sharings, from the engine's products."""
        engine = self._require()
        if op == "mul" and not args and not kwargs:
            # the engine hands a 0-d product back as shape (1,): x.sum() * y.sum() stays 0-d
            return engine.product(op, a, b, kind=kind).reshape(np.broadcast_shapes(a.shape, b.shape))
        if op in _OPS and not args and not kwargs:
            return engine.product(op, a, b, kind=kind)
        if op in _CONVS:
            def matmul(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.from_numpy(engine.product("matmul", u.numpy(), v.numpy(), kind=kind))
            return ring_conv(op, torch.from_numpy(a), torch.from_numpy(b), matmul, *args, **kwargs).numpy()
        raise NotInTwoPartyMode(f"{op!r} products (arguments {args}, {kwargs}) are not made in two-party mode")

    def generate_additive_triple(self, size0, size1, op, device=None, *args, **kwargs):
        if op not in _OPS + _CONVS:
            raise NotInTwoPartyMode(f"Beaver triples for {op!r} are not made in two-party mode")
        a, b = self._random(_shape(size0), _shape(size1))
        c = self._product(op, a, b, args, kwargs, "offline")
        return tuple(AST.from_shares(torch.from_numpy(t), precision=0) for t in (a, b, c))

    def square(self, size, device=None):
        (r,) = self._random(_shape(size))
        r2 = self._product("mul", r, r, (), {}, "offline")
        return AST.from_shares(torch.from_numpy(r), precision=0), AST.from_shares(torch.from_numpy(r2), precision=0)

    def generate_binary_triple(self, size0, size1, device=None):
        raise NotInTwoPartyMode("binary triples are not made in two-party mode: comparisons run in the engine")

    def wrap_rng(self, size, device=None):
        raise NotInTwoPartyMode("CrypTen's wrap randomness is not made in two-party mode")

    def B2A_rng(self, size, device=None):
        """A random bit r shared both ways (CrypTen's ``crypten.rand``, e.g. tie-breaking in its
        ``max``): each party draws a bit r_k, its XOR share; r = r0 + r1 - 2 r0 r1, where the
        product of the two private bits is one engine product (inputs shared as (r0, 0), (0, r1))."""
        engine = self._require()
        shape = _shape(size)
        (raw,) = self._random(shape)
        bit = raw & 1
        zero = np.zeros(shape, np.int64)
        mine, other = (bit, zero)
        x, y = (mine, other) if self.engine.rank == 0 else (other, mine)
        prod = engine.product("mul", x, y)
        arith = bit - 2 * prod
        return (AST.from_shares(torch.from_numpy(arith), precision=0),
                BST.from_shares(torch.from_numpy(bit.copy()), precision=0))

    def edabits(self, size, bits: int):
        raise NotInTwoPartyMode("edabits are not made in two-party mode: comparisons run in the engine")

    def trunc_pairs(self, size, lo: int, hi: int):
        """Truncation pairs for one exponent d = lo = hi (``mpc.truncation``; per-element exponents
        are truncated in the engine instead): shares of a uniform r, of msb(r) and of r >> d,
        taken from a stock that the engine fills in batches (``_take_pairs``)."""
        if lo != hi:
            raise NotInTwoPartyMode("truncation pairs for several exponents are not made in two-party mode: "
                                    "per-element exponents are truncated in the engine")
        shape = _shape(size)
        r, top, high = self._take_pairs(int(lo), int(np.prod(shape, dtype=np.int64)))
        return (torch.from_numpy(r.reshape(shape)), torch.from_numpy(top.reshape(shape)),
                torch.from_numpy(high.reshape(1, *shape)))

    def _take_pairs(self, d: int, n: int) -> tuple[np.ndarray, ...]:
        """n pairs for exponent d. Why a stock: an engine call costs about 30 ms whatever its size
        (its rounds), and the fixed-point products of a 2PC program are many and small (UE's
        Newton steps: hundreds of truncations of a few hundred values), so pairs are made
        ahead in batches that double from ``_PAIRS_FIRST`` up to ``_PAIRS_MAX``, each truncation
        then costing one round. Both parties ask for the same sizes in the same order, so their
        stocks stay in step; a session starts with none (``attach``)."""
        stock = self._pairs.get(d, (np.empty(0, np.int64),) * 3)
        if stock[0].size < n:
            batch = self._pair_batch.get(d, _PAIRS_FIRST)
            self._pair_batch[d] = min(2 * batch, _PAIRS_MAX)
            (r,) = self._random((max(n - stock[0].size, batch),))
            top, high = self._require().truncation_pairs(r, d)
            stock = tuple(np.concatenate([old, new]) for old, new in zip(stock, (r, top, high)))
        self._pairs[d] = tuple(part[n:] for part in stock)
        return tuple(part[:n] for part in stock)

    # ---------------------------------------------------------------- whole operations
    def direct_product(self, op: str, x: torch.Tensor, y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """This party's share of x op y (``mul``, ``matmul``, a convolution with torch's
        arguments) computed by the engine itself, in place of a Beaver triple and its two
        openings (``mpc.crypten_compat``)."""
        if op not in _OPS + _CONVS:
            raise NotInTwoPartyMode(f"{op!r} products are not made in two-party mode")
        return torch.from_numpy(self._product(op, x.contiguous().numpy(), y.contiguous().numpy(), args, kwargs,
                                              "online"))

    def nonnegative_share(self, share: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._require().nonnegative(share.numpy()))

    def below_power_of_two_share(self, share: torch.Tensor, k: int) -> torch.Tensor:
        return torch.from_numpy(self._require().below_power_of_two(share.numpy(), k))

    def floor_share(self, share: torch.Tensor, d: int) -> torch.Tensor:
        """This party's share of floor(x / 2**d), exactly (``mpc.exact_truncation``'s contract)."""
        return torch.from_numpy(self._require().floor(share.numpy(), int(d)))

    def truncate_share(self, share: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """This party's share of x / 2**d elementwise, ``d`` a public tensor of exponents (0:
        kept). A single exponent takes the truncation pairs instead (``mpc.truncation``)."""
        engine = self._require()
        exps = d.expand(share.shape).to(torch.long)
        out = share.clone()
        for e in torch.unique(exps).tolist():   # public exponents: one engine call per value
            if e == 0:
                continue
            where = exps == e
            out[where] = torch.from_numpy(engine.truncate(share[where].numpy(), int(e)))
        return out
