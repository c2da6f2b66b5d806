"""The messages of the control link between the two servers, typed.

Server 0 sends one request at a time (``servers.daemon.peer_link``); server 1 answers:

======================  =========================  ===========================================================
op                      request                    reply
======================  =========================  ===========================================================
``state``               :class:`GetState`          :class:`PeerState` (rounds, staged uploads, jobs)
``check_round``         :class:`CheckRound`        :class:`WorkerAddresses` (server 1 joins the range check's session)
``close_round``         :class:`CloseRound`        :class:`RoundShare` (server 1's share sum, digest)
``aggregate_round``     :class:`AggregateRound`    no fields (server 1 joins the robust aggregation's session)
``close_robust_round``  :class:`CloseRobustRound`  :class:`ModelDigest` (server 1's model digest)
``job_agree``           :class:`JobAgree`          no fields (server 1 holds the same request: queued)
``job_start``           :class:`JobStart`          no fields
``job_fail``            :class:`JobFail`           no fields
``job_adopt``           :class:`AdoptJob`          :class:`Confirmation` (server 1's erasure report)
``job_receipt``         :class:`JobReceipt`        no fields
======================  =========================  ===========================================================

Each message is a frozen dataclass that declares its fields the way the client API does
(``common.wire``: a :class:`~common.wire.Schema` of validators, ``SCHEMA``); ``to_wire()``
gives its msgpack map and ``from_wire()`` rebuilds it, checking every field (and, in
``__post_init__``, the invariants a message must hold, e.g. sorted unique participants with one
size each). A malformed message raises :class:`ValueError`, which server 1 reports as a refused
request and server 0 as a failed leader step. The peer is a server of the same deployment
running the same code, so there is no versioning: both sides change together; for the same
reason fields a message does not declare (the link's ``op`` and ``ok``) are left unread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from common import wire
from net import tls
from common.sample_count import SampleCount
from common.wire import (Schema, boolean, int_sequence, integer, member, nullable, number, ring_vector,
                         sample_count, sample_count_sequence, text)

from servers.store.job_records import JobState

if TYPE_CHECKING:  # pragma: no cover
    from servers.store.job_records import JobRecord

__all__ = ["GetState", "PeerState", "LastRound", "JobRow", "CloseRound", "RoundShare", "JobStart",
           "JobFail", "CheckRound", "WorkerAddresses", "AggregateRound", "CloseRobustRound", "ModelDigest", "AdoptJob", "JobAgree",
           "Confirmation", "JobReceipt", "PeerRequest", "parse_request",
           "params_key", "MAX_JOB_ROWS", "MAX_RECEIPT_BYTES"]

#: Server 1 reports at most this many of its most recent jobs.
MAX_JOB_ROWS = 1000
#: An erasure report or receipt is public bookkeeping of a few hundred bytes per round.
MAX_RECEIPT_BYTES = 1 << 20

M = TypeVar("M", bound="_Message")


# ------------------------------------------------------------------ the declarative base
@dataclass(frozen=True)
class _Codec:
    """A validator whose field has a wire form of its own (the reverse of the check)."""

    check: wire.Validator
    encode: Callable[[Any], Any]

    def __call__(self, name: str, v: Any) -> Any:
        return self.check(name, v)


def _plain(v: Any) -> Any:
    """The msgpack form of a field value: tuples as lists, enums by value, arrays as tensors."""
    if isinstance(v, _Message):
        return v.to_wire()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, np.ndarray):
        return wire.tensor(v)
    return v


class _Message:
    """A control message: its fields are the dataclass's, checked by the validators of ``SCHEMA``.

    ``VECTORS``: the fields holding a vector of model size (a share sum); their check needs the
    model size ``dim``, which only the receiver knows, so :meth:`schema` adds them for it.
    """

    OP: ClassVar[str] = ""
    SCHEMA: ClassVar[Schema] = Schema({})
    VECTORS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def schema(cls, dim: int | None) -> Schema:
        if not cls.VECTORS:
            return cls.SCHEMA
        if dim is None:
            raise TypeError(f"{cls.__name__}.from_wire needs the model size dim")
        return Schema({**cls.SCHEMA.required, **{name: ring_vector(dim) for name in cls.VECTORS}})

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            check = self.SCHEMA.required.get(f.name)
            value = getattr(self, f.name)
            out[f.name] = check.encode(value) if isinstance(check, _Codec) else _plain(value)
        return out

    @classmethod
    def from_wire(cls: type[M], msg: Any, dim: int | None = None) -> M:
        what = cls.OP or cls.__name__
        try:
            return cls(**wire.check_fields(cls.schema(dim), msg, what, ignore_unknown=True))
        except wire.WireError as exc:
            raise ValueError(exc.message if exc.message.startswith(what) else f"{what}: {exc.message}") from None


# ------------------------------------------------------------------ the link's own field kinds
def _json_object(name: str, v: Any) -> dict[str, Any]:
    """A JSON object sent as a string (bounded); receipts travel this way."""
    raw = text(name, v)
    if len(raw) > MAX_RECEIPT_BYTES:
        raise wire.WireError("bad_request", f"field {name!r} is larger than {MAX_RECEIPT_BYTES} bytes")
    try:
        out = json.loads(raw)
    except ValueError:
        raise wire.WireError("bad_request", f"field {name!r} is not JSON") from None
    if not isinstance(out, dict):
        raise wire.WireError("bad_request", f"field {name!r} must be a JSON object")
    return out


_JSON_OBJECT = _Codec(_json_object, lambda v: json.dumps(dict(v), sort_keys=True))


def _pairs(name: str, v: Any) -> dict[int, SampleCount]:
    """client -> |D_j| of staged uploads (the count checked as the client API checks it)."""
    if not isinstance(v, list) or any(not isinstance(p, list) or len(p) != 2 for p in v):
        raise wire.WireError("bad_request", f"field {name!r} must be a list of [client, size] pairs")
    pairs = [int_sequence(f"{name}[]", p) for p in v]
    return {j: sample_count(f"{name}[{j}]", n) for j, n in pairs}


_STAGED = _Codec(_pairs, lambda v: [[j, n] for j, n in v.items()])


def _message(cls: type[_Message]) -> wire.Validator:
    return lambda name, v: cls.from_wire(v)


def _messages(cls: type[_Message]) -> wire.Validator:
    def check(name: str, v: Any) -> tuple[Any, ...]:
        if not isinstance(v, list):
            raise wire.WireError("bad_request", f"field {name!r} must be a list")
        return tuple(cls.from_wire(x) for x in v)
    return check


_ROUND = integer(1)
_COUNT = integer(0)
_IDS = int_sequence
_SIZES = sample_count_sequence      # |D_j| of the participants, in their order
_DIGEST = text


def _addresses(name: str, v: Any) -> tuple[tuple[str, int], ...]:
    """``host:port`` of each of server 1's workers, worker k at index k (at most MAX_WORKERS)."""
    if not isinstance(v, list) or len(v) > tls.MAX_WORKERS:
        raise wire.WireError("bad_request", f"field {name!r} must be a list of at most {tls.MAX_WORKERS} addresses")
    out = []
    for k, a in enumerate(v):
        host, _, port = text(f"{name}[{k}]", a).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise wire.WireError("bad_request", f"field {name}[{k}] must be host:port, got {a!r}")
        out.append((host, int(port)))
    return tuple(out)


