"""The history store's catalog schema, its migrations and the rounds' content hash.

Why a module of its own: the table definitions are shared by every part of the store
(``servers.store.store_catalog`` creates them at open, ``servers.store.staging``,
``servers.store.job_records``, ``servers.store.erasure`` and ``servers.store.share_store`` read and write
them), a catalog created by an older version must keep opening (columns added since are
added in place, :func:`create_or_migrate`), and what a round's ``content_hash`` covers
(:func:`round_hash`) must be computed the same way by whoever writes a round: the commit
protocol and the erasure that rewrites rounds.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Mapping, Sequence

__all__ = ["SCHEMA", "JOB_COLUMNS_ADDED", "STAGED_COLUMNS_ADDED", "create_or_migrate", "round_hash"]

SCHEMA = """
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
    threshold_ref TEXT,
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
    updated_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    result_digest TEXT,
    receipt TEXT);
CREATE TABLE IF NOT EXISTS forgotten(
    client INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    at REAL NOT NULL,
    reenrolled_at REAL,
    reenrolled_by TEXT);
CREATE TABLE IF NOT EXISTS erasures(
    job TEXT PRIMARY KEY,
    clients TEXT NOT NULL,
    rounds TEXT NOT NULL,
    at REAL NOT NULL,
    share_rows INTEGER NOT NULL,
    staged_rows INTEGER NOT NULL,
    blobs_removed INTEGER NOT NULL,
    round_no INTEGER NOT NULL UNIQUE REFERENCES rounds(round));
"""

#: Columns of ``jobs`` added after the first release, with their definitions: a catalog
#: created before gets them by ``ALTER TABLE`` at open.
JOB_COLUMNS_ADDED: tuple[tuple[str, str], ...] = (
    ("attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("result_digest", "TEXT"),
    ("receipt", "TEXT"),
)


#: Columns of ``staged`` added since: FedSECA's lambda_k share (NULL in every other upload).
STAGED_COLUMNS_ADDED: tuple[tuple[str, str], ...] = (
    ("threshold_ref", "TEXT"),
)


def create_or_migrate(conn: sqlite3.Connection) -> list[str]:
    """Create the missing tables and add the missing ``jobs`` and ``staged`` columns (inside
    the caller's transaction); return the columns added (as ``table.column``)."""
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            conn.execute(stmt)
    added = []
    for table, columns in (("jobs", JOB_COLUMNS_ADDED), ("staged", STAGED_COLUMNS_ADDED)):
        have = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
        for name, decl in columns:
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
                added.append(f"{table}.{name}")
    return added


def round_hash(i: int, model_digest: str, parts: Sequence[int], weights: Mapping[int, float],
               refs: Mapping[int, Sequence[str]], meta_json: str) -> str:
    """Canonical digest of a round's full catalog content (what "identical replay" means,
    and what ``_load_round`` rechecks)."""
    doc = {
        "round": i, "model": model_digest, "participants": list(parts),
        "weights": [float(weights[j]).hex() for j in parts],
        "shares": [list(refs[j]) for j in parts], "metadata": meta_json,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
