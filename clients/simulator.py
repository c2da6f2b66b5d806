"""``starfish clients``: simulated FL clients talking to the two servers like real ones.

Each simulated client has its own TLS identity (``client-<id>``) and its own two
connections (one per server). Per FL round it fetches M_{i-1} from both servers (they
must publish the same bytes), trains locally (``clients.training``: the lab's
per-(client, round) batch order), splits its update, ||g|| and delta into two additive
shares (share 0 seed-compressed: 16 bytes per value for server 0) and uploads one share to
each server with its |D_j| in the clear. It answers correction tasks of unlearning jobs
(exact update on the task's public model, with the batch order of the task's round), and
can request unlearning of its own data.

Plaintext twin: the simulator knows every plaintext update it uploaded, so after
training it can hand the same history, in the clear, to a :class:`TwinRecorder` (the CLI
gives ``servers.lab.history.NpzTwinRecorder``; clients never import server code), with
the servers' published models and participants, and checks that every published model
is plaintext FedAvg of those updates (``fedavg_max_abs_error`` in the summary). Demos and
tests run the plaintext baselines and the plaintext Starfish on that twin.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mpc.sharing import share
from mpc import wire
from mpc.service_config import ServiceConfig

from .backdoor import BackdoorClient, default_trigger
from .datasets import load_dataset
from .models import build_model
from .partition import partition
from .service_client import ServiceClient, ServiceError
from .training import LocalClient

__all__ = ["FederationSpec", "Federation", "build_federation", "Simulator", "SimulatedClient",
           "TwinRecorder"]

log = logging.getLogger("starfish.clients")


@dataclass(frozen=True)
class FederationSpec:
    """Everything that fixes the clients' data and training, so a twin can be rebuilt."""

    dataset: str = "digits"
    data_dir: str | None = None
    n: int = 20
    seed: int = 0
    partition: str = "iid"
    architecture: str = "logreg"
    l2: float = 1e-3
    epochs: float = 5.0
    lr: float = 0.3
    batch_size: int = 16
    alpha: float = 0.4
    backdoor: tuple[int, ...] = ()
    poison_fraction: float = 0.5
    boost: float = 5.0
    target_label: int = 0
    train_limit: int | None = None


@dataclass
class Federation:
    spec: FederationSpec
    data: Any
    factory: Callable[[], Any]
    clients: list[Any]
    trigger: Any


def build_federation(spec: FederationSpec) -> Federation:
    """The clients of ``spec`` (deterministic: the same spec gives the same clients)."""
    data = load_dataset(spec.dataset, spec.data_dir).subset_train(spec.train_limit, spec.seed)
    parts = partition(spec.partition, data.y_train, spec.n, spec.seed, num_classes=data.num_classes)
    factory = build_model(spec.architecture, data.input_shape, data.num_classes, l2=spec.l2)
    trigger = default_trigger(data.input_shape)
    clients = []
    for j, idx in enumerate(parts):
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        c = LocalClient(j, data.x_train[idx_t], data.y_train[idx_t], factory, epochs=spec.epochs,
                        lr=spec.lr, batch_size=spec.batch_size, alpha=spec.alpha, seed=spec.seed)
        if j in spec.backdoor:
            c = BackdoorClient.from_clean(c, trigger, spec.target_label, spec.poison_fraction,
                                          boost=spec.boost, seed=spec.seed + j)
        clients.append(c)
    return Federation(spec, data, factory, clients, trigger)


class TwinRecorder(Protocol):
    """Where the plaintext twin goes: M_0 first, then every round in order (plain arrays)."""

    location: str

    def start(self, initial_model: np.ndarray, server_lr: float) -> None: ...

    def round(self, model: np.ndarray, participants: tuple[int, ...], weights: dict[int, float],
              updates: dict[int, np.ndarray], norms: dict[int, float],
              deltas: dict[int, float]) -> None: ...


@dataclass
class SimulatedClient:
    local: Any                                   # clients.training.LocalClient
    conns: tuple[ServiceClient, ServiceClient]
    uploaded: set[int] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    records: dict[int, tuple[np.ndarray, float, float]] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return int(self.local.client_id)


