"""The service's one configuration file (TOML), its defaults, and scratch deployments.

Why one file: the two servers, the dealer, the simulated clients and the admin tools must
agree on addresses, the FL parameters and the unlearning parameters; one file read by
every process (each with its own credentials from ``keys_dir``) keeps them consistent.
Every key has a default (see ``docs/service.md``); relative paths are resolved against the
directory of the config file, so a deployment directory can be moved as a whole.

This module imports only the standard library: clients read it too, and they never need
torch or CrypTen to know where the servers are.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import socket
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.robust_rules import (AGGREGATORS, BRACE_CLIENTS, BRACE_DECAY, BRACE_LAMBDA, BRACE_SCALE,
                                 FEDSECA_BETA, FEDSECA_GAMMA)
from common.offline_mode import DEFAULT_OFFLINE, OfflineMode
from common.starfish_params import PAPER
from net import tls

__all__ = ["ConfigError", "AGGREGATORS", "BRACE_CLIENTS", "Endpoint", "ServerSection", "DealerSection", "ModelSection",
           "FLSection", "UnlearningSection", "LimitsSection", "ClientsSection",
           "ServiceConfig", "load_config", "render_config", "write_scratch_deployment",
           "free_loopback_ports", "DEPLOYMENT_KEYS"]


class ConfigError(ValueError):
    """The configuration file is missing, malformed, or has a value out of range."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


@dataclass(frozen=True)
class ServerSection:
    """One server's addresses and its private data directory.

    ``api_port``: the client API (clients and admin connect here). ``peer_port``: the
    control link between the servers, where server 1 listens and server 0 connects.
    ``mpc_port``: the two-party computation session of an unlearning job (server 1
    listens, server 0 connects; one session per job). Server 0's peer/mpc ports are not
    opened by this version but are kept symmetric so that the roles could be swapped.
    """

    host: str = "127.0.0.1"
    api_port: int = 7100
    peer_port: int = 7101
    mpc_port: int = 7102
    data_dir: str = "data/server0"
    # where this server's workers (``[deployment] workers`` > 1) listen for their peer worker on an
    # ephemeral port (server 1's; server 0's connect): "" the server's host; "0.0.0.0" every
    # interface, each worker advertising its machine's address (workers on other machines)
    worker_host: str = ""
    # where worker k keeps its slices of the stored update shares, ``<shard_dir>/w<k>`` on its own
    # machine ([deployment] workers > 1): "" is ``<data_dir>/shards``
    shard_dir: str = ""

    def api(self) -> Endpoint:
        return Endpoint(self.host, self.api_port)

    def peer(self) -> Endpoint:
        return Endpoint(self.host, self.peer_port)

    def mpc(self) -> Endpoint:
        return Endpoint(self.host, self.mpc_port)


@dataclass(frozen=True)
class DealerSection:
    host: str = "127.0.0.1"
    port: int = 7200
    #: seconds the dealer waits for the next request of a connected server
    timeout: float = 3600.0

    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)


@dataclass(frozen=True)
class ModelSection:
    """How the servers draw the initial model M_0 (both draw the same one from the seed)."""

    dataset: str = "digits"          # fixes the input shape: digits, mnist, fmnist, cifar10
    architecture: str = ""           # "" = the dataset's default (digits: logreg)
    seed: int = 0
    l2: float = 1e-3                 # L2 term of logreg/mlp (a client-side training detail)


