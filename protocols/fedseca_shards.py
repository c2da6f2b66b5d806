"""FedSECA's checked round (``robust_aggregation.fedseca_checked``) with its coordinate-wise work on
coordinate shards (issue 30): what each worker pair computes on its shard, and the few values
that cross shards.

Why it splits where it does: almost all of FedSECA is per coordinate (the sign tests, CRISE's
elected signs, the agreement bits, x = c |g|, the partition network's clamped sum, the division);
three things sum over every coordinate, and each is a sum, so the shards' shares of their parts
add at each coordinator without communication:

* the threshold check's counts n_gt, n_ge per client (``fedseca_thresholds.claim_counts``);
* CRISE's omega~ = S S^T (K x K);
* the clip step's squared norms N_k (``robust_aggregation.clip_norms``).

The coordinators then decide in their own session (``verdict_from_counts``: K opened bits, the
only thing opened before the aggregate; CRISE's weights w and the clip factors c of the kept
clients) and hand their shares of w and c (2K values) to their workers; each pair computes its
shard of the aggregate with the same lines as the unsharded rule (``crise_signs``,
``vrs_aggregate``) and opens it: the shard of the round's aggregate, which the round opens anyway.

The programs are ``program(party, worker, *args)`` as in ``protocols.starfish.shard_steps``; the
driver :func:`fedseca_on_shards` takes any executor with ``run``, ``put_all`` and ``drop``
(``protocols.sharded.ShardExecutor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.robust_rules import FEDSECA_GAMMA

from . import backend as B
from .backend import from_share as wrap, share_of
from .comparator_networks import negative as _neg
from .fedseca_thresholds import check_gamma, claim_counts, verdict_from_counts
from .robust_aggregation import (check_crise, clip_factors, clip_norms, crise_omega, crise_signs, crise_weights,
                                 sign_blocks, vrs_aggregate)

__all__ = ["sums_program", "aggregate_program", "decide", "fedseca_on_shards"]


def _rows(worker: Any, names: Sequence[str], precision: int) -> Any:
    return B.stack([wrap(worker.share(n), precision) for n in names])


def sums_program(party, worker, names: Sequence[str], lam_name: str, precision: int, bits_name: str,
                 checked: bool = True) -> list:
    """On this shard: the one bounded sign-test call (6 K m tests: the rule's four blocks and the
    check's two; 4 K m unless ``checked``), its first four blocks kept at the worker as
    ``bits_name``; returned, this server's shares of the shard's parts of n_gt, n_ge (K each; None
    unless ``checked``), omega~ (K x K) and N (K), each with its fractional bits."""
    G = _rows(worker, names, precision)
    lam = wrap(worker.share(lam_name), precision).unsqueeze(1)
    K = int(G.shape[0])
    with party.meter("signs"):
        bits = _neg(B.cat(sign_blocks(G, lam, claims=checked)))
    share, b = share_of(bits[:4 * K])
    worker.put(bits_name, share)
    counts: list = [None, None]
    if checked:
        with party.meter("check"):
            counts = [share_of(v) for v in claim_counts(bits[2 * K:])]
    S = bits[K:2 * K] - bits[:K]
    del bits, share
    with party.meter("crise"):
        omega = crise_omega(S)
    with party.meter("clip"):
        N = clip_norms(G)
    return counts + [share_of(v) for v in (omega, N)] + [b]


def _added(party, parts: Sequence[tuple[np.ndarray, int]]) -> Any:
    """The shards' shares of a sum, added (the ring wraps) and read in the coordinators' session."""
    with np.errstate(over="ignore"):
        total = np.sum(np.stack([p for p, _ in parts]), axis=0, dtype=np.int64)
    return party.wrap_share(total, precision=parts[0][1])




def decide(party, parts: Sequence[list], lam: Any, D: int, gamma: float) -> tuple[torch.Tensor, list[int], Any, Any]:
    """At the coordinators, from every shard's :func:`sums_program` parts: the public verdict per
    client (its lambda_k is the gamma-quantile of its |g|), the kept clients, CRISE's weights w and
    the clip factors c of the kept (shared). Parts without counts (``sums_program`` not
    ``checked``) keep every client."""
    omega, N = (_added(party, [p[i] for p in parts]) for i in (2, 3))
    if parts[0][0] is None:
        ok = torch.ones(len(parts[0][3][0]), dtype=torch.bool)
    else:
        n_gt, n_ge = (_added(party, [p[i] for p in parts]) for i in (0, 1))
        with party.meter("check"):
            ok = verdict_from_counts(n_gt, n_ge, lam, D, gamma)
    kept = [k for k, good in enumerate(ok.tolist()) if good]
    if not kept:
        return ok, kept, None, None
    check_crise(len(kept), D)
    idx = torch.tensor(kept, dtype=torch.long)
    with party.meter("crise"):
        w = crise_weights(omega.index_select(0, idx).index_select(1, idx))
    with party.meter("clip"):
        c = clip_factors(N.index_select(0, idx))
    return ok, kept, w, c


def aggregate_program(party, worker, names: Sequence[str], kept: list[int], bits_name: str, bits_bits: int,
                      w: tuple[str, int], c: tuple[str, int], precision: int) -> np.ndarray:
    """On this shard, the kept clients' aggregate from the kept sign bits and the coordinators' w and
    c (``(name, fractional bits)`` at the worker): CRISE's elected signs and RoCA, opened."""
    K = len(names)
    G = _rows(worker, [names[k] for k in kept], precision)
    blocks = wrap(worker.share(bits_name), bits_bits)
    rows = torch.tensor([b * K + k for b in range(4) for k in kept], dtype=torch.long)
    bits = blocks if len(kept) == K else blocks.index_select(0, rows)
    n = len(kept)
    with party.meter("crise"):
        s_pos, s_neg = crise_signs(wrap(worker.share(w[0]), w[1]), bits[n:2 * n] - bits[:n])
    cw = wrap(worker.share(c[0]), c[1])
    agg = vrs_aggregate(G, bits, s_pos, s_neg, lambda: cw, party.meter)[0]
    with party.meter("open"):
        return B.reveal(agg).numpy().astype(np.float64).reshape(-1)


def fedseca_on_shards(ex: Any, party: Any, names: Sequence[str], lam_shares: np.ndarray, dim: int, *,
                      gamma: float = FEDSECA_GAMMA, precision: int, tag: str = "fedseca",
                      checked: bool = True) -> tuple[torch.Tensor, np.ndarray | None]:
    """FedSECA's checked round on the updates ``names`` (this server's shares at the executor's
    workers, at ``precision`` bits) and the claimed thresholds ``lam_shares`` (this server's shares,
    K int64 at ``precision``): (the public verdict per client, the opened aggregate of the kept or
    None), equal to ``fedseca_checked`` on the whole matrix. ``party``: the coordinators' session.

    ``checked=False`` is for thresholds the servers computed themselves (a replayed round's exact
    order statistics, ``ShardVector.fedseca_with``), as the one-process replay's ``fedseca``: no
    claim to check, so the check's 2 K D sign tests and its opening are left out and every client
    is kept (the verdict is all true), equal to ``fedseca`` with those thresholds."""
    check_gamma(gamma)
    lam_name, bits_name, w_name, c_name = (f"{tag}/{x}" for x in ("lam", "bits", "w", "c"))
    lam = np.asarray(lam_shares, dtype=np.int64).reshape(-1)
    try:
        ex.put_all(lam_name, lam)
        parts = ex.run(sums_program, list(names), lam_name, precision, bits_name, checked)
        ok, kept, w, c = decide(party, [p[:4] for p in parts], party.wrap_share(lam, precision=precision),
                                dim, gamma)
        if not kept:
            return ok, None
        (ws, wb), (cs, cb) = share_of(w), share_of(c)
        ex.put_all(w_name, ws)
        ex.put_all(c_name, cs)
        shards = ex.run(aggregate_program, list(names), kept, bits_name, parts[0][4], (w_name, wb), (c_name, cb),
                        precision)
        return ok, np.concatenate(shards)
    finally:
        ex.drop([lam_name, bits_name, w_name, c_name])
