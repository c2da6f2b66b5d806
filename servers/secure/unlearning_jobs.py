"""Running one unlearning job on a server: a fresh 2PC session, Stage II, the result on disk.

Why one session per job: a 2PC session holds CrypTen's process-wide communicator and a
dealer session whose seeds must not be reused across computations; opening it per job
(server 1 accepts on ``mpc_port``, server 0 connects, both reach the dealer) keeps the
daemon's idle state free of half-open sessions and gives each job its own meter, whose
per-step rows are the job's communication report.

Each replayed round steps with the rule that made it (its metadata: FedAvg, FedSECA or
BRACE's vote; ``protocols.starfish.robust_replay``), on the shares, opening only the round's
direction as the FedAvg replay does (docs/unlearning.md, "Robustly aggregated histories").

The history is pinned to the T rounds both servers agreed on when the job started, so a
round committed meanwhile (it cannot be, the leader does not close rounds during a job,
but the pin makes that independent of scheduling) would not change what Stage II reads.
"""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from common import wire
from net.channel import KIND_OBJECT
from common.service_config import ServiceConfig
from mpc.session import open_party, session_source
from protocols.sharded import ShardExecutor
from protocols.starfish.on_shards import ShardClients, ShardHistory, ShardSpace
from protocols.starfish.params import StarfishParams
from protocols.starfish.robust_replay import RuleCombine
from protocols.starfish.stage2 import run_stage2

from servers.secure.correction_tasks import LockstepError, ServiceCorrectionClients, TaskBoard
from servers.store.crash_points import checkpoint
from servers.secure.ring_aggregation import model_digest
from servers.secure.robust_steps import replay_rule
from servers.secure.share_history import ShareHistory
from servers.store.share_store import ShareStore

__all__ = ["run_job", "starfish_params", "job_params", "write_result", "read_result", "JobWorkers"]


class JobWorkers(Protocol):
    """A server's workers as a job uses them (``servers.workers.server_workers.ServerWorkers``)."""

    def open_job(self, party: Any, ticket: bytes) -> ShardExecutor:
        """The worker pairs' sessions ``ticket`` for this job, met through the job's session."""

    def end_job(self, failed: str | None) -> list[dict]:
        """Close the pairs' sessions (or, after a failure, end the workers); their meters."""


def starfish_params(cfg: ServiceConfig) -> StarfishParams:
    """The deployment's [unlearning] section as Stage II parameters (t_delta 0: measured default)."""
    u = cfg.unlearning
    return StarfishParams(sigma=u.sigma, alpha=u.alpha, beta=u.beta, buffer=u.buffer,
                          method=u.rs_method, t_delta=u.t_delta or None, server_lr=None, guard=u.guard)


def job_params(cfg: ServiceConfig) -> dict[str, Any]:
    """The public parameters recorded with a job (identical on both servers)."""
    u = cfg.unlearning
    return {"sigma": u.sigma, "beta": u.beta, "buffer": u.buffer, "rs_method": u.rs_method,
            "t_delta": u.t_delta, "guard": u.guard}


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_result(results_dir: Path, job: str, model: np.ndarray, summary: dict[str, Any]) -> Path:
    """``<job>.npy`` (the public unlearned model) and ``<job>.json``; returns the JSON path."""
    results_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, np.asarray(model, dtype=np.float64))
    _atomic_write(results_dir / f"{job}.npy", buf.getvalue())
    path = results_dir / f"{job}.json"
    _atomic_write(path, json.dumps(summary, indent=1, default=float).encode())
    return path


def read_result(json_path: str | os.PathLike[str]) -> tuple[dict[str, Any], np.ndarray]:
    p = Path(json_path)
    summary = json.loads(p.read_text())
    model = np.load(p.with_suffix(".npy"), allow_pickle=False)
    return summary, model


def _step_checkpoints(party: Any) -> None:
    """Crash-test seam: entering Stage II step X passes checkpoint ``job-step-X``."""
    meter = party.meter

    def step(name: str) -> Any:
        checkpoint(f"job-step-{name}")
        return meter(name)
    party.meter = step