_ADDRESSES = _Codec(_addresses, lambda v: [f"{h}:{p}" for h, p in v])


def params_key(params: Mapping[str, Any]) -> str:
    """A job's public parameters as the canonical JSON both servers compare."""
    return json.dumps(dict(params), sort_keys=True)


def _check_participants(participants: tuple[int, ...], sizes: tuple[SampleCount, ...]) -> None:
    parts = list(participants)
    if parts != sorted(set(parts)) or len(sizes) != len(parts) or not parts:
        raise ValueError("participants must be sorted, unique, non-empty, one size each")


# ------------------------------------------------------------------ state: server 1's view
@dataclass(frozen=True)
class GetState(_Message):
    """Server 0 asks for server 1's view (reply :class:`PeerState`)."""

    OP: ClassVar[str] = "state"


@dataclass(frozen=True)
class LastRound(_Message):
    """Server 1's last committed round: its participants and their |D_j|, in that order;
    for an unlearning round (no participants) the job whose model it adopted."""

    SCHEMA: ClassVar[Schema] = Schema({"round": _ROUND, "participants": _IDS, "sizes": _SIZES,
                                       "job": nullable(text)})
    round: int
    participants: tuple[int, ...]
    sizes: tuple[SampleCount, ...]
    job: str | None = None

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.participants):
            raise ValueError("last round: one size per participant")

    def sizes_by_client(self) -> dict[int, SampleCount]:
        return dict(zip(self.participants, self.sizes))


