"""The two-party engine's own process: SecretFlow SPU's CHEETAH runtime, its link and its relays.

This is the only module that imports ``spu`` or ``jax`` (as ``mpc.crypten_compat`` is for
CrypTen), and it does so only inside the engine process that ``mpc.spu_engine.SpuEngine`` starts
(for one session, or for a server daemon's life when an ``EnginePool`` keeps it): a server
process never loads either. CHEETAH is two-party and needs no third
party: its multiplications use lattice HE (RLWE) and its comparisons silent OT (Ferret). Nothing
of it is ours: we hand SPU our shares and take its shares back.

Why shares pass through unchanged: over FM64 a CHEETAH arithmetic share (``cheetah.AShr<FM64>``)
is a plain additive uint64 share, and so is ours (int64 ring elements, the same bits). A value
shared by our protocols goes into SPU as it is, and SPU's result is a share of ours (over FM32
likewise, for shares taken mod 2**32).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

from common.gc_pause import collector_paused
from net.metering import KINDS, Meter

__all__ = ["EngineError", "RINGS", "PRODUCTS", "engine_main", "prog_ge0", "prog_window", "prog_mul",
           "prog_matmul", "prog_trunc_pair", "prog_rows_exceed", "prog_positive"]

_CHUNK_BYTES = 1 << 26          # one SPU value chunk (64 MiB)
_FRACTION_BITS = 16              # unused by our integer programs; SPU needs a value
# seconds a closing party waits for the other at the link's barrier. Both parties close at the
# same point of a session, so the barrier is met at once (0.00-0.01 s measured); when it is not,
# the library can hold the process for about 10 s before it gives up (seen in 1 of 3-4 closes), so
# the parent does not wait longer than this plus the grace (``SpuEngine.shutdown``)
CLOSE_WAIT = 2.0
CLOSE_GRACE = 1.0                # seconds the link stays up after the barrier (its last replies)

#: per ring width: SPU field, storage name, SPU data type, numpy dtype of a share
RINGS = {
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


def prog_window(x, y, z):
    # two sign tests and their AND; y = 2**k - 1 - x (``SpuEngine.below_power_of_two``) is made
    # from x locally, so one program serves every k
    return ((x >= 0) & (y >= 0)).astype(jnp.int64) + z


def prog_mul(a, b):
    return a * b


def prog_matmul(a, b):
    return jnp.matmul(a, b)


def prog_trunc_pair(u, v, s, z):
    # the three carries of r = r0 + r1 (``SpuEngine.truncation_pairs``): of the low d bits, of the
    # low 63 bits, and out of bit 63 (a full adder's carry: [m0 + m1 + c63 >= 2])
    c63 = (v >= 0).astype(jnp.int64)
    return (u >= 0).astype(jnp.int64) + z, c63 + z, (s + c63 >= 0).astype(jnp.int64) + z


def prog_rows_exceed(y, thr, z):
    # all rows of a check in one program: the comparisons of every row run in the same rounds,
    # and the per-row OR reduces along the rows' axis together (log2(m) AND layers in all,
    # not per row)
    a = jnp.abs(thr)[:, None]
    return jnp.any((y >= a) | (y <= -a), axis=1).astype(jnp.int32) + z


def prog_positive(c, z):
    return (c > 0).astype(c.dtype) + z


PRODUCTS = {"mul": prog_mul, "matmul": prog_matmul}


# ============================================================================ the process
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Engine:
    """What runs in the engine process: the relays, the link and the runtimes."""

    def __init__(self, params: dict, peer_gone=None):
        global jnp
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        with collector_paused():
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
        # a peer-facing connection closed by the peer: the parent, waiting on a call, fails fast
        # the inbound relay forwards only the peer's address (where the session's channel came
        # from), a few connections at once: anyone can reach it (mpc.relay_gate)
        self.relays = RelayPair(self.meter, lambda: self.kind, params["link"], listen_host=params["listen_host"],
                                on_peer_closed=peer_gone.set if peer_gone is not None else None,
                                peer_host=params.get("peer_host"))
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
        # a receive inside a call may wait for a peer that is still computing its side; a long-lived
        # engine's link is given more than one session's timeout (``link_timeout``): its parent
        # notices a dead peer by itself (``mpc.spu_engine``) and ends this process
        recv = max(p["timeout"], p.get("link_timeout") or 0.0)
        desc.recv_timeout_ms = int(recv * 1000)
        desc.http_timeout_ms = int(recv * 1000)
        try:
            self.link = libspu.link.create_brpc(desc, p["rank"])
        except Exception as exc:  # brpc reports every failure as a RuntimeError with a trace
            raise EngineError(f"the two-party link did not come up: {str(exc).splitlines()[0:2]}") from None
        # refuse a library version whose share layout differs from the one we rely on
        cfg = self._config(64)
        meta = libspu.ValueMeta()
        meta.ParseFromString(self.spu.Io(2, cfg).make_shares(np.zeros(1, np.int64),
                                                             libspu.Visibility.VIS_SECRET)[0].meta)
        if meta.storage_type != RINGS[64][1] or meta.data_type != libspu.DataType.DT_I64:
            raise EngineError(f"unexpected SPU share layout {meta.storage_type}")
        self.runtimes[64] = self.spu.Runtime(self.link, cfg)
        # the link is up: a peer closing it from now on means its engine is gone
        self.relays.arm()

    def _config(self, bits: int):
        libspu = self.libspu
        cfg = libspu.RuntimeConfig(protocol=libspu.ProtocolKind.CHEETAH,
                                   field=getattr(libspu.FieldType, RINGS[bits][0]),
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
        # the function itself is part of the key: a long-lived engine serves many sessions, and two
        # programs that share a name and shapes must not share an executable
        key = (name, _function_key(fn), shapes, bits)
        prog = self.programs.get(key)
        if prog is None:
            libspu = self.libspu
            args = [np.zeros(s, RINGS[bits][3]) for s in shapes]
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
        _, storage, dtype_name, dtype = RINGS[bits]
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
        _, storage, dtype_name, dtype = RINGS[bits]
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
        _, storage, _, dtype = RINGS[bits]
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

    def probe(self, timeout: float) -> bool:
        """A barrier over the link within ``timeout`` seconds: is the peer's engine there and on
        the same link? (A reused engine's check at the start of a session.)"""
        link = self.link
        if link is None:
            return False
        met = threading.Event()

        def barrier() -> None:
            try:
                link.barrier()
                met.set()
            except Exception:  # noqa: BLE001 - the peer is gone or the link is broken
                pass
        t = threading.Thread(target=barrier, name="engine-probe", daemon=True)
        t.start()
        t.join(timeout)
        return met.is_set()

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
            t.join(CLOSE_WAIT)
            if met.is_set():
                # the barrier's own replies may still be on their way to the peer
                time.sleep(CLOSE_GRACE)
            try:
                link.stop_link()
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass
        self.relays.close()


def _function_key(fn: Callable) -> tuple:
    """What identifies a program's function: module and name, and a partial's bound arguments."""
    args: tuple = ()
    while hasattr(fn, "func") and hasattr(fn, "args"):   # functools.partial, possibly nested
        args = (*fn.args, *sorted((fn.keywords or {}).items()), *args)
        fn = fn.func
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)), repr(args))


