"""One server's durable FL history: public models in the clear, client values as shares.

Why this module: a server daemon (party 0 or 1) must keep, for every FL round, what
unlearning will later read (DESIGN.md 3, Stage I step 4): the public global model M_i, the
participants, their FedAvg weights, and this party's additive share of each participant's
update g_i^j, norm ||g_i^j|| and tolerance threshold delta_i^j. Unlearning may be requested
long after training, across restarts and crashes, so the store must never lose a round the
servers agreed on and never show half of one (DESIGN.md 4.4).

Design (details and the exact guarantees in ``docs/share_store.md``):

* Catalog: SQLite (stdlib ``sqlite3``), WAL journal, ``synchronous=FULL``. It holds the
  public values, the small shares (scalar norm/delta shares as 64-bit integers and 16-byte
  PRG seeds of party 0) and references to tensor files by digest.
* Tensors (models, update shares): :mod:`servers.blobs`, checksummed, content-addressed
  files written with temp file + fsync + rename + directory fsync.
* Commit protocol: every blob of a round is durable *before* the round's catalog rows are
  inserted, all in one SQLite transaction. A round is visible iff that transaction
  committed. Opening the store removes blobs no catalog row refers to (leftovers of a
  crash) and all temp files, and logs them.
* Replays are idempotent: writing a round (or a staged upload) that is already stored with
  identical content is a no-op that returns False; different content raises.

The store never sees both shares of anything and never decodes a share: it checks only
that shares are int64 ring elements of the right shape. Party 0's shares may be kept as the
client's 16-byte seed and are expanded on read with :func:`mpc.prg.expand` (stream 0), the
same expansion the client used (:func:`mpc.sharing.share_ring`).

This module imports neither torch nor CrypTen (a crash-test writer or a tool that only
inspects a store starts fast); :class:`ShareHistory`, the :class:`servers.history.History`
adapter, is built on first access.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from mpc.encoding import DEFAULT_PRECISION
from mpc.prg import SEED_BYTES, expand

from . import blobs as _blobs
from .blobs import BlobCorruptError, BlobError, BlobMissingError, BlobStore, EncodedBlob, encode_blob

if TYPE_CHECKING:  # pragma: no cover
    from .history import History

__all__ = [
    "StoreError",
    "StoreClosedError",
    "StoreLockedError",
    "CatalogCorruptError",
    "RoundOrderError",
    "RoundConflictError",
    "StagingError",
    "StagingConflictError",
    "JobError",
    "BlobError",
    "BlobCorruptError",
    "BlobMissingError",
    "ClientShares",
    "RoundInfo",
    "JobRecord",
    "JOB_STATES",
    "ShareStore",
    "ShareHistory",
]

log = logging.getLogger("starfish.store")

FORMAT_VERSION = 1
CATALOG = "catalog.sqlite3"
LOCK = "LOCK"
#: Free-form metadata of a round or job is public and small; bound it.
MAX_METADATA_BYTES = 64 * 1024
_MAX_CLIENT = 2**63 - 1
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Unlearning-job states and the transitions allowed between them. ``running -> queued``
#: lets a restarted daemon re-queue a job its crash interrupted.
JOB_STATES: Mapping[str, frozenset[str]] = MappingProxyType({
    "queued": frozenset({"running", "cancelled", "failed"}),
    "running": frozenset({"running", "queued", "done", "failed", "cancelled"}),
    "done": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
})


# ------------------------------------------------------------------------------ errors
class StoreError(RuntimeError):
    """Base class of the history store's errors."""


class StoreClosedError(StoreError):
    """The store was closed; reopen it to read or write."""


class StoreLockedError(StoreError):
    """Another process (or another handle in this one) has the store open."""


class CatalogCorruptError(StoreError):
    """The SQLite catalog is damaged or inconsistent with itself."""


class RoundOrderError(StoreError, ValueError):
    """A round was written out of order (rounds are appended as T+1)."""


class RoundConflictError(StoreError, ValueError):
    """A round that is already stored was written again with different content."""


class StagingError(StoreError, ValueError):
    """A staging operation does not fit the open round."""


class StagingConflictError(StagingError):
    """A client uploaded different shares for a round it had already uploaded to."""


class JobError(StoreError, ValueError):
    """An unlearning-job record operation is invalid."""


def _checkpoint(name: str) -> None:
    """Test seam: crash tests replace this to SIGKILL a writer at a named step. No-op."""


# ------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class ClientShares:
    """One client's upload for one round, as *this* party received it.

    On write each field is this party's share: a numpy int64 array (or numpy int64
    scalar, or torch.long tensor); party 0 may instead give the client's 16-byte PRG seed
    (``bytes``). ``update`` has the model's length; ``norm`` and ``delta`` are scalars
    (shape () or (1,)). On read every field is a numpy int64 array (seeds expanded).
    """

    update: Any
    norm: Any
    delta: Any


@dataclass(frozen=True)
class RoundInfo:
    """The public part of a stored round (everything but the shares and the model)."""

    round: int
    participants: tuple[int, ...]
    weights: Mapping[int, float]
    metadata: Mapping[str, Any]
    model_digest: str
    content_hash: str
    committed_at: float


@dataclass(frozen=True)
class JobRecord:
    """A durable unlearning-job record (public bookkeeping, no shares)."""

    id: str
    requester: str
    targets: tuple[int, ...]
    params: Mapping[str, Any]
    state: str
    progress: float
    result_path: str | None
    error: str | None
    created_at: float
    updated_at: float


@dataclass
class _Upload:
    """Validated shares of one client, ready for the catalog.

    ``refs`` are the catalog's text form: ``blob:<digest>``, ``seed:<hex>``, ``int:<n>``.
    """

    refs: tuple[str, str, str]
    blobs: list[EncodedBlob] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.sha256("|".join(self.refs).encode()).hexdigest()


