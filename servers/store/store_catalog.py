"""The history store's directory: lock file, SQLite catalog, blob files, crash recovery.

Why a module of its own: opening a store is where its durability guarantees are enforced
(docs/design.md 4.4): one process at a time (an exclusive lock file), a catalog in WAL mode with
``synchronous=FULL`` whose write transactions are durable when they return, a check that the
directory belongs to this party and run, and the removal of whatever a crash left behind
(blobs no catalog row refers to, temp files). :class:`StoreCatalog` does that and nothing
else; the store's contents are added by the parts built on it (``servers.store.staging``,
``servers.store.job_records``, ``servers.store.share_store``), which all use its transactions,
its :func:`locked` methods and its reading of share references.

Catalog schema (one SQLite file, ``catalog.sqlite3``; the tables in
``servers.store.store_schema``): ``meta`` (format, party, model length, precision, server learning
rate, digest of M_0, the ``compact_pending`` flag of an erasure), ``rounds`` and
``round_shares`` (committed rounds), ``staged`` (uploads for the open round), ``jobs``
(unlearning-job records), ``forgotten`` and ``erasures`` (``servers.store.erasure``). Share
references are text: ``blob:<digest>``, ``seed:<hex>``, ``int:<n>``. Every connection runs
with ``secure_delete=ON``: SQLite overwrites deleted rows with zeros. This module imports
neither torch nor CrypTen.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np

from common.encoding import DEFAULT_PRECISION
from common.prg import expand

from servers.store import blobs as _blobs
from servers.store import store_validation as check
from servers.store.blobs import BlobStore, EncodedBlob, encode_blob
from servers.store.shard_files import ShardFiles, join_checked
from servers.store.store_errors import CatalogCorruptError, StoreClosedError, StoreError, StoreLockedError
from servers.store.store_schema import create_or_migrate

__all__ = ["FORMAT_VERSION", "CATALOG", "LOCK", "StoreCatalog", "locked"]

log = logging.getLogger("starfish.store")

FORMAT_VERSION = 1
CATALOG = "catalog.sqlite3"
LOCK = "LOCK"


_F = TypeVar("_F", bound=Callable[..., Any])


def locked(fn: _F) -> _F:
    """Serialise a public method and refuse it on a closed store."""

    @wraps(fn)
    def inner(self: StoreCatalog, *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            if self._conn is None:
                raise StoreClosedError(f"history store {self.root} is closed")
            return fn(self, *args, **kwargs)

    return inner  # type: ignore[return-value]


class StoreCatalog:
    """An open store directory: its lock, its catalog, its blobs; the store's base class.

    ``StoreCatalog(root, party=0, initial_model=M0, server_lr=eta)`` creates the directory
    (or opens it if it exists: then the given values must match what is stored, so a daemon
    cannot be pointed at the other party's or another run's directory); without
    ``initial_model``/``server_lr`` it opens an existing one. A second open raises
    :class:`StoreLockedError`. ``precision`` is fixed at creation; on open, None means "as
    stored". Opening recovers from a crash: SQLite rolls back an uncommitted transaction,
    then blobs no catalog row refers to and temp files are removed; the removed paths are
    logged and kept in :attr:`recovered_files`.
    """

    def __init__(self, root: str | os.PathLike[str], *, party: int,
                 initial_model: Any = None, server_lr: float | None = None,
                 precision: int | None = None, shards: ShardFiles | None = None) -> None:
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1, got {party!r}")
        self.root = Path(root)
        self._mutex = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self.shards = shards
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

    def _checkpoint_hook(self, name: str) -> None:
        """Crash-test seam of the parts built on this class. No-op here;
        :class:`servers.store.share_store.ShareStore` routes it to ``servers.store.share_store._checkpoint``,
        the one name crash tests replace."""

    def _invalidate_caches(self) -> None:
        """Forget in-process copies of catalog rows (after a write that rewrites rounds).
        No-op here; :class:`servers.store.share_store.ShareStore` clears its round/model caches."""

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
        # deleted rows (an erasure, a dropped upload) are overwritten with zeros in the page
        if conn.execute("PRAGMA secure_delete=ON").fetchone()[0] != 1:
            raise StoreError(f"{path}: this SQLite cannot enable secure_delete")
        ok = conn.execute("PRAGMA quick_check").fetchone()[0]
        if ok != "ok":
            raise CatalogCorruptError(f"{path}: SQLite integrity check failed: {ok}")
        with self._txn() as c:
            added = create_or_migrate(c)
        if added and existed:
            log.warning("history store %s: catalog migrated (columns added: %s)",
                        self.root, ", ".join(added))
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
            m0 = check.model(initial_model, None)
            blob = encode_blob(m0)
            self.blobs.put_many([blob])
            with self._txn() as c:
                c.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", [
                    ("format", str(FORMAT_VERSION)), ("party", str(party)),
                    ("dim", str(m0.size)), ("precision", str(int(precision))),
                    ("server_lr", lr.hex()), ("model0", blob.digest),
                    ("created_at", repr(time.time())), ("shards", str(self._shard_count())),
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
        if initial_model is not None and \
                encode_blob(check.model(initial_model, None)).digest != self._model0:
            raise StoreError(f"{self.root} was created with a different initial model")
        stored = int(meta.get("shards", "1"))     # a store from before issue 30: one process
        if stored != self._shard_count():
            raise StoreError(f"{self.root} keeps its update shares on {stored} shard(s) and this server "
                             f"runs {self._shard_count()}: set [deployment] workers = {stored} (a store "
                             "cannot change its number of shards)")
        if server_lr is not None and float(server_lr) != self._lr:
            raise StoreError(f"{self.root} was created with server_lr {self._lr}, not {server_lr}")
        if precision is not None and int(precision) != self._precision:
            raise StoreError(f"{self.root} uses {self._precision} fractional bits, not {precision}")

    def _shard_count(self) -> int:
        return 1 if self.shards is None else len(self.shards.bounds)

    def _update_digests(self) -> set[str]:
        """The blobs of committed and staged update shares (on the shards where there are some)."""
        assert self._conn is not None
        refs: set[str] = set()
        for table in ("round_shares", "staged"):
            refs.update(r[5:] for (r,) in self._conn.execute(
                f"SELECT update_ref FROM {table} WHERE update_ref LIKE 'blob:%'"))
        return refs

    def _referenced(self) -> set[str]:
        assert self._conn is not None
        refs = {self._model0}
        refs.update(r for (r,) in self._conn.execute("SELECT model_blob FROM rounds"))
        return refs | self._update_digests()

    def _put_updates(self, blobs: Sequence[EncodedBlob]) -> None:
        """Update shares made durable: here, or each shard's slice in its directory."""
        if self.shards is None:
            self.blobs.put_many(blobs)
        elif blobs:
            self.shards.put([(b.digest, np.frombuffer(b.payload, dtype="<i8")) for b in blobs])

    def _sweep_shards(self, erasure: bool = False) -> int:
        """The shards' slices no catalog row names, removed (a crash's leftovers, or ``erasure``:
        the forgotten clients' updates)."""
        if self.shards is None:
            return 0
        removed = self.shards.sweep(self._update_digests())
        if removed:
            log.log(logging.INFO if erasure else logging.WARNING, "history store %s: removed %d slice "
                    "file(s) no round refers to from its shards%s", self.root, removed,
                    "" if erasure else " (crash leftovers)")
        return removed

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
        if removed:
            _blobs.fsync_dir(self.blobs.dir)  # the removals are durable (an erasure's blobs)
        self._sweep_shards()
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

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"T={getattr(self, '_T', '?')}"
        return (f"{type(self).__name__}({str(self.root)!r}, party={getattr(self, '_party', '?')}, "
                f"{state})")

    def _check_open(self) -> None:
        if self._conn is None:
            raise StoreClosedError(f"history store {self.root} is closed")

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

    # ---------------------------------------------------------------- share references
    def _materialize(self, ref: str, shape: tuple[int, ...], where: str) -> np.ndarray:
        """The int64 array a catalog share reference stands for (a seed is expanded)."""
        kind, _, value = ref.partition(":")
        try:
            if kind == "blob" and self.shards is not None and shape == (self._dim,):
                return join_checked(value, self.shards.read(value), self._dim, where)
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

    def _remove_if_unreferenced(self, refs: Iterable[str]) -> None:
        """Delete the blobs among ``refs`` that no catalog row refers to any more."""
        digests = {r[5:] for r in refs if r.startswith("blob:")}
        if digests:
            gone = digests - self._referenced()
            self.blobs.remove(gone)
            if self.shards is not None:
                self.shards.remove(gone)
