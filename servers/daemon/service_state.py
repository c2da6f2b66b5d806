"""A server's small durable bookkeeping next to its history store: nonces, data sizes and
the opened aggregates of robust rounds.

Why a separate file: the history store (``servers/store/share_store.py``) keeps shares and public
rounds; it has no place for two facts the service needs across restarts:

* the last accepted nonce of every identity (replay protection: a state-changing message
  whose nonce is not larger than the last accepted one is refused, also after a restart);
* |D_j|, the data size a client reported in the clear with its upload for the open round
  (FedAvg weights are |D_j| / sum |D_k| over the agreed participants; the servers compare
  the values they each received and drop a client that reported two different sizes);
* under a Byzantine-robust aggregator (``[fl] aggregator``), the aggregate the round's 2PC
  session opened, until the round is committed: a crash between the session and the
  commit then needs no second session (``servers.daemon.round_coordinator``). It is public (the
  next model reveals it), so it needs no erasure.

SQLite, WAL, ``synchronous=FULL``, ``secure_delete=ON`` (deleted rows are overwritten with
zeros): a write that returned survives a crash. When an unlearning job forgets a client,
:meth:`ServiceState.forget_client` deletes its sizes and truncates the WAL, so no copy of
them stays in this file (docs/share_store.md, "Erasure"). Ordering with
the history store: the size row is written before the upload is staged, the nonce after
the action succeeded; a crash in between leaves at most an unused size row (harmless) or
an action whose nonce was not recorded (its replay is then recognised by the history
store's idempotent staging / job creation instead).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import numpy as np

from common.sample_count import SampleCount

__all__ = ["ServiceState"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nonces (identity TEXT PRIMARY KEY, last INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS upload_sizes (round INTEGER NOT NULL, client INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, PRIMARY KEY (round, client));
CREATE TABLE IF NOT EXISTS opened_aggregates (round INTEGER PRIMARY KEY, record TEXT NOT NULL,
    vector BLOB NOT NULL);
"""


class ServiceState:
    """Nonces and upload sizes of one server (thread-safe; one process at a time)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        existed = self.path.exists()
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        if not existed:
            os.chmod(self.path, 0o600)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        if self._conn.execute("PRAGMA secure_delete=ON").fetchone()[0] != 1:
            raise RuntimeError(f"{self.path}: this SQLite cannot enable secure_delete")
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                self._conn.execute(stmt)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ nonces
    def last_nonce(self, identity: str) -> int:
        with self._lock:
            row = self._conn.execute("SELECT last FROM nonces WHERE identity = ?", (identity,)).fetchone()
        return 0 if row is None else int(row[0])

    def record_nonce(self, identity: str, nonce: int) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT INTO nonces(identity, last) VALUES (?, ?) ON CONFLICT(identity) "
                "DO UPDATE SET last = MAX(last, excluded.last)", (identity, int(nonce)))

    # ------------------------------------------------------------------ sizes
    # |D_j| is checked where it enters, the upload's wire field (``common.sample_count``); this
    # table keeps what it is given (tests store 8-byte values to find them on disk).
    def size(self, round_: int, client: int) -> SampleCount | None:
        with self._lock:
            row = self._conn.execute("SELECT num_samples FROM upload_sizes WHERE round = ? AND "
                                     "client = ?", (round_, client)).fetchone()
        return None if row is None else SampleCount(int(row[0]))

    def set_size(self, round_: int, client: int, num_samples: SampleCount) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO upload_sizes(round, client, num_samples) "
                               "VALUES (?, ?, ?)", (round_, client, int(num_samples)))

    def sizes(self, round_: int) -> dict[int, SampleCount]:
        with self._lock:
            rows = self._conn.execute("SELECT client, num_samples FROM upload_sizes WHERE round = ?",
                                      (round_,)).fetchall()
        return {int(c): SampleCount(int(n)) for c, n in rows}

    def forget_rounds_before(self, round_: int) -> None:
        """Sizes of committed rounds live in the round's metadata, their opened aggregates in
        the models; drop the sidecar copies."""
        with self._lock:
            self._conn.execute("DELETE FROM upload_sizes WHERE round < ?", (round_,))
            self._conn.execute("DELETE FROM opened_aggregates WHERE round < ?", (round_,))

    # ------------------------------------------------------------------ opened aggregates
    def put_opened(self, round_: int, record: dict[str, Any], vector: np.ndarray) -> None:
        """Durably keep what a robust round's 2PC session opened (replacing an earlier attempt)."""
        data = np.ascontiguousarray(vector, dtype="<f8").tobytes()
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO opened_aggregates(round, record, vector) "
                               "VALUES (?, ?, ?)", (round_, json.dumps(record, sort_keys=True), data))

    def opened(self, round_: int) -> tuple[dict[str, Any], np.ndarray] | None:
        """The record and vector kept by :meth:`put_opened` for ``round_``, or None."""
        with self._lock:
            row = self._conn.execute("SELECT record, vector FROM opened_aggregates WHERE round = ?",
                                     (round_,)).fetchone()
        if row is None:
            return None
        return json.loads(row[0]), np.frombuffer(row[1], dtype="<f8").astype(np.float64)

    def forget_client(self, client: int) -> int:
        """Delete every size row of ``client`` (an unlearning job forgot it); return how many.

        secure_delete overwrites the rows in their pages; the WAL is then checkpointed and
        truncated so that no older copy of those pages stays in it.
        """
        with self._lock:
            n = self._conn.execute("DELETE FROM upload_sizes WHERE client = ?",
                                   (int(client),)).rowcount
            busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            raise RuntimeError(f"{self.path}: the WAL could not be checkpointed (busy)")
        return int(n)