# ------------------------------------------------------------------------------ validation
def _torch_tensor_type() -> type | None:
    """torch.Tensor if torch is already loaded: nothing can be a tensor otherwise."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def _as_numpy(value: Any, what: str) -> np.ndarray:
    """numpy view of a numpy array/scalar or a CPU torch tensor; clear error otherwise."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(value, tensor_type):
        return value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    kind = type(value).__name__
    hint = " (pass this party's raw share, not a CrypTen tensor)" if "Tensor" in kind else ""
    raise TypeError(f"{what}: expected a numpy array or torch tensor, got {kind}{hint}")


def _check_seed(value: Any, what: str, party: int) -> bytes:
    seed = bytes(value)
    if party != 0:
        raise ValueError(f"{what}: only party 0 may store a seed-compressed share; party 1's "
                         "share is always the full difference")
    if len(seed) != SEED_BYTES:
        raise ValueError(f"{what}: a seed share must be {SEED_BYTES} bytes, got {len(seed)}")
    return seed


def _share_ref(value: Any, what: str, party: int, dim: int | None) -> tuple[str, EncodedBlob | None]:
    """Validate one share and give its catalog reference (and the blob to write, if any).

    ``dim`` is the model length for an update share and None for a scalar share.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"seed:{_check_seed(value, what, party).hex()}", None
    arr = _as_numpy(value, what)
    if arr.dtype != np.dtype(np.int64):
        plain = " (a plaintext value? shares are fixed-point ring elements)" \
            if arr.dtype.kind == "f" else ""
        raise TypeError(f"{what}: a share must have dtype int64, got {arr.dtype}{plain}")
    if dim is None:
        if arr.ndim > 1 or arr.size != 1:
            raise ValueError(f"{what}: must be a scalar share (shape () or (1,)), got shape {arr.shape}")
        return f"int:{int(arr.reshape(()))}", None
    if arr.shape != (dim,):
        raise ValueError(f"{what}: must have shape ({dim},) like the model, got {arr.shape}")
    blob = encode_blob(np.array(arr, dtype=np.int64, copy=True))  # own copy: no aliasing
    return f"blob:{blob.digest}", blob


def _upload(shares: ClientShares, who: str, party: int, dim: int) -> _Upload:
    if not isinstance(shares, ClientShares):
        if isinstance(shares, tuple) and len(shares) == 3:
            shares = ClientShares(*shares)
        else:
            raise TypeError(f"{who}: expected ClientShares(update, norm, delta), "
                            f"got {type(shares).__name__}")
    u, ub = _share_ref(shares.update, f"{who} update share", party, dim)
    n, _ = _share_ref(shares.norm, f"{who} norm share", party, None)
    d, _ = _share_ref(shares.delta, f"{who} delta share", party, None)
    seeds = [r for r in (u, n, d) if r.startswith("seed:")]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{who}: the same seed is used for two shares; each value needs its "
                         "own seed (a reused seed leaks the difference of the values)")
    return _Upload((u, n, d), [ub] if ub is not None else [])


def _client_id(value: Any, what: str = "client id") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    cid = int(value)
    if not 0 <= cid <= _MAX_CLIENT:
        raise ValueError(f"{what} {cid} out of range 0..2^63-1")
    return cid


def _round_no(value: Any) -> int:
    r = _client_id(value, "round number")
    if r < 1:
        raise ValueError("rounds are numbered from 1")
    return r


def _participants(values: Iterable[Any]) -> tuple[int, ...]:
    parts = [_client_id(v, "participant") for v in values]
    if not parts:
        raise ValueError("a round needs at least one participant")
    if len(set(parts)) != len(parts):
        raise ValueError(f"participants contain duplicates: {parts}")
    return tuple(sorted(parts))


def _weights(weights: Mapping[Any, Any], parts: tuple[int, ...]) -> dict[int, float]:
    if not isinstance(weights, Mapping):
        raise TypeError("weights must be a mapping client -> FedAvg weight")
    out = {_client_id(k, "weight key"): v for k, v in weights.items()}
    if set(out) != set(parts):
        raise ValueError(f"weights must have exactly one entry per participant: keys "
                         f"{sorted(out)} vs participants {list(parts)}")
    result: dict[int, float] = {}
    for j in parts:
        w = out[j]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise TypeError(f"weight of client {j} must be a number, got {type(w).__name__}")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight of client {j} must be finite and >= 0, got {w}")
        result[j] = w
    total = math.fsum(result.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"FedAvg weights must sum to 1, got {total}")
    return result


def _metadata(meta: Mapping[str, Any] | None) -> str:
    if meta is None:
        meta = {}
    if not isinstance(meta, Mapping):
        raise TypeError("metadata must be a JSON object (a mapping)")
    try:
        text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable without NaN/inf: {exc}") from None
    if len(text.encode()) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(text.encode())} bytes, limit {MAX_METADATA_BYTES}")
    return text


def _model(model: Any, dim: int | None) -> np.ndarray:
    """The public model as a flat float32/float64 array; refuses NaN/inf and wrong sizes."""
    arr = _as_numpy(model, "model")
    if arr.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"model must be float32 or float64, got {arr.dtype}")
    arr = np.array(arr, copy=True).reshape(-1)
    if dim is not None and arr.size != dim:
        raise ValueError(f"model has {arr.size} entries, the store's models have {dim}")
    if arr.size == 0:
        raise ValueError("model is empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError("model contains NaN or infinity; refusing to store it")
    return arr


def _round_hash(i: int, model_digest: str, parts: Sequence[int], weights: Mapping[int, float],
                refs: Mapping[int, Sequence[str]], meta_json: str) -> str:
    """Canonical digest of a round's full content (what "identical replay" means)."""
    doc = {
        "round": i, "model": model_digest, "participants": list(parts),
        "weights": [float(weights[j]).hex() for j in parts],
        "shares": [list(refs[j]) for j in parts], "metadata": meta_json,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(
    key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rounds(
    round INTEGER PRIMARY KEY CHECK(round >= 1),
    model_blob TEXT NOT NULL,
    participants TEXT NOT NULL,
    metadata TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    committed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS round_shares(
    round INTEGER NOT NULL REFERENCES rounds(round),
    client INTEGER NOT NULL,
    weight REAL NOT NULL,
    update_ref TEXT NOT NULL,
    norm_ref TEXT NOT NULL,
    delta_ref TEXT NOT NULL,
    PRIMARY KEY(round, client)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS staged(
    round INTEGER NOT NULL,
    client INTEGER NOT NULL,
    update_ref TEXT NOT NULL,
    norm_ref TEXT NOT NULL,
    delta_ref TEXT NOT NULL,
    upload_hash TEXT NOT NULL,
    staged_at REAL NOT NULL,
    PRIMARY KEY(round, client)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS jobs(
    id TEXT PRIMARY KEY,
    requester TEXT NOT NULL,
    targets TEXT NOT NULL,
    params TEXT NOT NULL,
    state TEXT NOT NULL,
    progress REAL NOT NULL,
    result_path TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL);
"""

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(fn: _F) -> _F:
    """Serialise a public method and refuse it on a closed store."""

    @wraps(fn)
    def inner(self: ShareStore, *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            if self._conn is None:
                raise StoreClosedError(f"history store {self.root} is closed")
            return fn(self, *args, **kwargs)

    return inner  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the store
class ShareStore:
    """The durable history of one party: catalog + blobs under one directory.

    ``ShareStore(root, party=0, initial_model=M0, server_lr=eta)`` creates a store (or
    opens it if it exists: then the given values must match what is stored, so a daemon
    cannot be pointed at the other party's or another run's directory). ``ShareStore(root,
    party=0)`` opens an existing store. One process at a time: a second open raises
    :class:`StoreLockedError`. Methods are thread-safe (serialised by a lock).
    ``precision`` (fractional bits of the clients' fixed-point encoding, default 16) is
    fixed at creation; on open, None means "as stored".

    Opening recovers from a crash: SQLite rolls back an uncommitted transaction, then blobs
    no catalog row refers to and temp files are removed; the removed paths are logged and
    kept in :attr:`recovered_files`.
    """

    def __init__(self, root: str | os.PathLike[str], *, party: int,
                 initial_model: Any = None, server_lr: float | None = None,
                 precision: int | None = None) -> None:
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1, got {party!r}")
        self.root = Path(root)
        self._mutex = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._round_cache: dict[int, tuple[RoundInfo, dict[int, tuple[str, str, str]]]] = {}
        self._model_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._model_cache_size = 8
        new_root = not self.root.exists()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if new_root:
            _blobs.fsync_dir(self.root.parent)
        self._acquire_lock()
        try:
            self._open_catalog()
            self.blobs = BlobStore(self.root)
            self._init_or_check(party, initial_model, server_lr, precision)
            self.recovered_files: tuple[Path, ...] = tuple(self._recover())
        except BaseException:
            self._release()
            raise

    # ---------------------------------------------------------------- open / close
    def _acquire_lock(self) -> None:
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(f"history store {self.root} is already open "
                                   "(another server process or handle holds its lock)") from None
        self._lock_fd = fd

    def _open_catalog(self) -> None:
        path = self.root / CATALOG
        existed = path.exists()
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn = conn
        if not existed:
            os.chmod(path, 0o600)  # SQLite gives its -wal/-shm files the same mode
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: cannot switch the catalog to WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        ok = conn.execute("PRAGMA quick_check").fetchone()[0]
        if ok != "ok":
            raise CatalogCorruptError(f"{path}: SQLite integrity check failed: {ok}")
        with self._txn():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
        if not existed:
            _blobs.fsync_dir(self.root)

    @contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        """One SQLite write transaction; COMMIT is durable (WAL, synchronous=FULL)."""
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # also after a failed COMMIT (e.g. disk full)
                conn.execute("ROLLBACK")
            raise

    def _meta(self) -> dict[str, str]:
        assert self._conn is not None
        return dict(self._conn.execute("SELECT key, value FROM meta").fetchall())

    def _init_or_check(self, party: int, initial_model: Any, server_lr: float | None,
                       precision: int | None) -> None:
        meta = self._meta()
        if "format" not in meta:
            # Never initialised (or a crash before the initialising transaction committed).
            if initial_model is None or server_lr is None:
                raise StoreError(f"no history store at {self.root}: give initial_model and "
                                 "server_lr to create one")
            lr = float(server_lr)
            if not math.isfinite(lr) or lr <= 0:
                raise ValueError(f"server_lr must be finite and > 0, got {server_lr}")
            precision = DEFAULT_PRECISION if precision is None else int(precision)
            if not 1 <= precision <= 30:
                raise ValueError(f"precision must be 1..30 fractional bits, got {precision}")
            m0 = _model(initial_model, None)
            blob = encode_blob(m0)
            self.blobs.put_many([blob])
            with self._txn() as c:
                c.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", [
                    ("format", str(FORMAT_VERSION)), ("party", str(party)),
                    ("dim", str(m0.size)), ("precision", str(int(precision))),
                    ("server_lr", lr.hex()), ("model0", blob.digest),
                    ("created_at", repr(time.time())),
                ])
            meta = self._meta()
        try:
            fmt = int(meta["format"])
            self._party = int(meta["party"])
            self._dim = int(meta["dim"])
            self._precision = int(meta["precision"])
            self._lr = float.fromhex(meta["server_lr"])
            self._model0 = meta["model0"]
        except (KeyError, ValueError) as exc:
            raise CatalogCorruptError(f"{self.root / CATALOG}: bad store metadata ({exc})") from None
        if fmt != FORMAT_VERSION:
            raise StoreError(f"{self.root}: store format {fmt}, this code reads {FORMAT_VERSION}")
        if self._party != party:
            raise StoreError(f"{self.root} holds party {self._party}'s shares, not party {party}'s")
        if initial_model is not None and encode_blob(_model(initial_model, None)).digest != self._model0:
            raise StoreError(f"{self.root} was created with a different initial model")
        if server_lr is not None and float(server_lr) != self._lr:
            raise StoreError(f"{self.root} was created with server_lr {self._lr}, not {server_lr}")
        if precision is not None and int(precision) != self._precision:
            raise StoreError(f"{self.root} uses {self._precision} fractional bits, not {precision}")

    def _referenced(self) -> set[str]:
        assert self._conn is not None
        refs = {self._model0}
        refs.update(r for (r,) in self._conn.execute("SELECT model_blob FROM rounds"))
        for table in ("round_shares", "staged"):
            refs.update(r[5:] for (r,) in self._conn.execute(
                f"SELECT update_ref FROM {table} WHERE update_ref LIKE 'blob:%'"))
        return refs

    def _recover(self) -> list[Path]:
        """Check the catalog's shape and remove what a crash left behind."""
        assert self._conn is not None
        count, top = self._conn.execute("SELECT COUNT(*), COALESCE(MAX(round), 0) FROM rounds").fetchone()
        if count != top:
            raise CatalogCorruptError(f"{self.root}: rounds are not 1..{top} ({count} rows)")
        self._T = int(top)
        stale = [r for (r,) in self._conn.execute(
            "SELECT DISTINCT round FROM staged WHERE round != ?", (self._T + 1,))]
        if stale:  # cannot happen with this code (commits drop them); keep them, say so
            log.warning("history store %s: staged uploads for closed rounds %s", self.root, stale)
        removed = self.blobs.sweep(self._referenced())
        for p in removed:
            log.warning("history store %s: removed crash leftover %s", self.root, p)
        return removed

    def _release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def close(self) -> None:
        """Close the catalog and release the lock. Idempotent; later calls raise."""
        with self._mutex:
            self._release()
            self._round_cache.clear()
            self._model_cache.clear()

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> ShareStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"T={getattr(self, '_T', '?')}"
        return f"ShareStore({str(self.root)!r}, party={getattr(self, '_party', '?')}, {state})"

    # ---------------------------------------------------------------- constants
    @property
    def party(self) -> int:
        return self._party

    @property
    def dim(self) -> int:
        """Length of every model and update share."""
        return self._dim

    @property
    def precision(self) -> int:
        """Fractional bits of the fixed-point encoding the shares use."""
        return self._precision

    @property
    def server_lr(self) -> float:
        return self._lr


    @property
    def num_rounds(self) -> int:
        """T: rounds 1..T are committed and visible."""
        with self._mutex:
            self._check_open()
            return self._T

    def _check_open(self) -> None:
        if self._conn is None:
            raise StoreClosedError(f"history store {self.root} is closed")

    # ---------------------------------------------------------------- reading
    def _load_round(self, i: int, *, cached: bool = True
                    ) -> tuple[RoundInfo, dict[int, tuple[str, str, str]]]:
        """Round i's catalog rows, checked against the content hash stored with them."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"round must be an integer, got {type(i).__name__}")
        i = int(i)
        if not 1 <= i <= self._T:
            raise IndexError(f"round {i} not in 1..{self._T}")
        if cached and i in self._round_cache:
            return self._round_cache[i]
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT model_blob, participants, metadata, content_hash, committed_at "
            "FROM rounds WHERE round = ?", (i,)).fetchone()
        rows = self._conn.execute(
            "SELECT client, weight, update_ref, norm_ref, delta_ref FROM round_shares "
            "WHERE round = ? ORDER BY client", (i,)).fetchall()
        if row is None:
            raise CatalogCorruptError(f"{self.root}: round {i} has no catalog row")
        model_blob, parts_json, meta_json, content_hash, committed_at = row
        try:
            parts = tuple(int(j) for j in json.loads(parts_json))
            meta = json.loads(meta_json)
        except (ValueError, TypeError) as exc:
            raise CatalogCorruptError(f"{self.root}: round {i} has unreadable catalog values ({exc})") from None
        weights = {int(r[0]): float(r[1]) for r in rows}
        refs = {int(r[0]): (str(r[2]), str(r[3]), str(r[4])) for r in rows}
        if parts != tuple(refs) or \
                _round_hash(i, model_blob, parts, weights, refs, meta_json) != content_hash:
            raise CatalogCorruptError(f"{self.root}: catalog rows of round {i} do not match the "
                                      "content hash committed with them")
        info = RoundInfo(i, parts, MappingProxyType(weights), MappingProxyType(meta),
                         model_blob, content_hash, float(committed_at))
        self._round_cache[i] = (info, refs)
        return info, refs

    def _materialize(self, ref: str, shape: tuple[int, ...], where: str) -> np.ndarray:
        kind, _, value = ref.partition(":")
        try:
            if kind == "blob":
                arr = self.blobs.read(value)
                if arr.dtype != np.dtype(np.int64) or arr.shape != shape:
                    raise CatalogCorruptError(f"{where}: blob {self.blobs.path(value)} holds "
                                              f"{arr.dtype}{list(arr.shape)}, expected int64{list(shape)}")
                return arr
            if kind == "seed":
                return expand(bytes.fromhex(value), shape)
            if kind == "int":
                return np.array(int(value), dtype=np.int64).reshape(shape)
        except ValueError as exc:
            raise CatalogCorruptError(f"{where}: bad share reference {ref!r} ({exc})") from None
        raise CatalogCorruptError(f"{where}: unknown share reference {ref!r}")

    def _refs(self, i: int, client: int) -> tuple[str, str, str]:
        _, refs = self._load_round(i)
        try:
            return refs[int(client)]
        except KeyError:
            raise KeyError(f"client {client} did not take part in round {i}") from None

    @_locked
    def round_info(self, i: int) -> RoundInfo:
        """Public catalog data of round i (participants, weights, metadata, digests)."""
        return self._load_round(i)[0]

    @_locked
    def model(self, i: int) -> np.ndarray:
        """Public model M_i (i = 0..T) as a flat float array (a fresh, writable copy)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"model index must be an integer, got {type(i).__name__}")
        if not 0 <= int(i) <= self._T:
            raise IndexError(f"model {i} not in 0..{self._T}")
        digest = self._model0 if int(i) == 0 else self._load_round(int(i))[0].model_digest
        arr = self._model_cache.get(digest)
        if arr is None:
            arr = self.blobs.read(digest)
            if arr.dtype.kind != "f" or arr.shape != (self._dim,):
                raise CatalogCorruptError(f"model {i}: blob {self.blobs.path(digest)} holds "
                                          f"{arr.dtype}{list(arr.shape)}, not a model")
            self._model_cache[digest] = arr
            while len(self._model_cache) > self._model_cache_size:
                self._model_cache.popitem(last=False)
        else:
            self._model_cache.move_to_end(digest)
        return arr.copy()

    @_locked
    def participants(self, i: int) -> tuple[int, ...]:
        return self._load_round(i)[0].participants

    @_locked
    def weights(self, i: int) -> Mapping[int, float]:
        return self._load_round(i)[0].weights

    @_locked
    def metadata(self, i: int) -> dict[str, Any]:
        """Round i's free-form metadata (a fresh copy)."""
        return json.loads(json.dumps(dict(self._load_round(i)[0].metadata)))

    @_locked
    def update_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of g_i^j: int64, shape (dim,)."""
        return self._materialize(self._refs(i, client)[0], (self._dim,), f"round {i} client {client} update")

    @_locked
    def norm_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of ||g_i^j||: int64, shape ()."""
        return self._materialize(self._refs(i, client)[1], (), f"round {i} client {client} norm")

    @_locked
    def delta_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of delta_i^j: int64, shape ()."""
        return self._materialize(self._refs(i, client)[2], (), f"round {i} client {client} delta")

    @_locked
    def client_shares(self, i: int, client: int) -> ClientShares:
        """All three shares of one participant of round i, as int64 arrays."""
        u, n, d = self._refs(i, client)
        where = f"round {i} client {client}"
        return ClientShares(self._materialize(u, (self._dim,), where + " update"),
                            self._materialize(n, (), where + " norm"),
                            self._materialize(d, (), where + " delta"))

    # ---------------------------------------------------------------- writing rounds
    def _check_replay(self, i: int, model_digest: str, parts: tuple[int, ...],
                      weights: Mapping[int, float], meta_json: str,
                      refs: Mapping[int, tuple[str, str, str]] | None) -> bool:
        """A write of an already committed round: no-op if identical, else raise.

        ``refs`` None compares the public part only (commit_round: the shares came from
        staging, which the first commit emptied).
        """
        info, stored = self._load_round(i)
        stored_meta = json.dumps(dict(info.metadata), sort_keys=True, separators=(",", ":"))
        diffs = []
        if info.model_digest != model_digest:
            diffs.append("model")
        if info.participants != parts:
            diffs.append(f"participants (stored {list(info.participants)}, new {list(parts)})")
        elif any(float(info.weights[j]).hex() != float(weights[j]).hex() for j in parts):
            diffs.append("weights")
        if stored_meta != meta_json:
            diffs.append("metadata")
        if refs is not None:
            changed = [j for j in parts if j in stored and stored[j] != refs[j]]
            if changed:
                diffs.append(f"shares of clients {changed}")
        if diffs:
            raise RoundConflictError(
                f"round {i} is already committed with different content ({'; '.join(diffs)}); "
                "a committed round is never overwritten")
        log.info("history store %s: replay of committed round %d ignored (identical)", self.root, i)
        return False

    def _write_round(self, i: int, model_blob: EncodedBlob, parts: tuple[int, ...],
                     weights: Mapping[int, float], refs: Mapping[int, tuple[str, str, str]],
                     meta_json: str, share_blobs: Sequence[EncodedBlob]) -> None:
        """The commit protocol: blobs durable first, then one catalog transaction."""
        self.blobs.put_many([model_blob, *share_blobs])
        _checkpoint("round-blobs-durable")
        content_hash = _round_hash(i, model_blob.digest, parts, weights, refs, meta_json)
        with self._txn() as c:
            old = [(int(j), str(r)) for j, r in c.execute(
                "SELECT client, update_ref FROM staged WHERE round = ?", (i,))]
            c.execute("INSERT INTO rounds(round, model_blob, participants, metadata, content_hash, "
                      "committed_at) VALUES (?, ?, ?, ?, ?, ?)",
                      (i, model_blob.digest, json.dumps(list(parts)), meta_json, content_hash, time.time()))
            c.executemany("INSERT INTO round_shares(round, client, weight, update_ref, norm_ref, "
                          "delta_ref) VALUES (?, ?, ?, ?, ?, ?)",
                          [(i, j, weights[j], *refs[j]) for j in parts])
            c.execute("DELETE FROM staged WHERE round = ?", (i,))
            _checkpoint("round-in-transaction")
        self._T = i
        _checkpoint("round-committed")
        dropped = sorted(j for j, _ in old if j not in parts)
        log.info("history store %s: round %d committed (%d participants%s)", self.root, i,
                 len(parts), f"; dropped staged uploads of {dropped}" if dropped else "")
        self._remove_if_unreferenced(r for _, r in old)

    def _remove_if_unreferenced(self, refs: Iterable[str]) -> None:
        digests = {r[5:] for r in refs if r.startswith("blob:")}
        if digests:
            self.blobs.remove(digests - self._referenced())

    @_locked
    def append_round(self, round: int, model: Any, participants: Iterable[int],
                     weights: Mapping[int, float], shares: Mapping[int, ClientShares],
                     metadata: Mapping[str, Any] | None = None) -> bool:
        """Store round ``round`` (must be T+1) with this party's shares of every participant.

        Returns True if written, False if the same round was already stored with identical
        content (a replay after a crash). Raises RoundConflictError for different content
        of a committed round, RoundOrderError for a gap. Validates everything before
        writing anything; staged uploads of that round, if any, are dropped.
        "Identical" compares the stored representation: a share given once as a seed and
        once expanded is a conflict.
        """
        i = _round_no(round)
        parts = _participants(participants)
        w = _weights(weights, parts)
        meta_json = _metadata(metadata)
        model_blob = encode_blob(_model(model, self._dim))
        if not isinstance(shares, Mapping):
            raise TypeError("shares must be a mapping client -> ClientShares")
        uploads = {_client_id(k, "shares key"): v for k, v in shares.items()}
        if set(uploads) != set(parts):
            raise ValueError(f"shares must have exactly one entry per participant: keys "
                             f"{sorted(uploads)} vs participants {list(parts)}")
        ups = {j: _upload(uploads[j], f"client {j}", self._party, self._dim) for j in parts}
        refs = {j: ups[j].refs for j in parts}
        if i <= self._T:
            return self._check_replay(i, model_blob.digest, parts, w, meta_json, refs)
        if i != self._T + 1:
            raise RoundOrderError(f"cannot store round {i}: the store has rounds 1..{self._T}, "
                                  f"the next is {self._T + 1}")
        self._write_round(i, model_blob, parts, w, refs, meta_json,
                          [b for j in parts for b in ups[j].blobs])
        return True

    # ---------------------------------------------------------------- staging
    def _staged_rows(self, i: int) -> dict[int, tuple[str, str, str]]:
        assert self._conn is not None
        out = {}
        for j, u, n, d, h in self._conn.execute(
                "SELECT client, update_ref, norm_ref, delta_ref, upload_hash FROM staged "
                "WHERE round = ? ORDER BY client", (i,)):
            refs = (str(u), str(n), str(d))
            if _Upload(refs).digest != h:
                raise CatalogCorruptError(f"{self.root}: staged upload of client {j} for round "
                                          f"{i} does not match its hash")
            out[int(j)] = refs
        return out

    def _check_open_round(self, i: int) -> None:
        if i <= self._T:
            raise StagingError(f"round {i} is already committed; its uploads are closed")
        if i != self._T + 1:
            raise StagingError(f"round {i} is not open; the open round is {self._T + 1}")

    @_locked
    def stage_upload(self, round: int, client: int, update: Any, norm: Any, delta: Any, *,
                     replace: bool = False) -> bool:
        """Durably stage one client's upload for the open round T+1.

        Returns True when stored, False when the identical upload was already staged (a
        client retry). A different upload from the same client raises
        StagingConflictError unless ``replace`` is True. When this returns, the upload
        survives a crash; a crash before it returns leaves either nothing or the whole
        upload staged.
        """
        i = _round_no(round)
        j = _client_id(client)
        up = _upload(ClientShares(update, norm, delta), f"client {j}", self._party, self._dim)
        self._check_open_round(i)
        old = self._staged_rows(i).get(j)
        if old is not None:
            if old == up.refs:
                log.info("history store %s: repeated upload of client %d for round %d ignored",
                         self.root, j, i)
                return False
            if not replace:
                raise StagingConflictError(f"client {j} already staged a different upload for "
                                           f"round {i} (pass replace=True to overwrite it)")
        self.blobs.put_many(up.blobs)
        _checkpoint("staged-blob-durable")
        with self._txn() as c:
            c.execute("INSERT OR REPLACE INTO staged(round, client, update_ref, norm_ref, delta_ref, "
                      "upload_hash, staged_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (i, j, *up.refs, up.digest, time.time()))
            _checkpoint("staged-in-transaction")
        _checkpoint("staged-committed")
        if old is not None:
            self._remove_if_unreferenced([old[0]])
        return True

    @_locked
    def staged(self, round: int) -> tuple[int, ...]:
        """Clients with a staged upload for ``round`` (sorted); empty once it is committed."""
        return tuple(self._staged_rows(_round_no(round)))

    @_locked
    def staged_upload(self, round: int, client: int) -> ClientShares:
        """The staged shares of one client (int64 arrays, seeds expanded)."""
        i, j = _round_no(round), _client_id(client)
        refs = self._staged_rows(i).get(j)
        if refs is None:
            raise KeyError(f"client {j} has no staged upload for round {i}")
        where = f"staged round {i} client {j}"
        return ClientShares(self._materialize(refs[0], (self._dim,), where + " update"),
                            self._materialize(refs[1], (), where + " norm"),
                            self._materialize(refs[2], (), where + " delta"))

    @_locked
    def drop_staged(self, round: int, client: int | None = None) -> tuple[int, ...]:
        """Withdraw staged uploads (one client's, or the whole round's); returns who was dropped."""
        i = _round_no(round)
        rows = self._staged_rows(i)
        gone = sorted(rows) if client is None else [j for j in rows if j == _client_id(client)]
        if gone:
            with self._txn() as c:
                c.executemany("DELETE FROM staged WHERE round = ? AND client = ?", [(i, j) for j in gone])
            self._remove_if_unreferenced(rows[j][0] for j in gone)
        return tuple(gone)

    @_locked
    def commit_round(self, round: int, model: Any, participants: Iterable[int],
                     weights: Mapping[int, float], metadata: Mapping[str, Any] | None = None) -> bool:
        """Close the open round: the agreed participants' staged shares become round ``round``.

        In one catalog transaction: the round row, one share row per participant (moved
        from staging) and the deletion of every staged upload of the round, including the
        non-participants' (dropped). Every participant must have a staged upload, else
        StagingError and nothing changes. Returns False for an identical replay of a
        committed round (public content compared: model, participants, weights,
        metadata), raises RoundConflictError if it differs.
        """
        i = _round_no(round)
        parts = _participants(participants)
        w = _weights(weights, parts)
        meta_json = _metadata(metadata)
        model_blob = encode_blob(_model(model, self._dim))
        if i <= self._T:
            return self._check_replay(i, model_blob.digest, parts, w, meta_json, None)
        if i != self._T + 1:
            raise RoundOrderError(f"cannot commit round {i}: the open round is {self._T + 1}")
        staged = self._staged_rows(i)
        missing = [j for j in parts if j not in staged]
        if missing:
            raise StagingError(f"cannot commit round {i}: participants {missing} have no staged "
                               "upload")
        self._write_round(i, model_blob, parts, w, {j: staged[j] for j in parts}, meta_json, [])
        return True

    # ---------------------------------------------------------------- checking
    @_locked
    def verify(self) -> list[str]:
        """Read and check everything (catalog hashes, every blob's checksum); list problems.

        Slow (reads every byte); for ``starfish status`` and operators, not for the hot path.
        """
        problems: list[str] = []
        for i in range(0, self._T + 1):
            try:
                self._model_cache.clear()
                self.model(i)
            except (StoreError, BlobError) as exc:
                problems.append(str(exc))
            if i == 0:
                continue
            try:
                info, refs = self._load_round(i, cached=False)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            for j, (u, n, d) in refs.items():
                try:
                    self._materialize(u, (self._dim,), f"round {i} client {j} update")
                    self._materialize(n, (), f"round {i} client {j} norm")
                    self._materialize(d, (), f"round {i} client {j} delta")
                except (StoreError, BlobError) as exc:
                    problems.append(str(exc))
        try:
            for j, refs in self._staged_rows(self._T + 1).items():
                try:
                    self._materialize(refs[0], (self._dim,), f"staged client {j} update")
                except (StoreError, BlobError) as exc:
                    problems.append(str(exc))
        except StoreError as exc:
            problems.append(str(exc))
        return problems

    # ---------------------------------------------------------------- unlearning jobs
    def _job_from_row(self, row: Sequence[Any]) -> JobRecord:
        jid, req, targets, params, state, progress, result, error, created, updated = row
        return JobRecord(str(jid), str(req), tuple(int(t) for t in json.loads(targets)),
                         MappingProxyType(json.loads(params)), str(state), float(progress),
                         result, error, float(created), float(updated))

    def _job_row(self, job_id: str) -> JobRecord | None:
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT id, requester, targets, params, state, progress, result_path, error, "
            "created_at, updated_at FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._job_from_row(row)

    @_locked
    def create_job(self, requester: str, targets: Iterable[int], *, job_id: str | None = None,
                   params: Mapping[str, Any] | None = None) -> JobRecord:
        """Record a new unlearning job in state ``queued``.

        Idempotent for a replayed request: the same ``job_id`` with the same requester,
        targets and params returns the stored record; different content raises JobError.
        """
        if not isinstance(requester, str) or not 0 < len(requester) <= 256:
            raise JobError("requester must be a non-empty string of at most 256 characters")
        tgt = _participants(targets)
        params_json = _metadata(params)
        jid = secrets.token_hex(8) if job_id is None else job_id
        if not isinstance(jid, str) or not _JOB_ID_RE.match(jid):
            raise JobError(f"job id must match {_JOB_ID_RE.pattern}, got {jid!r}")
        old = self._job_row(jid)
        if old is not None:
            same = (old.requester == requester and old.targets == tgt
                    and json.dumps(dict(old.params), sort_keys=True, separators=(",", ":")) == params_json)
            if not same:
                raise JobError(f"job {jid} already exists with a different request")
            return old
        now = time.time()
        with self._txn() as c:
            c.execute("INSERT INTO jobs(id, requester, targets, params, state, progress, "
                      "result_path, error, created_at, updated_at) VALUES (?, ?, ?, ?, 'queued', "
                      "0.0, NULL, NULL, ?, ?)", (jid, requester, json.dumps(list(tgt)), params_json,
                                                 now, now))
        rec = self._job_row(jid)
        assert rec is not None
        return rec

    @_locked
    def update_job(self, job_id: str, *, state: str | None = None, progress: float | None = None,
                   result_path: str | os.PathLike[str] | None = None,
                   error: str | None = None) -> JobRecord:
        """Change a job's state/progress/result durably (one transaction).

        Allowed transitions are :data:`JOB_STATES`; finished jobs (done, failed,
        cancelled) are immutable.
        """
        rec = self._job_row(job_id)
        if rec is None:
            raise KeyError(f"no unlearning job {job_id!r}")
        if not JOB_STATES[rec.state]:
            raise JobError(f"job {job_id} is {rec.state}; finished jobs cannot change")
        new_state = rec.state if state is None else state
        if new_state not in JOB_STATES:
            raise JobError(f"unknown job state {state!r}; states are {sorted(JOB_STATES)}")
        if new_state != rec.state and new_state not in JOB_STATES[rec.state]:
            raise JobError(f"job {job_id}: cannot go from {rec.state} to {new_state}")
        new_progress = rec.progress if progress is None else float(progress)
        if not (math.isfinite(new_progress) and 0.0 <= new_progress <= 1.0):
            raise JobError(f"progress must be in [0, 1], got {progress}")
        new_result = rec.result_path if result_path is None else os.fspath(result_path)
        new_error = rec.error if error is None else str(error)
        with self._txn() as c:
            c.execute("UPDATE jobs SET state = ?, progress = ?, result_path = ?, error = ?, "
                      "updated_at = ? WHERE id = ?",
                      (new_state, new_progress, new_result, new_error, time.time(), job_id))
        out = self._job_row(job_id)
        assert out is not None
        return out

    @_locked
    def job(self, job_id: str) -> JobRecord:
        rec = self._job_row(job_id)
        if rec is None:
            raise KeyError(f"no unlearning job {job_id!r}")
        return rec

    @_locked
    def jobs(self, state: str | None = None) -> list[JobRecord]:
        """Job records in creation order, optionally only those in ``state``.

        After a restart, ``jobs("running")`` are the jobs the crash interrupted: the daemon
        decides whether to re-queue or fail them.
        """
        assert self._conn is not None
        sql = ("SELECT id, requester, targets, params, state, progress, result_path, error, "
               "created_at, updated_at FROM jobs")
        args: tuple[Any, ...] = ()
        if state is not None:
            sql += " WHERE state = ?"
            args = (state,)
        return [self._job_from_row(r) for r in self._conn.execute(sql + " ORDER BY rowid", args)]

    # ---------------------------------------------------------------- History view
    def history(self, wrap: Callable[..., Any] | None = None) -> History:
        """This store as a :class:`servers.history.History` (see :class:`ShareHistory`)."""
        return _share_history_class()(self, wrap)


# ------------------------------------------------------------------------------ History adapter
_HISTORY_CLASS: type | None = None
_HISTORY_LOCK = threading.Lock()


def _share_history_class() -> type:
    """Build ShareHistory on first use: it needs torch (slow to import), the store does not."""
    global _HISTORY_CLASS
    with _HISTORY_LOCK:
        if _HISTORY_CLASS is None:
            _HISTORY_CLASS = _build_share_history()
        return _HISTORY_CLASS


def _build_share_history() -> type:
    import torch

    from .history import History, RoundRecord, Secret

    class ShareHistory(History):
        """:class:`History` over one party's :class:`ShareStore`.

        Public values come back in the clear: ``model(i)`` is a torch tensor (float32 or
        float64, as stored), ``participants``/``weights`` as stored. Per-client values
        are this party's *share*: ``update(i, j)`` a numpy int64 array of shape (dim,),
        ``norm``/``delta`` numpy int64 arrays of shape (). Give ``wrap`` (e.g.
        ``party.wrap_share``; called as ``wrap(share, precision=store.precision)``) to get
        CrypTen tensors instead, which is what the Starfish sub-protocols expect.

        A raw share is not a value: never feed this history, unwrapped, to a plaintext
        recovery method (FedRecover, FedEraser, ...). ``holds_shares`` is True so callers
        can refuse it.

        ``append_round(record, round_index=i)`` detects replays (identical content is a
        no-op, different content raises RoundConflictError); without ``round_index`` it
        appends T+1 and cannot tell a replay from a new round.
        """

        holds_shares = True

        def __init__(self, store: ShareStore, wrap: Callable[..., Any] | None = None) -> None:
            self.store = store
            self._wrap = wrap

        @property
        def party(self) -> int:
            return self.store.party

        @property
        def num_rounds(self) -> int:
            return self.store.num_rounds

        @property
        def server_lr(self) -> float:
            return self.store.server_lr

        def model(self, i: int) -> torch.Tensor:
            return torch.from_numpy(self.store.model(i))

        def participants(self, i: int) -> tuple[int, ...]:
            return self.store.participants(i)

        def weights(self, i: int) -> Mapping[int, float]:
            return self.store.weights(i)

        def _out(self, share: np.ndarray) -> Secret:
            return share if self._wrap is None else self._wrap(share, precision=self.store.precision)

        def update(self, i: int, client: int) -> Secret:
            return self._out(self.store.update_share(i, client))

        def norm(self, i: int, client: int) -> Secret:
            return self._out(self.store.norm_share(i, client))

        def delta(self, i: int, client: int) -> Secret:
            return self._out(self.store.delta_share(i, client))

        def append_round(self, record: RoundRecord, *, round_index: int | None = None,
                         metadata: Mapping[str, Any] | None = None) -> None:
            clients = set(record.updates) | set(record.norms) | set(record.deltas)
            shares = {}
            for j in clients:
                if j not in record.updates or j not in record.norms or j not in record.deltas:
                    raise ValueError(f"client {j} needs an update, a norm and a delta share")
                shares[j] = ClientShares(record.updates[j], record.norms[j], record.deltas[j])
            i = self.store.num_rounds + 1 if round_index is None else round_index
            self.store.append_round(i, record.model, record.participants, record.weights,
                                    shares, metadata)

    ShareHistory.__module__ = __name__
    ShareHistory.__qualname__ = "ShareHistory"
    return ShareHistory


def __getattr__(name: str) -> Any:
    """``ShareHistory`` is created lazily (PEP 562) so importing the store skips torch."""
    if name == "ShareHistory":
        return _share_history_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
