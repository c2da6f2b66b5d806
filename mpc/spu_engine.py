"""The two-party (dealer-free) engine: SecretFlow SPU's CHEETAH protocol between the two servers.

This is the only module that imports ``spu`` or ``jax`` (as ``mpc.crypten_compat`` is for
CrypTen). CHEETAH is two-party and needs no third party: its multiplications use lattice HE
(RLWE) and its comparisons and truncations silent OT (Ferret). Nothing of it is ours: we only
hand SPU our shares and take its shares back.

Why shares pass through unchanged: over FM64 a CHEETAH arithmetic share (``cheetah.AShr<FM64>``)
is a plain additive uint64 share, and so is ours (int64 ring elements, the same bits). A value
shared by our protocols goes into SPU as it is, and SPU's result is a share of ours.

The link. SPU talks over its own sockets (brpc). Both ends use TLS 1.3 with mutual
authentication, with keys that exist for this session only: each party makes a fresh EC key and
a self-signed certificate, and the two certificates are exchanged over the servers' own
authenticated channel (``mpc.channel``, the deployment's certificates). Each party then trusts
exactly the peer's certificate and nothing else, so no other key can join the link, not even a
certificate of the deployment's CA (which also signs clients), and the private keys never touch a
disk outside a 0700 directory that is removed when the session closes. Both sides' traffic passes
through ``mpc.metered_relay`` on loopback, which counts it at the sockets and applies the
emulated link.

What runs here (``docs/protocols.md``, "Two-party mode"): Beaver products (c = a op b for random
a, b of each party), the sign test, the window test and truncation.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

from .channel import KIND_OBJECT, Channel
from .link import NO_LINK, LinkProfile
from .metering import KINDS, Meter
from .wire import pack, unpack_bounded

__all__ = ["SpuEngine", "EngineError"]
log = logging.getLogger("starfish.engine")

_CHUNK_BYTES = 1 << 26          # one SPU value chunk (64 MiB)
_BATCH = 1 << 20                 # elements per SPU run of an elementwise op: bounds memory
_FRACTION_BITS = 16              # unused by our integer programs; SPU needs a value
_CLOSE_WAIT = 15.0               # seconds a closing party waits for the other at the link's barrier
_CLOSE_GRACE = 1.0               # seconds the link stays up after the barrier (its last replies)
_START_TIMEOUT = 120.0           # seconds the engine process may take to start (imports jax, SPU)

#: per ring width: SPU field, storage name, SPU data type, numpy dtype of a share
_RINGS = {
    64: ("FM64", "cheetah.AShr<FM64>", "DT_I64", np.int64),
    32: ("FM32", "cheetah.AShr<FM32>", "DT_I32", np.int32),
}


class EngineError(RuntimeError):
    """The two-party engine could not start or run (link refused, peer gone, bad input)."""


# ============================================================================ the programs
# Module-level functions (so they pickle by reference into the engine process); ``jnp`` is bound
# there when the engine starts. An extra all-zero secret input ``z`` is added to results that SPU
# would otherwise return as boolean shares: the sum makes them arithmetic shares of our ring.
jnp: Any = None


def prog_ge0(x, z):
    return (x >= 0).astype(jnp.int64) + z


def prog_window(k, x, z):
    # unsigned x < 2**k iff signed x >= 0 and x < 2**k; for x >= 0 the second sign test cannot
    # wrap, and for x < 0 the first is 0 whatever the second says; for k = 63 the first is all
    if k == 63:
        return (x >= 0).astype(jnp.int64) + z
    return ((x >= 0) & (x < np.int64(1 << k))).astype(jnp.int64) + z


def prog_mul(a, b):
    return a * b


def prog_matmul(a, b):
    return jnp.matmul(a, b)


def prog_exceed(y, thr, z):
    a = jnp.abs(thr)
    return jnp.any((y >= a) | (y <= -a)).astype(jnp.int32).reshape(1) + z


PRODUCTS = {"mul": prog_mul, "matmul": prog_matmul}


def _unsigned(dtype):
    return np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint64


# ============================================================================ parent side
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
            self._proc = ctx.Process(target=_engine_main, name=f"engine{rank}", daemon=False,
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
        dtype = _RINGS[bits][3]
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

        Why 32 bits: SecTC's documented domain is |x|, |d| < 2**15 at 16 fractional bits, so
        the values fit a 32-bit ring, where a comparison costs about half of a 64-bit one. The
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
                    if conn.poll(_CLOSE_WAIT + _CLOSE_GRACE + 10.0):
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


# ============================================================================ engine process
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Child:
    """What runs in the engine process: the relays, the link and the runtimes."""

    def __init__(self, params: dict):
        global jnp
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as _jnp
        import spu
        import spu.libspu as libspu
        from spu.utils import frontend

        from .metered_relay import RelayPair

        jnp = _jnp
        self.spu, self.libspu, self.frontend, self.jax = spu, libspu, frontend, jax
        self.p = params
        self._quiet_logging()
        self.meter = Meter()
        self.kind = "online"
        self.relays = RelayPair(self.meter, lambda: self.kind, params["link"], listen_host=params["listen_host"])
        self.inbound = self.relays.open_inbound()
        self.link = None
        self.runtimes: dict[int, Any] = {}
        self.programs: dict[tuple, tuple] = {}

    def _quiet_logging(self) -> None:
        opts = self.libspu.logging.LogOptions()
        opts.enable_console_logger = True    # errors only: a daemon's log must show why a link died
        # the library also writes a log file (default: spu.log in the working directory); keep it
        # in the session's private directory, removed with it
        opts.system_log_path = os.path.join(self.p["dir"], "spu.log")
        # STARFISH_ENGINE_LOG=info shows the library's own link events (for diagnosing a link)
        level = os.environ.get("STARFISH_ENGINE_LOG", "error").upper()
        opts.log_level = getattr(self.libspu.logging.LogLevel, level, self.libspu.logging.LogLevel.ERROR)
        self.libspu.logging.setup_logging(opts)

    def counts(self) -> dict:
        t = self.meter.as_dict()["total"]
        return {f"{k}_{f}": t[f"{k}_bytes_{f}"] if f != "rounds" else t[f"{k}_rounds"]
                for k in KINDS for f in ("sent", "received", "rounds")}

    def connect(self, peer_host: str, peer_port: int, peer_pem: bytes, link_id: str) -> None:
        libspu, p = self.libspu, self.p
        outbound = self.relays.open_outbound((peer_host, peer_port))
        # brpc binds its own listener: pick its port only now, after every relay socket of ours
        # is bound, so that no relay can take it between the pick and the bind
        own_port = _free_port("127.0.0.1")
        self.relays.inbound.set_target(("127.0.0.1", own_port))
        peer_cert = os.path.join(p["dir"], "peer.crt")
        with open(peer_cert, "wb") as f:
            f.write(peer_pem)
        desc = libspu.link.Desc()
        desc.id = link_id
        for r in range(2):
            addr = f"127.0.0.1:{own_port}" if r == p["rank"] else f"{outbound[0]}:{outbound[1]}"
            desc.add_party(f"server{r}", addr)
        desc.enable_ssl = True
        for opts in (desc.client_ssl_opts, desc.server_ssl_opts):
            opts.cert.certificate_path = p["cert"]
            opts.cert.private_key_path = p["key"]
            opts.verify.ca_file_path = peer_cert
            opts.verify.verify_depth = 1
        desc.connect_retry_times = max(1, int(p["timeout"] / 0.5))   # the parent ends us at its timeout
        desc.connect_retry_interval_ms = 500
        desc.recv_timeout_ms = int(p["timeout"] * 1000)
        desc.http_timeout_ms = int(p["timeout"] * 1000)
        try:
            self.link = libspu.link.create_brpc(desc, p["rank"])
        except Exception as exc:  # brpc reports every failure as a RuntimeError with a trace
            raise EngineError(f"the two-party link did not come up: {str(exc).splitlines()[0:2]}") from None
        # refuse a library version whose share layout differs from the one we rely on
        cfg = self._config(64)
        meta = libspu.ValueMeta()
        meta.ParseFromString(self.spu.Io(2, cfg).make_shares(np.zeros(1, np.int64),
                                                             libspu.Visibility.VIS_SECRET)[0].meta)
        if meta.storage_type != _RINGS[64][1] or meta.data_type != libspu.DataType.DT_I64:
            raise EngineError(f"unexpected SPU share layout {meta.storage_type}")
        self.runtimes[64] = self.spu.Runtime(self.link, cfg)

    def _config(self, bits: int):
        libspu = self.libspu
        cfg = libspu.RuntimeConfig(protocol=libspu.ProtocolKind.CHEETAH,
                                   field=getattr(libspu.FieldType, _RINGS[bits][0]),
                                   fxp_fraction_bits=_FRACTION_BITS)
        cfg.trunc_allow_msb_error = False   # never the large truncation error
        return cfg

    def runtime(self, bits: int):
        """The 32-bit runtime is made on first use, on a sub-link of its own (``spawn``), so
        its messages never mix with the 64-bit runtime's."""
        rt = self.runtimes.get(bits)
        if rt is None:
            rt = self.runtimes[bits] = self.spu.Runtime(self.link.spawn(), self._config(bits))
        return rt

    def program(self, name: str, fn: Callable, shapes: tuple, bits: int):
        key = (name, shapes, bits)
        prog = self.programs.get(key)
        if prog is None:
            libspu = self.libspu
            args = [np.zeros(s, _RINGS[bits][3]) for s in shapes]
            names = [f"{name}-in{i}" for i in range(len(shapes))]
            exe, out = self.frontend.compile(self.frontend.Kind.JAX, fn, args, {}, names,
                                             [libspu.Visibility.VIS_SECRET] * len(shapes),
                                             lambda outs: [f"{name}-out{i}" for i in range(len(outs))])
            prog = (exe, names, [tuple(o.shape) for o in self.jax.tree_util.tree_leaves(out)])
            if len(self.programs) > 256:
                self.programs.clear()
            self.programs[key] = prog
        return prog

    def run(self, name: str, fn: Callable, inputs: list, kind: str, bits: int) -> list:
        libspu = self.libspu
        _, storage, dtype_name, dtype = _RINGS[bits]
        shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in inputs)
        exe, names, out_shapes = self.program(name, fn, shapes, bits)
        rt = self.runtime(bits)
        self.kind = kind
        try:
            for nm, x, shp in zip(names, inputs, shapes):
                rt.set_var(nm, self._to_share(x, shp, bits))
            rt.run(exe)
            return [self._from_share(rt.get_var(o), s, bits) for o, s in zip(exe.output_names, out_shapes)]
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"two-party engine failed in {name}: {str(exc).splitlines()[0]}") from None
        finally:
            for nm in (*names, *exe.output_names):   # Runtime.clear() is broken in 0.9.5
                try:
                    rt.del_var(nm)
                except Exception:  # noqa: BLE001 - a variable that was never set
                    pass
            self.kind = "online"

    def _to_share(self, arr: np.ndarray, shape: tuple, bits: int):
        libspu = self.libspu
        _, storage, dtype_name, dtype = _RINGS[bits]
        meta = libspu.ValueMeta()
        meta.data_type = getattr(libspu.DataType, dtype_name)
        meta.visibility = libspu.Visibility.VIS_SECRET
        meta.storage_type = storage
        meta.shape.dims = list(shape)
        raw = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        share = libspu.Share()
        share.meta = meta.SerializeToString()
        chunks = []
        for off in range(0, max(len(raw), 1), _CHUNK_BYTES):
            c = libspu.ValueChunk()
            c.total_bytes = len(raw)
            c.chunk_offset = off
            c.content = raw[off : off + _CHUNK_BYTES]
            chunks.append(c.SerializeToString())
        share.share_chunks = chunks
        return share

    def _from_share(self, share, shape: tuple, bits: int) -> np.ndarray:
        libspu = self.libspu
        _, storage, _, dtype = _RINGS[bits]
        meta = libspu.ValueMeta()
        meta.ParseFromString(share.meta)
        if meta.storage_type != storage:
            raise EngineError(f"SPU returned {meta.storage_type}, expected {storage}")
        parts = []
        for raw in share.share_chunks:
            c = libspu.ValueChunk()
            c.ParseFromString(raw)
            parts.append(c.content)
        return np.frombuffer(b"".join(parts), dtype=dtype).reshape(shape).copy()

    def close(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            met = threading.Event()

            def barrier() -> None:
                try:
                    link.barrier()
                    met.set()
                except Exception:  # noqa: BLE001 - the peer is gone: nothing is in flight to it
                    pass
            t = threading.Thread(target=barrier, name="engine-close", daemon=True)
            t.start()
            t.join(_CLOSE_WAIT)
            if met.is_set():
                # the barrier's own replies may still be on their way to the peer
                time.sleep(_CLOSE_GRACE)
            try:
                link.stop_link()
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass
        self.relays.close()


def _engine_main(conn, params: dict) -> None:
    """The engine process: serve the parent's calls until ``close`` (or the parent is gone)."""
    logging.basicConfig(level=params.get("log_level") or logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    child = None
    try:
        child = _Child(params)
        conn.send(("ok", child.inbound[1], child.counts()))
        while True:
            try:
                op, args = conn.recv()
            except EOFError:
                break
            try:
                if op == "connect":
                    child.connect(*args)
                    value = None
                elif op == "run":
                    value = child.run(*args)
                elif op == "socket_bytes":
                    value = child.relays.totals
                elif op == "kernel_bytes":
                    value = child.relays.kernel_totals()
                elif op == "close":
                    child.close()
                    conn.send(("ok", None, child.counts()))
                    break
                else:
                    raise EngineError(f"unknown engine call {op!r}")
                conn.send(("ok", value, child.counts()))
            except EngineError as exc:
                conn.send(("error", str(exc), child.counts()))
            except Exception as exc:  # noqa: BLE001 - reported to the parent, the session fails
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}",
                           child.counts()))
    except BaseException as exc:  # noqa: BLE001 - start-up failed: tell the parent why
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", child.counts() if child else None))
        except OSError:
            pass
    finally:
        conn.close()
    # the library may still be tearing down threads; nothing of ours is left to do
    os._exit(0)
