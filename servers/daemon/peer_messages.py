"""The messages of the control link between the two servers, typed.

Server 0 sends one request at a time (``servers.daemon.peer_link``); server 1 answers:

======================  =========================  ===========================================================
op                      request                    reply
======================  =========================  ===========================================================
``state``               :class:`GetState`          :class:`PeerState` (rounds, staged uploads, jobs)
``check_round``         :class:`CheckRound`        no fields (server 1 joins the range check's session)
``close_round``         :class:`CloseRound`        :class:`RoundShare` (server 1's share sum, digest)
``aggregate_round``     :class:`AggregateRound`    no fields (server 1 joins the robust aggregation's session)
``close_robust_round``  :class:`CloseRobustRound`  :class:`ModelDigest` (server 1's model digest)
``job_start``           :class:`JobStart`          no fields
``job_fail``            :class:`JobFail`           no fields
``job_adopt``           :class:`AdoptJob`          :class:`Confirmation` (server 1's erasure report)
``job_receipt``         :class:`JobReceipt`        no fields
======================  =========================  ===========================================================

Each message is a frozen dataclass; ``to_wire()`` gives the fields of its msgpack map and
``from_wire()`` rebuilds it, checking every field's type (and the invariants a message must
hold, e.g. sorted unique participants with one size each). A malformed message raises
:class:`ValueError`, which server 1 reports as a refused request and server 0 as a failed
leader step. The peer is a server of the same deployment running the same code, so there is
no versioning: both sides change together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from common import wire

from servers.store.job_records import JobState

if TYPE_CHECKING:  # pragma: no cover
    from servers.store.job_records import JobRecord

__all__ = ["GetState", "PeerState", "LastRound", "JobRow", "CloseRound", "RoundShare", "JobStart",
           "JobFail", "CheckRound", "AggregateRound", "CloseRobustRound", "ModelDigest", "AdoptJob",
           "Confirmation", "JobReceipt", "PeerRequest", "parse_request",
           "params_key", "MAX_JOB_ROWS", "MAX_RECEIPT_BYTES"]

#: Server 1 reports at most this many of its most recent jobs.
MAX_JOB_ROWS = 1000
#: An erasure report or receipt is public bookkeeping of a few hundred bytes per round.
MAX_RECEIPT_BYTES = 1 << 20


# ------------------------------------------------------------------ field checks
def _fields(msg: Any, what: str) -> Callable[[str], Any]:
    """``get(name)``: the field ``name`` of the map ``msg``; a missing field is a ValueError."""
    if not isinstance(msg, Mapping):
        raise ValueError(f"{what} must be a map")

    def get(name: str) -> Any:
        if name not in msg:
            raise ValueError(f"{what} has no field {name!r}")
        return msg[name]
    return get


def _int(v: Any, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{what} must be an integer >= {lo}")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a string")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    return None if v is None else _str(v, what)


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number")
    return float(v)


def _int_list(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ValueError(f"{what} must be a list of integers")
    return tuple(v)


def _tensor(v: Any, what: str, dim: int) -> np.ndarray:
    if not isinstance(v, Mapping):
        raise ValueError(f"{what} must be a tensor map")
    try:
        return wire.decode_tensor(v, what, ("<i8",), (dim,))
    except KeyError as exc:
        raise ValueError(f"{what}: tensor map without field {exc}") from None
    except wire.WireError as exc:
        raise ValueError(exc.message) from None


def _bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{what} must be a boolean")
    return v


def _job_state(v: Any) -> JobState:
    try:
        return JobState(_str(v, "job.state"))
    except ValueError:
        raise ValueError(f"job.state must be one of {[s.value for s in JobState]}, got {v!r}") from None


def _json_map(v: Any, what: str) -> dict[str, Any]:
    """A JSON object sent as a string (bounded); receipts travel this way."""
    text = _str(v, what)
    if len(text) > MAX_RECEIPT_BYTES:
        raise ValueError(f"{what} is larger than {MAX_RECEIPT_BYTES} bytes")
    try:
        out = json.loads(text)
    except ValueError:
        raise ValueError(f"{what} is not JSON") from None
    if not isinstance(out, dict):
        raise ValueError(f"{what} must be a JSON object")
    return out


def params_key(params: Mapping[str, Any]) -> str:
    """A job's public parameters as the canonical JSON both servers compare."""
    return json.dumps(dict(params), sort_keys=True)


