"""The client API's message schema: msgpack maps over the mutually authenticated TLS channel.

Why a strict schema: a server must treat every client as untrusted input (docs/design.md 2).
Each request is one ``KIND_OBJECT`` frame holding a msgpack map; it is refused with a
clear error reply, before anything is stored, when it is too large, not msgpack, of
another protocol version, an unknown operation, has a missing or unknown field, a field
of the wrong type or range, or a tensor of the wrong dtype or shape. Types are exact: an
integer field (``v`` included) takes a msgpack integer only, never a float such as 1.0 or a
boolean, and a string field must match its pattern in full. Authorisation (who may do what)
and replay protection (nonces) are the daemon's job, on top of this; the nonce rule that
needs the server's clock is here, :func:`check_nonce_window`, for the daemon to call.

Envelope of every request: ``{"v": 1, "op": str, "id": 16 random bytes, ...fields}``.
Replies: ``{"v": 1, "id": <the request's id>, "ok": true, ...}`` or
``{"v": 1, "id": ..., "ok": false, "error": {"code": str, "message": str}}``.

Tensors travel as ``{"dtype": "<i8"|"<f8", "shape": [...], "data": raw little-endian
bytes}``; a share may instead be ``{"seed": 16 bytes}`` (party 0 only: the PRG seed the
client expanded with ``common.prg.expand``). Only numpy and msgpack are imported here, so
clients use this module without torch or CrypTen.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack
import numpy as np

from common.prg import SEED_BYTES
from common.sample_count import SampleCount, SampleCountError, check_sample_count, sample_counts

__all__ = ["VERSION", "ERROR_CODES", "MUTATING_OPS", "REQUESTS", "WireError", "Request",
           "pack", "unpack", "unpack_bounded", "parse_request", "make_request", "ok_reply",
           "error_reply", "tensor", "decode_tensor", "decode_share", "share_field", "check_reply",
           "client_id_of", "JOB_ID_RE", "TASK_ID_RE", "MAX_NONCE", "NONCE_WINDOW_NS",
           "check_nonce_window", "Validator", "Schema", "check_fields", "integer", "boolean", "number",
           "text", "string", "nullable", "member", "int_set", "int_sequence", "ring_vector",
           "sample_count", "sample_count_sequence"]

VERSION = 1
ERROR_CODES = ("bad_request", "too_large", "version", "unknown_op", "unauthorized", "replay",
               "conflict", "closed", "not_found", "unavailable", "internal", "forgotten", "paused", "rate_limited")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")      # the history store's job-id rule
#: ``<job>/<attempt>/<k>``: the k-th correction task of one run (attempt) of a job
TASK_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9]{1,9}/[0-9]{1,9}$")
CLIENT_NAME_RE = re.compile(r"^client-(0|[1-9][0-9]{0,17})$")
MAX_NONCE = 2**63 - 1              # the largest value SQLite stores as INTEGER
#: How far ahead of the server's clock a nonce may be. Clients send
#: ``max(last sent + 1, time.time_ns())``; the server keeps the largest nonce it accepted per
#: identity and wants a larger one next time, so without a bound one nonce near MAX_NONCE
#: (a bug, a bad clock) would lock that identity out for good. With it, the stored nonce is
#: never more than this window ahead of real time, and such a lockout ends within it.
NONCE_WINDOW_NS = 3600 * 10**9
MAX_TARGETS = 1024


class WireError(Exception):
    """A refused message: ``code`` is one of :data:`ERROR_CODES`, ``message`` says why."""

    def __init__(self, code: str, message: str, msg_id: bytes | None = None) -> None:
        assert code in ERROR_CODES, code
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.msg_id = msg_id


# ------------------------------------------------------------------ field validators
# The one set of field checks of both links: the client API's table below and the servers'
# control messages (``servers.daemon.peer_messages``) declare their fields with these.
Validator = Callable[[str, Any], Any]
#: msgpack's largest integer: an upper bound that refuses nothing msgpack can carry
MAX_MSGPACK_INT = 2**64 - 1


def integer(lo: int, hi: int = MAX_MSGPACK_INT) -> Validator:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise WireError("bad_request", f"field {name!r} must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise WireError("bad_request", f"field {name!r} must be in {lo}..{hi}, got {v}")
        return v
    return check


def boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise WireError("bad_request", f"field {name!r} must be a boolean")
    return v


def number(name: str, v: Any) -> float:
    """A finite float or integer (never a boolean), as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError("bad_request", f"field {name!r} must be a finite number")
    return float(v)


