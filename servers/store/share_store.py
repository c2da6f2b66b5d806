"""One server's durable FL history: public models in the clear, client values as shares.

Why this module: a server daemon (party 0 or 1) must keep, for every FL round, what
unlearning will later read (docs/design.md 3, Stage I step 4): the public global model M_i, the
participants, their FedAvg weights, and this party's additive share of each participant's
update g_i^j, norm ||g_i^j|| and tolerance threshold delta_i^j. Unlearning may be requested
long after training, across restarts and crashes, so the store must never lose a round the
servers agreed on and never show half of one (docs/design.md 4.4).

:class:`ShareStore` is the store a daemon opens. It is assembled from one part per job:

* ``servers.store.store_catalog``: the directory, its lock, the SQLite catalog, transactions,
  crash recovery at open, closing;
* ``servers.store.staging``: uploads of the open round, kept until the round is committed;
* ``servers.store.job_records``: unlearning-job records and their states;
* ``servers.store.erasure``: adopting an unlearned model as a round and erasing the forgotten
  clients (``adopt_unlearning``, ``forgotten``, ``reenrol``, ``erasure``, ``round_kind``);
* this module: the committed rounds (writing them, reading them, verifying them).

Input checks: ``servers.store.store_validation``; errors: ``servers.store.store_errors`` (re-exported
here); tensor files: ``servers.store.blobs``; the Stage II ``History`` view: ``servers.secure.share_history``.

Commit protocol (details and the exact guarantees in ``docs/share_store.md``): every blob
of a round is durable *before* the round's catalog rows are inserted, all in one SQLite
transaction. A round is visible iff that transaction committed. Replays are idempotent:
writing a round (or a staged upload) that is already stored with identical content is a
no-op that returns False; different content raises.

The store never sees both shares of anything and never decodes a share; party 0's shares
may be kept as the client's 16-byte seed, expanded on read as the client did
(:func:`common.prg.expand`). No torch, no CrypTen here: a crash-test writer or a tool that
only inspects a store starts fast.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from servers.store import store_validation as check
from servers.store.shard_files import ShardFiles
from servers.store.blobs import BlobCorruptError, BlobError, BlobMissingError, EncodedBlob, encode_blob
from servers.store.erasure import ErasureLog, ErasureReport
from servers.store.job_records import FINISHED, JobRecord, JobRecords, JobState
from servers.store.staging import StagingArea
from servers.store.store_catalog import locked
from servers.store.store_errors import (
    CatalogCorruptError,
    ForgottenClientError,
    JobError,
    RoundConflictError,
    RoundOrderError,
    StagingConflictError,
    StagingError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from servers.store.store_schema import round_hash
from servers.store.store_validation import MAX_METADATA_BYTES, ClientShares

__all__ = [
    "ShareStore", "ClientShares", "RoundInfo", "JobRecord", "JobState", "FINISHED",
    "ErasureReport", "MAX_METADATA_BYTES",
    # errors (defined in servers.store.store_errors and servers.store.blobs)
    "StoreError", "StoreClosedError", "StoreLockedError", "CatalogCorruptError",
    "RoundOrderError", "RoundConflictError", "StagingError", "StagingConflictError", "JobError",
    "ForgottenClientError", "BlobError", "BlobCorruptError", "BlobMissingError",
]

log = logging.getLogger("starfish.store")


def _checkpoint(name: str) -> None:
    """Test seam: crash tests replace this to SIGKILL a writer at a named step. No-op.

    Every step of the store's write paths passes through it (staging included, via
    :meth:`ShareStore._checkpoint_hook`), so replacing this one name hooks them all.
    """


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


class ShareStore(ErasureLog, StagingArea, JobRecords):
    """The durable history of one party: catalog + blobs under one directory.

    ``ShareStore(root, party=0, initial_model=M0, server_lr=eta)`` creates a store (or
    opens it if it exists: then the given values must match what is stored, so a daemon
    cannot be pointed at the other party's or another run's directory). ``ShareStore(root,
    party=0)`` opens an existing store. One process at a time: a second open raises
    :class:`StoreLockedError`. Methods are thread-safe (serialised by a lock).
    ``precision`` (fractional bits of the clients' fixed-point encoding, default 16) is
    fixed at creation; on open, None means "as stored". ``shards`` (``[deployment] workers`` >
    1): the update shares' slices live in the shards' directories (``servers.store.shard_files``),
    the catalog, models and scalar shares here; the number of shards is fixed at creation.

    Opening recovers from a crash: SQLite rolls back an uncommitted transaction, then blobs
    no catalog row refers to and temp files are removed; the removed paths are logged and
    kept in :attr:`recovered_files`.
    """

    def __init__(self, root: str | os.PathLike[str], *, party: int,
                 initial_model: Any = None, server_lr: float | None = None,
                 precision: int | None = None, shards: ShardFiles | None = None) -> None:
        self._round_cache: dict[int, tuple[RoundInfo, dict[int, tuple[str, str, str]]]] = {}
        self._model_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._model_cache_size = 8
        super().__init__(root, party=party, initial_model=initial_model, server_lr=server_lr,
                         precision=precision, shards=shards)

    def _checkpoint_hook(self, name: str) -> None:
        _checkpoint(name)

    def _invalidate_caches(self) -> None:
        self._round_cache.clear()
        self._model_cache.clear()

    def close(self) -> None:
        """Close the catalog and release the lock. Idempotent; later calls raise."""
        with self._mutex:
            super().close()
            self._round_cache.clear()
            self._model_cache.clear()

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
                round_hash(i, model_blob, parts, weights, refs, meta_json) != content_hash:
            raise CatalogCorruptError(f"{self.root}: catalog rows of round {i} do not match the "
                                      "content hash committed with them")
        info = RoundInfo(i, parts, MappingProxyType(weights), MappingProxyType(meta),
                         model_blob, content_hash, float(committed_at))
        self._round_cache[i] = (info, refs)
        return info, refs

    def _refs(self, i: int, client: int) -> tuple[str, str, str]:
        _, refs = self._load_round(i)
        try:
            return refs[int(client)]
        except KeyError:
            raise KeyError(f"client {client} did not take part in round {i}") from None

    @locked
    def round_info(self, i: int) -> RoundInfo:
        """Public catalog data of round i (participants, weights, metadata, digests)."""
        return self._load_round(i)[0]

    @locked
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

    @locked
    def participants(self, i: int) -> tuple[int, ...]:
        return self._load_round(i)[0].participants

    @locked
    def weights(self, i: int) -> Mapping[int, float]:
        return self._load_round(i)[0].weights

    @locked
    def metadata(self, i: int) -> dict[str, Any]:
        """Round i's free-form metadata (a fresh copy)."""
        return json.loads(json.dumps(dict(self._load_round(i)[0].metadata)))

    @locked
    def update_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of g_i^j: int64, shape (dim,)."""
        return self._materialize(self._refs(i, client)[0], (self._dim,), f"round {i} client {client} update")

    @locked
    def update_ref(self, i: int, client: int) -> str:
        """The catalog's reference to this party's share of g_i^j (``blob:<digest>`` or
        ``seed:<hex>``): what a worker reads its slice by (``servers.store.shard_files``)."""
        return self._refs(i, client)[0]

    @locked
    def norm_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of ||g_i^j||: int64, shape ()."""
        return self._materialize(self._refs(i, client)[1], (), f"round {i} client {client} norm")

    @locked
    def delta_share(self, i: int, client: int) -> np.ndarray:
        """This party's share of delta_i^j: int64, shape ()."""
        return self._materialize(self._refs(i, client)[2], (), f"round {i} client {client} delta")

    @locked
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
        self.blobs.put_many([model_blob])
        self._put_updates(share_blobs)
        _checkpoint("round-blobs-durable")
        content_hash = round_hash(i, model_blob.digest, parts, weights, refs, meta_json)
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

    @locked
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
        i = check.round_no(round)
        parts = check.participants(participants)
        w = check.weights(weights, parts)
        meta_json = check.metadata(metadata)
        model_blob = encode_blob(check.model(model, self._dim))
        if not isinstance(shares, Mapping):
            raise TypeError("shares must be a mapping client -> ClientShares")
        uploads = {check.client_id(k, "shares key"): v for k, v in shares.items()}
        if set(uploads) != set(parts):
            raise ValueError(f"shares must have exactly one entry per participant: keys "
                             f"{sorted(uploads)} vs participants {list(parts)}")
        ups = {j: check.upload(uploads[j], f"client {j}", self._party, self._dim) for j in parts}
        refs = {j: ups[j].refs for j in parts}
        if i <= self._T:
            return self._check_replay(i, model_blob.digest, parts, w, meta_json, refs)
        if i != self._T + 1:
            raise RoundOrderError(f"cannot store round {i}: the store has rounds 1..{self._T}, "
                                  f"the next is {self._T + 1}")
        self._refuse_forgotten(parts)
        self._write_round(i, model_blob, parts, w, refs, meta_json,
                          [b for j in parts for b in ups[j].blobs])
        return True

    @locked
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
        i = check.round_no(round)
        parts = check.participants(participants)
        w = check.weights(weights, parts)
        meta_json = check.metadata(metadata)
        model_blob = encode_blob(check.model(model, self._dim))
        if i <= self._T:
            return self._check_replay(i, model_blob.digest, parts, w, meta_json, None)
        if i != self._T + 1:
            raise RoundOrderError(f"cannot commit round {i}: the open round is {self._T + 1}")
        staged = self._staged_rows(i)
        missing = [j for j in parts if j not in staged]
        if missing:
            raise StagingError(f"cannot commit round {i}: participants {missing} have no staged "
                               "upload")
        # a staged threshold (FedSECA's lambda_k) served the round's close; the round keeps
        # update, norm and delta only
        self._write_round(i, model_blob, parts, w, {j: staged[j][:3] for j in parts}, meta_json, [])
        return True

    # ---------------------------------------------------------------- checking
    @locked
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