# ------------------------------------------------------------------ state: server 1's view
@dataclass(frozen=True)
class GetState:
    """Server 0 asks for server 1's view (reply :class:`PeerState`)."""

    OP: ClassVar[str] = "state"

    def to_wire(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class LastRound:
    """Server 1's last committed round: its participants and their |D_j|, in that order;
    for an unlearning round (no participants) the job whose model it adopted."""

    round: int
    participants: tuple[int, ...]
    sizes: tuple[int, ...]
    job: str | None = None

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.participants):
            raise ValueError("last round: one size per participant")

    def sizes_by_client(self) -> dict[int, int]:
        return dict(zip(self.participants, self.sizes))

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "participants": list(self.participants), "sizes": list(self.sizes),
                "job": self.job}

    @classmethod
    def from_wire(cls, msg: Any) -> LastRound:
        g = _fields(msg, "last round")
        return cls(_int(g("round"), "last.round", 1), _int_list(g("participants"), "last.participants"),
                   _int_list(g("sizes"), "last.sizes"), _opt_str(g("job"), "last.job"))


@dataclass(frozen=True)
class JobRow:
    """One unlearning job as server 1 holds it; server 0 compares it with its own record."""

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

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "requester": self.requester, "targets": list(self.targets),
                "state": self.state.value, "params": self.params, "created_at": self.created_at,
                "error": self.error, "attempts": self.attempts, "result_digest": self.result_digest,
                "has_receipt": self.has_receipt}

    @classmethod
    def from_wire(cls, msg: Any) -> JobRow:
        g = _fields(msg, "job row")
        return cls(_str(g("id"), "job.id"), _str(g("requester"), "job.requester"),
                   _int_list(g("targets"), "job.targets"), _job_state(g("state")),
                   _str(g("params"), "job.params"), _float(g("created_at"), "job.created_at"),
                   _opt_str(g("error"), "job.error"), _int(g("attempts"), "job.attempts"),
                   _opt_str(g("result_digest"), "job.result_digest"),
                   _bool(g("has_receipt"), "job.has_receipt"))


@dataclass(frozen=True)
class PeerState:
    """Server 1's view: committed rounds T, staged uploads of round T + 1 with their reported
    |D_j|, the last committed round, its recent jobs and the job it is running (if any)."""

    T: int
    staged: Mapping[int, int]
    last: LastRound | None
    jobs: tuple[JobRow, ...] = ()
    busy: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"T": self.T, "staged": [[j, n] for j, n in self.staged.items()],
                "last": None if self.last is None else self.last.to_wire(),
                "jobs": [j.to_wire() for j in self.jobs], "busy": self.busy}

    @classmethod
    def from_wire(cls, msg: Any) -> PeerState:
        g = _fields(msg, "state reply")
        pairs = g("staged")
        if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) != 2 for p in pairs):
            raise ValueError("staged must be a list of [client, size] pairs")
        staged = dict(_int_list(p, "staged pair") for p in pairs)
        jobs = g("jobs")
        if not isinstance(jobs, list):
            raise ValueError("jobs must be a list")
        last = g("last")
        return cls(_int(g("T"), "T"), staged, None if last is None else LastRound.from_wire(last),
                   tuple(JobRow.from_wire(j) for j in jobs), _opt_str(g("busy"), "busy"))