@dataclass(frozen=True)
class FLSection:
    rounds: int = 40                 # T: rounds of Stage I; no round opens after T
    clients_expected: int = 20       # a round closes early once this many reached both servers
    # A round never closes with fewer participants (the deadline restarts), even once forgotten
    # clients lower the expected count: a round's public step M_(i-1) - M_i = eta sum_j w_j g_j
    # is one client's update when it is alone, and another participant's when two are (the
    # other knows its own term); from 3 on, no single client or observer reads one update
    # out of it (issue 25, finding 5; docs/service.md). Must be <= clients_expected.
    min_clients: int = 3
    round_deadline: float = 60.0     # seconds after a round opens; then it closes with whoever made it
    server_lr: float = 0.3           # eta in M_i = M_{i-1} - eta * sum_j w_j g_j (digits default)
    precision: int = 16              # fractional bits of the clients' fixed-point encoding
    range_check: bool = True         # check every upload's range in 2PC before its round closes
    # How a round's uploads become M_i (docs/service.md, "Robust aggregation"): "fedavg" (the
    # exact ring sum), or a Byzantine-robust rule run by both servers in 2PC at round close.
    aggregator: str = "fedavg"       # fedavg | fedseca | brace-sign
    # The rules' parameters (defaults from common.robust_rules, their one definition).
    fedseca_gamma: float = FEDSECA_GAMMA   # FedSECA Sec. 5: lambda_k is the gamma-quantile of |g_k| (0.9)
    fedseca_beta: float = FEDSECA_BETA     # FedSECA eq. 11: server momentum beta_ra (0.5)
    brace_lambda: float = BRACE_LAMBDA     # BRACE Sec. 5.1: lambda for 100 clients; K clients use 5 K / 100 (5)
    brace_scale: float = BRACE_SCALE       # BRACE step of FL round t: server_lr * scale / t**decay (0.5)
    brace_decay: float = BRACE_DECAY       # 0 = the paper's fixed step (0.5)


@dataclass(frozen=True)
class UnlearningSection:
    """Stage II's parameters; the defaults are the paper's (``common.starfish_params.PAPER``)."""

    sigma: float = PAPER.sigma       # selection rate: T' = ceil(sigma T) replayed rounds
    alpha: float = PAPER.alpha       # tolerance rate of delta_i^j (used by clients in Stage I)
    beta: float = PAPER.beta         # interval rate: threshold check every ceil(beta T) replayed rounds
    buffer: int = PAPER.buffer       # L-BFGS buffer size B
    rs_method: str = PAPER.method    # round-selection comparison: auto | ratio | divide
    t_delta: int = 0                 # auto: Method 1 while T < t_delta; 0 = measured (protocols/starfish/data/t_delta.json, LAN)
    guard: float = PAPER.guard       # divergence guard ratio (protocols/starfish/replay.py); 0 = off
    # seconds the servers wait for the clients of one correction task; a client missing then is
    # absent from that step and not waited for again in the run, so a silent participant holds a
    # job (and FL, paused during it) for at most this long (issue 25: was 300 s, and failed the job)
    correction_timeout: float = 30.0
    agree_timeout: float = 60.0      # a request that reached only one server fails after this
    # seconds after a client's request ended without adoption (failed, expired at one server,
    # cancelled) before it may file a new one; 0 = none (issue 25: repeated at once)
    request_cooldown: float = 60.0
    session_timeout: float = 300.0   # 2PC session: seconds to wait for the peer/dealer


@dataclass(frozen=True)
class LimitsSection:
    """What one client (or a stranger) can make a server or the dealer hold; docs/service.md,
    "Limits and abuse", says what a peer sees when it reaches each."""

    max_message_bytes: int = 64 << 20   # a client message above this gets a "too_large" reply
    max_frame_bytes: int = 1 << 30      # hard per-frame cap of this process's TLS channels
    max_connections: int = 256          # concurrent authenticated client-API connections per server
    idle_timeout: float = 120.0         # a client connection silent this long is closed
    peer_timeout: float = 120.0         # control-link request timeout between the servers
    # Before TLS proves who connected, a connection may only use a small, separate pool for a
    # short time: counted with the authenticated ones, idle sockets locked everyone out (issue 14).
    handshake_timeout: float = 5.0      # seconds for TLS + hello, whatever the peer sends
    max_handshakes: int = 64            # unauthenticated connections at once; see net/admission.py
    # One address churning connections must not slow everyone's handshakes (issue 25, finding
    # 7): an address that has not authenticated before gets a handshake thread for this many
    # connections a second (this many at once); the rest wait without one. 0: no such rate.
    handshake_rate_per_source: float = 20.0
    handshake_burst_per_source: int = 16
    max_connections_per_identity: int = 4   # authenticated connections of one certificate name
    # Bytes held by frames being received or waiting for their handler, per port.
    max_buffered_bytes: int = 2 << 30   # all connections of one client API (or of the dealer)
    max_buffered_per_identity: int = 1 << 30  # one certificate name's connections
    # |D_j| is reported in the clear and cannot be checked; the cap bounds the FedAvg weight a
    # client can claim and keeps the exact ring aggregation from overflowing (issue 14).
    max_num_samples: int = 0            # per upload; 0: the largest that keeps any round exact
    requests_per_second: float = 50.0   # per identity, sustained (token bucket)
    request_burst: int = 200            # per identity, at once
    max_pending_jobs: int = 1           # unlearning jobs of one client not yet ended (admin: 16)


