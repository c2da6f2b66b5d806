"""Checksummed, content-addressed tensor files with atomic, fsync'd writes.

Why a module of its own: the history store (``servers.store.share_store``) keeps its catalog in
SQLite but the tensors (models of ~10^6 floats, update shares of ~10^6 ring elements) do
not belong in a database page file. This module owns everything about those files: their
format, how they reach the disk durably, how they are checked on every read, and how
leftovers of an interrupted write are found. It knows nothing about rounds or clients.

File format (all integers little-endian)::

    b"SFBLOB01"                  8 bytes, magic and format version
    header length                4 bytes, uint32
    header                       canonical JSON: {"dtype": "<i8", "nbytes": N,
                                 "sha256": <hex of payload>, "shape": [...]}
    payload                      N bytes, the array in C order, little-endian

The file is named ``<digest>.blob`` where ``digest = sha256(magic | length | header)``.
Because the header holds the payload's SHA-256, the name commits to the whole file while a
read hashes the payload only once: check the header against the name, then the payload
against the header. Equal arrays (same dtype, shape and bytes) get the same name, so a
replayed write is a no-op and the catalog can refer to a blob by its digest alone.

Durability protocol of :meth:`BlobStore.put_many`: write each file under ``tmp/``, flush
and ``fsync`` it, ``rename`` it to ``blobs/<digest>.blob`` (atomic on POSIX), then
``fsync`` the ``blobs/`` directory once so the new names survive a power cut. Only after
``put_many`` returns may a catalog refer to the digests. A crash in between leaves at
worst complete-but-unreferenced blobs or temp files, which :meth:`BlobStore.sweep` removes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "BlobError",
    "BlobCorruptError",
    "BlobMissingError",
    "EncodedBlob",
    "encode_blob",
    "fsync_dir",
    "BlobStore",
]

log = logging.getLogger("starfish.store")

MAGIC = b"SFBLOB01"
_LEN = struct.Struct("<I")
_MAX_HEADER = 4096
#: dtypes a blob may hold: ring elements (shares) and the public float models.
ALLOWED_DTYPES = ("<i8", "<f4", "<f8")
_NAME_RE = re.compile(r"^([0-9a-f]{64})\.blob$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobError(RuntimeError):
    """A blob file cannot be used; the message names the file."""


class BlobCorruptError(BlobError):
    """A blob file exists but its bytes do not match its name or its checksum."""


class BlobMissingError(BlobError):
    """The catalog refers to a blob file that is not on disk."""


def _checkpoint(name: str) -> None:
    """Test seam: crash tests replace this to SIGKILL a writer at a named step. No-op."""


def fsync_dir(path: Path) -> None:
    """fsync a directory so that the names created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class EncodedBlob:
    """An array serialised in the blob format, not yet written. ``digest`` is its name."""

    digest: str
    prefix: bytes          # magic | header length | header
    payload: memoryview    # the array's bytes (a view, no copy)

    @property
    def size(self) -> int:
        return len(self.prefix) + self.payload.nbytes


def encode_blob(array: np.ndarray) -> EncodedBlob:
    """Serialise ``array`` (dtype int64, float32 or float64) and compute its digest.

    Why separate from writing: the store compares digests of new content with the
    catalog (idempotent replay, conflict detection) before it writes anything.
    """
    arr = np.asarray(array)
    le = arr.dtype.newbyteorder("<")
    if le.str not in ALLOWED_DTYPES:
        raise TypeError(f"blob dtype must be one of {ALLOWED_DTYPES}, got {arr.dtype}")
    shape = arr.shape
    # (np.ascontiguousarray would turn a 0-d array into shape (1,); keep the shape exact)
    arr = np.asarray(arr, dtype=le)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    payload = memoryview(arr.reshape(-1)).cast("B")
    header = json.dumps(
        {"dtype": le.str, "nbytes": payload.nbytes, "sha256": hashlib.sha256(payload).hexdigest(),
         "shape": [int(s) for s in shape]},
        sort_keys=True, separators=(",", ":"),
    ).encode()
    prefix = MAGIC + _LEN.pack(len(header)) + header
    return EncodedBlob(hashlib.sha256(prefix).hexdigest(), prefix, payload)


