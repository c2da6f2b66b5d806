"""Stage II's secret m-long values on coordinate shards, as the coordinator holds them (issue 30).

Why: with ``[deployment] workers`` = K each server's workers hold coordinate shard k of every
update, secant and estimate, and Stage II (``stage2``, ``replay``, written once) must run on
them unchanged. So the history and correction ports hand it :class:`ShardVector` values
(secret: ``backend.is_shared``), and each backend function or Starfish step that touches every
coordinate asks the value to do it (``protocols.sharded``): the shard's part runs on each worker
pair (``shard_steps``), the coordinator adds its shares of the parts (additive shares add
without communication) and runs the small rest in its own session with the other coordinator:

* UE: S^T S, S^T v, S^T Y, Y^T v per shard, added; the 2B x 2B solve here; H v per shard;
* TC: per shard, shares of each row's count of coordinates over its threshold (dealer mode: of
  its batches with one, from the table-driven sign tests), added; the per-row OR here (one
  comparison, the one opened bit per client of the unsharded check);
* the curvature test and RS's inner products: per shard sums, added; the decisions here;
* an aggregate: a weighted sum per shard (local), each shard opened by its pair (the aggregate
  is public, as unsharded); a replayed BRACE round (``robust_replay``): each shard's vote, per
  coordinate, opened by its pair (the direction is public, as unsharded).

What crosses shards is a few shares per client (B x B sums, counts, inner products), never an
m-long value; what is opened is what the unsharded Stage II opens. Each worker keeps a value
as long as the coordinator holds a reference to it: when the last one goes, its name is
dropped (zeroed) at every worker before the next program runs.

Dealer mode's reused Beaver masks of Y are kept per column at the workers (``shard_steps._masked``); a
replayed FedSECA round's quantile search sums its per-digit counts over the shards
(:meth:`ShardVector.fedseca_with`).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.robust_rules import quantile_rank
from protocols import backend as B
from protocols.fedseca_shards import fedseca_on_shards
from protocols.inner_product import inner_finish, public_bits
from protocols.secure_quantile import quantile_digit, quantile_digits, quantile_step_bits
from protocols.sharded import ShardedValue, ShardExecutor
from protocols.threshold import flags_from_counts

from . import shard_steps as steps
from .pair_buffers import curvature_decide
from .ports import CorrectionClients, History, HistoryView, Secret
from .threshold_check import session_engine
from .update_estimation import HvpSums, hvp_solve

__all__ = ["ShardSpace", "ShardVector", "ShardMatrix", "ShardHistory", "ShardClients", "PublicColumns"]


class ShardSpace:
    """This coordinator's workers for one job, and the names of the values they keep for it."""

    def __init__(self, executor: ShardExecutor, dim: int, block: int = steps.BLOCK) -> None:
        """``block``: values per 2PC batch at a worker (``shard_steps.BLOCK``; its memory follows it)."""
        self.ex = executor
        self.dim = dim
        self.block = block
        self.bounds = list(executor.bounds)
        if self.bounds[-1][1] != dim:
            raise ValueError(f"shards {self.bounds} do not cover {dim} coordinates")
        self._live: Counter[str] = Counter()
        self._gone: list[str] = []
        self._public: dict[int, tuple[weakref.ref, str]] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ names
    def name(self, kind: str) -> str:
        return f"{kind}{next(self._ids)}"

    def hold(self, name: str) -> None:
        self._live[name] += 1

    def release(self, name: str) -> None:
        self._live[name] -= 1
        if self._live[name] <= 0:
            del self._live[name]
            self._gone.append(name)

    def flush(self) -> None:
        """Drop every value the coordinator no longer references (zeroed at the workers)."""
        gone, self._gone = self._gone, []
        if gone:
            self.ex.drop(gone)

    def close(self) -> None:
        """Drop everything this job left at the workers."""
        self._gone.extend(self._live)
        self._live.clear()
        self.flush()

    # ------------------------------------------------------------------ moving values
    def run(self, program, *args, per_shard=None) -> list[Any]:
        self.flush()
        return self.ex.run(program, *args, per_shard=per_shard)

    def put(self, x: Any) -> ShardVector:
        """A coordinator-held m-long sharing (a correction answer, a stored update) to the workers."""
        share, bits = steps.share_of(x)
        if share.shape[-1] != self.dim:
            raise ValueError(f"a value of {share.shape[-1]} coordinates on shards of {self.dim}")
        name = self.name("v")
        self.flush()
        self.ex.scatter(name, share)
        return ShardVector(self, (name, None), bits)

    def load(self, ref: str, bits: int) -> ShardVector:
        """A stored m-long sharing that already lies on the shards (``History.stored_update``),
        read by the workers: it never passes through the coordinator."""
        name = self.name("v")
        self.flush()
        self.ex.load(name, ref)
        return ShardVector(self, (name, None), bits)

    def public(self, t: torch.Tensor) -> str:
        """The workers' name of a public m-vector (s, the model difference), sent once while the
        coordinator keeps the tensor (its float64 bits travel as int64: what a worker holds)."""
        key = id(t)
        held = self._public.get(key)
        if held is not None and held[0]() is t:
            return held[1]
        name = self.name("p")
        self.flush()
        self.ex.scatter(name, np.ascontiguousarray(t.detach().to(torch.float64).numpy()).view(np.int64))
        self.hold(name)
        self._public[key] = (weakref.ref(t, lambda _ref, k=key, n=name: self._forget_public(k, n)), name)
        return name

    def _forget_public(self, key: int, name: str) -> None:
        if self._public.get(key, (None, None))[1] == name:
            del self._public[key]
        self.release(name)

    def gather(self, parts: Sequence[tuple[np.ndarray, int]]) -> Any:
        """The sum of the shards' shares of a value (local), as a sharing of this session."""
        bits = parts[0][1]
        with np.errstate(over="ignore"):   # the ring wraps
            total = np.sum(np.stack([p for p, _ in parts]), axis=0, dtype=np.int64)
        return steps.wrap(total, bits)