@dataclass(frozen=True)
class JobRow(_Message):
    """One unlearning job as server 1 holds it; server 0 compares it with its own record."""

    SCHEMA: ClassVar[Schema] = Schema({
        "id": text, "requester": text, "targets": _IDS, "state": member(JobState), "params": text,
        "created_at": number, "error": nullable(text), "attempts": _COUNT,
        "result_digest": nullable(text), "has_receipt": boolean})
    id: str
    requester: str
    targets: tuple[int, ...]
    state: JobState
    params: str              # params_key() of the job's public parameters
    created_at: float
    error: str | None
    attempts: int = 0
    result_digest: str | None = None   # sha256 of the computed model (state computed or done)
    has_receipt: bool = False          # the full erasure receipt is recorded (state done)

    @classmethod
    def of(cls, rec: JobRecord) -> JobRow:
        return cls(rec.id, rec.requester, tuple(rec.targets), JobState(rec.state), params_key(rec.params),
                   rec.created_at, rec.error, rec.attempts, rec.result_digest, rec.receipt is not None)

    def same_request(self, rec: JobRecord) -> bool:
        """Whether ``rec`` is the same request (requester, targets, parameters)."""
        return (self.requester == rec.requester and self.targets == tuple(rec.targets)
                and self.params == params_key(rec.params))


@dataclass(frozen=True)
class PeerState(_Message):
    """Server 1's view: committed rounds T, staged uploads of round T + 1 with their reported
    |D_j|, the last committed round, its recent jobs and the job it is running (if any)."""

    SCHEMA: ClassVar[Schema] = Schema({"T": _COUNT, "staged": _STAGED, "last": nullable(_message(LastRound)),
                                       "jobs": _messages(JobRow), "busy": nullable(text)})
    T: int
    staged: Mapping[int, SampleCount]
    last: LastRound | None
    jobs: tuple[JobRow, ...] = ()
    busy: str | None = None


# ------------------------------------------------------------------ closing a round
@dataclass(frozen=True, eq=False)
class CloseRound(_Message):
    """Server 0 closes round ``round`` with these participants (sorted, unique, non-empty)
    and their |D_j|; ``share`` is server 0's weighted share sum (int64 ring elements)."""

    OP: ClassVar[str] = "close_round"
    SCHEMA: ClassVar[Schema] = Schema({"round": _ROUND, "participants": _IDS, "sizes": _SIZES, "refused": _IDS})
    VECTORS: ClassVar[tuple[str, ...]] = ("share",)
    round: int
    participants: tuple[int, ...]
    sizes: tuple[SampleCount, ...]
    share: np.ndarray = field(repr=False)
    refused: tuple[int, ...] = ()     # clients whose upload failed the range check this round

    def __post_init__(self) -> None:
        _check_participants(self.participants, self.sizes)

    def sizes_by_client(self) -> dict[int, SampleCount]:
        return dict(zip(self.participants, self.sizes))


@dataclass(frozen=True)
class _RoundSession(_Message):
    """Server 0 asks server 1 to join a 2PC session on these uploads of the open round; server 1
    answers at once and runs its side in a thread. Subclasses name the session's step."""

    SCHEMA: ClassVar[Schema] = Schema({"round": _ROUND, "participants": _IDS})
    round: int
    participants: tuple[int, ...]


@dataclass(frozen=True)
class CheckRound(_RoundSession):
    """The range check of the open round's uploads."""

    OP: ClassVar[str] = "check_round"


@dataclass(frozen=True)
class WorkerAddresses(_Message):
    """Server 1's reply to :class:`CheckRound`: where its workers wait for server 0's (one per
    coordinate shard, worker k first-come on an ephemeral port; empty for a server without
    workers). Asked at every check because a worker that failed is replaced by one on a new port."""

    SCHEMA: ClassVar[Schema] = Schema({"workers": _ADDRESSES})
    workers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, eq=False)
class RoundShare(_Message):
    """Server 1's reply to :class:`CloseRound`: its share sum and the digest of the model it
    computed (server 0 commits only if its own model has the same digest)."""

    SCHEMA: ClassVar[Schema] = Schema({"model_sha256": _DIGEST})
    VECTORS: ClassVar[tuple[str, ...]] = ("share",)
    share: np.ndarray = field(repr=False)
    model_sha256: str


@dataclass(frozen=True)
class AggregateRound(_RoundSession):
    """The robust aggregation (``[fl] aggregator``) of the open round, after its range check."""

    OP: ClassVar[str] = "aggregate_round"


@dataclass(frozen=True)
class CloseRobustRound(_Message):
    """Server 0 closes a robustly aggregated round: the participants whose shares entered the
    aggregate (sorted, unique, non-empty) with their |D_j|, the clients the range check
    (``refused``) and FedSECA's threshold check (``threshold_refused``) left out, and the
    SHA-256 of the aggregate the session opened. No share sum travels: under a robust rule the
    FedAvg sum is not public."""

    OP: ClassVar[str] = "close_robust_round"
    SCHEMA: ClassVar[Schema] = Schema({"round": _ROUND, "participants": _IDS, "sizes": _SIZES,
                                       "aggregate_sha256": _DIGEST, "refused": _IDS,
                                       "threshold_refused": _IDS})
    round: int
    participants: tuple[int, ...]
    sizes: tuple[SampleCount, ...]
    aggregate_sha256: str
    refused: tuple[int, ...] = ()
    threshold_refused: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_participants(self.participants, self.sizes)

    def sizes_by_client(self) -> dict[int, SampleCount]:
        return dict(zip(self.participants, self.sizes))