class BlobStore:
    """The ``blobs/`` and ``tmp/`` directories under a store root.

    Not thread-safe by itself; the history store serialises calls. Only one process may
    use a root at a time (the history store holds a lock file), which is what makes the
    orphan sweep at open safe.
    """

    def __init__(self, root: str | os.PathLike[str], *, keyed: bool = True) -> None:
        """``keyed`` False: a file's name is a key its writer chose, not the digest of its header
        (a worker's slice of a stored update, named by the whole update's digest:
        ``servers.store.shard_files``); a read still checks the header and the payload's checksum,
        and whoever joins the slices checks the whole against its name."""
        self.keyed = keyed
        self.root = Path(root)
        self.dir = self.root / "blobs"
        self.tmp = self.root / "tmp"
        created = False
        for d in (self.dir, self.tmp):
            if not d.is_dir():
                d.mkdir(mode=0o700)
                created = True
        if created:
            fsync_dir(self.root)

    def path(self, digest: str) -> Path:
        if not DIGEST_RE.match(digest):
            raise ValueError(f"not a blob digest: {digest!r}")
        return self.dir / f"{digest}.blob"

    # ---------------------------------------------------------------- writing
    def put_many(self, blobs: Sequence[EncodedBlob]) -> list[str]:
        """Make every blob durable under its digest; return the digests.

        An existing file with the right name is kept if it verifies (a replay or shared
        content) and rewritten otherwise, so a corrupt leftover never gets referenced.
        """
        renamed = False
        seen: set[str] = set()
        for blob in blobs:
            if blob.digest in seen:
                continue
            seen.add(blob.digest)
            final = self.path(blob.digest)
            if final.exists():
                try:
                    self.read(blob.digest)
                    continue
                except BlobError as exc:
                    log.warning("rewriting damaged blob %s (%s)", final, exc)
            fd, tmp_name = tempfile.mkstemp(dir=self.tmp, prefix="blob-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(blob.prefix)
                    fh.write(blob.payload)
                    fh.flush()
                    os.fsync(fh.fileno())
                _checkpoint("blob-temp-written")
                os.replace(tmp_name, final)
            except BaseException:
                try:
                    os.unlink(tmp_name)
                except FileNotFoundError:
                    pass
                raise
            renamed = True
            _checkpoint("blob-renamed")
        if renamed:
            fsync_dir(self.dir)
        return [b.digest for b in blobs]

    # ---------------------------------------------------------------- reading
    def read(self, digest: str) -> np.ndarray:
        """The array stored under ``digest``, verified (name, header, size, checksum).

        Returns a writable array that owns its memory, so callers (and torch.from_numpy)
        can use it freely.
        """
        path = self.path(digest)
        try:
            with path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                buf = bytearray(size)
                got = fh.readinto(buf)
        except FileNotFoundError:
            raise BlobMissingError(f"blob file {path} is missing") from None
        if got != size:
            raise BlobCorruptError(f"blob file {path}: short read ({got} of {size} bytes)")
        head = len(MAGIC) + _LEN.size
        if size < head or bytes(buf[: len(MAGIC)]) != MAGIC:
            raise BlobCorruptError(f"blob file {path}: bad magic, not a Starfish blob")
        (hlen,) = _LEN.unpack_from(buf, len(MAGIC))
        if hlen > _MAX_HEADER or head + hlen > size:
            raise BlobCorruptError(f"blob file {path}: header length {hlen} is invalid")
        prefix = memoryview(buf)[: head + hlen]
        if self.keyed and hashlib.sha256(prefix).hexdigest() != digest:
            raise BlobCorruptError(f"blob file {path}: header does not match the file name "
                                   "(corrupt header)")
        try:
            meta = json.loads(bytes(buf[head: head + hlen]))
            dtype = np.dtype(meta["dtype"])
            shape = tuple(int(s) for s in meta["shape"])
            nbytes = int(meta["nbytes"])
            want = str(meta["sha256"])
        except (ValueError, KeyError, TypeError) as exc:  # cannot happen if the name matched
            raise BlobCorruptError(f"blob file {path}: unreadable header ({exc})") from None
        if dtype.str not in ALLOWED_DTYPES or any(s < 0 for s in shape) \
                or nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise BlobCorruptError(f"blob file {path}: inconsistent header {meta}")
        if size - head - hlen != nbytes:
            raise BlobCorruptError(f"blob file {path}: payload is {size - head - hlen} bytes, "
                                   f"header says {nbytes} (truncated or extended file)")
        payload = memoryview(buf)[head + hlen:]
        if hashlib.sha256(payload).hexdigest() != want:
            raise BlobCorruptError(f"blob file {path}: payload checksum mismatch "
                                   "(the file was corrupted on disk)")
        arr = np.frombuffer(buf, dtype=dtype, offset=head + hlen, count=nbytes // dtype.itemsize)
        return arr.astype(dtype.newbyteorder("="), copy=False).reshape(shape)

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    # ---------------------------------------------------------------- cleaning
    def remove(self, digests: Iterable[str]) -> list[Path]:
        """Delete the named blobs (the caller checked nothing refers to them)."""
        removed = []
        for d in digests:
            p = self.path(d)
            try:
                p.unlink()
                removed.append(p)
            except FileNotFoundError:
                pass
        return removed

    def sweep(self, referenced: set[str]) -> list[Path]:
        """Remove temp files and blobs not in ``referenced``; return what was removed.

        Files that match neither naming pattern are left alone (with a warning): a sweep
        must never delete something it does not understand.
        """
        removed: list[Path] = []
        for p in sorted(self.tmp.iterdir()):
            if p.is_file():
                p.unlink()
                removed.append(p)
            else:
                log.warning("store sweep: leaving unexpected directory %s", p)
        for p in sorted(self.dir.iterdir()):
            m = _NAME_RE.match(p.name)
            if m and p.is_file():
                if m.group(1) not in referenced:
                    p.unlink()
                    removed.append(p)
            elif p.name.endswith(".tmp") and p.is_file():
                p.unlink()
                removed.append(p)
            else:
                log.warning("store sweep: leaving unexpected file %s", p)
        return removed

    def digests(self) -> set[str]:
        """Digests of every blob file present."""
        out = set()
        for p in self.dir.iterdir():
            m = _NAME_RE.match(p.name)
            if m:
                out.add(m.group(1))
        return out
