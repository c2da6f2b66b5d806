"""The history store's errors, in one place for every part of the store.

Why a module of its own: the store is split by job (``servers.store.store_catalog``,
``servers.store.staging``, ``servers.store.job_records``, ``servers.store.erasure``, ``servers.store.share_store``)
and all of them raise these; callers catch them through ``servers.store.share_store``, which
re-exports them.
"""

from __future__ import annotations

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
    "ForgottenClientError",
]


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


class ForgottenClientError(StoreError):
    """The client was forgotten by an unlearning job (and not re-enrolled): its uploads are
    refused."""