class _Coordinators:
    """What ``fedseca_shards`` asks of the coordinators' session, inside Stage II: its meter, and
    shares read in the session Stage II runs in (the current one, as ``ShardSpace.gather``)."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter

    def wrap_share(self, share: np.ndarray, precision: int) -> Any:
        return steps.wrap(share, precision)


class _Held(ShardedValue):
    """A value the workers keep under names; the names are released with the value."""

    def __init__(self, space: ShardSpace, names: Sequence[str]) -> None:
        self.space = space
        self._names = list(names)
        for n in self._names:
            space.hold(n)

    def __del__(self) -> None:
        try:
            for n in self._names:
                self.space.release(n)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _names(refs: Any) -> list[str]:
    if isinstance(refs, tuple) and refs and refs[0] == "cols":
        return [n for r in refs[1] for n in _names(r)]
    if isinstance(refs, list):
        return [n for r in refs for n in _names(r)]
    return [refs[0]]


class ShardVector(_Held):
    """One m-long secret on the shards: reference ``ref`` at ``bits`` fractional bits."""

    def __init__(self, space: ShardSpace, ref: steps.Ref, bits: int) -> None:
        super().__init__(space, [ref[0]])
        self.ref, self.bits = ref, bits

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.space.dim,)

    def __sub__(self, other: ShardVector) -> ShardVector:
        if not isinstance(other, ShardVector) or other.bits != self.bits:
            raise TypeError("a shard vector minus another at the same bits only")
        out = self.space.name("d")
        self.space.run(steps.sub_program, out, self.ref, other.ref)
        return ShardVector(self.space, (out, None), self.bits)

    def stack_with(self, xs: list, dim: int) -> ShardMatrix:
        bits = {x.bits for x in xs}
        if len(bits) != 1:
            raise ValueError("stacking shard vectors of different bits")
        if dim == 0:
            return ShardMatrix(self.space, [x.ref for x in xs], bits.pop())
        if dim in (-1, 1):
            return ShardMatrix(self.space, ("cols", [x.ref for x in xs]), bits.pop())
        raise ValueError(f"shard vectors stack on axis 0 or -1, not {dim}")

    def weighted_with(self, values: list, weights: list) -> ShardVector:
        out = self.space.name("w")
        bits = self.space.run(steps.weighted_program, out, [v.ref for v in values], [v.bits for v in values],
                              [float(w) for w in weights])[0]
        return ShardVector(self.space, (out, None), bits)

    def brace_with(self, rows: list, lam: float) -> torch.Tensor:
        """BRACE's vote over ``rows`` (shard vectors at any bits), each shard's voted and opened
        by its pair (``robust_replay``): the opened +-1 direction, float64."""
        parts = self.space.run(steps.brace_program, [r.ref for r in rows], [r.bits for r in rows], float(lam),
                               self.space.block)
        return torch.from_numpy(np.concatenate(parts)).to(torch.float64)

    def inner_raw(self, y: Any, e: int | None) -> Any:
        """The raw inner product with a public m-vector ``y`` encoded with ``e`` bits
        (``inner_product.inner_rows``: one row of a public factor at a time), its shards' parts
        added here; ``y`` stays at the workers only while the coordinator holds it."""
        if e is None or B.is_shared(y):
            raise TypeError("a shard vector's raw inner product is with a public vector only")
        y = torch.as_tensor(y, dtype=torch.float64)
        name = self.space.public(y)
        parts = self.space.run(steps.inner_program, [self.ref], self.bits, ("rows", [name], (1,)), e)
        return self.space.gather(parts).reshape(())

    def fedseca_with(self, rows: list, gamma: float, meter: Any) -> torch.Tensor:
        """A replayed FedSECA round over ``rows`` (``robust_replay``): each row's lambda_k, the
        gamma-quantile of its |g|, by the secure search with each digit's counts summed over the
        shards (``quantile_below`` per pair, ``quantile_digit`` here), then FedSECA's round on the
        shards with those thresholds (``fedseca_shards`` unchecked, as the one-process replay's
        ``fedseca``: each lambda_k is the exact order statistic of the same values, not a claim),
        opened: g_tilde, float64."""
        sp = self.space
        K, D = len(rows), sp.dim
        out = sp.name("f")
        bits = sp.run(steps.fedseca_rows_program, out, [r.ref for r in rows], [r.bits for r in rows])[0]
        sp.hold(out)
        try:
            need = D - quantile_rank(D, gamma)
            lam = None
            with meter("quantile"):
                for b, n in quantile_digits(quantile_step_bits(K, D)):
                    parts = sp.run(steps.quantile_below_program, f"{out}#abs",
                                   None if lam is None else steps.share_of(lam), b, n)
                    step = quantile_digit(sp.gather(parts), D, need, b)
                    lam = step if lam is None else lam + step
            _, agg = fedseca_on_shards(sp.ex, _Coordinators(meter), [f"{out}#{k}" for k in range(K)],
                                        steps.share_of(lam)[0], D, gamma=gamma, precision=bits, tag=f"{out}#round",
                                        checked=False)
        finally:
            sp.release(out)
        return torch.from_numpy(agg).to(torch.float64)

    def rescale(self, bits: int) -> ShardVector:
        out = self.space.name("r")
        got = self.space.run(steps.rescale_program, out, self.ref, self.bits, bits)[0]
        return ShardVector(self.space, (out, None), got)

    def reveal(self) -> torch.Tensor:
        parts = self.space.run(steps.open_program, self.ref, self.bits)
        return torch.from_numpy(np.concatenate(parts, axis=-1)).to(torch.float64)

    def curvature(self, s: torch.Tensor, ys: list, min_cos: float) -> list[bool]:
        """The curvature test of the secants ``ys`` (``pair_buffers``) from per-shard sums."""
        bits = {y.bits for y in ys}.pop()
        parts = self.space.run(steps.curvature_program, [y.ref for y in ys], bits, self.space.public(s))
        return curvature_decide(sum(p[0] for p in parts), self.space.gather([p[1] for p in parts]),
                                self.space.gather([p[2] for p in parts]), min_cos)


class ShardMatrix(_Held):
    """Rows (``refs`` a list) or L-BFGS columns (``("cols", [...])``; a list of those: one client's
    m x B per row) of shard vectors, at ``bits``."""

    def __init__(self, space: ShardSpace, refs: Any, bits: int) -> None:
        super().__init__(space, _names(refs))
        self.refs, self.bits = refs, bits

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self.refs, tuple):
            return (self.space.dim, len(self.refs[1]))
        first = self.refs[0]
        return (len(self.refs), self.space.dim) + ((len(first[1]),) if isinstance(first, tuple) and
                                                   first and first[0] == "cols" else ())

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, r: int) -> ShardVector:
        if isinstance(self.refs, tuple) or not isinstance(self.refs[r], tuple) or self.refs[r][0] == "cols":
            raise TypeError("only the rows of a matrix of shard vectors are vectors")
        return ShardVector(self.space, self.refs[r], self.bits)

    def stack_with(self, xs: list, dim: int) -> ShardMatrix:
        if dim != 0 or any(not isinstance(x.refs, tuple) for x in xs) or len({x.bits for x in xs}) != 1:
            raise ValueError("shard matrices stack as one client's columns per row only")
        return ShardMatrix(self.space, [x.refs for x in xs], xs[0].bits)

    def public_columns(self, cols: list[list[torch.Tensor]]) -> PublicColumns:
        """The public S beside these L-BFGS columns, kept as its columns (``PairBuffers.stacked``)."""
        return PublicColumns(self.space, cols)

    # ------------------------------------------------------------------ Starfish's steps
    def estimate(self, model_diff: torch.Tensor, S: Any, Y: ShardMatrix, inverse: Any) -> ShardMatrix:
        """UE on the shards: g_hat = g + H v for every row (``update_estimation``, three phases)."""
        sp = self.space
        if not isinstance(S, PublicColumns):
            S = PublicColumns(sp, [[S[r, :, c] for c in range(S.shape[-1])] for r in range(S.shape[0])])
        s_refs, v_ref = S.names(), sp.public(model_diff)
        parts = sp.run(steps.hvp_sums_program, Y.refs, Y.bits, s_refs, v_ref, sp.block)
        sums = HvpSums(sum(p[0] for p in parts), sum(p[1] for p in parts),
                       sp.gather([p[2] for p in parts]), sp.gather([p[3] for p in parts]))
        c = hvp_solve(sums, inverse)
        coef = [steps.share_of(x) for x in (c.sigma, c.sigma_z1, c.z2)]
        out = sp.name("e")
        bits = sp.run(steps.hvp_apply_program, out, Y.refs, Y.bits, self.refs, self.bits, coef, s_refs, v_ref,
                      sp.block)[0]
        return ShardMatrix(sp, [(out, r) for r in range(len(self))], bits)

    def exceeds(self, thresholds: Any) -> torch.Tensor:
        """SecTC on the shards: one public flag per row (``threshold_check``)."""
        d = B.rescale(B.to_shared_like(thresholds))
        parts = self.space.run(steps.counts_program, self.refs, self.bits, steps.share_of(d), self.space.block)
        if parts[0][1]:     # the engine's 32-bit counts (two-party mode): its comparison, opened
            with np.errstate(over="ignore"):
                total = np.sum(np.stack([c for c, _ in parts]).astype(np.uint32), axis=0, dtype=np.uint32)
            return torch.from_numpy(session_engine().any_hits(total.view(np.int32))).to(torch.int64)
        total = self.space.gather([(c, 0) for c, _ in parts])
        return flags_from_counts(total).reshape(-1).to(torch.int64)

    def inner(self, other: Any) -> Any:
        """Row-wise inner products with a public (rows, m) tensor or with the rows themselves."""
        sp = self.space
        if other is self:
            parts = sp.run(steps.inner_program, self.refs, self.bits, None, None)
            return inner_finish(sp.gather(parts), None)
        if B.is_shared(other):
            raise TypeError("shard rows times another secret: only with themselves")
        y = torch.as_tensor(other, dtype=torch.float64)
        e = public_bits(y)
        # row by row to the workers (each named while it is in use), so that the object store
        # never holds all of a (rows, m) factor at once (round selection's T model steps)
        rows = list(y.reshape(-1, y.shape[-1]))
        names = [sp.public(r) for r in rows]
        parts = sp.run(steps.inner_program, self.refs, self.bits, ("rows", names, tuple(y.shape[:-1])), e)
        del rows
        return inner_finish(sp.gather(parts), e)


# ------------------------------------------------------------------ the ports on shards
class ShardHistory(HistoryView):
    """``base`` (this server's shares) with every update read onto the shards: put there at its
    first read (or, where the store keeps it on the shards, read there by the workers) and kept
    while Stage II references it (a round's rows while it is replayed)."""

    def __init__(self, base: History, space: ShardSpace) -> None:
        super().__init__(base)
        self.space = space
        self._read: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def update(self, i: int, client: int) -> Secret:
        held = self._read.get((i, client))
        if held is None:
            stored = self._base.stored_update(i, client)
            held = self.space.load(*stored) if stored is not None else self.space.put(self._base.update(i, client))
            self._read[(i, client)] = held
        return held


class ShardClients:
    """``base``'s exact updates (this server's shares of the answers) put onto the shards."""

    def __init__(self, base: CorrectionClients, space: ShardSpace) -> None:
        self._base, self.space = base, space

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Secret]:
        return {j: self.space.put(x) for j, x in self._base.exact_updates(round_index, model, client_ids).items()}


class PublicColumns:
    """S (n, m, B), public, as its columns: each distinct s tensor goes to the workers once
    (``ShardSpace.public``) and every estimate names it instead of sending it."""

    def __init__(self, space: ShardSpace, cols: list[list[torch.Tensor]]) -> None:
        self.space, self.cols = space, cols

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.cols), self.space.dim, len(self.cols[0]) if self.cols else 0)

    def names(self) -> list[list[str]]:
        return [[self.space.public(s) for s in row] for row in self.cols]