def _watch_parent(session_dir: str | None = None) -> None:
    """End this process once its parent is gone. Why: a pooled engine's link waits up to an hour
    inside a call (``link_timeout``); if the server daemon died meanwhile (killed, no atexit), the
    pipe's end-of-file is read only between calls, and the engine would hold its memory and its
    link until the library gave up. ``session_dir`` (the parent's ``SpuEngine._dir``, which holds
    the session's private key) is removed first: a parent killed outright cannot remove it."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                if session_dir:
                    shutil.rmtree(session_dir, ignore_errors=True)
                os._exit(1)
    threading.Thread(target=watch, name="engine-parent-watch", daemon=True).start()


def engine_main(conn, params: dict, peer_gone=None) -> None:
    """The engine process: serve the parent's calls until ``close`` (or the parent is gone).
    ``peer_gone``: an event shared with the parent, set when the peer closes the link."""
    logging.basicConfig(level=params.get("log_level") or logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    child = None
    _watch_parent(params.get("dir"))
    try:
        child = _Engine(params, peer_gone)
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
                elif op == "probe":
                    value = child.probe(*args)
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
        # the session's private key: a parent killed outright (the pipe's end-of-file above) can
        # no longer remove it; after a close, the parent's own removal finds it gone
        if params.get("dir"):
            shutil.rmtree(params["dir"], ignore_errors=True)
    # the library may still be tearing down threads; nothing of ours is left to do
    os._exit(0)
