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
import os
import shutil
import socket
import tempfile
import threading
from typing import Callable

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import spu  # noqa: E402
import spu.libspu as libspu  # noqa: E402
from spu.utils import frontend  # noqa: E402

from .channel import KIND_OBJECT, Channel  # noqa: E402
from .link import NO_LINK, LinkProfile  # noqa: E402
from .metered_relay import RelayPair  # noqa: E402
from .metering import Meter  # noqa: E402
from .wire import pack, unpack_bounded  # noqa: E402

__all__ = ["SpuEngine", "EngineError", "active", "set_active"]

_STORAGE = "cheetah.AShr<FM64>"
_CHUNK_BYTES = 1 << 26          # one SPU value chunk (64 MiB)
_BATCH = 1 << 20                 # elements per SPU run of an elementwise op: bounds memory
_FRACTION_BITS = 16              # unused by our integer programs; SPU needs a value

_logging_done = False


class EngineError(RuntimeError):
    """The two-party engine could not start or run (link refused, peer gone, bad input)."""


def _quiet_logging() -> None:
    global _logging_done
    if not _logging_done:
        opts = libspu.logging.LogOptions()
        opts.enable_console_logger = True    # errors only: a daemon's log must show why a link died
        opts.log_level = libspu.logging.LogLevel.ERROR
        libspu.logging.setup_logging(opts)
        _logging_done = True


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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _to_share(arr: np.ndarray, meta: bytes) -> "libspu.Share":
    raw = np.ascontiguousarray(arr, dtype=np.int64).tobytes()
    share = libspu.Share()
    share.meta = meta
    chunks = []
    for off in range(0, max(len(raw), 1), _CHUNK_BYTES):
        c = libspu.ValueChunk()
        c.total_bytes = len(raw)
        c.chunk_offset = off
        c.content = raw[off : off + _CHUNK_BYTES]
        chunks.append(c.SerializeToString())
    share.share_chunks = chunks
    return share


def _share_meta(shape: tuple[int, ...]) -> bytes:
    meta = libspu.ValueMeta()
    meta.data_type = libspu.DataType.DT_I64
    meta.visibility = libspu.Visibility.VIS_SECRET
    meta.storage_type = _STORAGE
    meta.shape.dims = list(shape)
    return meta.SerializeToString()


def _from_share(share: "libspu.Share", shape: tuple[int, ...]) -> np.ndarray:
    meta = libspu.ValueMeta()
    meta.ParseFromString(share.meta)
    if meta.storage_type != _STORAGE:
        raise EngineError(f"SPU returned {meta.storage_type}, expected {_STORAGE}")
    parts = []
    for raw in share.share_chunks:
        c = libspu.ValueChunk()
        c.ParseFromString(raw)
        parts.append(c.content)
    return np.frombuffer(b"".join(parts), dtype=np.int64).reshape(shape).copy()


