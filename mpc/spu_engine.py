"""The two-party (dealer-free) engine as a server process sees it: SecretFlow SPU's CHEETAH
protocol between the two servers, run in a child process (``mpc.spu_process``, the only module
that imports ``spu`` or ``jax``), for one session or, kept by an ``EnginePool`` (``mpc.engine_pool``), for as many
sessions as the daemon runs.

The link. SPU talks over its own sockets (brpc). Both ends use TLS 1.3 with mutual
authentication, with keys that exist for this engine only: each party makes a fresh EC key and
a self-signed certificate, and the two certificates are exchanged over the servers' own
authenticated channel (``net.channel``, the deployment's certificates). Each party then trusts
exactly the peer's certificate and nothing else, so no other key can join the link, not even a
certificate of the deployment's CA (which also signs clients), and the private keys never touch a
disk outside a 0700 directory that is removed when the engine closes. Both sides' traffic passes
through ``mpc.metered_relay`` on loopback, which counts it at the sockets and applies the
emulated link.

Why a pool (issue 26, ``mpc.engine_pool``): starting an engine (a process importing jax and SPU,
the link's TLS handshakes, CHEETAH's OT set-up) took most of an FL round's range check in two-party
mode (about 10 s). ``EnginePool`` keeps one engine per peer pair for the daemon's life; each
session borrows it (``mpc.session.open_party(engine_pool=...)``), after both servers have agreed
over the session's authenticated channel that they hold the two ends of the same link and a barrier
has crossed it. An engine whose process died, whose peer closed the link, or that failed inside a
call is dropped and a fresh one made for the next session; a call waiting on a peer that is gone
fails within seconds (``_PEER_GRACE``), not at a timeout.

What runs here (``docs/protocols.md``, "Two-party mode"): products of two sharings, the sign
test, the window test, exact truncation and SecTC's test over all rows.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from net.channel import KIND_OBJECT, Channel
from net.link import NO_LINK, LinkProfile
from net.metering import KINDS, Meter
from .engine_certificate import session_certificate
from .spu_process import (CLOSE_GRACE, CLOSE_WAIT, PRODUCTS, RINGS, EngineError, engine_main, prog_ge0,
                          prog_matmul, prog_mul, prog_trunc_pair, prog_positive, prog_rows_exceed, prog_window)
from common.wire import pack, unpack_bounded

__all__ = ["SpuEngine", "EngineError"]
log = logging.getLogger("starfish.engine")

_BATCH = 1 << 20                 # elements per engine run of an elementwise op: bounds its memory
#: coordinates per engine call of SecTC's test (all rows x some columns); the engine peaked at
#: about 2.6 GB for 800,000 of them, and a server's party and engine together stay below 6 GiB
_EXCEED_BATCH = 3 << 18
#: rows of a 2-D matmul's left operand per engine call, times its columns: the engine peaked at
#: 2.07 GB for (582,026 x 38) @ (38 x 1), a replayed round's folded estimate (issue 26)
_MATMUL_ELEMENTS = 1 << 25
#: matmuls up to this many scalar products run as one elementwise product (``SpuEngine.product``)
_ELEMENTWISE_PRODUCTS = 1 << 15
#: elementwise calls of up to this many elements are padded to one of four sizes per octave
#: (``_padded_size``): the engine compiles a program per input shape (36-70 ms a party), and small
#: calls come in many sizes (a round's uploads, a step's rows); larger ones repeat (full batches)
_PAD_UP_TO = 1 << 16
_START_TIMEOUT = 120.0           # seconds the engine process may take to start (imports jax, SPU)
_POLL = 0.2                      # seconds between liveness checks while a call is in flight
#: seconds a call may still answer after the peer closed the link or the session's channel (its
#: last reply may be on the way); then the engine is ended and the call fails
_PEER_GRACE = 3.0
_PROBE_TIMEOUT = 10.0            # seconds a reused engine's barrier may take at a session's start


def _padded_size(n: int, least: int = 16) -> int:
    """n rounded up to one of four sizes per octave (at most 25% more; at least ``least``); n
    itself above ``_PAD_UP_TO``."""
    if n > _PAD_UP_TO:
        return n
    if n <= least:
        return least
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    """1-D x with zeros appended up to length n (x itself when it has that length)."""
    return x if x.size == n else np.concatenate([x, np.zeros(n - x.size, x.dtype)])


def _scalar_products(a_shape: tuple, b_shape: tuple) -> int:
    """Scalar multiplications in a (..., i, k) @ (..., k, j), the broadcast batch included."""
    lead = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    return int(np.prod(lead, dtype=np.int64)) * a_shape[-2] * a_shape[-1] * b_shape[-1]


def _unsigned(dtype):
    return np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint64


class SpuEngine:
    """One CHEETAH runtime between the two servers, for the life of a two-party session.

    Why a process of its own: the library's link sends asynchronously, and a send that fails
    (the peer stopped its link a moment early, or died) ends the whole process from inside the
    library. A server daemon must survive that, so SPU, its link and the metered relays live in a
    child process for the session; this object hands it the work and copies the child's meter
    counts into the session's meter after every call.
    """

    def __init__(self, rank: int, channel: Channel, meter: Meter, *, link: LinkProfile = NO_LINK,
                 timeout: float = 120.0, trust_override: bytes | None = None,
                 link_timeout: float | None = None):
        """Set up the link; both parties call this at the same point of their session.

        ``trust_override`` (tests only): trust this PEM instead of the peer's certificate (a
        wrong certificate is refused). ``link_timeout``: how long the library's receives wait in a
        call (default ``timeout``; a pooled engine's is longer: it outlives its first session)."""
        self.rank = rank
        self.meter = meter
        self._channel: Channel | None = channel
        self._timeout = timeout
        self._lock = threading.Lock()
        self._counts = {f"{k}_{f}": 0 for k in KINDS for f in ("sent", "received", "rounds")}
        self._dir = tempfile.mkdtemp(prefix="starfish-spu-")
        self._proc = None
        self._conn = None
        self._stuck = False
        self.broken = False          # failed inside a call, or its peer left: never reused
        self.link_id = ""
        self.started = time.monotonic()
        self._pool: Any = None        # the mpc.engine_pool.EnginePool that keeps this engine, if any
        self.in_use = False
        self.answered = time.monotonic()   # when the engine last answered a call
        try:
            cert, key, pem = session_certificate(self._dir, f"starfish-spu-{rank}")
            own_host, peer_host = channel.hosts
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._peer_gone = ctx.Event()
            self._proc = ctx.Process(target=engine_main, name=f"engine{rank}", daemon=False,
                                     args=(child, dict(rank=rank, dir=self._dir, cert=cert, key=key, link=link,
                                                       listen_host=own_host, peer_host=peer_host,
                                                       timeout=timeout,
                                                       link_timeout=link_timeout,
                                                       log_level=logging.getLogger().level),
                                           self._peer_gone))
            self._proc.start()
            child.close()
            inbound_port = self._reply(_START_TIMEOUT)
            nonce = os.urandom(8)
            channel.send_frame(KIND_OBJECT, pack({"cert": pem, "port": inbound_port, "nonce": nonce}))
            peer = unpack_bounded(channel.recv_frame(KIND_OBJECT), max_bin_len=1 << 16, max_map_len=4)
            if not isinstance(peer, dict) or not isinstance(peer.get("cert"), bytes) \
                    or not isinstance(peer.get("port"), int) or not isinstance(peer.get("nonce"), bytes):
                raise EngineError("malformed two-party link offer from the peer")
            # a link id of its own per session (brpc keeps services of earlier links)
            ids = (nonce, peer["nonce"]) if rank == 0 else (peer["nonce"], nonce)
            self.link_id = "starfish-" + b"".join(ids).hex()
            # the library retries a refused handshake for about 10 s an attempt, whatever it is
            # told: the session's timeout is kept here, by ending the engine process
            try:
                self._call("connect", peer_host, peer["port"],
                           trust_override if trust_override is not None else peer["cert"],
                           self.link_id, timeout=timeout)
            except EngineError as exc:
                if not self._stuck:
                    raise
                raise EngineError(f"the two-party link did not come up within {timeout:.0f}s (a refused "
                                  "certificate, or no peer engine)") from exc
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _reply(self, timeout: float):
        """The engine's answer, waiting at most ``timeout`` seconds; fails fast (``_PEER_GRACE``)
        once the peer is gone: its engine closed the link (its process died: the kernel closes
        its sockets) or the peer left the session's channel. Then the engine is ended: its
        library would wait for the peer up to its own receive timeout."""
        deadline = time.monotonic() + timeout
        gone_since = None
        while not self._conn.poll(_POLL):
            now = time.monotonic()
            how = self._peer_left()
            if how:
                gone_since = now if gone_since is None else gone_since
                if now - gone_since >= _PEER_GRACE:
                    self._stuck = self.broken = True
                    raise EngineError(f"the peer's two-party engine is gone ({how})")
            if now >= deadline:
                self._stuck = True   # close() ends it at once: it would not hear a close request
                raise EngineError(f"the two-party engine did not answer within {timeout:.0f}s")
        try:
            status, value, counts = self._conn.recv()
        except EOFError:
            self.broken = True
            self._proc.join(1.0)
            code = self._proc.exitcode if self._proc is not None else None
            if self._peer_left():
                # the engine library may crash (SIGSEGV) on a link its peer dropped: name the cause
                raise EngineError("the peer's two-party engine is gone (its link closed; ours then "
                                  f"ended with exit code {code})") from None
            raise EngineError(f"the two-party engine process ended (exit code {code})") from None
        self._account(counts)
        self.answered = time.monotonic()
        if status != "ok":
            self.broken = True   # a failed call may leave the link's sequence out of step
            raise EngineError(value)
        return value

    def _peer_left(self) -> str:
        """Which sign of a departed peer is seen, if any: the session's channel closed, or the
        peer closed every connection of the link (the relays saw it); "" while it is there."""
        if self._channel is not None and self._channel.peer_closed:
            return "the session's channel closed"
        if self._peer_gone.is_set():
            return "it closed every connection of the link"
        return ""

    def _account(self, counts: dict | None) -> None:
        """Copy the growth of the child's counters into this session's meter (open steps)."""
        if not counts:
            return
        if self.meter is None:   # between sessions (a pooled engine): nothing to charge
            self._counts = dict(counts)
            return
        for kind in KINDS:
            for field, add in (("sent", self.meter.sent), ("received", self.meter.received)):
                delta = counts[f"{kind}_{field}"] - self._counts[f"{kind}_{field}"]
                if delta:
                    add(kind, delta)
                    self.meter.wire(kind, **{field: delta})
            for _ in range(counts[f"{kind}_rounds"] - self._counts[f"{kind}_rounds"]):
                self.meter.round(kind)
        self._counts = dict(counts)

    def _call(self, op: str, *args, timeout: float | None = None):
        with self._lock:
            if self._conn is None:
                raise EngineError("the two-party engine is closed")
            try:
                self._conn.send((op, args))
            except (BrokenPipeError, OSError):
                self.broken = True
                raise EngineError("the two-party engine process is gone") from None
            return self._reply(self._timeout * 4 if timeout is None else timeout)

    def run(self, name: str, fn: Callable, inputs: list[np.ndarray], *, kind: str = "online",
            bits: int = 64) -> list[np.ndarray]:
        """Run ``fn`` (a module-level jax function, or a partial of one: it is pickled into the
        engine process) on secret inputs given as this party's shares; returns this party's
        shares of the outputs. ``bits`` = 64 (our ring) or 32 (values that fit 32 bits, shares
        taken mod 2**32: cheaper comparisons). Both parties call it with the same name,
        function and shapes."""
        dtype = RINGS[bits][3]
        return self._call("run", name, fn, [np.ascontiguousarray(x, dtype=dtype) for x in inputs], kind, bits)

    # ------------------------------------------------------------------ sessions (pool)
    def bind(self, channel: Channel, meter: Meter, timeout: float) -> None:
        """Serve the session of ``channel``: its meter gets the engine's traffic from now on."""
        self._channel, self.meter, self._timeout = channel, meter, timeout

    def alive(self) -> bool:
        """This side's engine process runs, has not failed, and its peer has not left the link."""
        return (self._conn is not None and self._proc is not None and self._proc.is_alive()
                and not self.broken and not self._stuck and not self._peer_gone.is_set())

    def probe(self) -> bool:
        """A barrier over the link (bounded): both engines are there, on the same link."""
        try:
            return bool(self._call("probe", _PROBE_TIMEOUT, timeout=_PROBE_TIMEOUT + 10.0))
        except EngineError:
            return False

    @property
    def pid(self) -> int | None:
        """The engine process's id (tests: a reused engine keeps it)."""
        return self._proc.pid if self._proc is not None else None

    def open_public(self, share: np.ndarray) -> np.ndarray:
        """Both parties learn the value of a (small) sharing: each sends its share over the
        servers' own channel. Only for values the protocol makes public (e.g. SecTC's flags)."""
        mine = np.ascontiguousarray(share)
        self._channel.send_frame(KIND_OBJECT, mine.tobytes())
        other = np.frombuffer(self._channel.recv_frame(KIND_OBJECT, mine.nbytes), dtype=mine.dtype)
        return (mine.view(_unsigned(mine.dtype)) + other.view(_unsigned(mine.dtype))).view(mine.dtype) \
            .reshape(mine.shape)

    # ------------------------------------------------------------------ operations
    def _elementwise(self, name: str, fn: Callable, *shares: np.ndarray, kind: str = "online") -> np.ndarray:
        """``fn`` on flat batches of at most ``_BATCH`` elements (shapes repeat, programs are reused)."""
        shape = np.shape(shares[0])
        flat = [np.ascontiguousarray(s, dtype=np.int64).reshape(-1) for s in shares]
        n = flat[0].size
        out = np.empty(n, dtype=np.int64)
        for off in range(0, n, _BATCH):
            part = [f[off : off + _BATCH] for f in flat]
            out[off : off + part[0].size] = self._run_flat(name, fn, part, kind=kind)[0]
        return out.reshape(shape)

    def _run_flat(self, name: str, fn: Callable, flat: list[np.ndarray], *, kind: str = "online",
                  bits: int = 64) -> list[np.ndarray]:
        """``run`` of an elementwise ``fn`` on 1-D inputs of one length, padded with shares of
        zero to ``_padded_size`` (so programs are reused across lengths); the padding's outputs
        are dropped, never opened."""
        n = flat[0].size
        size = _padded_size(n)
        outs = self.run(name, fn, [_pad(np.asarray(f), size) for f in flat], kind=kind, bits=bits)
        return [o[:n] for o in outs]

    def nonnegative(self, share: np.ndarray) -> np.ndarray:
        """Share of [x >= 0] (x read as a signed ring element), 0/1 in the ring."""
        if share.size == 0:
            return np.zeros(np.shape(share), np.int64)
        return self._elementwise("ge0", prog_ge0, share, np.zeros(np.shape(share), np.int64))

    def below_power_of_two(self, share: np.ndarray, k: int) -> np.ndarray:
        """Share of [x < 2**k] with x read as unsigned (0 .. 2**64 - 1); 1 <= k <= 63.

        Unsigned x < 2**k iff signed x >= 0 and y = 2**k - 1 - x >= 0: for x >= 0, y lies in
        (2**k - 2**63, 2**k - 1] and cannot wrap; for x < 0 the first test is 0 whatever y is.
        y's shares are x's, negated, with party 0 adding 2**k - 1 (local), so the engine's
        program does not depend on k; for k = 63 the second test is always true."""
        if share.size == 0:
            return np.zeros(np.shape(share), np.int64)
        if k == 63:
            return self.nonnegative(share)
        x = np.ascontiguousarray(share, dtype=np.int64)
        y = -x + np.int64((1 << k) - 1) if self.rank == 0 else -x
        return self._elementwise("window", prog_window, x, y, np.zeros(np.shape(x), np.int64))

    def floor(self, share: np.ndarray, d: int) -> np.ndarray:
        """Share of floor(x / 2**d), exactly, for a signed ring element |x| < 2**62, 1 <= d <= 62.

        SPU's right shift of a secret converts all 64 bits to boolean shares; this takes two sign
        tests on small values instead. With the bias x' = x + 2**62 (in [0, 2**63))
        and the shares read unsigned, x0 + x1 = x' + w 2**64, and
            floor(x' / 2**d) = (x0 >> d) + (x1 >> d) + carry - w 2**(64 - d)
        with carry = [x0 mod 2**d + x1 mod 2**d >= 2**d] and, because x' < 2**63,
        w = msb(x0) OR msb(x1) = [msb(x0) + msb(x1) >= 1]. Both bits are sign tests of values
        the parties already hold as tiny additive parts (no wrap), in one engine call."""
        if share.size == 0:
            return np.array(share, dtype=np.int64, copy=True)
        x = np.ascontiguousarray(share, dtype=np.int64).reshape(-1)
        if self.rank == 0:
            x = x + np.int64(1 << 62)
        u = x.view(np.uint64)
        low = (u & np.uint64((1 << d) - 1)).astype(np.int64)
        high = (u >> np.uint64(d)).astype(np.int64)
        msb = (u >> np.uint64(63)).astype(np.int64)
        if self.rank == 0:
            low = low - np.int64(1 << d)
            msb = msb - 1
        bits = self.nonnegative(np.concatenate([low, msb]))
        n = x.size
        carry, wrap = bits[:n], bits[n:]
        out = (high.view(np.uint64) + carry.view(np.uint64)
               - wrap.view(np.uint64) * np.uint64(1 << (64 - d)))   # uint64 wraps as the ring does
        if self.rank == 0:
            out -= np.uint64(1 << (62 - d))
        out = out.view(np.int64)
        return out.reshape(np.shape(share))

    def truncation_pairs(self, r: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
        """This party's shares of msb(r) and of r >> d (logical), r = r0 + r1 mod 2**64 and ``r``
        this party's own uniform r_i: the rest of a truncation pair (``mpc.truncation``), 1 <= d <= 62.
        With r0 + r1 = r + w 2**64: r >> d = (r0 >> d) + (r1 >> d) + c_d - w 2**(64 - d) and
        msb(r) = m0 + m1 + c63 - 2 w (a full adder), c_d, c63 the carries of the low d and 63 bits,
        w = [m0 + m1 + c63 >= 2]: three sign tests of parts that cannot wrap the signed ring, in
        one engine call (offline). Proof: docs/protocols.md, "Two-party mode"."""
        r = np.ascontiguousarray(r, dtype=np.int64).reshape(-1)
        u = r.view(np.uint64)
        low_d = (u & np.uint64((1 << d) - 1)).astype(np.int64)
        low_63 = (u & np.uint64((1 << 63) - 1)).astype(np.int64)
        msb = (u >> np.uint64(63)).astype(np.int64)
        if self.rank == 0:
            low_d, low_63, s = low_d - np.int64(1 << d), low_63 + np.int64(-(1 << 63)), msb - 2
        else:
            s = msb
        carry_d, carry_63, wrap = (np.empty(r.size, np.int64) for _ in range(3))
        for off in range(0, r.size, _BATCH):
            part = slice(off, off + _BATCH)
            outs = self._run_flat("trunc-pair", prog_trunc_pair, [low_d[part], low_63[part], s[part],
                                                                  np.zeros(low_d[part].size, np.int64)], kind="offline")
            carry_d[part], carry_63[part], wrap[part] = outs
        top = msb + carry_63 - 2 * wrap
        high = ((u >> np.uint64(d)) + carry_d.view(np.uint64)
                - wrap.view(np.uint64) * np.uint64(1 << (64 - d))).view(np.int64)   # wraps as the ring does
        return top, high

    def truncate(self, share: np.ndarray, d: int) -> np.ndarray:
        """Share of x / 2**d for |x| < 2**62: the floor. (CHEETAH's own truncation failed on a
        public factor in SPU 0.9.5 and was wrong by up to 2**39 with a constant one.)"""
        return self.floor(share, d)

    def rows_exceed(self, x: np.ndarray, drop_bits: int, d: np.ndarray) -> np.ndarray:
        """Public flags, one per row of ``x`` (rows, m): does some |y| reach |d|, where y is
        x / 2**drop_bits truncated (floor or one less) and d one shared threshold per row?
        SecTC's test, opened per row only.

        Why 32 bits: SecTC's domain (|y|, |d| < 2**14 at 16 fractional bits) fits, and a 32-bit
        comparison costs about half. Shares are taken mod 2**32; the truncation by ``drop_bits``
        (0..30) is local and drops the carry, so y is the floor or one less (the test moves by
        at most 2**-16 at the threshold); |y| >= |d| is [y >= |d|] OR [y <= -|d|].

        All rows go through the same engine calls (``rows_hits``; docs/protocols.md, SecTC).
        """
        rows, m = x.shape
        if m == 0 or rows == 0:
            self._check_drop(drop_bits)
            return np.zeros(rows, dtype=bool)
        hits, blocks = self._rows_hits(x, drop_bits, d, _EXCEED_BATCH)
        return self.open_public(self._positive32(hits) if blocks > 1 else hits) != 0

    def rows_hits(self, x: np.ndarray, drop_bits: int, d: np.ndarray, batch: int = _EXCEED_BATCH) -> np.ndarray:
        """:meth:`rows_exceed`'s test left shared: 32-bit shares (int32, rows) of how many of the
        row's blocks of columns (at most ``batch`` coordinates a call) hold a hit; a coordinate
        shard's pair hands these to its coordinator, which adds the shards' (no wrap: a count of
        blocks) and opens [sum > 0] once (:meth:`any_hits`). Zero shares for an empty shard."""
        rows, m = x.shape
        if m == 0 or rows == 0:
            self._check_drop(drop_bits)
            return np.zeros(rows, dtype=np.int32)
        return self._rows_hits(x, drop_bits, d, batch)[0]

    def any_hits(self, hits: np.ndarray) -> np.ndarray:
        """Public flags [count > 0] of 32-bit shared counts (:meth:`rows_hits`, added over the
        shards mod 2**32): one comparison and one opened bit per row."""
        hits = np.asarray(hits).astype(np.uint32).view(np.int32)   # any integer dtype, taken mod 2**32
        if hits.size == 0:
            return np.zeros(0, dtype=bool)
        return self.open_public(self._positive32(hits)) != 0

    @staticmethod
    def _check_drop(drop_bits: int) -> int:
        k = int(drop_bits)
        if not 0 <= k <= 30:
            raise ValueError(f"rows_exceed drops 0..30 bits, got {k}")
        return k

    def _rows_hits(self, x: np.ndarray, drop_bits: int, d: np.ndarray, batch: int) -> tuple[np.ndarray, int]:
        """(32-bit shares of the per-row count of blocks with a hit, blocks per row) for a
        non-empty ``x``: blocks of (all rows) x (columns) of at most ``batch`` coordinates (the
        engine's memory grows with a call); a block's per-row OR inside its call, the block bits
        (0/1 each: no wrap) summed locally."""
        k = self._check_drop(drop_bits)
        u = np.ascontiguousarray(x, dtype=np.int64).view(np.uint64)
        if self.rank == 0 and k:
            u = u + np.uint64(1 << 62)
        y = (u >> np.uint64(k)).astype(np.uint32).view(np.int32)
        d = np.ascontiguousarray(d, dtype=np.int64).view(np.uint64).astype(np.uint32).view(np.int32)
        rows, m = y.shape
        row_block = min(rows, batch)
        col_block = max(1, min(m, batch // row_block))
        out = np.empty(rows, dtype=np.uint32)
        for r0 in range(0, rows, row_block):
            r1 = min(rows, r0 + row_block)
            zero = np.zeros(r1 - r0, np.int32)
            hits = np.zeros(r1 - r0, np.uint32)
            for c0 in range(0, m, col_block):
                hits += self.run("rows-exceed", prog_rows_exceed, [y[r0:r1, c0 : c0 + col_block], d[r0:r1], zero],
                                 bits=32)[0].view(np.uint32)
            out[r0:r1] = hits
        return out.view(np.int32), -(-m // col_block)

    def _positive32(self, c: np.ndarray) -> np.ndarray:
        """32-bit shares of [c > 0] for 32-bit shared counts c."""
        return self._run_flat("any-hit", prog_positive, [c, np.zeros_like(c)], bits=32)[0]

    def product(self, op: str, a: np.ndarray, b: np.ndarray, kind: str = "offline") -> np.ndarray:
        """Share of a op b (``PRODUCTS``: "mul" with broadcasting, "matmul") of two shared
        operands, ring arithmetic mod 2**64; metered as ``kind``: offline when it makes a Beaver
        triple, online when it is the product itself (``direct_product``).

        A large batched matmul runs one batch entry per engine call, a large elementwise product
        in flat batches: the engine's memory grows with a call (5.6 GB for (19, 582026, 2)).

        A small matmul (at most ``_ELEMENTWISE_PRODUCTS`` scalar products) is one elementwise
        multiplication of the broadcast operands (the flat products' programs, reused) summed
        along the inner dimension: the library's matrix product costs about 0.45 s a call however
        small (measured table: docs/protocols.md, "Small products and truncations")."""
        a, b = np.asarray(a), np.asarray(b)
        if a.size == 0 or b.size == 0:   # nothing to compute (the engine would return a public value)
            shape = (np.matmul if op == "matmul" else np.multiply)(np.zeros(a.shape), np.zeros(b.shape)).shape
            return np.zeros(shape, dtype=np.int64)
        if op == "matmul" and a.ndim >= 3 and a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2] \
                and a.size > _BATCH:
            lead = a.shape[:-2]
            a2, b2 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
            outs = [self.run("triple-matmul", prog_matmul, [a2[i], b2[i]], kind=kind)[0]
                    for i in range(a2.shape[0])]
            return np.stack(outs).reshape(*lead, *outs[0].shape)
        if op == "matmul" and _scalar_products(a.shape if a.ndim > 1 else (1, *a.shape),
                                               b.shape if b.ndim > 1 else (*b.shape, 1)) <= _ELEMENTWISE_PRODUCTS:
            # the operands broadcast against each other locally (a share of a broadcast is the
            # broadcast of a share), one flat product, the inner sum local (shares add mod 2**64);
            # 1-D operands are promoted and the added axis dropped, as matmul does
            a2 = a[None, :] if a.ndim == 1 else a
            b2 = b[:, None] if b.ndim == 1 else b
            x, y = np.broadcast_arrays(a2[..., :, :, None], b2[..., None, :, :])
            out = self._elementwise("triple-mul", prog_mul, x, y, kind=kind).sum(axis=-2, dtype=np.int64)
            if b.ndim == 1:
                out = out[..., 0]
            if a.ndim == 1:
                out = out[..., 0, :] if b.ndim > 1 else out[..., 0]
            return out
        if op == "matmul" and a.ndim == 2 and a.size > _MATMUL_ELEMENTS:
            # rows of the output are independent: the left operand in blocks of rows
            rows = max(1, _MATMUL_ELEMENTS // a.shape[1])
            return np.concatenate([self.run("triple-matmul", prog_matmul, [a[r : r + rows], b], kind=kind)[0]
                                   for r in range(0, a.shape[0], rows)])
        if op == "mul":
            # broadcast here, not in the engine: the same products (one per output element), and
            # flat batches whose programs repeat
            a, b = np.broadcast_arrays(a, b)
            return self._elementwise("triple-mul", prog_mul, a, b, kind=kind)
        return self.run(f"triple-{op}", PRODUCTS[op], [a, b], kind=kind)[0]

    # ------------------------------------------------------------------ life
    @property
    def socket_bytes(self) -> tuple[int, int]:
        """(sent, received) at this party's sockets of the engine's link so far."""
        return tuple(self._call("socket_bytes"))

    @property
    def kernel_bytes(self) -> tuple[int, int]:
        """(sent, received) on the same sockets as the kernel counts them (tests' oracle)."""
        return tuple(self._call("kernel_bytes"))

    def close(self) -> None:
        """End this session's use: a pooled engine that is still sound goes back to its pool
        (its process and link stay up); any other engine shuts down."""
        pool = self._pool
        if pool is not None and pool.release(self):
            return
        self.shutdown()

    def shutdown(self, graceful: bool = True, linger: float = 0.0) -> None:
        """End the engine: gracefully, at a barrier with the peer's (a one-off session's end);
        otherwise (a pooled engine dropped alone, a daemon stopping) without one, but a sound
        engine's link stays up until ``linger`` s after its last answer (sends may be in flight)."""
        try:
            conn, proc = self._conn, self._proc
            if not graceful and linger > 0 and self.alive():
                time.sleep(max(0.0, self.answered + linger - time.monotonic()))
            if proc is not None and (self._stuck or not graceful):
                proc.kill()
            if conn is not None and not self._stuck and graceful:
                try:
                    with self._lock:
                        conn.send(("close", ()))
                        # a close that hangs inside the library (its barrier message lost) is cut
                        # short below: the session is over and nothing of ours is left in the engine
                        if conn.poll(CLOSE_WAIT + CLOSE_GRACE + 1.0):
                            status, value, counts = conn.recv()
                            self._account(counts)
                            if status != "ok":
                                log.warning("two-party engine: %s", value)
                except (EOFError, OSError):
                    pass
            if conn is not None:
                self._conn = None
                conn.close()
            if proc is not None:
                proc.join(0.5 if graceful else 10.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)
                self._proc = None
        finally:
            # also when the party is ended meanwhile (run_parties' SIGTERM raises SystemExit here):
            # the directory holds the session's private key
            shutil.rmtree(self._dir, ignore_errors=True)