def text(name: str, v: Any) -> str:
    """Any string; a field whose content matters takes :func:`string` with its pattern."""
    if not isinstance(v, str):
        raise WireError("bad_request", f"field {name!r} must be a string")
    return v


def string(pattern: re.Pattern[str]) -> Validator:
    # fullmatch, not match: the patterns end in ``$``, which also matches before a final
    # newline, and "job\n" must not pass as a job id (it becomes a file name on the server)
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or not pattern.fullmatch(v):
            raise WireError("bad_request", f"field {name!r} must match {pattern.pattern}")
        return v
    return check


def nullable(check: Validator) -> Validator:
    """``check``, or nil (None)."""
    def nil_or(name: str, v: Any) -> Any:
        return None if v is None else check(name, v)
    return nil_or


def member(enum: type[Enum]) -> Validator:
    """The member of a string-valued enum named by its value."""
    def check(name: str, v: Any) -> Any:
        try:
            return enum(text(name, v))
        except ValueError:
            raise WireError("bad_request", f"field {name!r} must be one of "
                                           f"{[m.value for m in enum]}, got {v!r}") from None
    return check


def int_set(max_len: int) -> Validator:
    """1..max_len distinct identifiers (0..MAX_NONCE), sorted: the order carries nothing."""
    def check(name: str, v: Any) -> list[int]:
        if not isinstance(v, list) or not 1 <= len(v) <= max_len:
            raise WireError("bad_request", f"field {name!r} must be a list of 1..{max_len} integers")
        out = [integer(0, MAX_NONCE)(f"{name}[]", x) for x in v]
        if len(set(out)) != len(out):
            raise WireError("bad_request", f"field {name!r} has repeated values")
        return sorted(out)
    return check


def int_sequence(name: str, v: Any) -> tuple[int, ...]:
    """A list of integers kept in its order (the order pairs it with another list)."""
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise WireError("bad_request", f"field {name!r} must be a list of integers")
    return tuple(v)


def sample_count(name: str, v: Any) -> SampleCount:
    """A client's |D_j| (``common.sample_count``: the one bound and message), as a field."""
    try:
        return check_sample_count(v, f"field {name!r}")
    except SampleCountError as exc:
        raise WireError("bad_request", str(exc)) from None


def sample_count_sequence(name: str, v: Any) -> tuple[SampleCount, ...]:
    """A list of |D_j| kept in its order (it pairs with a list of participants)."""
    try:
        return sample_counts(int_sequence(name, v), f"field {name!r}")
    except SampleCountError as exc:
        raise WireError("bad_request", str(exc)) from None


def _tensor_map(name: str, v: Any) -> dict:
    """Structure only; dtype/shape against expectations happens in :func:`decode_tensor`."""
    if not isinstance(v, dict):
        raise WireError("bad_request", f"field {name!r} must be a map")
    if set(v) == {"seed"}:
        if not isinstance(v["seed"], bytes) or len(v["seed"]) != SEED_BYTES:
            raise WireError("bad_request", f"field {name!r}: a seed must be {SEED_BYTES} bytes")
        return v
    if set(v) != {"dtype", "shape", "data"}:
        raise WireError("bad_request", f"field {name!r} must have exactly dtype, shape, data "
                                       f"(or only seed), got {sorted(map(str, v))}")
    if not isinstance(v["dtype"], str) or not isinstance(v["data"], bytes):
        raise WireError("bad_request", f"field {name!r}: dtype must be a string and data bytes")
    shape = v["shape"]
    if not isinstance(shape, list) or len(shape) > 4 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise WireError("bad_request", f"field {name!r}: shape must be a list of at most 4 "
                                       "non-negative integers")
    return v