# ------------------------------------------------------------------ closing a round
@dataclass(frozen=True, eq=False)
class CloseRound:
    """Server 0 closes round ``round`` with these participants (sorted, unique, non-empty)
    and their |D_j|; ``share`` is server 0's weighted share sum (int64 ring elements)."""

    OP: ClassVar[str] = "close_round"
    round: int
    participants: tuple[int, ...]
    sizes: tuple[int, ...]
    share: np.ndarray = field(repr=False)
    refused: tuple[int, ...] = ()     # clients whose upload failed the range check this round

    def __post_init__(self) -> None:
        parts = list(self.participants)
        if parts != sorted(set(parts)) or len(self.sizes) != len(parts) or not parts:
            raise ValueError("participants must be sorted, unique, non-empty, one size each")

    def sizes_by_client(self) -> dict[int, int]:
        return dict(zip(self.participants, self.sizes))

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "participants": list(self.participants),
                "sizes": list(self.sizes), "share": wire.tensor(self.share), "refused": list(self.refused)}

    @classmethod
    def from_wire(cls, msg: Any, dim: int) -> CloseRound:
        g = _fields(msg, "close_round")
        return cls(_int(g("round"), "round", 1), _int_list(g("participants"), "participants"),
                   _int_list(g("sizes"), "sizes"), _tensor(g("share"), "share", dim),
                   _int_list(g("refused"), "refused"))


@dataclass(frozen=True)
class _RoundSession:
    """Server 0 asks server 1 to join a 2PC session on these uploads of the open round; server 1
    answers at once and runs its side in a thread. Subclasses name the session's step."""

    OP: ClassVar[str] = ""
    round: int
    participants: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "participants": list(self.participants)}

    @classmethod
    def from_wire(cls, msg: Any) -> Any:
        g = _fields(msg, cls.OP)
        return cls(_int(g("round"), "round", 1), _int_list(g("participants"), "participants"))


@dataclass(frozen=True)
class CheckRound(_RoundSession):
    """The range check of the open round's uploads."""

    OP: ClassVar[str] = "check_round"


@dataclass(frozen=True, eq=False)
class RoundShare:
    """Server 1's reply to :class:`CloseRound`: its share sum and the digest of the model it
    computed (server 0 commits only if its own model has the same digest)."""

    share: np.ndarray = field(repr=False)
    model_sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"share": wire.tensor(self.share), "model_sha256": self.model_sha256}

    @classmethod
    def from_wire(cls, msg: Any, dim: int) -> RoundShare:
        g = _fields(msg, "close_round reply")
        return cls(_tensor(g("share"), "share", dim), _str(g("model_sha256"), "model_sha256"))


@dataclass(frozen=True)
class AggregateRound(_RoundSession):
    """The robust aggregation (``[fl] aggregator``) of the open round, after its range check."""

    OP: ClassVar[str] = "aggregate_round"


@dataclass(frozen=True)
class CloseRobustRound:
    """Server 0 closes a robustly aggregated round: the participants whose shares entered the
    aggregate (sorted, unique, non-empty) with their |D_j|, the clients the range check
    (``refused``) and FedSECA's threshold check (``threshold_refused``) left out, and the
    SHA-256 of the aggregate the session opened. No share sum travels: under a robust rule the
    FedAvg sum is not public."""

    OP: ClassVar[str] = "close_robust_round"
    round: int
    participants: tuple[int, ...]
    sizes: tuple[int, ...]
    aggregate_sha256: str
    refused: tuple[int, ...] = ()
    threshold_refused: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        parts = list(self.participants)
        if parts != sorted(set(parts)) or len(self.sizes) != len(parts) or not parts:
            raise ValueError("participants must be sorted, unique, non-empty, one size each")

    def sizes_by_client(self) -> dict[int, int]:
        return dict(zip(self.participants, self.sizes))

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "participants": list(self.participants),
                "sizes": list(self.sizes), "aggregate_sha256": self.aggregate_sha256,
                "refused": list(self.refused), "threshold_refused": list(self.threshold_refused)}

    @classmethod
    def from_wire(cls, msg: Any) -> CloseRobustRound:
        g = _fields(msg, "close_robust_round")
        return cls(_int(g("round"), "round", 1), _int_list(g("participants"), "participants"),
                   _int_list(g("sizes"), "sizes"), _str(g("aggregate_sha256"), "aggregate_sha256"),
                   _int_list(g("refused"), "refused"),
                   _int_list(g("threshold_refused"), "threshold_refused"))


@dataclass(frozen=True)
class ModelDigest:
    """Server 1's reply to :class:`CloseRobustRound`: the digest of the model it committed."""

    model_sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"model_sha256": self.model_sha256}

    @classmethod
    def from_wire(cls, msg: Any) -> ModelDigest:
        return cls(_str(_fields(msg, "close_robust_round reply")("model_sha256"), "model_sha256"))


