"""CrypTen's trusted-first-party provider, plus the correlations our protocols add.

TEST ONLY: party 0 generates every correlated value, so it knows all of them and a
computation run with it is not private. ``mpc.session`` registers it under CrypTen's
name "TFP" and uses it only under ``open_party(insecure_tfp=True)``; daemons never set it.
"""

from __future__ import annotations

import torch

from . import bitplanes
from .crypten_compat import ArithmeticSharedTensor as AST
from .crypten_compat import BinarySharedTensor as BST
from .crypten_compat import TrustedFirstParty, crypten

__all__ = ["TestOnlyTFP"]


class TestOnlyTFP(TrustedFirstParty):
    NAME = "TFP"

    def trunc_pairs(self, size, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Same contract as ``DealerProvider.trunc_pairs``; r is drawn by party 0 (src=0)."""
        size = tuple(int(d) for d in (size if hasattr(size, "__len__") else (size,)))
        gen = crypten.generators["local"][torch.device("cpu")]
        r = torch.randint(-(2**63), 2**63 - 1, size, dtype=torch.int64, generator=gen)
        top = (r >> 63) & 1
        highs = torch.stack([(r >> d) & ((1 << (64 - d)) - 1) for d in range(lo, hi + 1)])
        return tuple(AST(v, precision=0, src=0).share for v in (r, top, highs))

    def edabits(self, size, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``DealerProvider.edabits``; r is drawn by party 0 (src=0)."""
        size = tuple(int(d) for d in (size if hasattr(size, "__len__") else (size,)))
        gen = crypten.generators["local"][torch.device("cpu")]
        r = torch.randint(-(2**63), 2**63 - 1, size, dtype=torch.int64, generator=gen)
        if bits < 64:
            r &= (1 << bits) - 1
        planes = bitplanes.to_planes(r, bits)
        return AST(r, precision=0, src=0).share, BST(planes, src=0).share
