"""Correction tasks of Stage II: asking remaining clients for exact updates, as shares.

Why: Starfish's warm-up and its periodic correction (docs/design.md 3, Stage II steps 3-4)
need exact updates g_bar computed by clients on the recovered model M_hat, which is
public. ``run_stage2`` asks for them through ``clients.exact_updates(round, model, ids)``
on both servers in lockstep. :class:`ServiceCorrectionClients` implements that call for a
server daemon:

1. post a task ``<job>/<attempt>/<k>`` (k counts the calls of this run of the job, identical
   on both servers; the attempt numbers the runs, so a re-run after a crash posts new tasks
   and a client's answer to an abandoned run can never be taken for this one's)
   with the round, the model and the client ids on this server's :class:`TaskBoard`;
   clients find it with ``poll_tasks``, fetch the model with ``get_task``, compute the
   exact update with round t's batch order, split it into two additive shares and upload
   one to each server (``task_result``);
2. wait until every addressed client uploaded here, or the timeout; every half second check
   that the 2PC session's peers (the other server, the dealer) are still connected, so a dead
   peer ends the wait in about a second rather than at the timeout. A client that already
   missed a deadline in this run is not waited for again (its answer is used if it is there
   when the others are done), so a silent participant costs a job one ``correction_timeout``,
   not one per task;
3. agree with the other server on the clients that reached *both*: each sends the task id
   and its set over the 2PC session's link (one small exchange, metered);
4. check those answers in 2PC like uploads (``servers.secure.round_checks.check_task_answers``:
   the coordinate window and a norm bound of ``ANSWER_NORM_FACTOR`` times the client's largest
   reported norm; one opened bit per answer, the same on both servers);
5. return this party's shares of the accepted answers as CrypTen tensors.

A client that did not reach both servers in time, or whose answer failed the check, is left out
of the returned dict: Stage II treats it as absent from that correction step
(``protocols.starfish.replay``) and the job goes on (issue 25: one silent client used to fail
every other client's unlearning with ``CorrectionTimeout``, and an unchecked answer became the
client's exact update at full weight). Who was left out, and why, is counted in
``missed``/``refused`` (the job's result summary). Tasks live in memory, scoped by the run: a job
interrupted by a crash is re-run from the start (a new attempt), which posts new tasks; a
task of a dead run is only a public model and some shares of exact updates that no run will
read, and it is dropped with the run (``TaskBoard.close_job``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import wire
from net.channel import KIND_OBJECT
from common.prg import expand
from protocols.backend import stack, to_compute
from protocols.starfish.ports import rounds_of
from protocols.starfish.threshold_determination import determine_thresholds

from servers.secure.ring_aggregation import model_digest
from servers.secure.round_checks import ANSWER_NORM_FACTOR, check_task_answers

__all__ = ["Task", "TaskBoard", "ServiceCorrectionClients", "CorrectionTimeout", "LockstepError",
           "PeerGone"]


class CorrectionTimeout(RuntimeError):
    """Some addressed clients did not upload their exact update to both servers in time."""


class LockstepError(RuntimeError):
    """The two servers disagree on which task they are at (they left lockstep)."""


class PeerGone(ConnectionError):
    """The other server or the dealer closed its connection while we waited for clients."""


@dataclass
class Task:
    id: str
    job: str
    round: int
    model: np.ndarray                      # public M_hat, float64
    clients: tuple[int, ...]
    results: dict[int, Any] = field(default_factory=dict)  # client -> this party's share (array or seed)
    open: bool = True
    model_sha256: str = ""


class TaskBoard:
    """This server's open correction tasks (thread-safe, in memory)."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._cond = threading.Condition()

    def post(self, task_id: str, job: str, round_: int, model: np.ndarray,
             clients: Sequence[int]) -> Task:
        m = np.ascontiguousarray(model, dtype=np.float64).copy()
        t = Task(task_id, job, int(round_), m, tuple(sorted(int(c) for c in clients)),
                 model_sha256=model_digest(m))
        with self._cond:
            self._tasks[task_id] = t
        return t

    def open_for(self, client: int) -> list[Task]:
        """Open tasks addressed to ``client`` that it has not answered yet."""
        with self._cond:
            return [t for t in self._tasks.values()
                    if t.open and client in t.clients and client not in t.results]

    def get(self, task_id: str, client: int) -> Task:
        with self._cond:
            t = self._tasks.get(task_id)
            if t is None:
                raise wire.WireError("not_found", f"no correction task {task_id}")
            if client not in t.clients:
                raise wire.WireError("unauthorized", f"task {task_id} is not addressed to client {client}")
            if not t.open:
                raise wire.WireError("closed", f"task {task_id} is closed")
            return t

    def submit(self, task_id: str, client: int, share: Any) -> bool:
        """Store a client's share; an identical repeat returns False, a different one is refused."""
        with self._cond:
            t = self.get(task_id, client)
            old = t.results.get(client)
            if old is not None:
                if _same_share(old, share):
                    return False
                raise wire.WireError("conflict", f"client {client} already answered task {task_id} "
                                                 "with a different share")
            t.results[client] = share
            self._cond.notify_all()
            return True

    def wait(self, task_id: str, timeout: float, stop: threading.Event | None = None,
             alive: Callable[[], bool] | None = None, skip: frozenset[int] = frozenset()) -> set[int]:
        """Block until every addressed client not in ``skip`` answered, or ``timeout``; return
        who answered (``skip``'s answers included, if they came).

        ``alive`` is polled every half second; once it returns False, :class:`PeerGone`.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            t = self._tasks[task_id]
            awaited = set(t.clients) - set(skip)
            while not awaited <= set(t.results):
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    break
                if alive is not None and not alive():
                    raise PeerGone(f"task {task_id}: a peer of the 2PC session disconnected")
                self._cond.wait(min(left, 0.5))
            return set(t.results)

    def share(self, task_id: str, client: int) -> Any:
        with self._cond:
            return self._tasks[task_id].results[client]

    def close(self, task_id: str) -> None:
        with self._cond:
            t = self._tasks.get(task_id)
            if t is not None:
                t.open = False
                t.model = np.empty(0)   # keep the record small; results are no longer needed
                t.results.clear()

    def close_job(self, job: str) -> None:
        with self._cond:
            for tid in [k for k, t in self._tasks.items() if t.job == job]:
                del self._tasks[tid]


def _same_share(a: Any, b: Any) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    return bool(np.array_equal(a, b))


class ServiceCorrectionClients:
    """``run_stage2``'s ``clients`` on a server daemon (see the module docstring)."""

    def __init__(self, board: TaskBoard, party: Any, job: str, *, timeout: float, dim: int,
                 precision: int, attempt: int = 1, stop: threading.Event | None = None,
                 max_bytes: int = 1 << 20, history: Any = None) -> None:
        self.board = board
        self.party = party
        self.job = job
        self.attempt = attempt
        self.timeout = timeout
        self.dim = dim
        self.precision = precision
        self.stop = stop
        self.max_bytes = max_bytes
        self.calls = 0
        self.requested: dict[int, int] = {}   # client -> exact updates asked (the paper's T_r)
        self.history = history                # this party's shares: the clients' reported norms
        self._norm_caps: dict[int, Any] = {}  # client -> share of its largest reported norm
        self.late: set[int] = set()           # clients that missed a deadline in this run
        self.missed: dict[int, int] = {}      # client -> tasks it did not answer at both in time
        self.refused: dict[int, int] = {}     # client -> answers that failed the range check
        self.wait_seconds = 0.0               # time spent waiting for answers in this run

    def _agree(self, task_id: str, mine: set[int]) -> set[int]:
        """Exchange (task id, answered set) with the other server over the session link."""
        ch = self.party.channel
        ch.send_frame(KIND_OBJECT, wire.pack({"task": task_id, "clients": sorted(mine)}))
        other = wire.unpack(ch.recv_frame(KIND_OBJECT), self.max_bytes)
        if other.get("task") != task_id or not isinstance(other.get("clients"), list):
            raise LockstepError(f"the other server is at task {other.get('task')!r}, we are at {task_id}")
        return mine & {int(c) for c in other["clients"] if isinstance(c, int) and not isinstance(c, bool)}

    def _norm_bounds(self, ids: list[int]) -> Any:
        """Shares of ANSWER_NORM_FACTOR x max_t ||g_t^j|| over client j's rounds, one per id.

        The max is a batched SecMax over the client's reported norms (range-checked when they
        were uploaded, so < 2**14), computed once per client and run; the factor is applied on
        the ring (an integer multiple of a share is a share of the multiple).
        """
        todo = [j for j in ids if j not in self._norm_caps]
        if todo:
            rows = [[to_compute(self.history.norm(i, j)) for i in rounds_of(self.history, j)]
                    for j in todo]
            width = max(len(r) for r in rows)
            padded = [r + [r[0]] * (width - len(r)) for r in rows]   # the max does not change
            caps = determine_thresholds(stack([stack(r) for r in padded]))
            for k, j in enumerate(todo):
                self._norm_caps[j] = caps[k]
        ring = np.stack([self._norm_caps[j].share.reshape(()).numpy() for j in ids]) * ANSWER_NORM_FACTOR
        return self.party.wrap_share(ring, precision=self.precision)

    def exact_updates(self, round_index: int, model: Any, client_ids: list[int]) -> dict[int, Any]:
        self.calls += 1
        task_id = f"{self.job}/{self.attempt}/{self.calls}"
        model_np = model.detach().cpu().numpy() if hasattr(model, "detach") else np.asarray(model)
        ids = sorted(int(c) for c in client_ids)
        self.board.post(task_id, self.job, round_index, model_np, ids)
        try:
            alive = getattr(self.party, "peer_alive", None)
            t0 = time.monotonic()
            mine = self.board.wait(task_id, self.timeout, self.stop, alive, frozenset(self.late))
            self.wait_seconds += time.monotonic() - t0
            both = self._agree(task_id, mine)   # the same set on both servers
            shares = {j: self.board.share(task_id, j) for j in sorted(both)}
        finally:
            self.board.close(task_id)
        for j in ids:
            self.requested[j] = self.requested.get(j, 0) + 1
            if j not in both:   # absent from this step (the replay's rule); not waited for again
                self.missed[j] = self.missed.get(j, 0) + 1
                self.late.add(j)
        if not shares:
            return {}
        got = sorted(shares)
        wrapped = [self.party.wrap_share(expand(shares[j], (self.dim,)) if isinstance(shares[j], bytes)
                                         else shares[j], precision=self.precision) for j in got]
        bounds = self._norm_bounds(got) if self.history is not None else None
        bits = check_task_answers(stack(wrapped), bounds, self.precision)
        out = {}
        for j, w, ok in zip(got, wrapped, bits):
            if ok:
                out[j] = w
            else:
                self.refused[j] = self.refused.get(j, 0) + 1
        return out
