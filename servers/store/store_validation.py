"""Checks on everything a caller hands the history store: shares, ids, weights, models.

Why a module of its own: every write path of the store (committed rounds, staged uploads,
job records) validates its input *before* writing anything, with the same rules and the same
messages; these functions are pure (no catalog, no files) so they are shared and tested on
their own. Each returns the value in the form the catalog keeps, or raises TypeError /
ValueError with a message that says what was wrong.

The store never sees both shares of anything and never decodes a share: a share is checked
only for being int64 ring elements of the right shape (or, for party 0, a 16-byte PRG seed).
This module imports neither torch nor CrypTen; a torch tensor is accepted if torch is
already loaded (nothing can be a tensor otherwise).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.prg import SEED_BYTES

from servers.store.blobs import EncodedBlob, encode_blob

__all__ = [
    "MAX_METADATA_BYTES",
    "MAX_CLIENT",
    "JOB_ID_RE",
    "ClientShares",
    "Upload",
    "upload",
    "client_id",
    "round_no",
    "participants",
    "weights",
    "metadata",
    "model",
    "job_id",
]

#: Free-form metadata of a round or job is public and small; bound it.
MAX_METADATA_BYTES = 64 * 1024
#: Client ids (and round numbers) are SQLite integers: 0..2^63-1.
MAX_CLIENT = 2**63 - 1
#: Unlearning-job ids: short, printable, safe in file names and logs.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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


@dataclass
class Upload:
    """Validated shares of one client, ready for the catalog.

    ``refs`` are the catalog's text form: ``blob:<digest>``, ``seed:<hex>``, ``int:<n>``;
    update, norm, delta and, if given, the threshold (so an upload without one hashes as
    before).
    """

    refs: tuple[str, ...]
    blobs: list[EncodedBlob] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.sha256("|".join(self.refs).encode()).hexdigest()


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


def upload(shares: ClientShares, who: str, party: int, dim: int, threshold: Any = None) -> Upload:
    """One client's shares (a ClientShares or a 3-tuple) as catalog references.

    ``threshold``: FedSECA's lambda_k share (a scalar), only in a staged upload of a
    deployment aggregating with FedSECA; it serves the round's close and is not kept in the
    committed round.
    """
    if not isinstance(shares, ClientShares):
        if isinstance(shares, tuple) and len(shares) == 3:
            shares = ClientShares(*shares)
        else:
            raise TypeError(f"{who}: expected ClientShares(update, norm, delta), "
                            f"got {type(shares).__name__}")
    u, ub = _share_ref(shares.update, f"{who} update share", party, dim)
    n, _ = _share_ref(shares.norm, f"{who} norm share", party, None)
    d, _ = _share_ref(shares.delta, f"{who} delta share", party, None)
    refs = (u, n, d)
    if threshold is not None:
        refs += (_share_ref(threshold, f"{who} threshold share", party, None)[0],)
    seeds = [r for r in refs if r.startswith("seed:")]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{who}: the same seed is used for two shares; each value needs its "
                         "own seed (a reused seed leaks the difference of the values)")
    return Upload(refs, [ub] if ub is not None else [])


def client_id(value: Any, what: str = "client id") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    cid = int(value)
    if not 0 <= cid <= MAX_CLIENT:
        raise ValueError(f"{what} {cid} out of range 0..2^63-1")
    return cid


def round_no(value: Any) -> int:
    r = client_id(value, "round number")
    if r < 1:
        raise ValueError("rounds are numbered from 1")
    return r


def participants(values: Iterable[Any]) -> tuple[int, ...]:
    """Distinct client ids, sorted; at least one."""
    parts = [client_id(v, "participant") for v in values]
    if not parts:
        raise ValueError("a round needs at least one participant")
    if len(set(parts)) != len(parts):
        raise ValueError(f"participants contain duplicates: {parts}")
    return tuple(sorted(parts))


def weights(values: Mapping[Any, Any], parts: tuple[int, ...]) -> dict[int, float]:
    """FedAvg weights: one finite, non-negative float per participant, summing to 1."""
    if not isinstance(values, Mapping):
        raise TypeError("weights must be a mapping client -> FedAvg weight")
    out = {client_id(k, "weight key"): v for k, v in values.items()}
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


def metadata(meta: Mapping[str, Any] | None) -> str:
    """Free-form public metadata (or job params) as canonical JSON text, bounded in size."""
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


def model(value: Any, dim: int | None) -> np.ndarray:
    """The public model as a flat float32/float64 array; refuses NaN/inf and wrong sizes."""
    arr = _as_numpy(value, "model")
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


def job_id(value: Any) -> str:
    """An unlearning-job id (``JOB_ID_RE``)."""
    if not isinstance(value, str) or not JOB_ID_RE.match(value):
        raise ValueError(f"job id must match {JOB_ID_RE.pattern}, got {value!r}")
    return value