def ring_vector(dim: int) -> Validator:
    """A tensor of ``dim`` int64 ring elements (never a seed), decoded."""
    def check(name: str, v: Any) -> np.ndarray:
        return decode_tensor(_tensor_map(name, v), name, ("<i8",), (dim,))
    return check


_NONCE = integer(1, MAX_NONCE)
_ROUND = integer(1, 2**31 - 1)


@dataclass(frozen=True)
class Schema:
    """A message's fields: the required and the optional ones, each with its validator."""

    required: Mapping[str, Validator]
    optional: Mapping[str, Validator] = field(default_factory=dict)


def check_fields(schema: Schema, body: Any, what: str, *, ignore_unknown: bool = False) -> dict[str, Any]:
    """The validated fields of the map ``body`` (``what`` names it in errors).

    ``ignore_unknown``: leave fields outside the schema unread instead of refusing them (the
    servers' link, whose maps also carry its envelope, ``op`` or ``ok``).
    """
    if not isinstance(body, Mapping):
        raise WireError("bad_request", f"{what} must be a map")
    known = set(schema.required) | set(schema.optional)
    if ignore_unknown:
        body = {k: v for k, v in body.items() if k in known}
    unknown = sorted(set(body) - known)
    if unknown:
        raise WireError("bad_request", f"{what}: unknown fields {unknown}")
    missing = sorted(set(schema.required) - set(body))
    if missing:
        raise WireError("bad_request", f"{what}: missing fields {missing}")
    return {k: (schema.required.get(k) or schema.optional[k])(k, v) for k, v in body.items()}


#: Every operation of the client API: required and optional fields (besides v, op, id).
REQUESTS: Mapping[str, Schema] = {
    # public state: open round, T, whether training goes on (no model bytes)
    "state": Schema({}, {}),
    # the published model M_T (or M_round); public
    "get_model": Schema({}, {"round": integer(0, 2**31 - 1)}),
    # public data of a committed round: participants, weights
    "round_info": Schema({"round": _ROUND}, {}),
    # this client's shares of g, ||g||, delta for the open round, and |D_j| in the clear;
    # ``threshold``: its share of FedSECA's lambda_k, required (only) where fl.aggregator = fedseca
    "upload": Schema({"round": _ROUND, "update": _tensor_map, "norm": _tensor_map,
                      "delta": _tensor_map, "num_samples": sample_count,
                      "nonce": _NONCE}, {"threshold": _tensor_map}),
    # unlearning of the caller's own data (clients) or of any targets (admin)
    "unlearn": Schema({"job": string(JOB_ID_RE), "nonce": _NONCE},
                      {"targets": int_set(MAX_TARGETS)}),
    # open correction tasks addressed to the caller
    "poll_tasks": Schema({}, {}),
    # one task's public model (large; fetched once per task)
    "get_task": Schema({"task": string(TASK_ID_RE)}, {}),
    # this client's share of its exact update for a task
    "task_result": Schema({"task": string(TASK_ID_RE), "update": _tensor_map,
                           "nonce": _NONCE}, {}),
    # a job's record (and optionally its result model)
    "job_status": Schema({"job": string(JOB_ID_RE)}, {"with_model": boolean}),
    # server status: rounds, staging, jobs visible to the caller, forgotten clients (admin)
    "status": Schema({}, {}),
    # admin: cancel a job that has not been adopted yet (queued, running or computed)
    "cancel_job": Schema({"job": string(JOB_ID_RE), "nonce": _NONCE}, {}),
    # admin: the uploads staged for the open round (public bookkeeping, no shares)
    "staged": Schema({}, {}),
    # admin: withdraw one client's staged upload of the open round
    "drop_staged": Schema({"client": integer(0, 10**18), "nonce": _NONCE}, {}),
    # admin: let a forgotten client take part again (its erased data stays erased)
    "reenrol": Schema({"client": integer(0, 10**18), "nonce": _NONCE}, {}),
}
#: Operations that change state; they carry a per-identity strictly increasing nonce.
MUTATING_OPS = frozenset({"upload", "unlearn", "task_result", "cancel_job", "reenrol", "drop_staged"})


