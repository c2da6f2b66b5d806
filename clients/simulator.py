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
gives ``lab.history.NpzTwinRecorder``; clients never import server code), with
the servers' published models and participants, and checks that every published model of a
FedAvg round is plaintext FedAvg of those updates (``fedavg_max_abs_error`` in the summary;
robustly aggregated rounds, ``[fl] aggregator``, are checked by whoever can run their rule).
Under ``fedseca`` each upload also carries a share of the client's lambda_k
(``clients.fedseca_threshold``). Demos and
tests run the plaintext baselines and the plaintext Starfish on that twin.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from net import tls
from common import wire
from common.service_config import ServiceConfig
from common.starfish_params import PAPER

from .backdoor import BackdoorClient, default_trigger
from .datasets import load_dataset
from .fedseca_threshold import upload_threshold
from .models import build_model
from .partition import partition
from .service_client import ServiceClient, ServiceError
from .share_seeds import seeded_shares, share_seed
from .training import LocalClient, resolve_device

__all__ = ["FederationSpec", "Federation", "build_federation", "Simulator", "SimulatedClient",
           "TwinRecorder", "parse_unlearn"]

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
    alpha: float = PAPER.alpha
    backdoor: tuple[int, ...] = ()
    poison_fraction: float = 0.5
    boost: float = 5.0
    target_label: int = 0
    train_limit: int | None = None
    #: where the clients' local SGD runs (``--device``: auto, cpu, cuda); uploads, shares and
    #: everything sent to the servers stay on the CPU
    device: str = "cpu"


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
    device = str(resolve_device(spec.device))
    clients = []
    for j, idx in enumerate(parts):
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        c = LocalClient(j, data.x_train[idx_t], data.y_train[idx_t], factory, epochs=spec.epochs,
                        lr=spec.lr, batch_size=spec.batch_size, alpha=spec.alpha, seed=spec.seed,
                        device=device)
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
    seed_key: bytes = b""                        # the client's private key: the source of its seeds
    uploaded: set[int] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    records: dict[int, tuple[np.ndarray, float, float]] = field(default_factory=dict)
    forgotten: bool = False

    @property
    def id(self) -> int:
        return int(self.local.client_id)