@dataclass(frozen=True)
class ClientsSection:
    """Defaults of ``starfish clients`` (the simulator); command-line options override them."""

    dataset: str = "digits"
    data_dir: str = ""
    partition: str = "iid"
    seed: int = 0
    poll_interval: float = 0.05      # seconds between polls of the servers when idle
    retry_seconds: float = 120.0     # how long a request is retried while a server restarts




@dataclass(frozen=True)
class ServiceConfig:
    path: Path
    keys_dir: Path
    offline: OfflineMode = DEFAULT_OFFLINE   # where the 2PC sessions' correlations come from
    # K > 1: each server is a coordinator and K Ray workers owning coordinate shards (docs/service.md,
    # "A server across machines"); 1: one process per server, Ray never imported
    workers: int = 1
    # the server's own Ray cluster to join ("auto" or "host:port"); "": each daemon starts a local one
    ray_address: str = ""
    # a worker's shares of at least this many MiB live in files of its temporary directory, read
    # through a memory map when used (its memory follows a step, not all it keeps); 0: in memory
    worker_spill_mib: float = 0.0
    server0: ServerSection = field(default_factory=ServerSection)
    server1: ServerSection = field(default_factory=lambda: ServerSection(
        api_port=7110, peer_port=7111, mpc_port=7112, data_dir="data/server1"))
    dealer: DealerSection = field(default_factory=DealerSection)
    model: ModelSection = field(default_factory=ModelSection)
    fl: FLSection = field(default_factory=FLSection)
    unlearning: UnlearningSection = field(default_factory=UnlearningSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    clients: ClientsSection = field(default_factory=ClientsSection)

    def server(self, party: int) -> ServerSection:
        if party not in (0, 1):
            raise ConfigError(f"party must be 0 or 1, got {party}")
        return self.server0 if party == 0 else self.server1

    def data_dir(self, party: int) -> Path:
        return self.resolve(self.server(party).data_dir)

    def resolve(self, p: str | os.PathLike[str]) -> Path:
        q = Path(p)
        return q if q.is_absolute() else (self.path.parent / q)


_SECTIONS: dict[str, type] = {
    "server0": ServerSection, "server1": ServerSection, "dealer": DealerSection,
    "model": ModelSection, "fl": FLSection, "unlearning": UnlearningSection,
    "limits": LimitsSection, "clients": ClientsSection,
}


#: the keys of ``[deployment]`` (the others are sections of their own)
DEPLOYMENT_KEYS = ("keys_dir", "offline", "workers", "ray_address", "worker_spill_mib")


def _section(cls: type, name: str, raw: Any, base: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"[{name}]: unknown keys {unknown}; known: {sorted(known)}")
    values = {}
    for key, value in raw.items():
        want = type(getattr(base, key))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"[{name}] {key} must be {want.__name__}, got {value!r}")
        values[key] = value
    return dataclasses.replace(base, **values)


