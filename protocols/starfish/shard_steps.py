"""What a worker pair computes on its coordinate shard for Stage II (``protocols.starfish.on_shards``).

Each program is ``program(party, worker, *args)``: ``party`` the pair's 2PC session, ``worker``
this side's holder of named int64 shares (``share``/``put``). A value is named by a reference
``(name, row)`` (``row`` None: the whole array). What a program returns to its coordinator is
this server's *share* of a sum over the shard's coordinates (added by the coordinator to the
other shards'), a public sum, or a shard of a value the pair opened on purpose (an aggregate).
Everything m-long stays at the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.offline_mode import OfflineMode
from mpc import reused_masks, table_compare
from protocols import backend as B
from protocols.backend import from_share as wrap, share_of
from protocols.inner_product import inner_raw
from protocols.robust_aggregation import brace_sign
from protocols.secure_quantile import quantile_below, quantile_magnitudes
from protocols.threshold import exceed_counts_blocked

from .pair_buffers import curvature_sums
from .robust_replay import rows_at_frac_bits
from .threshold_check import ENGINE_DROP, session_engine
from .update_estimation import HvpCoefficients, hvp_apply, hvp_sums

__all__ = ["Ref", "share_of", "wrap", "sub_program", "weighted_program", "rescale_program", "open_program",
           "hvp_sums_program", "hvp_apply_program", "counts_program", "inner_program", "curvature_program", "brace_program",
           "fedseca_rows_program", "quantile_below_program",
           "BLOCK", "TWO_PARTY_BLOCK", "block_for", "batch_values", "row_chunks"]

#: (name, row): the named share at a worker, or its row ``row``
Ref = tuple[str, "int | None"]


def _array(worker: Any, ref: Ref) -> np.ndarray:
    name, row = ref
    a = worker.share(name)
    return a if row is None else a[row]


def _stacked(worker: Any, refs: Sequence[Any]) -> np.ndarray:
    """Nested references as one array: a list is stacked on a new first axis; a ``("cols", [..])``
    entry on a new last axis (the L-BFGS columns of one client)."""
    if isinstance(refs, tuple) and refs and refs[0] == "cols":
        return np.stack([_stacked(worker, r) for r in refs[1]], axis=-1)
    if isinstance(refs, list):
        return np.stack([_stacked(worker, r) for r in refs])
    return _array(worker, refs)


def _masked(worker: Any, refs: Sequence[Ref]) -> list[reused_masks.MaskedShare] | None:
    """Dealer mode: each of the columns ``refs`` with its reused Beaver mask opened
    (``mpc.reused_masks``, as ``PairBuffers`` keeps them in one process): opened at a column's
    first use here, one round for all missing, and kept beside it at the worker as
    ``<name>#mask<row>...``, which goes when the column's name is dropped. So an estimate's
    ``Y z`` opens only z's mask (a few values per client), not Y's m x B again. None where the
    pair's session has no reusable masks (two-party mode: an ordinary product)."""
    if not reused_masks.supported():
        return None
    keys = [f"{name}#mask{'' if row is None else row}" for name, row in refs]
    missing = [k for k, key in enumerate(keys) if not worker.has(key + "e")]
    opened = reused_masks.open_masks([torch.from_numpy(np.ascontiguousarray(_array(worker, refs[k])))
                                      for k in missing])
    for k, m in zip(missing, opened):
        worker.put(keys[k] + "e", m.e.numpy())
        worker.put(keys[k] + "a", m.a.numpy())
        worker.put(keys[k] + "n", np.array([m.index, int(m.a_norm2.reshape(-1)[0])], dtype=np.int64))
    out = []
    for key in keys:
        index, a_norm2 = (int(v) for v in worker.share(key + "n"))
        out.append(reused_masks.MaskedShare(index, torch.from_numpy(worker.share(key + "e")),
                                            torch.from_numpy(worker.share(key + "a")),
                                            torch.tensor(a_norm2, dtype=torch.long)))
    return out


def _column_masks(worker: Any, y_refs: Sequence[Any]) -> list[list[reused_masks.MaskedShare]] | None:
    """Per client row of ``y_refs`` (``("cols", [...])`` each), its columns' masks (``_masked``),
    or None (no reusable masks, or rows of unequal column counts, which one product cannot take)."""
    if not y_refs or any(not (isinstance(r, tuple) and r and r[0] == "cols") for r in y_refs) \
            or len({len(r[1]) for r in y_refs}) != 1:
        return None
    flat = _masked(worker, [c for r in y_refs for c in r[1]])
    if flat is None:
        return None
    b = len(y_refs[0][1])
    return [flat[k * b:(k + 1) * b] for k in range(len(y_refs))]


