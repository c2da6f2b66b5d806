"""CrypTen tuple provider backed by the dealer (``mpc.dealer``).

CrypTen asks its provider for triples, squares, binary triples and random bits. Both
servers make the same calls in the same order (the sizes never depend on data), so a
running request index keeps them and the dealer in step. Party 0 derives everything
from its seed; party 1 derives its free shares and takes the correction from the dealer,
either per request (online fetch), from a cache filled before the online phase
(``prefill`` with a plan recorded in an earlier run), or from a bounded buffer that a
background thread fills while the session computes (``fetch_ahead``, the same kind of plan:
the dealer's link and work then overlap the parties' own). Every request is recorded, which
is how such a plan is obtained. A plan is a guess, never trusted: a request that differs
from it is answered afresh (its number keyed by the request itself, ``correlations.request_prg``,
so the material fetched for the guess is unrelated to it).
"""

from __future__ import annotations

import logging
import threading

import torch

from . import correlations
from .crypten_compat import ArithmeticSharedTensor as AST
from .crypten_compat import BinarySharedTensor as BST
from .crypten_compat import TupleProviderBase
from .dealer import DealerLink

NAME = "STARFISH_DEALER"
log = logging.getLogger("starfish.provider")
#: seconds a closing session waits for the background fetch to leave the dealer link
DETACH_WAIT = 30.0