def _check(cfg: ServiceConfig) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    for name in ("server0", "server1"):
        s = getattr(cfg, name)
        for port in ("api_port", "peer_port", "mpc_port"):
            need(0 < getattr(s, port) < 65536, f"[{name}] {port} must be 1..65535")
    need(0 < cfg.dealer.port < 65536, "[dealer] port must be 1..65535")
    need(cfg.fl.rounds >= 1, "[fl] rounds must be >= 1")
    need(cfg.fl.clients_expected >= 1, "[fl] clients_expected must be >= 1")
    need(1 <= cfg.fl.min_clients <= cfg.fl.clients_expected,
         f"[fl] min_clients must be in 1..clients_expected (got {cfg.fl.min_clients} and "
         f"{cfg.fl.clients_expected}; the default is 3, so a deployment of fewer clients sets "
         "min_clients itself, knowing that a round of 1 or 2 publishes a client's update)")
    need(cfg.fl.round_deadline > 0, "[fl] round_deadline must be > 0 seconds")
    need(math.isfinite(cfg.fl.server_lr) and cfg.fl.server_lr > 0, "[fl] server_lr must be > 0")
    need(1 <= cfg.fl.precision <= 30, "[fl] precision must be 1..30 fractional bits")
    fl = cfg.fl
    need(fl.aggregator in AGGREGATORS,
         f"[fl] aggregator must be one of {', '.join(AGGREGATORS)}, got {fl.aggregator!r}")
    # the robust rules' 2PC is exact only inside the ranges the range check guarantees
    # (protocols/robust_aggregation.py, "Ranges"), so it cannot be switched off under them
    need(fl.aggregator == "fedavg" or fl.range_check,
         f"[fl] aggregator = {fl.aggregator!r} needs range_check = true (its 2PC relies on the "
         "ranges that check guarantees)")
    need(fl.aggregator == "fedavg" or fl.precision == 16,
         f"[fl] aggregator = {fl.aggregator!r} needs precision = 16 (the robust rules' 2PC is "
         "written for CrypTen's 16 fractional bits)")
    need(0 <= fl.fedseca_gamma < 1, "[fl] fedseca_gamma must be in [0, 1) (FedSECA's sparsification "
                                    "quantile; the paper uses 0.9)")
    need(0 <= fl.fedseca_beta < 1, "[fl] fedseca_beta must be in [0, 1) (server momentum; the paper "
                                   "uses 0.5, 0 = none)")
    need(math.isfinite(fl.brace_lambda), "[fl] brace_lambda must be a finite number")
    need(math.isfinite(fl.brace_scale) and fl.brace_scale > 0, "[fl] brace_scale must be > 0")
    need(math.isfinite(fl.brace_decay) and fl.brace_decay >= 0,
         "[fl] brace_decay must be >= 0 (0 = a fixed step)")
    u = cfg.unlearning
    need(0 < u.sigma <= 1, "[unlearning] sigma must be in (0, 1]")
    need(0 <= u.alpha <= 1, "[unlearning] alpha must be in [0, 1]")
    need(0 < u.beta <= 1, "[unlearning] beta must be in (0, 1]")
    need(u.buffer >= 1, "[unlearning] buffer must be >= 1")
    need(u.rs_method in ("auto", "ratio", "divide"), "[unlearning] rs_method: auto, ratio or divide")
    need(u.t_delta >= 0, "[unlearning] t_delta must be >= 0 (0: from the measured costs)")
    need(u.guard == 0 or u.guard >= 1, "[unlearning] guard must be 0 (off) or >= 1")
    for key in ("correction_timeout", "agree_timeout", "session_timeout"):
        need(getattr(u, key) > 0, f"[unlearning] {key} must be > 0")
    need(u.request_cooldown >= 0, "[unlearning] request_cooldown must be >= 0 seconds (0: none)")
    lim = cfg.limits
    need(1024 <= lim.max_message_bytes <= lim.max_frame_bytes,
         "[limits] need 1024 <= max_message_bytes <= max_frame_bytes")
    need(lim.max_connections >= 1, "[limits] max_connections must be >= 1")
    need(lim.idle_timeout > 0 and lim.peer_timeout > 0 and lim.handshake_timeout > 0,
         "[limits] timeouts must be > 0")
    need(lim.max_handshakes >= 1, "[limits] max_handshakes must be >= 1")
    need(lim.handshake_rate_per_source >= 0 and lim.handshake_burst_per_source >= 1,
         "[limits] need handshake_rate_per_source >= 0 (0: none) and handshake_burst_per_source >= 1")
    need(1 <= lim.max_connections_per_identity <= lim.max_connections,
         "[limits] need 1 <= max_connections_per_identity <= max_connections")
    # a frame the cap admits must fit the budgets, or it would be dropped by them instead
    need(lim.max_frame_bytes <= lim.max_buffered_per_identity <= lim.max_buffered_bytes,
         "[limits] need max_frame_bytes <= max_buffered_per_identity <= max_buffered_bytes")
    need(lim.max_num_samples >= 0, "[limits] max_num_samples must be >= 0 (0: derived)")
    need(lim.requests_per_second > 0 and lim.request_burst >= 1,
         "[limits] need requests_per_second > 0 and request_burst >= 1")
    need(lim.max_pending_jobs >= 1, "[limits] max_pending_jobs must be >= 1")
    need(cfg.clients.poll_interval > 0 and cfg.clients.retry_seconds > 0,
         "[clients] poll_interval and retry_seconds must be > 0")