def _public(worker: Any, name: str) -> torch.Tensor:
    """A public vector kept at the worker (``ShardSpace.public``: float64 bits held as int64)."""
    return torch.from_numpy(worker.share(name).view(np.float64))


def _public_columns(worker: Any, names: list[list[str]]) -> torch.Tensor:
    """S (n, m_k, B) from the names of its columns."""
    return torch.stack([torch.stack([_public(worker, n) for n in row], dim=-1) for row in names])


def sub_program(party, worker, out: str, a: Ref, b: Ref) -> None:
    """out = a - b (same bits; local)."""
    with np.errstate(over="ignore"):     # the ring wraps
        worker.put(out, _array(worker, a) - _array(worker, b))


def weighted_program(party, worker, out: str, refs: Sequence[Ref], bits: Sequence[int], weights: Sequence[float]) -> int:
    """out = sum_k w_k x_k, untruncated (``backend.raw_weighted_sum``: local); returns its bits."""
    y = B.raw_weighted_sum([wrap(_array(worker, r), b) for r, b in zip(refs, bits)], weights)
    worker.put(out, y.share.numpy())
    return B.bits_of(y)


def rescale_program(party, worker, out: str, ref: Ref, bits: int, to_bits: int) -> int:
    y = B.rescale(wrap(_array(worker, ref), bits), to_bits)
    worker.put(out, y.share.numpy())
    return B.bits_of(y)


def open_program(party, worker, ref: Ref, bits: int) -> np.ndarray:
    """The shard of a value both servers open (an aggregate the round publishes anyway)."""
    with party.meter("aggregate"):
        return B.reveal(wrap(_array(worker, ref), bits)).numpy()


#: values per 2PC batch at a worker: UE's products and SecTC's rescale and comparisons run over
#: as many client rows at a time as fit (at least one row), so a worker's peak memory follows the
#: batch, not its shard times the number of clients (measured on the MNIST shapes before this:
#: about 3.5 KB per shard coordinate, 20 clients, B = 2)
BLOCK = 1 << 21

#: the batch in two-party mode, where it goes to the pair's engine and the engine's peak memory
#: follows it (measured, one SecTC batch: 1.8 GiB at 2**18 values, 2.7 GiB at 2**19, 4.0-4.2 GiB
#: at 2**20 and above, where the engine splits; 55,000 comparisons a second at each size)
TWO_PARTY_BLOCK = 1 << 18


def block_for(offline: Any, block: int = BLOCK) -> int:
    """The values per 2PC batch in mode ``offline``: ``block``, at most ``TWO_PARTY_BLOCK`` in
    two-party mode (the engine's memory follows a call's size)."""
    return min(block, TWO_PARTY_BLOCK) if offline == OfflineMode.TWO_PARTY else block


def batch_values(party: Any, block: int) -> int:
    """The values per 2PC batch this pair uses (``block_for`` its party's mode)."""
    return block_for(getattr(party, "offline", None), block)