class SpuEngine:
    """One CHEETAH runtime between the two servers, for the life of a two-party session."""

    def __init__(self, rank: int, channel: Channel, meter: Meter, *, link: LinkProfile = NO_LINK,
                 timeout: float = 120.0, trust_override: bytes | None = None):
        """Set up the link; both parties call this at the same point of their session.

        ``trust_override`` (tests only): trust this PEM instead of the certificate the peer sent,
        which is how a test shows that a wrong certificate is refused.
        """
        _quiet_logging()
        self.rank = rank
        self.meter = meter
        self.kind = "online"
        self._lock = threading.Lock()
        self._programs: dict[tuple, tuple] = {}
        self._dir = tempfile.mkdtemp(prefix="starfish-spu-")
        own_host, peer_host = channel.hosts
        self._relays = RelayPair(meter, lambda: self.kind, link, listen_host=own_host)
        self._link = None
        try:
            cert, key, pem = _session_certificate(self._dir, f"starfish-spu-{rank}")
            own_port = _free_port("127.0.0.1")
            inbound = self._relays.open_inbound(("127.0.0.1", own_port))
            nonce = os.urandom(8)
            channel.send_frame(KIND_OBJECT, pack({"cert": pem, "port": inbound[1], "nonce": nonce}))
            peer = unpack_bounded(channel.recv_frame(KIND_OBJECT), max_bin_len=1 << 16, max_map_len=4)
            if not isinstance(peer, dict) or not isinstance(peer.get("cert"), bytes) \
                    or not isinstance(peer.get("port"), int) or not isinstance(peer.get("nonce"), bytes):
                raise EngineError("malformed two-party link offer from the peer")
            outbound = self._relays.open_outbound((peer_host, peer["port"]))
            peer_cert = os.path.join(self._dir, "peer.crt")
            with open(peer_cert, "wb") as f:
                f.write(trust_override if trust_override is not None else peer["cert"])
            desc = libspu.link.Desc()
            # a link id of its own per session: brpc keeps services of earlier links in the
            # process, and a second link under the same id is answered by the dead one's
            mine_first = (nonce, peer["nonce"]) if rank == 0 else (peer["nonce"], nonce)
            desc.id = "starfish-" + b"".join(mine_first).hex()
            for r in range(2):
                addr = f"127.0.0.1:{own_port}" if r == rank else f"{outbound[0]}:{outbound[1]}"
                desc.add_party(f"server{r}", addr)
            desc.enable_ssl = True
            for opts in (desc.client_ssl_opts, desc.server_ssl_opts):
                opts.cert.certificate_path = cert
                opts.cert.private_key_path = key
                opts.verify.ca_file_path = peer_cert
                opts.verify.verify_depth = 1
            retries = max(1, int(min(timeout, 30.0) / 0.5))
            desc.connect_retry_times = retries
            desc.connect_retry_interval_ms = 500
            desc.recv_timeout_ms = int(timeout * 1000)
            desc.http_timeout_ms = int(timeout * 1000)
            try:
                self._link = libspu.link.create_brpc(desc, rank)
            except Exception as exc:  # brpc reports every failure as a RuntimeError with a trace
                raise EngineError(f"the two-party link did not come up: {str(exc).splitlines()[0:2]}") from None
            cfg = libspu.RuntimeConfig(protocol=libspu.ProtocolKind.CHEETAH, field=libspu.FieldType.FM64,
                                       fxp_fraction_bits=_FRACTION_BITS)
            cfg.trunc_allow_msb_error = False   # never the large truncation error
            self._cfg = cfg
            self._runtime = spu.Runtime(self._link, cfg)
            self._check_layout()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _check_layout(self) -> None:
        """Our shares go in as SPU's own would: refuse a version whose layout differs."""
        meta = libspu.ValueMeta()
        meta.ParseFromString(spu.Io(2, self._cfg).make_shares(np.zeros(1, np.int64),
                                                              libspu.Visibility.VIS_SECRET)[0].meta)
        if meta.storage_type != _STORAGE or meta.data_type != libspu.DataType.DT_I64:
            raise EngineError(f"unexpected SPU share layout {meta.storage_type}")

    def _program(self, name: str, fn: Callable, shapes: tuple[tuple[int, ...], ...]):
        key = (name, shapes)
        prog = self._programs.get(key)
        if prog is None:
            args = [np.zeros(s, np.int64) for s in shapes]
            names = [f"{name}-in{i}" for i in range(len(shapes))]
            exe, out = frontend.compile(frontend.Kind.JAX, fn, args, {}, names,
                                        [libspu.Visibility.VIS_SECRET] * len(shapes),
                                        lambda outs: [f"{name}-out{i}" for i in range(len(outs))])
            out_shapes = [tuple(o.shape) for o in jax.tree_util.tree_leaves(out)]
            prog = (exe, names, out_shapes)
            if len(self._programs) > 256:
                self._programs.clear()
            self._programs[key] = prog
        return prog

    def run(self, name: str, fn: Callable, inputs: list[np.ndarray], *, kind: str = "online") -> list[np.ndarray]:
        """Run ``fn`` (jax, on int64 ring values) on secret inputs given as this party's shares;
        returns this party's shares of the outputs. Both parties call it with the same name,
        function and shapes."""
        shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in inputs)
        exe, names, out_shapes = self._program(name, fn, shapes)
        with self._lock:
            self.kind = kind
            try:
                for nm, x, shp in zip(names, inputs, shapes):
                    self._runtime.set_var(nm, _to_share(np.asarray(x), _share_meta(shp)))
                self._runtime.run(exe)
                outs = [_from_share(self._runtime.get_var(o), s) for o, s in zip(exe.output_names, out_shapes)]
            except Exception as exc:
                if isinstance(exc, EngineError):
                    raise
                raise EngineError(f"two-party engine failed in {name}: {str(exc).splitlines()[0]}") from None
            finally:
                for nm in (*names, *exe.output_names):   # Runtime.clear() is broken in 0.9.5
                    try:
                        self._runtime.del_var(nm)
                    except Exception:  # noqa: BLE001 - a variable that was never set
                        pass
                self.kind = "online"
        return outs

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
        return self._elementwise("ge0", lambda x, z: (x >= 0).astype(jnp.int64) + z, share,
                                 np.zeros(np.shape(share), np.int64))

    def below_power_of_two(self, share: np.ndarray, k: int) -> np.ndarray:
        """Share of [x < 2**k] with x read as unsigned (0 .. 2**64 - 1); 1 <= k <= 63."""
        if share.size == 0:
            return np.zeros(np.shape(share), np.int64)
        bound = np.int64(1 << k)

        def fn(x, z):
            # unsigned x < 2**k iff signed x >= 0 and x < 2**k; for x >= 0 the second sign test
            # cannot wrap, and for x < 0 the first is 0 whatever the second says
            return ((x >= 0) & (x < bound)).astype(jnp.int64) + z
        return self._elementwise(f"below{k}", fn, share, np.zeros(np.shape(share), np.int64))

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
        this one is always the floor)."""
        return self.floor(share, d)

    def product(self, name: str, fn: Callable, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Share of fn(a, b) (a ring product: mul, matmul, ...) of two shared operands."""
        return self.run(name, fn, [a, b], kind="offline")[0]

    # ------------------------------------------------------------------ life
    @property
    def socket_bytes(self) -> tuple[int, int]:
        """(sent, received) at this party's sockets of the engine's link so far."""
        return self._relays.totals

    @property
    def kernel_bytes(self) -> tuple[int, int]:
        """(sent, received) on the same sockets as the kernel counts them (tests' oracle)."""
        return self._relays.kernel_totals()

    def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            try:
                link.stop_link()
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass
        self._relays.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_active: SpuEngine | None = None


def active() -> SpuEngine | None:
    """The engine of this process's two-party session, if it runs in two-party mode."""
    return _active


def set_active(engine: SpuEngine | None) -> None:
    global _active
    _active = engine