@dataclass(frozen=True)
class Request:
    op: str
    id: bytes
    fields: dict[str, Any]


# ------------------------------------------------------------------ encoding
def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack extension types are not accepted")


def pack(msg: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(msg), use_bin_type=True)


def unpack_bounded(buf: bytes | bytearray | memoryview, *, max_bin_len: int,
                   max_str_len: int = 1 << 16, max_array_len: int = 1 << 20,
                   max_map_len: int = 4096) -> Any:
    """One msgpack value with every length bounded and no extension types.

    Raises msgpack's own errors (several types, mostly ValueError). Every msgpack message of
    the project is decoded here, each protocol with its own limits: the client API and the
    server link (:func:`unpack`) and the dealer's control messages (``mpc.dealer.unpack``).
    """
    return msgpack.unpackb(bytes(buf), raw=False, strict_map_key=True, use_list=True,
                           max_bin_len=max_bin_len, max_str_len=max_str_len,
                           max_array_len=max_array_len, max_map_len=max_map_len,
                           max_ext_len=0, ext_hook=_no_ext)


def unpack(buf: bytes | bytearray | memoryview, max_bytes: int) -> dict:
    """Decode one msgpack map of at most ``max_bytes``; any problem is a WireError."""
    n = len(buf)
    if n > max_bytes:
        raise WireError("too_large", f"message of {n} bytes exceeds the limit of {max_bytes}")
    try:
        msg = unpack_bounded(buf, max_bin_len=max_bytes)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise WireError("bad_request", f"not a valid msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, dict):
        raise WireError("bad_request", "a message must be a msgpack map")
    return msg


def parse_request(buf: bytes | bytearray | memoryview, max_bytes: int) -> Request:
    """Decode and validate one client request (envelope and fields, not authorisation)."""
    msg = unpack(buf, max_bytes)
    raw_id = msg.get("id")
    msg_id = raw_id if isinstance(raw_id, bytes) and len(raw_id) == 16 else None
    try:
        if not _is_version(msg.get("v")):
            raise WireError("version", f"protocol version {msg.get('v')!r} is not supported; "
                                       f"this server speaks v{VERSION} (the integer)")
        # msgpack map keys may also be bytes; a field name is a string, and checking here
        # keeps the set arithmetic of check_fields on one key type
        odd = [k for k in msg if not isinstance(k, str)]
        if odd:
            raise WireError("bad_request", f"field names must be strings, got {odd[:3]!r}")
        if msg_id is None:
            raise WireError("bad_request", "field 'id' must be 16 bytes")
        op = msg.get("op")
        if not isinstance(op, str) or op not in REQUESTS:
            raise WireError("unknown_op", f"unknown operation {op!r}; known: {sorted(REQUESTS)}")
        body = {k: v for k, v in msg.items() if k not in ("v", "op", "id")}
        fields = check_fields(REQUESTS[op], body, op)
        return Request(op, msg_id, fields)
    except WireError as exc:
        exc.msg_id = msg_id
        raise


def _is_version(v: Any) -> bool:
    # ``type(v) is int``: 1.0 == 1 and True == 1 in Python, but neither is protocol v1
    return type(v) is int and v == VERSION


def check_nonce_window(nonce: int, now_ns: int | None = None,
                       window_ns: int = NONCE_WINDOW_NS) -> None:
    """Refuse a nonce more than ``window_ns`` ahead of ``now_ns`` (default: this host's clock).

    The daemon calls this for every state-changing request before comparing the nonce with
    the identity's last accepted one, so that a nonce it stores is never far in the future
    (see :data:`NONCE_WINDOW_NS`). Clients' clocks must therefore not run more than the
    window ahead of the servers'.
    """
    now = time.time_ns() if now_ns is None else now_ns
    if nonce > now + window_ns:
        raise WireError("bad_request",
                        f"nonce {nonce} is {(nonce - now) / 1e9:.0f} s ahead of this server's clock; "
                        f"at most {window_ns / 1e9:.0f} s are accepted (nonces are "
                        "max(last + 1, time in ns): is the client's clock wrong?)")


def make_request(op: str, **fields: Any) -> tuple[bytes, bytes]:
    """(message id, packed request) for a client."""
    msg_id = os.urandom(16)
    return msg_id, pack({"v": VERSION, "op": op, "id": msg_id, **fields})


def ok_reply(msg_id: bytes | None, **fields: Any) -> bytes:
    return pack({"v": VERSION, "id": msg_id, "ok": True, **fields})


def error_reply(msg_id: bytes | None, code: str, message: str) -> bytes:
    return pack({"v": VERSION, "id": msg_id, "ok": False,
                 "error": {"code": code, "message": message[:2000]}})


def check_reply(buf: bytes | bytearray | memoryview, msg_id: bytes, max_bytes: int) -> dict:
    """A client's view of a reply: the map if ok, else a WireError with the server's reason."""
    msg = unpack(buf, max_bytes)
    if not _is_version(msg.get("v")) or msg.get("id") not in (msg_id, None):
        raise WireError("bad_request", "reply does not answer this request")
    if msg.get("ok") is True:
        return msg
    err = msg.get("error")
    err = err if isinstance(err, dict) else {}    # a malformed refusal is still a refusal
    code = err.get("code") if err.get("code") in ERROR_CODES else "internal"
    raise WireError(code, str(err.get("message", "(no message)")), msg_id)


# ------------------------------------------------------------------ tensors and shares
_DTYPES = {"<i8": np.dtype("<i8"), "<f8": np.dtype("<f8"), "<f4": np.dtype("<f4")}


def tensor(arr: np.ndarray) -> dict:
    """The wire form of a numpy array (little-endian, C order)."""
    a = np.asarray(arr)
    dt = a.dtype.newbyteorder("<")
    if dt.str not in _DTYPES:
        raise TypeError(f"cannot send dtype {a.dtype}")
    return {"dtype": dt.str, "shape": list(a.shape),
            "data": np.ascontiguousarray(a, dtype=dt).tobytes()}


def decode_tensor(obj: Mapping[str, Any], name: str, dtypes: tuple[str, ...],
                  shape: tuple[int, ...]) -> np.ndarray:
    """Check dtype, shape and byte length exactly; return a fresh native array."""
    if "seed" in obj:
        raise WireError("bad_request", f"field {name!r} must be a tensor, not a seed")
    if obj["dtype"] not in dtypes:
        raise WireError("bad_request", f"field {name!r}: dtype {obj['dtype']!r} not accepted, "
                                       f"expected {' or '.join(dtypes)}")
    if tuple(obj["shape"]) != tuple(shape):
        raise WireError("bad_request", f"field {name!r}: shape {list(obj['shape'])} does not "
                                       f"match the expected {list(shape)}")
    dt = _DTYPES[obj["dtype"]]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(obj["data"]) != n * dt.itemsize:
        raise WireError("bad_request", f"field {name!r}: {len(obj['data'])} data bytes for "
                                       f"shape {list(shape)} of {obj['dtype']}")
    arr = np.frombuffer(obj["data"], dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise WireError("bad_request", f"field {name!r} contains NaN or infinity")
    return arr


def decode_share(obj: Mapping[str, Any], name: str, shape: tuple[int, ...],
                 party: int) -> np.ndarray | bytes:
    """A share for ``party``: int64 ring elements of ``shape``, or (party 0) a 16-byte seed."""
    if "seed" in obj:
        if party != 0:
            raise WireError("bad_request", f"field {name!r}: only server 0 accepts a seed share")
        return bytes(obj["seed"])
    return decode_tensor(obj, name, ("<i8",), shape)


def share_field(value: np.ndarray | bytes) -> dict:
    """Wire form of one share: a seed (bytes) or ring elements (int64 array)."""
    if isinstance(value, (bytes, bytearray)):
        return {"seed": bytes(value)}
    return tensor(np.asarray(value, dtype=np.int64))


def client_id_of(identity: str) -> int | None:
    """``client-<id>`` -> id; anything else (admin, servers) -> None."""
    m = CLIENT_NAME_RE.fullmatch(identity)
    return int(m.group(1)) if m else None