def run_job(*, rank: int, cfg: ServiceConfig, store: ShareStore, board: TaskBoard, job_id: str,
            targets: list[int], rounds: int, results_dir: Path,
            mpc_listener: socket.socket | None, stop: threading.Event, attempt: int = 1,
            progress: Callable[[float, str], None] | None = None,
            workers: JobWorkers | None = None) -> tuple[Path, str]:
    """Open the 2PC session of run ``attempt``, run Stage II on this party's shares, write the
    result; returns its path and the model's digest (the same on both servers).

    ``workers`` (``[deployment] workers`` > 1): Stage II with every m-long
    value on the workers' coordinate shards (``protocols.starfish.on_shards``), the pairs'
    sessions met through this job's session; any failure ends the workers (the next run starts
    new ones).

    ``progress`` is called after every replayed round; it may raise to abandon the run (a
    cancelled job): the session is closed and the other server's run then fails too.
    """
    timeout = max(cfg.unlearning.session_timeout, cfg.unlearning.correction_timeout + 60.0)
    t0 = time.perf_counter()
    space: ShardSpace | None = None
    worker_meters: list[dict] = []
    party = open_party(
        rank, cfg.keys_dir,
        peer_listener=mpc_listener if rank == 1 else None,
        peer_address=cfg.server1.mpc().address if rank == 0 else None,
        **session_source(cfg),
        timeout=timeout,
        ticket=f"job:{job_id}:attempt:{attempt}".encode(),
    )
    try:
        # both parties say which job they run before computing anything
        hello = {"job": job_id, "attempt": attempt, "rounds": rounds, "targets": targets}
        party.channel.send_frame(KIND_OBJECT, wire.pack(hello))
        other = wire.unpack(party.channel.recv_frame(KIND_OBJECT), 1 << 16)
        if other != hello:
            raise LockstepError(f"the other server started {other}, we started job {job_id}")
        _step_checkpoints(party)
        history = ShareHistory(store, wrap=party.wrap_share, rounds=rounds)
        clients = ServiceCorrectionClients(board, party, job_id, timeout=cfg.unlearning.correction_timeout,
                                           dim=store.dim, precision=store.precision, attempt=attempt,
                                           stop=stop, history=history)
        stage_history: Any = history
        stage_clients: Any = clients
        if workers is not None:
            space = ShardSpace(workers.open_job(party, f"job:{job_id}:attempt:{attempt}:shards".encode()),
                               store.dim)
            stage_history, stage_clients = ShardHistory(history, space), ShardClients(clients, space)

        def on_step(done: int, total: int, info: str) -> None:
            if progress is not None:
                progress(done / max(1, total), info)

        # each replayed round steps with the rule its metadata records (FedAvg, FedSECA, BRACE),
        # on the shares; only the round's direction is opened, as in the FedAvg replay
        combine = RuleCombine(lambda t: replay_rule(cfg.fl, store.metadata(t)), meter=party.meter)
        result = run_stage2(party, stage_history, targets, starfish_params(cfg), stage_clients,
                            progress=on_step, combine=combine)
        model = result.model.detach().to(torch.float64).numpy().copy()
        digest = model_digest(model)
        party.channel.send_frame(KIND_OBJECT, wire.pack({"job": job_id, "model_sha256": digest}))
        other = wire.unpack(party.channel.recv_frame(KIND_OBJECT), 1 << 16)
        if other.get("model_sha256") != digest:
            raise LockstepError(f"job {job_id}: the servers computed different models")
        meters = party.meters()
        if space is not None:
            del stage_history, stage_clients
            space.close()
            worker_meters, space = workers.end_job(None), None
    finally:
        if space is not None:
            workers.end_job("the job's run failed")
        party.close()
        board.close_job(job_id)
    summary = {
        "job": job_id, "attempt": attempt, "targets": targets, "rounds": rounds, **result.to_json(),
        "model_sha256": digest, "wall_seconds": time.perf_counter() - t0,
        "client_exact_updates": {str(k): v for k, v in sorted(clients.requested.items())},
        "replay_rules": {str(t): name for t, name in combine.applied},
        # clients left out of correction steps (absent, the job went on): no answer at both
        # servers in time, or an answer refused by the range check (correction_tasks)
        "client_missed_answers": {str(k): v for k, v in sorted(clients.missed.items())},
        "client_refused_answers": {str(k): v for k, v in sorted(clients.refused.items())},
        "correction_wait_seconds": clients.wait_seconds,
        "meters": meters,
        # each worker pair's traffic (on shards; the coordinators' is in ``meters``)
        **({"worker_meters": worker_meters} if worker_meters else {}),
    }
    return write_result(results_dir, job_id, model, summary), digest