def load_config(path: str | os.PathLike[str]) -> ServiceConfig:
    """Read and validate a config file; missing keys take their documented defaults."""
    p = Path(path).resolve()
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file at {p} (write one with `starfish init-deployment DIR`)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    top = dict(raw)
    deployment = top.pop("deployment", {})
    if not isinstance(deployment, dict) or set(deployment) - set(DEPLOYMENT_KEYS):
        raise ConfigError(f"[deployment] takes only {', '.join(DEPLOYMENT_KEYS)}")
    keys = deployment.get("keys_dir", "keys")
    if not isinstance(keys, str):
        raise ConfigError("[deployment] keys_dir must be a string")
    workers = deployment.get("workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= tls.MAX_WORKERS:
        raise ConfigError(f"[deployment] workers must be an integer in 1..{tls.MAX_WORKERS} (1: one "
                          f"process per server), got {workers!r}")
    ray_address = deployment.get("ray_address", "")
    if not isinstance(ray_address, str):
        raise ConfigError("[deployment] ray_address must be a string (\"\": a local cluster per server)")
    spill = deployment.get("worker_spill_mib", 0.0)
    if isinstance(spill, bool) or not isinstance(spill, (int, float)) or not 0 <= spill < math.inf:
        raise ConfigError(f"[deployment] worker_spill_mib must be a number >= 0 (0: a worker keeps its "
                          f"shares in memory), got {spill!r}")
    try:
        offline = OfflineMode.of(deployment.get("offline", DEFAULT_OFFLINE))
    except ValueError as exc:
        raise ConfigError(f"[deployment] {exc}") from None
    cfg = ServiceConfig(path=p, keys_dir=Path("."), offline=offline, workers=workers,
                        ray_address=ray_address, worker_spill_mib=float(spill))
    unknown = sorted(set(top) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown sections {unknown}; known: deployment, {', '.join(_SECTIONS)}")
    updates = {name: _section(_SECTIONS[name], name, top[name], getattr(cfg, name))
               for name in top}
    cfg = dataclasses.replace(cfg, **updates)
    cfg = dataclasses.replace(cfg, keys_dir=cfg.resolve(keys))
    _check(cfg)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {v!r} to TOML")


def render_config(cfg: ServiceConfig, keys_dir: str = "keys") -> str:
    """The complete TOML text of ``cfg`` (every key written out, so the file documents itself)."""
    lines = ["# Starfish service configuration; every key and default: docs/service.md",
             "[deployment]", f"keys_dir = {_toml_value(keys_dir)}",
             "# dealer: a third process supplies correlated randomness (trusted not to collude);",
             "# two-party: none, the servers make it between themselves (docs/protocols.md)",
             f"offline = {_toml_value(cfg.offline)}",
             "# workers > 1: each server a coordinator and that many Ray workers (docs/service.md)",
             f"workers = {cfg.workers}", f"ray_address = {_toml_value(cfg.ray_address)}",
             "# > 0: a worker's shares from this many MiB up live in its temporary directory's files",
             f"worker_spill_mib = {_toml_value(cfg.worker_spill_mib)}", ""]
    for name in _SECTIONS:
        sec = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in dataclasses.fields(sec):
            lines.append(f"{f.name} = {_toml_value(getattr(sec, f.name))}")
        lines.append("")
    return "\n".join(lines)


#: scratch deployments take their ports from here, below the kernel's ephemeral range
_SCRATCH_PORTS = (20000, 32767)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections (Linux; else IANA's)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago (for scratch deployments).

    Chosen at random below the ephemeral range where that range leaves room: a port picked
    inside it (``bind(0)``) can be taken by any outgoing connection of the machine before the
    daemon binds it, which failed a service test on CI ("address already in use"). Bound all
    at once so they are distinct; another process that binds the same port first still makes
    the daemon fail with "address in use".
    """
    low, high = _SCRATCH_PORTS
    high = min(high, _ephemeral_ports()[0] - 1)
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(64 * n if high - low >= 16 * n else 0):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", rng.randint(low, high)))
            except OSError:
                s.close()
                continue
            if not _claim(s.getsockname()[1]):
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:      # no room below the ephemeral range: let the kernel choose
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: a port handed to one scratch deployment is not handed to another for this long (seconds): two
#: processes (the test suite's two workers) could otherwise draw the same free port before either
#: daemon binds it (seen on CI: "address already in use")
CLAIM_SECONDS = 600.0


def _claim(port: int, folder: Path | None = None) -> bool:
    """Whether ``port`` was not handed out by a process of this machine in the last
    ``CLAIM_SECONDS``; if not, it is recorded as handed out now. Without a writable claims
    folder every port passes (the bind test above still holds)."""
    folder = folder or Path(tempfile.gettempdir()) / "starfish-scratch-ports"
    path = folder / str(port)
    try:
        folder.mkdir(exist_ok=True)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            if time.time() - path.stat().st_mtime < CLAIM_SECONDS:
                return False
            os.utime(path)            # a stale claim: take it over
            return True
    except OSError:
        return True


#: where ``write_scratch_deployment`` puts the CA (key, CRL, issued list), beside ``keys``
SCRATCH_CA_DIR = "ca-offline"


def write_scratch_deployment(directory: str | os.PathLike[str], *, clients: int = 20,
                             overrides: dict[str, dict[str, Any]] | None = None,
                             offline: OfflineMode | str = DEFAULT_OFFLINE, workers: int = 1) -> Path:
    """Keys (servers, dealer, admin, client-0..N-1) and a config on free loopback ports.

    Returns the path of ``config.toml``. ``workers`` > 1 issues the workers' certificates too.
    ``overrides`` maps section -> {key: value};
    ``fl.min_clients``, unless given, is min(3, clients_expected). The
    daemons read ``keys/`` (certificates, their keys, ``ca.pem``, ``crl.pem``); the CA's
    private key goes to ``ca-offline/`` beside it, never into ``keys/``, because a daemon
    refuses a key directory that holds it (``tls.check_key_dir``). For demos and tests; a
    real deployment moves ``ca-offline/`` off the machine and hands every party only its
    own key.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tls.init_keys(d / "keys", clients=clients, ca_dir=d / SCRATCH_CA_DIR,
                  workers=workers if workers > 1 else 0)
    ports = free_loopback_ports(7)
    try:
        mode = OfflineMode.of(offline)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = ServiceConfig(path=d / "config.toml", keys_dir=d / "keys", offline=mode, workers=workers)
    cfg = dataclasses.replace(
        cfg,
        server0=ServerSection("127.0.0.1", ports[0], ports[1], ports[2], "data/server0"),
        server1=ServerSection("127.0.0.1", ports[3], ports[4], ports[5], "data/server1"),
        dealer=dataclasses.replace(cfg.dealer, port=ports[6]),
        fl=dataclasses.replace(cfg.fl, clients_expected=clients),
    )
    for name, values in (overrides or {}).items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown section {name!r}")
        cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)})
    if "min_clients" not in (overrides or {}).get("fl", {}):
        # the default cohort (3) where clients_expected allows it; a scratch deployment of 1-2
        # clients needs all of them in every round; a caller who wants less says so
        cfg = dataclasses.replace(cfg, fl=dataclasses.replace(
            cfg.fl, min_clients=min(FLSection.min_clients, cfg.fl.clients_expected)))
    text = render_config(cfg)
    (d / "config.toml").write_text(text)
    load_config(d / "config.toml")  # validate what we wrote
    return d / "config.toml"