class Simulator:
    """Runs simulated clients against a deployment until its exit condition."""

    def __init__(self, cfg: ServiceConfig, federation: Federation, ids: Sequence[int], *,
                 twin: TwinRecorder | None = None, unlearn: Sequence[int] = (),
                 until: str = "training", max_seconds: float = 3600.0,
                 say: Callable[[str], None] | None = None) -> None:
        if until not in ("training", "jobs", "never"):
            raise ValueError("until must be training, jobs or never")
        if until == "jobs" and not unlearn:
            raise ValueError("--until jobs needs --unlearn")
        self.cfg = cfg
        self.fed = federation
        self.twin = twin
        self.unlearn = list(unlearn)
        self.until = until
        self.max_seconds = max_seconds
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.retry = cfg.clients.retry_seconds
        self.clients: list[SimulatedClient] = []
        by_id = {c.client_id: c for c in federation.clients}
        for j in ids:
            conns = tuple(ServiceClient(cfg.keys_dir, f"client-{j}", p, cfg.server(p).api().address,
                                        max_bytes=cfg.limits.max_frame_bytes) for p in (0, 1))
            self.clients.append(SimulatedClient(by_id[j], conns))  # type: ignore[arg-type]
        self.jobs: dict[str, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {"rounds_uploaded": 0, "tasks_answered": 0}
        self._twin_done = False
        self._last_line = ""
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ helpers
    def _call(self, c: SimulatedClient, party: int, op: str, **fields: Any) -> dict:
        return c.conns[party].call(op, retry_seconds=self.retry, **fields)

    def _both(self, c: SimulatedClient, op: str, **fields: Any) -> tuple[dict, dict]:
        return self._call(c, 0, op, **fields), self._call(c, 1, op, **fields)

    @staticmethod
    def _model(reply: dict) -> np.ndarray:
        t = reply["model"]
        return wire.decode_tensor(t, "model", ("<f8", "<f4"), tuple(t["shape"])).astype(np.float64)

    def _upload_shares(self, c: SimulatedClient, op: str, values: dict[str, np.ndarray],
                       precision: int, **extra: Any) -> list[bool]:
        """Share each value (share 0 as a seed) and send one share to each server."""
        shares = {k: share(v, compress=True, precision=precision) for k, v in values.items()}
        out = []
        for p in (0, 1):
            fields = {k: wire.share_field(s.seed0 if p == 0 else s.share1) for k, s in shares.items()}
            out.append(bool(self._call(c, p, op, **fields, **extra).get("stored")))
        return out

    # ------------------------------------------------------------------ FL
    def _train_round(self, r: int, precision: int) -> bool:
        pending = [c for c in self.clients if r not in c.uploaded]
        if not pending:
            return False
        ref = self.clients[0]
        m0, m1 = self._both(ref, "get_model")
        if m0["round"] != r - 1 or m1["round"] != r - 1:
            return False  # one server is mid-commit; poll again
        model = self._model(m0)
        if not np.array_equal(model, self._model(m1)):
            raise RuntimeError(f"the servers publish different models M_{r - 1}")
        vec = torch.from_numpy(model)
        t0 = time.monotonic()
        for c in pending:
            up = c.local.train(vec, r)
            g = up.update.detach().to(torch.float64).numpy()
            values = {"update": g, "norm": np.array(up.norm), "delta": np.array(up.delta)}
            try:
                self._upload_shares(c, "upload", values, precision, round=r,
                                    num_samples=int(up.num_samples))
                c.records[r] = (g.copy(), float(up.norm), float(up.delta))
            except ServiceError as exc:
                if exc.code != "closed":
                    raise
                self.say(f"client {c.id}: round {r} closed before its upload ({exc.message})")
            c.uploaded.add(r)
        self.summary["rounds_uploaded"] += 1
        self.say(f"clients: round {r}/{self.cfg.fl.rounds}: {len(pending)} uploads "
                 f"({time.monotonic() - t0:.1f}s, {time.monotonic() - self._t0:.0f}s total)")
        return True

    # ------------------------------------------------------------------ correction tasks
    def _answer_tasks(self, precision: int) -> bool:
        did = False
        for c in self.clients:
            t0 = {t["task"]: t for t in self._call(c, 0, "poll_tasks")["tasks"]}
            t1 = {t["task"]: t for t in self._call(c, 1, "poll_tasks")["tasks"]}
            for tid in sorted(set(t0) & set(t1)):
                if tid in c.answered:
                    continue
                try:
                    a, b = self._both(c, "get_task", task=tid)
                except ServiceError as exc:
                    if exc.code in ("closed", "not_found"):
                        continue
                    raise
                model = self._model(a)
                if not np.array_equal(model, self._model(b)) or a["round"] != b["round"]:
                    self.say(f"client {c.id}: task {tid}: the servers sent different models; refused")
                    c.answered.add(tid)
                    continue
                up = c.local.train(torch.from_numpy(model), int(a["round"]))
                g = up.update.detach().to(torch.float64).numpy()
                try:
                    self._upload_shares(c, "task_result", {"update": g}, precision, task=tid)
                except ServiceError as exc:
                    if exc.code not in ("closed", "not_found"):
                        raise
                c.answered.add(tid)
                self.summary["tasks_answered"] += 1
                did = True
        return did

    # ------------------------------------------------------------------ twin
    def write_twin(self, T: int, server_lr: float) -> dict[str, Any]:
        """The plaintext twin history and the FedAvg check (needs every participant here)."""
        ref = self.clients[0]
        by_id = {c.id: c for c in self.clients}
        prev = self._model(self._call(ref, 0, "get_model", round=0))
        twin = self.twin
        if twin is not None:
            twin.start(prev, server_lr)
        worst = 0.0
        participants = {}
        for i in range(1, T + 1):
            info = self._call(ref, 0, "round_info", round=i)
            parts = list(info["participants"])
            participants[i] = parts
            weights = dict(zip(parts, info["weights"]))
            model = self._model(self._call(ref, 0, "get_model", round=i))
            missing = [j for j in parts if j not in by_id or i not in by_id[j].records]
            if missing:
                raise RuntimeError(f"round {i}: no plaintext record of clients {missing}")
            recs = {j: by_id[j].records[i] for j in parts}
            fedavg = prev - server_lr * sum(weights[j] * recs[j][0] for j in parts)
            worst = max(worst, float(np.abs(model - fedavg).max()))
            if twin is not None:
                twin.round(model, tuple(parts), weights, {j: recs[j][0] for j in parts},
                           {j: recs[j][1] for j in parts}, {j: recs[j][2] for j in parts})
            prev = model
        return {"fedavg_max_abs_error": worst, "participants": participants,
                "twin_dir": twin.location if twin is not None else None}

    # ------------------------------------------------------------------ unlearning
    def request_unlearning(self, client: int) -> str:
        c = next(x for x in self.clients if x.id == client)
        job = f"unlearn-{client}-{secrets.token_hex(6)}"
        for p in (0, 1):
            self._call(c, p, "unlearn", job=job)
        self.jobs[job] = {"requester": client, "targets": [client]}
        self.say(f"client {client}: requested unlearning of its data (job {job})")
        return job

    def _jobs_finished(self) -> bool:
        done = True
        for job, info in self.jobs.items():
            c = next(x for x in self.clients if x.id == info["requester"])
            states = []
            for p in (0, 1):
                rec = self._call(c, p, "job_status", job=job)
                states.append(rec["state"])
                info[f"server{p}"] = {k: rec.get(k) for k in ("state", "progress", "error")}
            if any(s not in ("done", "failed", "cancelled") for s in states):
                done = False
        return done

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.max_seconds
        ref = self.clients[0]
        last_progress = 0.0
        try:
            while time.monotonic() < deadline:
                s0, s1 = self._both(ref, "state")
                precision = int(s0["precision"])
                progressed = False
                if s0["training"] and s0["T"] == s1["T"]:
                    progressed |= self._train_round(int(s0["T"]) + 1, precision)
                progressed |= self._answer_tasks(precision)
                if not s0["training"] and not s1["training"] and s0["T"] == s1["T"]:
                    if not self._twin_done:
                        self.summary["T"] = int(s0["T"])
                        self._twin_done = True
                        if any(c.records for c in self.clients):
                            self.summary.update(self.write_twin(int(s0["T"]), float(s0["server_lr"])))
                            self.say(f"clients: training finished after {s0['T']} rounds; published "
                                     f"models = plaintext FedAvg within "
                                     f"{self.summary['fedavg_max_abs_error']:.2e}")
                        else:
                            self.say(f"clients: training had finished ({s0['T']} rounds) before we "
                                     "joined; no plaintext twin")
                        for cid in self.unlearn:
                            self.request_unlearning(cid)
                    if self.until == "training":
                        break
                    if self.until == "jobs" and time.monotonic() - last_progress > 1.0:
                        last_progress = time.monotonic()
                        if self._jobs_finished():
                            break
                        info = next(iter(self.jobs.values()))
                        line = (f"clients: unlearning progress {100 * (info['server0']['progress'] or 0):.0f}% "
                                f"({self.summary['tasks_answered']} correction uploads so far)")
                        if line != self._last_line:
                            self.say(line)
                            self._last_line = line
                if not progressed:
                    time.sleep(self.cfg.clients.poll_interval)  # nothing to do until a server moves
            else:
                raise TimeoutError(f"clients: gave up after {self.max_seconds:.0f}s")
        finally:
            for c in self.clients:
                for conn in c.conns:
                    conn.close()
        self.summary["jobs"] = self.jobs
        self.summary["seconds"] = time.monotonic() - self._t0
        return self.summary


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(summary, indent=1, default=str))