class DealerProvider(TupleProviderBase):
    NAME = NAME

    def __init__(self) -> None:
        super().__init__()
        self._link: DealerLink | None = None
        self._rank = -1
        self._seed = b""
        self._index = 0
        self._mask_next = correlations.MASK_STREAM
        self._stream_cache: dict[int, tuple] = {}
        self._cache: dict[int, tuple[tuple, tuple[torch.Tensor, ...]]] = {}
        self.recorded: list[tuple] = []
        self.cache_misses = 0
        self.served_ahead = 0          # corrections taken from the background fetch (this session)
        self._ahead: _Ahead | None = None

    def attach(self, rank: int, link: DealerLink) -> None:
        self._stop_ahead()
        self._link, self._rank, self._seed = link, rank, link.seed
        self._index, self._cache, self.recorded, self.cache_misses = 0, {}, [], 0
        self._mask_next, self._stream_cache, self.served_ahead = correlations.MASK_STREAM, {}, 0

    def detach(self) -> None:
        # the session closes the link next (party 1 says bye on it): the thread must be off it
        # first, since one TLS connection takes no two writers. It ends after its piece in
        # flight (at most ``_Ahead.PIECE`` bytes); a dealer that stopped answering is waited for
        # at most ``DETACH_WAIT`` seconds, then the close goes ahead and ends the fetch
        if self._ahead is not None:
            if not self._ahead.stop(timeout=DETACH_WAIT):
                log.warning("dealer fetch-ahead still waiting on the dealer after %.0f s; closing the link",
                            DETACH_WAIT)
            self._ahead = None
        self._link = None

    def fetch_ahead(self, plan: list[tuple], budget_bytes: int = 256 << 20) -> None:
        """Fetch the corrections of the next ``len(plan)`` requests in a background thread while
        the session computes, holding at most ``budget_bytes`` of them at once. Party 1 only
        (party 0 derives its shares from its seed and fetches nothing). A request that differs
        from the plan stops the thread; it and every later request are answered as usual."""
        if self._rank != 1 or not plan:
            return
        self._stop_ahead()
        plan = [correlations.validate(r) for r in plan]
        self._ahead = _Ahead(self._require_link(), self._index, plan, budget_bytes)

    def _stop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

    # ----------------------------------------------------------------- offline
    def prefill(self, plan: list[tuple]) -> None:
        """Fetch/derive the shares of the next ``len(plan)`` requests ahead of time."""
        start = self._index
        plan = [correlations.validate(r) for r in plan]
        self._stop_ahead()
        if self._rank == 0:
            shares = [correlations.party0_shares(r, self._seed, start + k) for k, r in enumerate(plan)]
        else:
            corrs = self._require_link().prefill(start, plan)
            shares = [correlations.party1_shares(r, self._seed, start + k, c)
                      for k, (r, c) in enumerate(zip(plan, corrs))]
        for k, (r, s) in enumerate(zip(plan, shares)):
            self._cache[start + k] = (r, s)

    # ------------------------------------------------------------------ online
    def _require_link(self) -> DealerLink:
        if self._link is None:
            raise RuntimeError("dealer provider used outside a two-party session")
        return self._link

    def _shares(self, req: tuple) -> tuple[torch.Tensor, ...]:
        self._require_link()
        i = self._index
        self._index += 1
        self.recorded.append(req)
        cached = self._cache.pop(i, None)
        if cached is not None and cached[0] == req:
            return cached[1]
        if cached is not None:
            # both parties see the same mismatch (same plan, same calls) and both derive
            # afresh for index i, so they stay consistent; the dealer derives by index too.
            self.cache_misses += 1
            log.warning("dealer plan mismatch at request %d: planned %s, got %s", i, cached[0][:1], req[:1])
        if self._rank == 0:
            return correlations.party0_shares(req, self._seed, i)
        corr = None
        if self._ahead is not None:
            corr = self._ahead.take(i, req)
            if corr is None:          # off the plan: the thread has stopped, the link is ours
                self._ahead = None
            else:
                self.served_ahead += 1
        if corr is None:
            corr = self._link.get(i, req)
        return correlations.party1_shares(req, self._seed, i, corr)

    def generate_additive_triple(self, size0, size1, op, device=None, *args, **kwargs):
        a, b, c = self._shares(correlations.make_request("triple", size0, size1, op, *args, **kwargs))
        return AST.from_shares(a, precision=0), AST.from_shares(b, precision=0), AST.from_shares(c, precision=0)

    def square(self, size, device=None):
        r, r2 = self._shares(correlations.make_request("square", size))
        return AST.from_shares(r, precision=0), AST.from_shares(r2, precision=0)

    def generate_binary_triple(self, size0, size1, device=None):
        a, b, c = self._shares(correlations.make_request("binary_triple", size0, size1))
        return BST.from_shares(a, precision=0), BST.from_shares(b, precision=0), BST.from_shares(c, precision=0)

    def wrap_rng(self, size, device=None):
        r, theta = self._shares(correlations.make_request("wrap_rng", size))
        return AST.from_shares(r, precision=0), AST.from_shares(theta, precision=0)

    def edabits(self, size, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This party's shares of a random r < 2**bits: (ring share of r, XOR share of its
        bit planes, shape (bits, words)). Raw tensors, for ``mpc.nonnegative``."""
        r, planes = self._shares(correlations.make_request("edabit", size, bits))
        return r, planes

    def trunc_pairs(self, size, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This party's ring shares of a uniform r, of msb(r), and of r >> d (logical) for each
        d = lo..hi stacked in front. Raw tensors, for ``mpc.truncation``."""
        return self._shares(correlations.make_request("trunc_pair", size, lo, hi))

    # ------------------------------------------------- reusable masks (``mpc.reused_masks``)
    def _stream(self, reqs: list[tuple]) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
        """(request number, shares) of ``reqs`` in the mask stream: numbers from ``MASK_STREAM``
        on, apart from the planned sequence, because which masks exist depends on the replay's
        state (a column is opened once, then reused), so these requests cannot be part of a
        per-step template (``bench/offline.py``). Party 1 fetches a whole batch in one exchange."""
        start = self._mask_next
        ready = [self._stream_cache.pop(start + k, None) for k in range(len(reqs))]
        if reqs and all(r is not None and r[0] == req for r, req in zip(ready, reqs)):
            self._mask_next += len(reqs)
            return [(start + k, r[1]) for k, r in enumerate(ready)]
        self._stream_cache.clear()   # not what was fetched ahead (both parties see the same): derive afresh
        self._stop_ahead()           # the link is needed here: no thread may use it meanwhile
        self._mask_next += len(reqs)
        if self._rank == 0:
            return [(start + k, correlations.party0_shares(r, self._seed, start + k)) for k, r in enumerate(reqs)]
        corrs = self._require_link().prefill(start, reqs)
        return [(start + k, correlations.party1_shares(r, self._seed, start + k, c))
                for k, (r, c) in enumerate(zip(reqs, corrs))]

    def prefetch_stream(self, reqs: list[tuple]) -> None:
        """Fetch the next ``reqs`` of the mask stream ahead of the step that will ask for them
        (their material is offline work: ``Replay`` meters it as the step's offline part)."""
        reqs = [correlations.validate(r) for r in reqs]
        self._stop_ahead()
        start = self._mask_next
        if self._rank == 0:
            shares = [correlations.party0_shares(r, self._seed, start + k) for k, r in enumerate(reqs)]
        else:
            corrs = self._require_link().prefill(start, reqs)
            shares = [correlations.party1_shares(r, self._seed, start + k, c) for k, (r, c) in enumerate(zip(reqs, corrs))]
        self._stream_cache = {start + k: (r, sh) for k, (r, sh) in enumerate(zip(reqs, shares))}

    def masks(self, sizes) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per size: (request number, this party's ring share of a fresh uniform mask a, its share
        of sum(a * a), shape (1,)); the number is how ``masked_matvecs`` names a later."""
        out = self._stream([correlations.make_request("mask", size) for size in sizes])
        return [(i, shares[0], shares[1]) for i, shares in out]

    def masked_matvecs(self, items) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per (mask numbers, size): this party's ring shares of a fresh b (one entry per mask)
        and of c = sum_k a_k * b_k, with a_k the masks named (each of shape ``size``)."""
        out = self._stream([correlations.make_request("mask_matvec", masks, size) for masks, size in items])
        return [shares for _, shares in out]

    def compare_tables(self, size) -> tuple[torch.Tensor, torch.Tensor]:
        """This party's share of a random r mod 2**32 (int64 whose low 32 bits count) and its XOR
        share of r's comparison tables (``correlations.comparison_tables`` as the (4, n) int64
        words of ``correlations.tables_as_words``), for ``mpc.table_compare``."""
        r, tables = self._shares(correlations.make_request("cmp_tables", size))
        return r, tables

    def B2A_rng(self, size, device=None):
        ra, rb = self._shares(correlations.make_request("b2a_rng", size))
        return AST.from_shares(ra, precision=0), BST.from_shares(rb, precision=0)


