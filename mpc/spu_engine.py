"""The two-party (dealer-free) engine as a server process sees it: SecretFlow SPU's CHEETAH
protocol between the two servers, run in a child process per session (``mpc.spu_process``, the
only module that imports ``spu`` or ``jax``).

The link. SPU talks over its own sockets (brpc). Both ends use TLS 1.3 with mutual
authentication, with keys that exist for this session only: each party makes a fresh EC key and
a self-signed certificate, and the two certificates are exchanged over the servers' own
authenticated channel (``net.channel``, the deployment's certificates). Each party then trusts
exactly the peer's certificate and nothing else, so no other key can join the link, not even a
certificate of the deployment's CA (which also signs clients), and the private keys never touch a
disk outside a 0700 directory that is removed when the session closes. Both sides' traffic passes
through ``mpc.metered_relay`` on loopback, which counts it at the sockets and applies the
emulated link.

What runs here (``docs/protocols.md``, "Two-party mode"): products of two sharings, the sign
test, the window test, exact truncation and SecTC's per-row test.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from typing import Callable

import numpy as np

from net.channel import KIND_OBJECT, Channel
from net.link import NO_LINK, LinkProfile
from net.metering import KINDS, Meter
from .spu_process import (CLOSE_GRACE, CLOSE_WAIT, PRODUCTS, RINGS, EngineError, engine_main, prog_exceed,
                          prog_ge0, prog_matmul, prog_mul, prog_window)
from common.wire import pack, unpack_bounded

__all__ = ["SpuEngine", "EngineError"]
log = logging.getLogger("starfish.engine")

_BATCH = 1 << 20                 # elements per engine run of an elementwise op: bounds its memory
_START_TIMEOUT = 120.0           # seconds the engine process may take to start (imports jax, SPU)


def _unsigned(dtype):
    return np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint64


def _session_certificate(directory: str, name: str) -> tuple[str, str, bytes]:
    """A fresh EC key and a self-signed certificate valid for a day: (cert path, key path, PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            # a trust anchor for exactly one peer: it may only sign itself
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = os.path.join(directory, "own.crt"), os.path.join(directory, "own.key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(pem)
    return cert_path, key_path, pem


class SpuEngine:
    """One CHEETAH runtime between the two servers, for the life of a two-party session.

    Why a process of its own: the library's link sends asynchronously, and a send that fails
    (the peer stopped its link a moment early, or died) ends the whole process from inside the
    library. A server daemon must survive that, so SPU, its link and the metered relays live in a
    child process for the session; this object hands it the work and copies the child's meter
    counts into the session's meter after every call.
    """

    def __init__(self, rank: int, channel: Channel, meter: Meter, *, link: LinkProfile = NO_LINK,
                 timeout: float = 120.0, trust_override: bytes | None = None):
        """Set up the link; both parties call this at the same point of their session.

        ``trust_override`` (tests only): trust this PEM instead of the certificate the peer sent,
        which is how a test shows that a wrong certificate is refused.
        """
        self.rank = rank
        self.meter = meter
        self._channel = channel
        self._timeout = timeout
        self._lock = threading.Lock()
        self._counts = {f"{k}_{f}": 0 for k in KINDS for f in ("sent", "received", "rounds")}
        self._dir = tempfile.mkdtemp(prefix="starfish-spu-")
        self._proc = None
        self._conn = None
        self._stuck = False
        try:
            cert, key, pem = _session_certificate(self._dir, f"starfish-spu-{rank}")
            own_host, peer_host = channel.hosts
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=engine_main, name=f"engine{rank}", daemon=False,
                                     args=(child, dict(rank=rank, dir=self._dir, cert=cert, key=key, link=link,
                                                       listen_host=own_host, timeout=timeout,
                                                       log_level=logging.getLogger().level)))
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
            # the library retries a refused handshake for about 10 s an attempt, whatever it is
            # told: the session's timeout is kept here, by ending the engine process
            try:
                self._call("connect", peer_host, peer["port"],
                           trust_override if trust_override is not None else peer["cert"],
                           "starfish-" + b"".join(ids).hex(), timeout=timeout)
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
        if not self._conn.poll(timeout):
            self._stuck = True   # close() ends it at once: it would not hear a close request
            raise EngineError(f"the two-party engine did not answer within {timeout:.0f}s")
        try:
            status, value, counts = self._conn.recv()
        except EOFError:
            code = self._proc.exitcode if self._proc is not None else None
            raise EngineError(f"the two-party engine process ended (exit code {code})") from None
        self._account(counts)
        if status != "ok":
            raise EngineError(value)
        return value

    def _account(self, counts: dict | None) -> None:
        """Copy the growth of the child's counters into this session's meter (open steps)."""
        if not counts:
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
            out[off : off + part[0].size] = self.run(name, fn, part, kind=kind)[0]
        return out.reshape(shape)

    def nonnegative(self, share: np.ndarray) -> np.ndarray:
        """Share of [x >= 0] (x read as a signed ring element), 0/1 in the ring."""
        if share.size == 0:
            return np.zeros(np.shape(share), np.int64)
        return self._elementwise("ge0", prog_ge0, share, np.zeros(np.shape(share), np.int64))

    def below_power_of_two(self, share: np.ndarray, k: int) -> np.ndarray:
        """Share of [x < 2**k] with x read as unsigned (0 .. 2**64 - 1); 1 <= k <= 63."""
        if share.size == 0:
            return np.zeros(np.shape(share), np.int64)
        return self._elementwise(f"below{k}", functools.partial(prog_window, k), share,
                                 np.zeros(np.shape(share), np.int64))

    def floor(self, share: np.ndarray, d: int) -> np.ndarray:
        """Share of floor(x / 2**d), exactly, for a signed ring element |x| < 2**62, 1 <= d <= 62.

        SPU's own right shift of a secret integer goes through a boolean conversion of all 64
        bits, and its fixed-point truncation has one fixed width; so the truncation is written
        here from two sign tests on small values. With the bias x' = x + 2**62 (in [0, 2**63))
        and the shares read unsigned, x0 + x1 = x' + w 2**64, and
            floor(x' / 2**d) = (x0 >> d) + (x1 >> d) + carry - w 2**(64 - d)
        with carry = [x0 mod 2**d + x1 mod 2**d >= 2**d] and, because x' < 2**63,
        w = msb(x0) OR msb(x1) = [msb(x0) + msb(x1) >= 1]. Both bits are sign tests of values
        that are already additively shared by the two parties' own local numbers (no ring wrap:
        they are tiny), done together in one engine call.
        """
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

    def truncate(self, share: np.ndarray, d: int) -> np.ndarray:
        """Share of x / 2**d for |x| < 2**62 (``mpc.truncation``'s contract: floor or one more;
        this one is always the floor). CHEETAH's own fixed-point truncation would be much faster,
        but feeding it a public factor failed inside SPU 0.9.5's value conversion and a constant
        factor compiled to a truncation that was wrong by up to 2**39 on our values: not used."""
        return self.floor(share, d)

    def rows_exceed(self, x: np.ndarray, drop_bits: int, d: np.ndarray) -> np.ndarray:
        """Public flags, one per row of ``x`` (rows, m): does some |y| reach |d|, where y is
        x / 2**drop_bits truncated (floor or one less) and d one shared threshold per row?
        SecTC's test, opened per row only.

        Why 32 bits: SecTC's values are small (domain |y|, |d| < 2**14 at 16 fractional bits, so
        that y -+ |d| fits a signed 32-bit value, as for the dealer mode's ``mpc.table_compare``),
        and in a 32-bit ring a comparison costs about half of a 64-bit one. The
        shares are taken mod 2**32 (a ring homomorphism: still shares of the same value). The
        truncation by ``drop_bits`` (0 <= k <= 30) is local: with the bias 2**62 and the shares
        read unsigned, floor(x' / 2**k) = (x0 >> k) + (x1 >> k) + carry - w 2**(64 - k), and
        mod 2**32 the wrap term and the bias's 2**(62 - k) vanish for k <= 30; the carry
        (0 or 1) is left out, so y is the floor or one less, as the dealer mode's truncation is
        the floor or one more: the test moves by at most one unit (2**-16) at the threshold.
        Then |y| >= |d| is [y >= |d|] OR [y <= -|d|], and the per-row OR is taken in the engine:
        2 comparisons per coordinate, no product, one opened bit per row.
        """
        rows, m = x.shape
        k = int(drop_bits)
        if not 0 <= k <= 30:
            raise ValueError(f"rows_exceed drops 0..30 bits, got {k}")
        if m == 0:
            return np.zeros(rows, dtype=bool)
        u = np.ascontiguousarray(x, dtype=np.int64).view(np.uint64)
        if self.rank == 0 and k:
            u = u + np.uint64(1 << 62)
        high = (u >> np.uint64(k)).astype(np.uint32).view(np.int32)
        dd = np.ascontiguousarray(d, dtype=np.int64).view(np.uint64).astype(np.uint32).view(np.int32)
        zero = np.zeros(1, np.int32)
        bits = np.empty(rows, dtype=np.int32)
        for r in range(rows):
            bits[r] = self.run("exceed", prog_exceed, [high[r], dd[r : r + 1], zero], bits=32)[0][0]
        return self.open_public(bits) != 0

    def product(self, op: str, a: np.ndarray, b: np.ndarray, kind: str = "offline") -> np.ndarray:
        """Share of a op b (``PRODUCTS``: "mul" with broadcasting, "matmul") of two shared
        operands, ring arithmetic mod 2**64; metered as ``kind``: offline when it makes a Beaver
        triple, online when it is the product itself (``direct_product``).

        A batched matmul (same leading dimensions) runs one batch entry per engine call, and a
        large elementwise product in flat batches: the engine's memory grows with the operands
        of one call (a (19, 582026, 2) matmul in one call held 5.6 GB per party)."""
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
        if op == "mul" and a.shape == b.shape and a.size > _BATCH:
            flat_a, flat_b = a.reshape(-1), b.reshape(-1)
            out = np.empty(flat_a.size, dtype=np.int64)
            for off in range(0, flat_a.size, _BATCH):
                out[off : off + _BATCH] = self.run("triple-mul", prog_mul, [flat_a[off : off + _BATCH],
                                                                             flat_b[off : off + _BATCH]],
                                                   kind=kind)[0]
            return out.reshape(a.shape)
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
        """End the session: the engine process meets the peer's at a barrier of the link, stops
        it and exits; whatever the library does while tearing down stays in that process."""
        conn, proc = self._conn, self._proc
        if proc is not None and self._stuck:
            proc.kill()
        if conn is not None and not self._stuck:
            try:
                with self._lock:
                    conn.send(("close", ()))
                    if conn.poll(CLOSE_WAIT + CLOSE_GRACE + 10.0):
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
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)