def row_chunks(rows: int, per_row: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of at most ``block`` values (``per_row`` values a row; one row at least)."""
    step = max(1, block // max(1, per_row))
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]


def _concat(parts: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    return np.concatenate([p[0] for p in parts]), parts[0][1]


def hvp_sums_program(party, worker, y_refs: list, y_bits: int, s_names: list[list[str]], v_name: str,
                     block: int = BLOCK) -> tuple:
    """UE's sums over this shard (``update_estimation.hvp_sums``): public S^T S, S^T v; shares
    of S^T Y and Y^T v (``block``: values per batch of client rows)."""
    v = _public(worker, v_name)
    parts = []
    with party.meter("UE"):
        for lo, hi in row_chunks(len(y_refs), v.numel() * len(s_names[0]), batch_values(party, block)):
            sums = hvp_sums(_public_columns(worker, s_names[lo:hi]), wrap(_stacked(worker, y_refs[lo:hi]), y_bits), v)
            parts.append((sums.sts, sums.stv, share_of(sums.sty), share_of(sums.ytv)))
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            _concat([p[2] for p in parts]), _concat([p[3] for p in parts]))


def hvp_apply_program(party, worker, out: str, y_refs: list, y_bits: int, stored: list, stored_bits: int,
                      coef: Sequence[tuple[np.ndarray, int]], s_names: list[list[str]], v_name: str,
                      block: int = BLOCK) -> int:
    """g_hat = g + H v on this shard from the coordinators' coefficients; kept as ``out``
    (``block``: values per batch of client rows)."""
    v = _public(worker, v_name)
    est, bits = None, None
    with party.meter("UE"):
        masks = _column_masks(worker, y_refs)
        for lo, hi in row_chunks(len(y_refs), v.numel() * len(s_names[0]), batch_values(party, block)):
            hv = hvp_apply(_public_columns(worker, s_names[lo:hi]), wrap(_stacked(worker, y_refs[lo:hi]), y_bits), v,
                           HvpCoefficients(*(wrap(a[lo:hi], b) for a, b in coef)),
                           None if masks is None else masks[lo:hi])
            part = hv + B.lift(wrap(_stacked(worker, stored[lo:hi]), stored_bits), B.bits_of(hv))
            if est is None:
                est = np.empty((len(y_refs), v.numel()), dtype=np.int64)
            est[lo:hi] = part.share.numpy()
            bits = B.bits_of(part)
    worker.put(out, est)
    return bits


def counts_program(party, worker, refs: list, bits: int, thresholds: tuple[np.ndarray, int],
                   block: int = BLOCK) -> tuple[np.ndarray, bool]:
    """SecTC on this shard: (per row, a share of a count the coordinator adds over the shards and
    compares with 1, whether those are the two-party engine's 32-bit shares), ``block`` values
    at a time. ``refs``: the client rows (none: no counts).

    Two-party mode (``_engine_counts``): the unsharded two-party check's test in the engine's
    32-bit ring (``SpuEngine.rows_hits``: per row, the blocks with a hit), left shared; the
    coordinators add them mod 2**32 and open [sum > 0] in their engine (``SpuEngine.any_hits``).
    Dealer mode (``_table_counts``): per row and batch, the bit "some coordinate reaches the
    threshold" from the table-driven sign tests of the unsharded dealer-mode check (about 24 bytes
    a coordinate), so the sum counts the batches with a hit. Otherwise: rescaled, then the number
    of coordinates at or above the threshold (generic comparison, about 91 bytes a coordinate);
    the coordinators compare the ring sum (``flags_from_counts``)."""
    d, d_bits = thresholds
    block = batch_values(party, block)
    rows = len(refs)
    engine = _engine_counts(bits, d_bits, block)
    if not rows:
        return np.zeros(0, dtype=np.int64), engine is not None
    table = None if engine is not None else _table_counts(bits, d_bits)
    counts = []
    with party.meter("TC"):
        for lo, hi in row_chunks(rows, _array(worker, refs[0]).shape[-1], block):
            dk = d[lo:hi] if d.ndim and d.shape[0] == rows else d     # one threshold per row, or one for all
            direct = engine or table
            if direct is not None:
                counts.append(direct(_stacked(worker, refs[lo:hi]), np.broadcast_to(dk, (hi - lo,))))
                continue
            x = B.rescale(wrap(_stacked(worker, refs[lo:hi]), bits))
            counts.append(exceed_counts_blocked(x, wrap(dk, d_bits), block).share.numpy().copy())
    return np.concatenate(counts).astype(np.int64), engine is not None


def _engine_counts(bits: int, d_bits: int, block: int):
    """Two-party mode, where the engine truncates locally into 32 bits: the per-row 32-bit shared
    counts of a batch (rows, m) against its thresholds (rows,), ``block`` coordinates an engine
    call (its memory follows a call). None elsewhere."""
    engine = session_engine()
    drop = bits - B.frac_bits()
    if engine is None or d_bits != B.frac_bits() or not 0 <= drop <= ENGINE_DROP:
        return None
    return lambda x, d: engine.rows_hits(np.ascontiguousarray(x), drop, np.ascontiguousarray(d, dtype=np.int64),
                                         batch=block)


def _table_counts(bits: int, d_bits: int):
    """Dealer mode, where the local truncation into 32 bits applies (``mpc.table_compare``:
    values at ``bits`` fractional bits, thresholds at F): the per-row shared hit bits of a batch
    (rows, m) against its thresholds (rows,). None elsewhere (the generic count then)."""
    drop = bits - B.frac_bits()
    if not table_compare.supported() or d_bits != B.frac_bits() or not 0 <= drop <= table_compare.MAX_DROP:
        return None
    return lambda x, d: table_compare.rows_exceed_shares(np.ascontiguousarray(x), drop,
                                                         np.ascontiguousarray(d, dtype=np.int64))


def inner_program(party, worker, refs: list, bits: int, other: Any, e: int | None) -> tuple[np.ndarray, int]:
    """The raw inner products of rows with a public ``other`` (encoded with ``e`` bits, the
    whole vector's) or with themselves (``other`` None) on this shard (``inner_product.inner_raw``).
    A public ``other`` is ``("rows", names, lead)``: its rows kept here by name, ``lead`` its
    leading shape."""
    x = wrap(_stacked(worker, refs), bits)
    if other is None:
        return share_of(inner_raw(x, x, -1, e))
    _, names, lead = other
    y = torch.stack([_public(worker, n) for n in names]).reshape(*lead, -1)
    return share_of(inner_raw(x, y, -1, e))


def curvature_program(party, worker, refs: list, bits: int, s_name: str) -> tuple:
    """The curvature test's sums on this shard (``pair_buffers.curvature_sums``)."""
    with party.meter("pairs"):
        # each new column's mask is opened here, where the test needs y^T y anyway (the same
        # bytes as a Beaver product's opening), and then serves every estimate's product
        ss, u, yy = curvature_sums(_public(worker, s_name), [wrap(_array(worker, r), bits) for r in refs],
                                   _masked(worker, refs))
    return ss, share_of(u), share_of(yy)


def brace_program(party, worker, refs: list, bits: list[int], lam: float, block: int = BLOCK) -> np.ndarray:
    """BRACE's vote (``robust_aggregation.brace_sign``) on this shard's coordinates of the rows
    ``refs`` (each at its ``bits``: estimates at 2F, exact updates at F), opened: the +-1 direction
    a replayed BRACE round opens anyway. The vote is coordinate-wise, so a shard's part is the
    vote of its coordinates; ``block`` values (all rows of a range of coordinates) per batch."""
    m = _array(worker, refs[0]).shape[-1]
    step = max(1, batch_values(party, block) // max(1, len(refs)))
    out = np.empty(m, dtype=np.int64)
    with party.meter("aggregate"):
        for lo in range(0, m, step):
            hi = min(m, lo + step)
            G = rows_at_frac_bits([wrap(_array(worker, r)[lo:hi], b) for r, b in zip(refs, bits)])
            out[lo:hi] = B.reveal(brace_sign(G, lam=lam, meter=party.meter)).numpy()
    return out


def fedseca_rows_program(party, worker, out: str, refs: list, bits: list[int]) -> int:
    """A replayed FedSECA round's rows on this shard (``robust_replay``): at F bits
    (``rows_at_frac_bits``), kept row k as ``<out>#<k>`` (the names ``fedseca_shards`` reads),
    and their |g| as ring integers (``secure_quantile.quantile_magnitudes``) as ``<out>#abs``;
    all go when ``out`` is dropped. Returns the rows' fractional bits."""
    with party.meter("rescale"):
        G = rows_at_frac_bits([wrap(_array(worker, r), b) for r, b in zip(refs, bits)])
    share, g_bits = share_of(G)
    for k in range(share.shape[0]):
        worker.put(f"{out}#{k}", share[k])
    with party.meter("quantile"):
        worker.put(f"{out}#abs", share_of(quantile_magnitudes(G))[0])
    return g_bits


def quantile_below_program(party, worker, abs_name: str, lam: tuple[np.ndarray, int] | None, b: int,
                           n: int) -> tuple[np.ndarray, int]:
    """One digit of the quantile search on this shard (``secure_quantile.quantile_below``): this
    server's share of #{|g| < candidate} per candidate and row over the shard's coordinates, for
    the coordinators to add (``lam``: their shares of the digits so far, K ring integers)."""
    with party.meter("quantile"):
        below = quantile_below(wrap(worker.share(abs_name), 0), None if lam is None else wrap(*lam), b, n)
    return share_of(below)