class _Ahead:
    """Party 1's background fetch of a plan's corrections (``DealerProvider.fetch_ahead``).

    The thread owns the dealer link until it stops: it asks for the plan in pieces of at most
    ``min(budget / 4, PIECE)`` bytes and waits while ``budget`` bytes are unclaimed. ``take`` hands out
    request ``i``'s correction once it has arrived; a request off the plan stops the thread
    (after its piece in flight) and returns None.
    """

    #: bytes of corrections asked for in one message: a stop waits for at most one such piece
    #: (2 s at 1 Gbit/s, 21 s at 100 Mbit/s). Between two pieces the dealer idles for a round
    #: trip and a request's making: with 32 MB pieces a FedSECA round on the MNIST shapes took
    #: 63.9 s where 256 MB gave 58.1-58.7 s (bench/README.md)
    PIECE = 256 << 20

    def __init__(self, link: DealerLink, start: int, plan: list[tuple], budget: int) -> None:
        self._link, self._start, self._plan, self._budget = link, start, plan, max(1, budget)
        self._ready: dict[int, torch.Tensor] = {}
        self._held = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dealer-ahead", daemon=True)
        self._thread.start()

    @staticmethod
    def _nbytes(req: tuple) -> int:
        n = 8
        for d in correlations.correction_shape(req):
            n *= int(d)
        return n

    def _run(self) -> None:
        try:
            k = 0
            while k < len(self._plan):
                piece, size = [], 0
                limit = min(self._budget // 4, self.PIECE)
                while k + len(piece) < len(self._plan) and (not piece or size < limit):
                    req = self._plan[k + len(piece)]
                    piece.append(req)
                    size += self._nbytes(req)
                with self._cond:
                    while not self._stopping and self._held > 0 and self._held + size > self._budget:
                        self._cond.wait()
                    if self._stopping:
                        return
                corrs = self._link.prefill(self._start + k, piece)
                with self._cond:
                    for off, corr in enumerate(corrs):
                        self._ready[self._start + k + off] = corr
                    self._held += size
                    self._cond.notify_all()
                k += len(piece)
        except BaseException as exc:   # handed to the computing thread by ``take``
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def take(self, index: int, req: tuple) -> torch.Tensor | None:
        pos = index - self._start
        if not (0 <= pos < len(self._plan)) or self._plan[pos] != req:
            self.stop()
            return None
        with self._cond:
            while index not in self._ready and self._error is None:
                self._cond.wait()
            if index not in self._ready:
                raise self._error
            corr = self._ready.pop(index)
            self._held -= self._nbytes(req)
            self._cond.notify_all()
            return corr

    def stop(self, timeout: float | None = None) -> bool:
        """Stop fetching and wait for the thread (at most ``timeout`` seconds); True once it
        has left the link."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