def parse_unlearn(spec: str | None) -> list[tuple[int, int | None]]:
    """``"3@20,5"``: client 3 asks once 20 FL rounds are committed, client 5 after training."""
    out: list[tuple[int, int | None]] = []
    for item in str(spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        cid, _, at = item.partition("@")
        try:
            out.append((int(cid), int(at) if at else None))
        except ValueError:
            raise ValueError(f"--unlearn: {item!r} is not CLIENT or CLIENT@ROUND") from None
    return out


class Simulator:
    """Runs simulated clients against a deployment until its exit condition.

    ``unlearn``: (client, fl_round) pairs: the client requests unlearning of its own data once
    ``fl_round`` FL rounds are committed (None: once training is over). ``until``: "training"
    exits when training is over and every request made has finished (adopted, failed or
    cancelled); "never" runs until stopped.
    """

    def __init__(self, cfg: ServiceConfig, federation: Federation, ids: Sequence[int], *,
                 twin: TwinRecorder | None = None, unlearn: Sequence[tuple[int, int | None]] = (),
                 until: str = "training", max_seconds: float = 3600.0,
                 say: Callable[[str], None] | None = None) -> None:
        if until not in ("training", "jobs", "never"):
            raise ValueError("until must be training, jobs or never")
        self.cfg = cfg
        self.fed = federation
        self.twin = twin
        self.unlearn = [(int(c), None if r is None else int(r)) for c, r in unlearn]
        unknown = sorted({c for c, _ in self.unlearn} - set(ids))
        if unknown:
            raise ValueError(f"--unlearn names clients {unknown} that are not simulated here")
        self.until = until
        self.max_seconds = max_seconds
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.retry = cfg.clients.retry_seconds
        self.clients: list[SimulatedClient] = []
        by_id = {c.client_id: c for c in federation.clients}
        for j in ids:
            ident = f"client-{j}"
            conns = tuple(ServiceClient(cfg.keys_dir, ident, p, cfg.server(p).api().address,
                                        max_bytes=cfg.limits.max_frame_bytes) for p in (0, 1))
            key = tls.identity(cfg.keys_dir, ident).key.read_bytes()
            self.clients.append(SimulatedClient(by_id[j], conns, seed_key=key))  # type: ignore[arg-type]
        self.jobs: dict[str, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {"rounds_uploaded": 0, "tasks_answered": 0, "refused_uploads": {}}
        self._infos: dict[int, dict[str, Any]] = {}
        self._requested: set[int] = set()
        self._last_line = ""
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ helpers
    def _call(self, c: SimulatedClient, party: int, op: str, **fields: Any) -> dict:
        # `unavailable` (a server's disk full, its connections full) is retried like a restart:
        # nothing was stored (issue 25, finding 8: the clients used to exit on it)
        return c.conns[party].call(op, retry_seconds=self.retry, retry_unavailable=True, **fields)

    def _both(self, c: SimulatedClient, op: str, **fields: Any) -> tuple[dict, dict]:
        return self._call(c, 0, op, **fields), self._call(c, 1, op, **fields)

    @staticmethod
    def _model(reply: dict) -> np.ndarray:
        t = reply["model"]
        return wire.decode_tensor(t, "model", ("<f8", "<f4"), tuple(t["shape"])).astype(np.float64)

    def _upload_shares(self, c: SimulatedClient, op: str, label: str, values: dict[str, np.ndarray],
                       precision: int, **extra: Any) -> list[bool]:
        """Share each value (share 0 as a seed) and send one share to each server.

        The seeds come from the client's private key and ``label`` (``clients.share_seeds``),
        so after a crash the client sends the very same shares again, which the servers
        recognise as a replay.
        """
        shares = seeded_shares(c.seed_key, label, values, precision)
        out = []
        for p in (0, 1):
            fields = {k: wire.share_field(s.seed0 if p == 0 else s.share1) for k, s in shares.items()}
            out.append(bool(self._call(c, p, op, **fields, **extra).get("stored")))
        return out

    # ------------------------------------------------------------------ FL
    def _upload_values(self, g: np.ndarray, up: Any, precision: int) -> dict[str, np.ndarray]:
        """What a round's upload shares: g, ||g||, delta, and FedSECA's lambda_k where the
        deployment aggregates with it (``clients.fedseca_threshold``)."""
        values = {"update": g, "norm": np.array(up.norm), "delta": np.array(up.delta)}
        if self.cfg.fl.aggregator == "fedseca":
            values["threshold"] = upload_threshold(g, self.cfg.fl.fedseca_gamma, precision)
        return values

    def _train_round(self, r: int, precision: int) -> bool:
        pending = [c for c in self.clients if r not in c.uploaded and not c.forgotten]
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
        done = 0
        for c in pending:
            up = c.local.train(vec, r)
            g = up.update.detach().to(torch.float64).numpy()
            values = self._upload_values(g, up, precision)
            try:
                self._upload_shares(c, "upload", f"round/{r}", values, precision, round=r,
                                    num_samples=int(up.num_samples))
                c.records[r] = (g.copy(), float(up.norm), float(up.delta))
            except ServiceError as exc:
                if exc.code == "paused":
                    return done > 0   # an unlearning job started; retry on the model it adopts
                if exc.code == "forgotten":
                    c.forgotten = True
                    self.summary["refused_uploads"][str(c.id)] = f"{exc.code}: {exc.message}"
                    self.say(f"client {c.id}: upload for round {r} refused: {exc.code} ({exc.message})")
                    continue
                if exc.code != "closed":
                    raise
                self.say(f"client {c.id}: round {r} closed before its upload ({exc.message})")
            c.uploaded.add(r)
            done += 1
        self.summary["rounds_uploaded"] += 1
        self.say(f"clients: round {r}: {done} uploads ({time.monotonic() - t0:.1f}s, "
                 f"{time.monotonic() - self._t0:.0f}s total)")
        return True

    def try_forgotten_upload(self, client: int, r: int, precision: int) -> str | None:
        """Show that a forgotten client is refused: one upload attempt; the refusal or None."""
        c = next(x for x in self.clients if x.id == client)
        model = self._model(self._call(c, 0, "get_model"))
        up = c.local.train(torch.from_numpy(model), r)
        values = self._upload_values(up.update.detach().to(torch.float64).numpy(), up, precision)
        try:
            self._upload_shares(c, "upload", f"round/{r}", values, precision, round=r,
                                num_samples=int(up.num_samples))
        except ServiceError as exc:
            c.forgotten = exc.code == "forgotten" or c.forgotten
            self.summary["refused_uploads"][str(client)] = f"{exc.code}: {exc.message}"
            return f"{exc.code}: {exc.message}"
        return None

    # ------------------------------------------------------------------ correction tasks
    def _answer_tasks(self, precision: int) -> bool:
        did = False
        for c in self.clients:
            if c.forgotten:
                continue
            try:
                t0 = {t["task"]: t for t in self._call(c, 0, "poll_tasks")["tasks"]}
                t1 = {t["task"]: t for t in self._call(c, 1, "poll_tasks")["tasks"]}
            except ServiceError as exc:
                if exc.code != "forgotten":
                    raise
                c.forgotten = True   # its job was adopted: it takes no further part
                continue
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
                    self._upload_shares(c, "task_result", f"task/{tid}", {"update": g}, precision, task=tid)
                except ServiceError as exc:
                    if exc.code not in ("closed", "not_found"):
                        raise
                c.answered.add(tid)
                self.summary["tasks_answered"] += 1
                did = True
        return did

    # ------------------------------------------------------------------ twin
    def _note_rounds(self, T: int) -> None:
        """Keep each committed round's public info as first seen, before any erasure: the
        FedAvg check needs the participants the model was computed from."""
        ref = self.clients[0]
        for i in range(len(self._infos) + 1, T + 1):
            self._infos[i] = self._call(ref, 0, "round_info", round=i)

    def write_twin(self, T: int, server_lr: float) -> dict[str, Any]:
        """The plaintext twin of rounds 1..T as the clients saw them (nothing erased; an
        unlearning round has no participants) and the FedAvg check of every FL round."""
        self._note_rounds(T)
        ref = self.clients[0]
        by_id = {c.id: c for c in self.clients}
        prev = self._model(self._call(ref, 0, "get_model", round=0))
        twin = self.twin
        if twin is not None:
            twin.start(prev, server_lr)
        worst = 0.0
        fedavg_rounds = 0
        participants = {}
        for i in range(1, T + 1):
            info = self._infos[i]
            parts = list(info["participants"]) if info.get("kind", "fl") == "fl" else []
            participants[i] = parts
            weights = dict(zip(parts, info["weights"]))
            model = self._model(self._call(ref, 0, "get_model", round=i))
            missing = [j for j in parts if j not in by_id or i not in by_id[j].records]
            if missing:
                raise RuntimeError(f"round {i}: no plaintext record of clients {missing}")
            recs = {j: by_id[j].records[i] for j in parts}
            # a robust round is checked by whoever can run its rule (``starfish demo``, the tests)
            if parts and info.get("aggregator", "fedavg") == "fedavg":
                fedavg = prev - server_lr * sum(weights[j] * recs[j][0] for j in parts)
                worst = max(worst, float(np.abs(model - fedavg).max()))
                fedavg_rounds += 1
            if twin is not None:
                twin.round(model, tuple(parts), weights, {j: recs[j][0] for j in parts},
                           {j: recs[j][1] for j in parts}, {j: recs[j][2] for j in parts})
            prev = model
        return {"fedavg_max_abs_error": worst, "fedavg_rounds": fedavg_rounds,
                "aggregators": {i: self._infos[i].get("aggregator") for i in range(1, T + 1)},
                "participants": participants,
                "twin_dir": twin.location if twin is not None else None}

    # ------------------------------------------------------------------ unlearning
    def request_unlearning(self, client: int) -> str:
        c = next(x for x in self.clients if x.id == client)
        # the id comes from the key, so a restarted simulator repeats the same request (the
        # servers return the existing job) instead of queueing a second one
        job = f"unlearn-{client}-{share_seed(c.seed_key, 'unlearn-request').hex()[:12]}"
        for p in (0, 1):
            try:
                self._call(c, p, "unlearn", job=job)
            except ServiceError as exc:
                if exc.code != "forgotten":
                    raise
                c.forgotten = True   # the request was made and adopted before a restart
        self.jobs[job] = {"requester": client, "targets": [client], "order": len(self.jobs)}
        self.say(f"client {client}: requested unlearning of its data (job {job})")
        return job

    def _due_requests(self, fl_rounds: int, training: bool) -> list[int]:
        return [c for c, at in self.unlearn if c not in self._requested
                and ((at is not None and fl_rounds >= at) or not training)]

    def _jobs_finished(self) -> bool:
        done = True
        for job, info in self.jobs.items():
            c = next(x for x in self.clients if x.id == info["requester"])
            states = []
            for p in (0, 1):
                rec = self._call(c, p, "job_status", job=job)
                states.append(rec["state"])
                info[f"server{p}"] = {k: rec.get(k) for k in ("state", "progress", "error", "attempts")}
                if rec.get("result"):
                    info["rounds"] = rec["result"].get("rounds")
                if rec.get("receipt"):
                    info["receipt"] = rec["receipt"]
            if any(s not in ("done", "failed", "cancelled") for s in states):
                done = False
            elif states == ["done", "done"] and not info.get("announced"):
                info["announced"] = True
                r = info.get("receipt") or {}
                self.say(f"client {info['requester']}: job {job} adopted as round "
                         f"{r.get('adopted_round')}; erasure receipt: rounds {r.get('rounds_erased')} "
                         f"erased at both servers")
        return done

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.max_seconds
        ref = self.clients[0]
        last_poll = 0.0
        try:
            while time.monotonic() < deadline:
                s0, s1 = self._both(ref, "state")
                precision = int(s0["precision"])
                same = s0["T"] == s1["T"]
                if same:
                    self._note_rounds(int(s0["T"]))
                progressed = False
                training = bool(s0["training"] or s1["training"])
                paused = bool(s0["paused"] or s1["paused"])
                due = self._due_requests(int(s0["fl_rounds"]), training) if same and not paused else []
                for cid in due:   # before training: the request comes between two rounds
                    self._requested.add(cid)
                    self.request_unlearning(cid)
                if due:
                    continue
                if s0["training"] and same and not paused:
                    progressed |= self._train_round(int(s0["T"]) + 1, precision)
                progressed |= self._answer_tasks(precision)
                finished = True
                if self.jobs and time.monotonic() - last_poll > 1.0:
                    last_poll = time.monotonic()
                    finished = self._jobs_finished()
                    self._progress_line()
                elif self.jobs:
                    finished = False
                all_asked = len(self._requested) == len(self.unlearn)
                if self.until != "never" and not training and same and all_asked and finished:
                    break
                if not progressed:
                    time.sleep(self.cfg.clients.poll_interval)  # nothing to do until a server moves
            else:
                raise TimeoutError(f"clients: gave up after {self.max_seconds:.0f}s")
            T = int(s0["T"])
            self.summary["T"] = T
            if any(c.records for c in self.clients):
                self.summary.update(self.write_twin(T, float(s0["server_lr"])))
                checked = (f"published models = plaintext FedAvg within "
                           f"{self.summary['fedavg_max_abs_error']:.2e}" if self.summary["fedavg_rounds"]
                           else f"rounds aggregated by {self.cfg.fl.aggregator}")
                self.say(f"clients: training finished ({s0['fl_rounds']} FL rounds, {T} rounds in "
                         f"all); {checked}")
            for job, info in self.jobs.items():
                if info.get("server0", {}).get("state") == "done":
                    refusal = self.try_forgotten_upload(info["requester"], T + 1, precision)
                    self.say(f"client {info['requester']}: upload after being forgotten: "
                             f"{refusal or 'ACCEPTED (not forgotten!)'}")
        finally:
            for c in self.clients:
                for conn in c.conns:
                    conn.close()
        self.summary["jobs"] = self.jobs
        self.summary["seconds"] = time.monotonic() - self._t0
        return self.summary

    def _progress_line(self) -> None:
        running = [(j, i) for j, i in self.jobs.items()
                   if i.get("server0", {}).get("state") not in ("done", "failed", "cancelled")]
        if not running:
            return
        job, info = running[0]
        s0 = info.get("server0", {})
        line = (f"clients: job {job}: {s0.get('state')} {100 * (s0.get('progress') or 0):.0f}% "
                f"({self.summary['tasks_answered']} correction uploads so far)")
        if line != self._last_line:
            self.say(line)
            self._last_line = line


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(summary, indent=1, default=str))
