"""Forgetting takes effect: adopt an unlearned model as round T+1 and erase the forgotten.

Why a module of its own: when both servers finish an unlearning job, each store must, as
one atomic and durable step, make the job's model the current global model (a new round
T+1 with no participants) and delete everything it holds of the forgotten clients: their
shares in every round, their staged uploads, the blob files only they used, and the
catalog pages those rows lived in. A crash at any moment must leave the store entirely
before (round T, nothing erased) or entirely after (round T+1, the clients erased, their
files gone once the store is opened again). :class:`ErasureLog` is that transaction plus
what it leaves for later: the ``forgotten`` table (whose uploads are refused until an
admin re-enrols them) and the ``erasures`` table (one :class:`ErasureReport` per job).

Order of :meth:`ErasureLog.adopt_unlearning` (docs/share_store.md, "Erasure"): the model
blob is made durable; one SQLite transaction rewrites every round the clients took part in
(participants, metadata, content hash), deletes their share rows and staged uploads (and
all of round T+1's, computed on M_T), inserts round T+1, records the clients and the
report and sets ``compact_pending``; after the COMMIT the unreferenced blob files are
unlinked, the WAL is truncated, the catalog is rebuilt by ``VACUUM`` and the WAL truncated
again, and only then is ``compact_pending`` cleared. A store opened with the flag set (a
crash in between) finishes that compaction first. The catalog connection runs with
``secure_delete=ON`` (deleted rows are overwritten with zeros).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.sample_count import METADATA_KEY

from servers.store import blobs as _blobs
from servers.store import store_validation as check
from servers.store.blobs import encode_blob
from servers.store.store_catalog import StoreCatalog, locked
from servers.store.store_errors import CatalogCorruptError, RoundConflictError, RoundOrderError, StoreError
from servers.store.store_schema import round_hash

__all__ = ["ErasureReport", "ErasureLog", "COMPACT_FLAG"]

log = logging.getLogger("starfish.store")

#: ``meta`` key set by an erasure's transaction and cleared once the catalog is compacted.
COMPACT_FLAG = "compact_pending"


def renormalised(weights: Mapping[int, float], sizes: Any) -> dict[int, float]:
    """The remaining clients' FedAvg weights over themselves (issue 25, finding 5).

    Kept as stored, w_j = |D_j| / N with the erased clients' sizes in N, they summed to
    1 - |D_erased| / N; with the remaining |D_j| public (``round_info``) that gave N and hence
    the erased |D_j| exactly. Renormalised they say nothing about it: |D_j| / sum of the remaining
    |D_j| where the round records the sizes (exact integers; both servers get the same floats),
    else w_j / the sum of the remaining w_j. Stage II renormalises over the clients present in a
    replayed round anyway, so the replay does not change.
    """
    if not weights:
        return {}
    if isinstance(sizes, dict) and all(str(j) in sizes for j in weights):
        n = {j: int(sizes[str(j)]) for j in weights}
        total = sum(n.values())
        if total > 0:
            return {j: n[j] / total for j in sorted(weights)}
    total_w = math.fsum(weights[j] for j in sorted(weights))
    return {j: weights[j] / total_w for j in sorted(weights)} if total_w > 0 else dict(weights)


@dataclass(frozen=True)
class ErasureReport:
    """What one store erased for one unlearning job (public bookkeeping, no data values).

    ``rounds``: the committed rounds shares were erased from; ``share_rows``/``staged_rows``:
    catalog rows deleted (staged rows include every upload staged for ``round``, computed on
    the superseded model); ``blobs_removed``: blob files the erasure left unreferenced (and
    unlinked); ``round``: the adoption round T+1; ``at``: commit time (Unix seconds);
    ``replayed``: True when returned by a replay of an adoption already committed.
    """

    job: str
    clients: tuple[int, ...]
    rounds: tuple[int, ...]
    share_rows: int
    staged_rows: int
    blobs_removed: int
    round: int
    at: float
    party: int
    replayed: bool = False

    def to_json(self) -> dict[str, Any]:
        """A plain JSON object (lists, numbers, strings)."""
        return {"job": self.job, "clients": list(self.clients), "rounds": list(self.rounds),
                "share_rows": self.share_rows, "staged_rows": self.staged_rows,
                "blobs_removed": self.blobs_removed, "round": self.round, "at": self.at,
                "party": self.party, "replayed": self.replayed}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


class ErasureLog(StoreCatalog):
    """Adoption of unlearned models and erasure of forgotten clients (a part of
    :class:`servers.store.share_store.ShareStore`)."""

    _unlearning_rounds: set[int]

    # ---------------------------------------------------------------- open
    def _recover(self) -> list[Path]:
        removed = super()._recover()  # also unlinks an interrupted erasure's blobs
        assert self._conn is not None
        self._unlearning_rounds = {int(r) for (r,) in self._conn.execute(
            "SELECT round_no FROM erasures")}
        if self._meta().get(COMPACT_FLAG) == "1":
            log.warning("history store %s: an erasure was committed but its compaction did not "
                        "finish; compacting now", self.root)
            try:
                self._compact()
            except (sqlite3.Error, OSError, StoreError) as exc:
                log.error("history store %s: compaction failed (%s); the flag stays set and "
                          "the next open retries", self.root, exc)
        return removed

    # ---------------------------------------------------------------- compaction
    def _wal_truncate(self) -> None:
        assert self._conn is not None
        busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise StoreError(f"{self.root}: the catalog's WAL could not be checkpointed (busy)")

    def _compact(self) -> None:
        """Leave no deleted catalog content in the store's files: the blob directory's
        removals fsynced, the shards' unreferenced slices removed, the WAL checkpointed and truncated, the database rebuilt
        (VACUUM), the WAL truncated again; then clear :data:`COMPACT_FLAG`."""
        assert self._conn is not None
        _blobs.fsync_dir(self.blobs.dir)
        # the erased updates' slices, every shard's (the flag stays set until they are gone, so a
        # shard that failed here is swept at the adoption's replay or the next open)
        self._sweep_shards(erasure=True)
        self._wal_truncate()
        self._conn.execute("VACUUM")
        self._checkpoint_hook("compact-vacuumed")
        self._wal_truncate()
        with self._txn() as c:
            c.execute("DELETE FROM meta WHERE key = ?", (COMPACT_FLAG,))
        self._wal_truncate()

    def _compact_or_raise(self, i: int) -> None:
        try:
            self._compact()
        except (sqlite3.Error, OSError, StoreError) as exc:
            raise StoreError(f"{self.root}: round {i} is adopted and the clients' rows are "
                             f"deleted, but compacting the catalog failed ({exc}); a replay of "
                             "the adoption or the next open retries") from exc

    # ---------------------------------------------------------------- reading
    def _erasure_row(self, job: str) -> ErasureReport | None:
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT clients, rounds, share_rows, staged_rows, blobs_removed, round_no, at "
            "FROM erasures WHERE job = ?", (job,)).fetchone()
        if row is None:
            return None
        clients, rounds, shares, staged, blobs, round_no, at = row
        try:
            return ErasureReport(job, tuple(int(c) for c in json.loads(clients)),
                                 tuple(int(r) for r in json.loads(rounds)), int(shares),
                                 int(staged), int(blobs), int(round_no), float(at), self._party)
        except (ValueError, TypeError) as exc:
            raise CatalogCorruptError(f"{self.root}: erasure record of job {job} is unreadable "
                                      f"({exc})") from None

    @locked
    def erasure(self, job: str) -> ErasureReport | None:
        """The erasure report of ``job``'s adoption, or None if it was not adopted here."""
        return self._erasure_row(str(job))

    @locked
    def forgotten(self) -> dict[int, dict[str, Any]]:
        """Every client an adoption forgot: client -> {"job", "at", "reenrolled_at",
        "reenrolled_by"} (the last two None unless an admin re-enrolled it)."""
        assert self._conn is not None
        return {int(c): {"job": str(j), "at": float(at),
                         "reenrolled_at": None if ra is None else float(ra),
                         "reenrolled_by": None if rb is None else str(rb)}
                for c, j, at, ra, rb in self._conn.execute(
                    "SELECT client, job, at, reenrolled_at, reenrolled_by FROM forgotten "
                    "ORDER BY client")}

    @locked
    def is_forgotten(self, client: int) -> bool:
        """True if an adoption forgot ``client`` and it was not re-enrolled since."""
        assert self._conn is not None
        return self._conn.execute("SELECT 1 FROM forgotten WHERE client = ? AND reenrolled_at "
                                  "IS NULL", (check.client_id(client),)).fetchone() is not None

    @locked
    def reenrol(self, client: int, by: str) -> None:
        """Let a forgotten client upload again (records who and when). Nothing erased comes
        back. KeyError if the client was never forgotten; a no-op if already re-enrolled."""
        j = check.client_id(client)
        if not isinstance(by, str) or not 0 < len(by) <= 256:
            raise ValueError("by must be a non-empty string of at most 256 characters")
        assert self._conn is not None
        row = self._conn.execute("SELECT reenrolled_at FROM forgotten WHERE client = ?",
                                 (j,)).fetchone()
        if row is None:
            raise KeyError(f"client {j} is not forgotten")
        if row[0] is not None:
            return
        with self._txn() as c:
            c.execute("UPDATE forgotten SET reenrolled_at = ?, reenrolled_by = ? WHERE client = ?",
                      (time.time(), by, j))
        log.info("history store %s: client %d re-enrolled by %s", self.root, j, by)

    @locked
    def round_kind(self, i: int) -> str:
        """``"unlearning"`` for a round an adoption wrote, ``"fl"`` for a training round."""
        r = check.round_no(i)
        if r > self._T:
            raise IndexError(f"round {r} not in 1..{self._T}")
        return "unlearning" if r in self._unlearning_rounds else "fl"

    @property
    def fl_rounds(self) -> int:
        """Committed rounds of kind ``"fl"`` (cheap: kept in memory)."""
        with self._mutex:
            self._check_open()
            return self._T - len(self._unlearning_rounds)

    # ---------------------------------------------------------------- adoption
    def _check_adoption_replay(self, i: int, job: str, clients: tuple[int, ...],
                               model_digest: str) -> ErasureReport:
        assert self._conn is not None
        done = self._erasure_row(job)
        if done is None or done.round != i:
            other = self._conn.execute("SELECT job FROM erasures WHERE round_no = ?",
                                       (i,)).fetchone()
            what = (f"the adoption of job {other[0]}" if other is not None else "an FL round")
            where = f" (job {job} was adopted as round {done.round})" if done is not None else ""
            raise RoundConflictError(f"round {i} is already committed as {what}{where}; a "
                                     "committed round is never overwritten")
        (stored_model,) = self._conn.execute("SELECT model_blob FROM rounds WHERE round = ?",
                                             (i,)).fetchone()
        diffs = []
        if stored_model != model_digest:
            diffs.append("model")
        if done.clients != clients:
            diffs.append(f"forgotten clients (stored {list(done.clients)}, new {list(clients)})")
        if diffs:
            raise RoundConflictError(f"round {i} is already committed as the adoption of job "
                                     f"{job} with different content ({'; '.join(diffs)})")
        if self._meta().get(COMPACT_FLAG) == "1":
            self._compact_or_raise(i)
        log.info("history store %s: replay of the adoption of job %s (round %d) ignored",
                 self.root, job, i)
        return replace(done, replayed=True)

    def _rewrite_round(self, c: sqlite3.Connection, r: int, gone: set[int]) -> None:
        """Round r without the clients in ``gone``: participants, metadata (their
        ``num_samples`` dropped, ``erased`` extended), the remaining weights renormalised over
        the remaining clients (``renormalised``) and the content hash rewritten."""
        model_blob, parts_json, meta_json, content_hash = c.execute(
            "SELECT model_blob, participants, metadata, content_hash FROM rounds WHERE round = ?",
            (r,)).fetchone()
        rows = c.execute("SELECT client, weight, update_ref, norm_ref, delta_ref FROM round_shares "
                         "WHERE round = ? ORDER BY client", (r,)).fetchall()
        parts = tuple(int(j) for j in json.loads(parts_json))
        weights = {int(row[0]): float(row[1]) for row in rows}
        refs = {int(row[0]): (str(row[2]), str(row[3]), str(row[4])) for row in rows}
        if parts != tuple(refs) or \
                round_hash(r, model_blob, parts, weights, refs, meta_json) != content_hash:
            raise CatalogCorruptError(f"{self.root}: catalog rows of round {r} do not match the "
                                      "content hash committed with them; not erasing")
        keep = tuple(j for j in parts if j not in gone)
        erased = {j for j in parts if j in gone}
        meta = json.loads(meta_json)
        sizes = meta.get(METADATA_KEY)
        if isinstance(sizes, dict):
            meta[METADATA_KEY] = {k: v for k, v in sizes.items()
                                   if k not in {str(j) for j in erased}}
        prev = meta.get("erased")
        earlier = {x for x in prev if isinstance(x, int) and not isinstance(x, bool)} \
            if isinstance(prev, list) else set()
        meta["erased"] = sorted(earlier | erased)
        if erased:
            weights = renormalised({j: weights[j] for j in keep}, meta.get(METADATA_KEY))
            refs = {j: refs[j] for j in keep}
            for j, w in weights.items():
                c.execute("UPDATE round_shares SET weight = ? WHERE round = ? AND client = ?", (w, r, j))
        new_meta = _canonical(meta)
        c.execute("UPDATE rounds SET participants = ?, metadata = ?, content_hash = ? "
                  "WHERE round = ?",
                  (json.dumps(list(keep)), new_meta,
                   round_hash(r, model_blob, keep, weights, refs, new_meta), r))

    @locked
    def adopt_unlearning(self, round: int, model: Any, *, job: str,
                         forgotten: Iterable[int]) -> ErasureReport:
        """Commit ``model`` (job ``job``'s result) as round ``round`` = T+1 and erase the
        ``forgotten`` clients, atomically and durably; return what was erased.

        One transaction: round T+1 (no participants; metadata ``{"kind": "unlearning",
        "job", "forgotten"}``), the clients' share rows deleted from every round and those
        rounds rewritten, their staged uploads and every upload staged for round T+1
        deleted, the clients recorded as forgotten, the report recorded. Then their blob
        files are unlinked and the catalog compacted (WAL truncated, VACUUM). Idempotent:
        the same adoption again returns the stored report with ``replayed=True``; another
        adoption of a committed round raises RoundConflictError; a round other than T+1
        RoundOrderError. A crash leaves it entirely done or entirely undone (the next open
        finishes the file removal and compaction of a committed one).
        """
        i = check.round_no(round)
        jid = check.job_id(job)
        if isinstance(forgotten, (str, bytes)):
            raise TypeError("forgotten must be an iterable of client ids")
        clients = tuple(sorted({check.client_id(j, "forgotten client") for j in forgotten}))
        if not clients:
            raise ValueError("an adoption must forget at least one client")
        model_blob = encode_blob(check.model(model, self._dim))
        if i <= self._T:
            return self._check_adoption_replay(i, jid, clients, model_blob.digest)
        if i != self._T + 1:
            raise RoundOrderError(f"cannot adopt round {i}: the store has rounds 1..{self._T}, "
                                  f"the next is {self._T + 1}")
        earlier = self._erasure_row(jid)
        if earlier is not None:
            raise RoundConflictError(f"job {jid} was already adopted as round {earlier.round}")
        self.blobs.put_many([model_blob])
        self._checkpoint_hook("adopt-model-durable")
        now = time.time()
        ids = json.dumps(list(clients))
        in_clients = f"client IN ({', '.join('?' * len(clients))})"
        with self._txn() as c:
            rows = c.execute(f"SELECT round, update_ref FROM round_shares WHERE {in_clients}",
                             clients).fetchall()
            rounds = sorted({int(r) for r, _ in rows})
            for r in rounds:
                self._rewrite_round(c, r, set(clients))
            c.execute(f"DELETE FROM round_shares WHERE {in_clients}", clients)
            staged = c.execute(f"SELECT update_ref FROM staged WHERE round = ? OR {in_clients}",
                               (i, *clients)).fetchall()
            c.execute(f"DELETE FROM staged WHERE round = ? OR {in_clients}", (i, *clients))
            meta_json = _canonical({"kind": "unlearning", "job": jid, "forgotten": list(clients)})
            c.execute("INSERT INTO rounds(round, model_blob, participants, metadata, content_hash, "
                      "committed_at) VALUES (?, ?, ?, ?, ?, ?)",
                      (i, model_blob.digest, "[]", meta_json,
                       round_hash(i, model_blob.digest, (), {}, {}, meta_json), now))
            c.executemany("INSERT OR REPLACE INTO forgotten(client, job, at, reenrolled_at, "
                          "reenrolled_by) VALUES (?, ?, ?, NULL, NULL)",
                          [(j, jid, now) for j in clients])
            refs = [str(u) for _, u in rows] + [str(u) for (u,) in staged]
            unused = {u[5:] for u in refs if u.startswith("blob:")} - self._referenced()
            c.execute("INSERT INTO erasures(job, clients, rounds, at, share_rows, staged_rows, "
                      "blobs_removed, round_no) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (jid, ids, json.dumps(rounds), now, len(rows), len(staged), len(unused), i))
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, '1')", (COMPACT_FLAG,))
            self._checkpoint_hook("adopt-in-transaction")
        self._T = i
        self._unlearning_rounds.add(i)
        self._invalidate_caches()
        self._checkpoint_hook("adopt-committed")
        removed = self.blobs.sweep(self._referenced())
        _blobs.fsync_dir(self.blobs.dir)
        extra = sorted(p.name for p in removed if p.name.removesuffix(".blob") not in unused)
        if extra:
            log.warning("history store %s: also removed leftovers %s", self.root, extra)
        self._checkpoint_hook("adopt-blobs-removed")
        self._compact_or_raise(i)
        report = self._erasure_row(jid)
        assert report is not None
        log.info("history store %s: job %s adopted as round %d; clients %s erased from rounds %s "
                 "(%d share rows, %d staged uploads, %d blob files)", self.root, jid, i,
                 list(clients), rounds, report.share_rows, report.staged_rows, report.blobs_removed)
        return report