# ------------------------------------------------------------------ jobs
@dataclass(frozen=True)
class JobStart:
    """Server 0 starts run ``attempt`` of job ``job`` on the first ``rounds`` rounds; server 1
    starts it too. The attempt names the run's 2PC session and correction tasks, so nothing
    of an earlier, interrupted run can be mistaken for this one's."""

    OP: ClassVar[str] = "job_start"
    job: str
    rounds: int
    attempt: int = 1

    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "rounds": self.rounds, "attempt": self.attempt}

    @classmethod
    def from_wire(cls, msg: Any) -> JobStart:
        g = _fields(msg, "job_start")
        return cls(_str(g("job"), "job"), _int(g("rounds"), "rounds"), _int(g("attempt"), "attempt", 1))


@dataclass(frozen=True)
class JobFail:
    """Server 0 tells server 1 to end a job that has not been adopted: ``state`` failed or
    cancelled (with the reason)."""

    OP: ClassVar[str] = "job_fail"
    job: str
    error: str
    state: JobState = JobState.FAILED

    def __post_init__(self) -> None:
        if self.state not in (JobState.FAILED, JobState.CANCELLED):
            raise ValueError("job_fail: state must be failed or cancelled")

    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "error": self.error, "state": self.state.value}

    @classmethod
    def from_wire(cls, msg: Any) -> JobFail:
        g = _fields(msg, "job_fail")
        return cls(_str(g("job"), "job"), _str(g("error"), "error"), _job_state(g("state")))


@dataclass(frozen=True)
class AdoptJob:
    """Server 0 asks server 1 to adopt job ``job``'s model as round ``round`` and to erase the
    job's targets; server 1 checks that its own result has digest ``model_sha256``."""

    OP: ClassVar[str] = "job_adopt"
    job: str
    round: int
    model_sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "round": self.round, "model_sha256": self.model_sha256}

    @classmethod
    def from_wire(cls, msg: Any) -> AdoptJob:
        g = _fields(msg, "job_adopt")
        return cls(_str(g("job"), "job"), _int(g("round"), "round", 1),
                   _str(g("model_sha256"), "model_sha256"))


@dataclass(frozen=True)
class Confirmation:
    """A server's erasure report for one adopted job (``ErasureReport.to_json()``)."""

    report: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"report": json.dumps(dict(self.report), sort_keys=True)}

    @classmethod
    def from_wire(cls, msg: Any) -> Confirmation:
        g = _fields(msg, "job_adopt reply")
        return cls(_json_map(g("report"), "report"))


@dataclass(frozen=True)
class JobReceipt:
    """Server 0 gives server 1 the full erasure receipt (both confirmations) of a job."""

    OP: ClassVar[str] = "job_receipt"
    job: str
    receipt: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "receipt": json.dumps(dict(self.receipt), sort_keys=True)}

    @classmethod
    def from_wire(cls, msg: Any) -> JobReceipt:
        g = _fields(msg, "job_receipt")
        return cls(_str(g("job"), "job"), _json_map(g("receipt"), "receipt"))


PeerRequest = (GetState | CloseRound | CheckRound | AggregateRound | CloseRobustRound | JobStart
               | JobFail | AdoptJob | JobReceipt)


def parse_request(op: str, msg: Mapping[str, Any], dim: int) -> PeerRequest:
    """The typed request of a control message (server 1's side); ``dim`` is the model size."""
    if op == GetState.OP:
        return GetState()
    if op == CloseRound.OP:
        return CloseRound.from_wire(msg, dim)
    if op == CheckRound.OP:
        return CheckRound.from_wire(msg)
    if op == AggregateRound.OP:
        return AggregateRound.from_wire(msg)
    if op == CloseRobustRound.OP:
        return CloseRobustRound.from_wire(msg)
    if op == JobStart.OP:
        return JobStart.from_wire(msg)
    if op == JobFail.OP:
        return JobFail.from_wire(msg)
    if op == AdoptJob.OP:
        return AdoptJob.from_wire(msg)
    if op == JobReceipt.OP:
        return JobReceipt.from_wire(msg)
    raise ValueError(f"unknown control op {op!r}")
