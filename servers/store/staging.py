"""Staging of client uploads for the open round T+1, until the servers commit it.

Why a module of its own: during a round each client uploads its three shares to each
server at its own time; a server must keep every upload durably the moment it
acknowledges it (a crash must not lose an acknowledged upload), yet none of it is part of
the history until both servers agree on the participants and commit the round
(``ShareStore.commit_round``, which moves the agreed uploads into the round and drops the
others). :class:`StagingArea` is that waiting room: the ``staged`` table of the catalog plus
the upload's blob, written blob first, then one transaction.

A client's retry of the identical upload is a no-op; a different upload for the same
round is refused unless explicitly replaced. Uploads are accepted for the open round only,
and never from a client an unlearning job forgot (``servers.store.erasure``) unless it was
re-enrolled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from servers.store import store_validation as check
from servers.store.store_catalog import StoreCatalog, locked
from servers.store.store_errors import (
    CatalogCorruptError,
    ForgottenClientError,
    StagingConflictError,
    StagingError,
)
from servers.store.store_validation import ClientShares, Upload

__all__ = ["StagingArea"]

log = logging.getLogger("starfish.store")


class StagingArea(StoreCatalog):
    """The staged uploads of a store (a part of :class:`servers.store.share_store.ShareStore`)."""

    def _staged_rows(self, i: int) -> dict[int, tuple[str, ...]]:
        """client -> (update, norm, delta[, threshold]) refs of round i's staged uploads."""
        assert self._conn is not None
        out = {}
        for j, u, n, d, h, t in self._conn.execute(
                "SELECT client, update_ref, norm_ref, delta_ref, upload_hash, threshold_ref "
                "FROM staged WHERE round = ? ORDER BY client", (i,)):
            refs = (str(u), str(n), str(d)) + (() if t is None else (str(t),))
            if Upload(refs).digest != h:
                raise CatalogCorruptError(f"{self.root}: staged upload of client {j} for round "
                                          f"{i} does not match its hash")
            out[int(j)] = refs
        return out

    def _refuse_forgotten(self, clients: Iterable[int]) -> None:
        """ForgottenClientError if any of ``clients`` is forgotten and not re-enrolled."""
        assert self._conn is not None
        for j in clients:
            row = self._conn.execute("SELECT job FROM forgotten WHERE client = ? AND "
                                     "reenrolled_at IS NULL", (j,)).fetchone()
            if row is not None:
                raise ForgottenClientError(
                    f"client {j} was forgotten by unlearning job {row[0]}; its uploads are "
                    "refused unless an admin re-enrols it")

    def _check_open_round(self, i: int) -> None:
        if i <= self._T:
            raise StagingError(f"round {i} is already committed; its uploads are closed")
        if i != self._T + 1:
            raise StagingError(f"round {i} is not open; the open round is {self._T + 1}")

    @locked
    def stage_upload(self, round: int, client: int, update: Any, norm: Any, delta: Any,
                     threshold: Any = None, *, replace: bool = False) -> bool:
        """Durably stage one client's upload for the open round T+1.

        Returns True when stored, False when the identical upload was already staged (a
        client retry). A different upload from the same client raises
        StagingConflictError unless ``replace`` is True; a forgotten client (not
        re-enrolled) raises ForgottenClientError. When this returns, the upload
        survives a crash; a crash before it returns leaves either nothing or the whole
        upload staged. ``threshold``: FedSECA's lambda_k share, staged with the upload (the
        same upload with another threshold is a different upload).
        """
        i = check.round_no(round)
        j = check.client_id(client)
        up = check.upload(ClientShares(update, norm, delta), f"client {j}", self._party, self._dim,
                          threshold)
        self._refuse_forgotten([j])
        self._check_open_round(i)
        old = self._staged_rows(i).get(j)
        if old is not None:
            if old == up.refs:
                log.info("history store %s: repeated upload of client %d for round %d ignored",
                         self.root, j, i)
                return False
            if not replace:
                # the message reaches clients as a ``conflict`` reply: it names what they can
                # do, not this method's ``replace`` argument (no field of the wire schema)
                raise StagingConflictError(f"client {j} already staged a different upload for "
                                           f"round {i}; an upload cannot be replaced (send the "
                                           f"same one again, or the operator withdraws it with "
                                           f"`starfish admin drop-staged {j}`, then upload anew)")
        self._put_updates(up.blobs)
        self._checkpoint_hook("staged-blob-durable")
        with self._txn() as c:
            u, n, d = up.refs[:3]
            t = up.refs[3] if len(up.refs) > 3 else None
            c.execute("INSERT OR REPLACE INTO staged(round, client, update_ref, norm_ref, delta_ref, "
                      "upload_hash, staged_at, threshold_ref) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (i, j, u, n, d, up.digest, time.time(), t))
            self._checkpoint_hook("staged-in-transaction")
        self._checkpoint_hook("staged-committed")
        if old is not None:
            self._remove_if_unreferenced([old[0]])
        return True

    @locked
    def staged(self, round: int) -> tuple[int, ...]:
        """Clients with a staged upload for ``round`` (sorted); empty once it is committed."""
        return tuple(self._staged_rows(check.round_no(round)))

    @locked
    def staged_summary(self, round: int) -> list[dict[str, Any]]:
        """Public bookkeeping of ``round``'s staged uploads, for an admin listing: one
        ``{"client", "staged_at", "upload_hash"}`` per upload, by client (no share values)."""
        assert self._conn is not None
        return [{"client": int(j), "staged_at": float(t), "upload_hash": str(h)}
                for j, t, h in self._conn.execute(
                    "SELECT client, staged_at, upload_hash FROM staged WHERE round = ? "
                    "ORDER BY client", (check.round_no(round),))]

    def _staged_refs(self, i: int, j: int) -> tuple[str, ...]:
        refs = self._staged_rows(i).get(j)
        if refs is None:
            raise KeyError(f"client {j} has no staged upload for round {i}")
        return refs

    @locked
    def staged_upload(self, round: int, client: int) -> ClientShares:
        """The staged shares of one client (int64 arrays, seeds expanded)."""
        i, j = check.round_no(round), check.client_id(client)
        refs = self._staged_refs(i, j)
        where = f"staged round {i} client {j}"
        return ClientShares(self._materialize(refs[0], (self._dim,), where + " update"),
                            self._materialize(refs[1], (), where + " norm"),
                            self._materialize(refs[2], (), where + " delta"))

    @locked
    def staged_update_ref(self, round: int, client: int) -> str:
        """The catalog's reference to one client's staged update share (``update_ref``'s twin)."""
        return self._staged_refs(check.round_no(round), check.client_id(client))[0]

    @locked
    def staged_scalars(self, round: int, client: int) -> tuple[np.ndarray, np.ndarray]:
        """One client's staged norm and delta shares (int64, shape ()), without its update."""
        i, j = check.round_no(round), check.client_id(client)
        refs = self._staged_refs(i, j)
        where = f"staged round {i} client {j}"
        return self._materialize(refs[1], (), where + " norm"), self._materialize(refs[2], (), where + " delta")

    @locked
    def staged_threshold(self, round: int, client: int) -> Any:
        """The staged FedSECA threshold share of one client (int64, shape ()), or None if its
        upload has none."""
        i, j = check.round_no(round), check.client_id(client)
        refs = self._staged_refs(i, j)
        if len(refs) < 4:
            return None
        return self._materialize(refs[3], (), f"staged round {i} client {j} threshold")

    @locked
    def drop_staged(self, round: int, client: int | None = None) -> tuple[int, ...]:
        """Withdraw staged uploads (one client's, or the whole round's); returns who was dropped."""
        i = check.round_no(round)
        rows = self._staged_rows(i)
        gone = sorted(rows) if client is None else [j for j in rows if j == check.client_id(client)]
        if gone:
            with self._txn() as c:
                c.executemany("DELETE FROM staged WHERE round = ? AND client = ?", [(i, j) for j in gone])
            self._remove_if_unreferenced(rows[j][0] for j in gone)
        return tuple(gone)