@dataclass(frozen=True)
class ModelDigest(_Message):
    """Server 1's reply to :class:`CloseRobustRound`: the digest of the model it committed."""

    SCHEMA: ClassVar[Schema] = Schema({"model_sha256": _DIGEST})
    model_sha256: str


# ------------------------------------------------------------------ jobs
@dataclass(frozen=True)
class JobAgree(_Message):
    """Server 0 found the same request (id, requester, targets, parameters) recorded at both
    servers: server 1 moves its record from ``requested`` to ``queued`` (then server 0 does), and
    from then on FL waits for the job. Until this message a request pauses nothing: each server
    checked the requester's certificate itself, so neither acts on a request the other lacks
    (issue 25, finding 2). Server 1 checks the request against its own record, not the leader's
    word."""

    OP: ClassVar[str] = "job_agree"
    SCHEMA: ClassVar[Schema] = Schema({"job": text, "requester": text, "targets": _IDS, "params": text})
    job: str
    requester: str
    targets: tuple[int, ...]
    params: str              # params_key() of the job's public parameters

    @classmethod
    def of(cls, rec: JobRecord) -> JobAgree:
        return cls(rec.id, rec.requester, tuple(rec.targets), params_key(rec.params))


@dataclass(frozen=True)
class JobStart(_Message):
    """Server 0 starts run ``attempt`` of job ``job`` on the first ``rounds`` rounds; server 1
    starts it too. The attempt names the run's 2PC session and correction tasks, so nothing
    of an earlier, interrupted run can be mistaken for this one's."""

    OP: ClassVar[str] = "job_start"
    SCHEMA: ClassVar[Schema] = Schema({"job": text, "rounds": _COUNT, "attempt": integer(1)})
    job: str
    rounds: int
    attempt: int = 1


@dataclass(frozen=True)
class JobFail(_Message):
    """Server 0 tells server 1 to end a job that has not been adopted: ``state`` failed or
    cancelled (with the reason)."""

    OP: ClassVar[str] = "job_fail"
    SCHEMA: ClassVar[Schema] = Schema({"job": text, "error": text, "state": member(JobState)})
    job: str
    error: str
    state: JobState = JobState.FAILED

    def __post_init__(self) -> None:
        if self.state not in (JobState.FAILED, JobState.CANCELLED):
            raise ValueError("job_fail: state must be failed or cancelled")


@dataclass(frozen=True)
class AdoptJob(_Message):
    """Server 0 asks server 1 to adopt job ``job``'s model as round ``round`` and to erase the
    job's targets; server 1 checks that its own result has digest ``model_sha256``."""

    OP: ClassVar[str] = "job_adopt"
    SCHEMA: ClassVar[Schema] = Schema({"job": text, "round": _ROUND, "model_sha256": _DIGEST})
    job: str
    round: int
    model_sha256: str


@dataclass(frozen=True)
class Confirmation(_Message):
    """A server's erasure report for one adopted job (``ErasureReport.to_json()``)."""

    SCHEMA: ClassVar[Schema] = Schema({"report": _JSON_OBJECT})
    report: Mapping[str, Any]


@dataclass(frozen=True)
class JobReceipt(_Message):
    """Server 0 gives server 1 the full erasure receipt (both confirmations) of a job."""

    OP: ClassVar[str] = "job_receipt"
    SCHEMA: ClassVar[Schema] = Schema({"job": text, "receipt": _JSON_OBJECT})
    job: str
    receipt: Mapping[str, Any]


PeerRequest = (GetState | CloseRound | CheckRound | AggregateRound | CloseRobustRound | JobAgree
               | JobStart | JobFail | AdoptJob | JobReceipt)
#: server 1's requests by op
_REQUESTS: dict[str, type[_Message]] = {cls.OP: cls for cls in (
    GetState, CloseRound, CheckRound, AggregateRound, CloseRobustRound, JobAgree, JobStart, JobFail,
    AdoptJob, JobReceipt)}


def parse_request(op: str, msg: Mapping[str, Any], dim: int) -> PeerRequest:
    """The typed request of a control message (server 1's side); ``dim`` is the model size."""
    cls = _REQUESTS.get(op)
    if cls is None:
        raise ValueError(f"unknown control op {op!r}")
    return cls.from_wire(msg, dim)  # type: ignore[return-value]
