"""Party programs for the property tests of the comparison layer (module-level: the party
processes import them). Inputs arrive as *specs* so that one call evaluates many cases:

* ``("pub", array)``: a public torch tensor (both parties hold it);
* ``("fix", array, src)``: ``crypten.cryptensor(array, src=src)``, CrypTen's fixed-point
  encoding ``trunc(x * 2**16)`` of party ``src``'s float64 input;
* ``("ring", share0, share1, precision)``: an MPCTensor from raw int64 ring shares (party 0
  holds ``share0``, party 1 ``share1``), labelled with ``precision`` fractional bits;
* ``("scalar", value)``: a python float (public);
* a list of specs: a list of tensors (the sequences of ``compare_exchange``).
"""

from __future__ import annotations

import numpy as np
import torch

from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.compare import compare_exchange, ge, ge_ratio, lex_ge, lex_ge_ratio, select


def make(party, spec):
    if isinstance(spec, list):
        return [make(party, s) for s in spec]
    kind = spec[0]
    if kind == "pub":
        return torch.from_numpy(np.ascontiguousarray(spec[1]))
    if kind == "scalar":
        return float(spec[1])
    if kind == "fix":
        return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(spec[1])), src=spec[2])
    if kind == "ring":
        mine = spec[1] if party.rank == 0 else spec[2]
        return crypten.mpc.MPCTensor.from_shares(torch.from_numpy(np.ascontiguousarray(mine)),
                                                 precision=spec[3])
    raise ValueError(f"unknown input spec {kind!r}")


def opened(x):
    """(shared?, ring integers as int64 numpy, fractional bits) of a result, opened if shared."""
    if B.is_shared(x):
        if x.share.numel() == 0:  # nothing to open (the transport cannot frame empty 2-D tensors)
            return True, np.zeros(tuple(x.share.shape), dtype=np.int64), B.bits_of(x)
        return True, x.reveal().numpy().copy(), B.bits_of(x)
    return False, torch.as_tensor(x).numpy().copy(), None


def _call(name, args, kwargs):
    if name == "ge":
        return ge(*args)
    if name == "ge_ratio":
        return ge_ratio(*args)
    if name == "select":
        return select(*args)
    if name == "lex_ge":
        return lex_ge(*args, **kwargs)
    if name == "lex_ge_ratio":
        u1, v1, u2, v2, ta, tb = args
        return lex_ge_ratio((u1, v1), (u2, v2), ta, tb, **kwargs)
    if name == "compare_exchange":
        new_a, new_b = compare_exchange(*args)
        return new_a + new_b
    raise ValueError(f"unknown primitive {name!r}")


def evaluate(party, cases):
    """Run each ``(name, specs, kwargs)`` case; returns per case the opened result(s)."""
    out = []
    for name, specs, kwargs in cases:
        res = _call(name, [make(party, s) for s in specs], kwargs)
        out.append([opened(r) for r in res] if isinstance(res, list) else opened(res))
    return out


def online_rounds(party, cases):
    """Online rounds of each case's primitive call alone (inputs made outside the step)."""
    rounds = []
    for i, (name, specs, kwargs) in enumerate(cases):
        args = [make(party, s) for s in specs]
        with party.meter(f"case-{i}"):
            key = party.metering.open_steps()[-1]  # nested under the pair's "call-N"
            _call(name, args, kwargs)
        rounds.append(party.meters()["steps"][key]["online_rounds"])
    return rounds
