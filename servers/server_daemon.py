"""``starfish server --party 0|1``: one of the two non-colluding servers, as a daemon.

What it runs (DESIGN.md 3 and 4.4):

* the client API (``servers.wire`` messages over mutually authenticated TLS 1.3; a client
  is the certificate name ``client-<id>``, the operator ``admin``): public state and models,
  share uploads for the open FL round, unlearning requests, correction tasks, job status;
* the control link to the other server (``servers.peer_link``): server 0 leads, server 1
  answers. Server 0 decides when a round closes, both agree on the clients whose uploads
  reached *both* of them and on their |D_j|, exchange their weighted share sums
  (``servers.ring_aggregation``, exact on the ring), publish the same M_i (checked by
  digest) and commit it to their history stores; server 1 commits first, so after a crash
  of either the leader can always finish or replay the round (commits are idempotent);
* unlearning jobs: a request must reach both servers (each checks the requester's
  certificate itself); server 0 starts a job only when server 1 holds the same request,
  then both run Stage II in a fresh 2PC session (``servers.unlearning_jobs``).

Restart: the history store is reopened (committed rounds, staged uploads), the sidecar
(``servers.service_state``) restores nonces and reported data sizes, jobs that were
running are re-queued. Nothing else is needed to resume.

Crash-test seam: ``STARFISH_CRASH_AT=name[:n]`` makes the process SIGKILL itself the n-th
time (default first) it passes the named checkpoint, in this module or in the history
store (``servers.share_store._checkpoint`` / ``servers.blobs._checkpoint`` names).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

from mpc import tls
from mpc.channel import KIND_OBJECT, Channel, ChannelError, PeerTimeout, ProtocolError, accept_loop, listen

from . import blobs as _blobs
from . import share_store as _ss
from . import wire
from .correction_tasks import TaskBoard
from .initial_model import initial_model
from .peer_link import PeerClient, PeerRefused, PeerServer, PeerUnavailable
from .ring_aggregation import (fedavg_weights, model_digest, next_model, open_aggregate,
                               weighted_share_sum)
from .service_config import ServiceConfig
from .service_state import ServiceState
from .share_store import JobRecord, ShareStore, StagingConflictError, StagingError
from .unlearning_jobs import job_params, read_result, run_job

__all__ = ["ServerDaemon", "install_crash_points", "checkpoint"]

log = logging.getLogger("starfish.server")

FINISHED = ("done", "failed", "cancelled")
MAX_JOB_ATTEMPTS = 3


# ------------------------------------------------------------------ crash-test seam
_crash_plan: dict[str, int] = {}
_crash_counts: dict[str, int] = {}


def checkpoint(name: str) -> None:
    """Named point in the daemon's write path; SIGKILLs the process when planned (tests)."""
    if name in _crash_plan:
        _crash_counts[name] = _crash_counts.get(name, 0) + 1
        if _crash_counts[name] == _crash_plan[name]:
            log.warning("crash-test seam: SIGKILL at %s (pass %d)", name, _crash_counts[name])
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


def install_crash_points(spec: str | None) -> None:
    """Parse ``name[:n],name2[:n2]`` and hook the history store's checkpoints too."""
    _crash_plan.clear()
    _crash_counts.clear()
    if not spec:
        return
    for item in spec.split(","):
        name, _, hit = item.strip().partition(":")
        _crash_plan[name] = int(hit or 1)
    _ss._checkpoint = checkpoint
    _blobs._checkpoint = checkpoint


# ------------------------------------------------------------------ the daemon
class ServerDaemon:
    """One server process; ``serve_forever()`` until ``stop()`` (or SIGTERM in the CLI)."""

    def __init__(self, cfg: ServiceConfig, party: int) -> None:
        self.cfg = cfg
        self.party = party
        self.name = tls.PARTY_NAMES[party]
        self.max_bytes = cfg.limits.max_message_bytes
        self.data_dir = cfg.data_dir(party)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.results_dir = self.data_dir / "results"
        self.ident = tls.identity(cfg.keys_dir, self.name)
        self._api_ctx = tls.server_context(self.ident)
        self.store = ShareStore(self.data_dir / "store", party=party,
                                initial_model=initial_model(cfg.model),
                                server_lr=cfg.fl.server_lr, precision=cfg.fl.precision)
        self.state = ServiceState(self.data_dir / "service.sqlite3")
        self.board = TaskBoard()
        self.stop_event = threading.Event()
        self._wake = threading.Condition()
        self._round_opened = time.monotonic()
        self._id_locks: dict[str, threading.Lock] = {}
        self._id_guard = threading.Lock()
        self._connections = 0
        self._conn_guard = threading.Lock()
        self._job_thread: threading.Thread | None = None
        self._running_job: str | None = None
        self._attempts: dict[str, int] = {}
        self._progress_at: dict[str, float] = {}
        self._clients_cache: tuple[int, frozenset[int]] = (-1, frozenset())
        for rec in self.store.jobs("running"):
            log.warning("job %s was running when the server stopped; re-queued", rec.id)
            self.store.update_job(rec.id, state="queued")
        me = cfg.server(party)
        self._api_listener = listen(me.host, me.api_port, backlog=128)
        self._peer_listener: socket.socket | None = None
        self._mpc_listener: socket.socket | None = None
        self.peer: PeerClient | None = None
        if party == 1:
            self._peer_listener = listen(me.host, me.peer_port)
            self._mpc_listener = listen(me.host, me.mpc_port)
        else:
            self.peer = PeerClient(cfg.keys_dir, cfg.server1.peer().address,
                                   timeout=cfg.limits.peer_timeout, max_bytes=cfg.limits.max_frame_bytes)
        log.info("%s: history with %d committed rounds, %d staged uploads for round %d",
                 self.name, self.store.num_rounds, len(self.store.staged(self.store.num_rounds + 1)),
                 self.store.num_rounds + 1)

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        threads = [threading.Thread(target=self._api_loop, name="api", daemon=True)]
        if self.party == 1:
            assert self._peer_listener is not None
            peer = PeerServer(self.cfg.keys_dir, self._peer_listener, self._peer_request,
                              timeout=self.cfg.limits.peer_timeout,
                              max_bytes=self.cfg.limits.max_frame_bytes, stop=self.stop_event)
            threads.append(threading.Thread(target=peer.serve_forever, name="peer", daemon=True))
        else:
            threads.append(threading.Thread(target=self._leader_loop, name="leader", daemon=True))
        for t in threads:
            t.start()
        (self.data_dir / "ready.json").write_text(json.dumps({"pid": os.getpid(), "party": self.party}))
        log.info("%s ready: client API on %s:%d", self.name, *self._api_listener.getsockname()[:2])
        try:
            while not self.stop_event.wait(0.5):
                pass
        finally:
            self._shutdown(threads)

    def stop(self) -> None:
        self.stop_event.set()
        with self._wake:
            self._wake.notify_all()

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        for s in (self._api_listener, self._peer_listener, self._mpc_listener):
            if s is not None:
                s.close()
        if self.peer is not None:
            self.peer.close()
        for t in threads:
            t.join(5)
        if self._job_thread is not None:
            self._job_thread.join(5)
        self.state.close()
        self.store.close()
        log.info("%s stopped", self.name)

    # ------------------------------------------------------------------ client API
    def _api_loop(self) -> None:
        accept_loop(self._api_listener, self._serve_client, self.stop_event, name="client",
                    admit=self._admit_client)

    def _admit_client(self) -> bool:
        with self._conn_guard:
            if self._connections >= self.cfg.limits.max_connections:
                log.warning("refusing a client connection: %d open", self._connections)
                return False
            self._connections += 1
            return True

    @staticmethod
    def _allowed(name: str) -> bool:
        return name == tls.ADMIN_NAME or wire.client_id_of(name) is not None

    def _serve_client(self, sock: socket.socket) -> None:
        try:
            try:
                ch = Channel.wrap_accepted(sock, self._api_ctx, self._allowed, kind="online",
                                           timeout=self.cfg.limits.idle_timeout,
                                           max_frame=self.cfg.limits.max_frame_bytes)
            except ChannelError as exc:
                log.info("refused a client connection: %s", exc)
                return
            who = ch.peer
            try:
                while not self.stop_event.is_set():
                    try:
                        buf = ch.recv_frame(KIND_OBJECT)
                    except ProtocolError as exc:
                        # a frame of another kind: answer and go on. A frame above the hard cap
                        # ended the reader, so this send fails and the connection is dropped.
                        ch.send_frame(KIND_OBJECT, wire.error_reply(
                            None, "bad_request", f"{exc} (requests are msgpack object frames)"))
                        continue
                    ch.send_frame(KIND_OBJECT, self.handle(who, buf))
            except PeerTimeout:
                log.debug("%s: idle connection closed", who)
            except ChannelError as exc:
                log.debug("%s: connection ended: %s", who, exc)
            finally:
                ch.close()
        finally:
            with self._conn_guard:
                self._connections -= 1

    def _identity_lock(self, who: str) -> threading.Lock:
        with self._id_guard:
            return self._id_locks.setdefault(who, threading.Lock())

    def handle(self, who: str, buf: bytes | bytearray) -> bytes:
        """Answer one request of identity ``who``: a reply frame, never an exception."""
        msg_id = None
        try:
            req = wire.parse_request(buf, self.max_bytes)
            msg_id = req.id
            self._authorize(who, req)
            fn = getattr(self, "_op_" + req.op)
            if req.op in wire.MUTATING_OPS:
                with self._identity_lock(who):
                    last = self.state.last_nonce(who)
                    if req.fields["nonce"] <= last:
                        raise wire.WireError("replay", f"nonce {req.fields['nonce']} is not larger "
                                                       f"than the last accepted one ({last}) of {who}")
                    out = fn(who, req.fields)
                    self.state.record_nonce(who, req.fields["nonce"])
            else:
                out = fn(who, req.fields)
            return wire.ok_reply(msg_id, **out)
        except wire.WireError as exc:
            return wire.error_reply(exc.msg_id or msg_id, exc.code, exc.message)
        except StagingConflictError as exc:
            return wire.error_reply(msg_id, "conflict", str(exc))
        except StagingError as exc:
            return wire.error_reply(msg_id, "closed", str(exc))
        except _ss.JobError as exc:
            return wire.error_reply(msg_id, "conflict", str(exc))
        except (ValueError, TypeError) as exc:
            return wire.error_reply(msg_id, "bad_request", str(exc))
        except Exception:  # noqa: BLE001 - the client gets a reply, the log the traceback
            log.exception("request from %s failed", who)
            return wire.error_reply(msg_id, "internal", "internal error (see the server log)")

    _ADMIN_OPS = frozenset({"state", "get_model", "round_info", "unlearn", "job_status", "status"})

    def _authorize(self, who: str, req: wire.Request) -> None:
        if who == tls.ADMIN_NAME:
            if req.op not in self._ADMIN_OPS:
                raise wire.WireError("unauthorized", f"{req.op} is for FL clients; admin may use "
                                                     f"{sorted(self._ADMIN_OPS)}")
            return
        if wire.client_id_of(who) is None:  # the TLS layer lets no one else in; belt and braces
            raise wire.WireError("unauthorized", f"{who} is not a client of this deployment")

    # ---- public state
    def _open_round(self) -> int | None:
        T = self.store.num_rounds
        return T + 1 if T < self.cfg.fl.rounds else None

    def _op_state(self, who: str, f: dict) -> dict:
        T = self.store.num_rounds
        return {"party": self.party, "T": T, "rounds": self.cfg.fl.rounds,
                "open_round": self._open_round(), "training": T < self.cfg.fl.rounds,
                "dim": self.store.dim, "precision": self.store.precision,
                "server_lr": self.store.server_lr, "busy_job": self._running_job}

    def _op_get_model(self, who: str, f: dict) -> dict:
        T = self.store.num_rounds
        i = f.get("round", T)
        if i > T:
            raise wire.WireError("not_found", f"model {i} does not exist yet (T = {T})")
        return {"round": i, "model": wire.tensor(self.store.model(i))}

    def _op_round_info(self, who: str, f: dict) -> dict:
        i, T = f["round"], self.store.num_rounds
        if i > T:
            raise wire.WireError("not_found", f"round {i} is not committed (T = {T})")
        parts = list(self.store.participants(i))
        w = self.store.weights(i)
        sizes = self.store.metadata(i).get("num_samples", {})
        return {"round": i, "participants": parts, "weights": [w[j] for j in parts],
                "num_samples": [int(sizes.get(str(j), 0)) for j in parts]}

    # ---- uploads
    def _op_upload(self, who: str, f: dict) -> dict:
        cid = wire.client_id_of(who)
        assert cid is not None
        r, T = f["round"], self.store.num_rounds
        if T >= self.cfg.fl.rounds:
            raise wire.WireError("closed", f"training finished after {T} rounds; no round is open")
        if r != T + 1:
            raise wire.WireError("closed", f"round {r} is not open; the open round is {T + 1}")
        dim = self.store.dim
        update = wire.decode_share(f["update"], "update", (dim,), self.party)
        norm = wire.decode_share(f["norm"], "norm", (), self.party)
        delta = wire.decode_share(f["delta"], "delta", (), self.party)
        n = f["num_samples"]
        staged = cid in self.store.staged(r)
        prev = self.state.size(r, cid)
        if staged and prev is not None and prev != n:
            raise wire.WireError("conflict", f"client {cid} already uploaded for round {r} with "
                                             f"num_samples {prev}, not {n}")
        if prev != n:
            self.state.set_size(r, cid, n)
        stored = self.store.stage_upload(r, cid, update, norm, delta)
        checkpoint("upload-staged")
        with self._wake:
            self._wake.notify_all()
        return {"round": r, "stored": stored}

    # ---- unlearning requests and jobs
    def _fl_clients(self) -> frozenset[int]:
        T = self.store.num_rounds
        if self._clients_cache[0] != T:
            seen: set[int] = set()
            for i in range(1, T + 1):
                seen.update(self.store.participants(i))
            self._clients_cache = (T, frozenset(seen))
        return self._clients_cache[1]

    def _op_unlearn(self, who: str, f: dict) -> dict:
        cid = wire.client_id_of(who)
        targets = f.get("targets")
        if cid is not None:
            if targets is not None and targets != [cid]:
                raise wire.WireError("unauthorized", f"{who} may request unlearning of its own data "
                                                     f"only (client {cid}), not of {targets}")
            targets = [cid]
        elif targets is None:
            raise wire.WireError("bad_request", "admin must name the targets")
        unknown = sorted(set(targets) - self._fl_clients())
        if unknown:
            raise wire.WireError("not_found", f"clients {unknown} took part in no committed round")
        rec = self.store.create_job(who, targets, job_id=f["job"], params=job_params(self.cfg))
        with self._wake:
            self._wake.notify_all()
        return {"job": rec.id, "state": rec.state}

    @staticmethod
    def _job_dict(rec: JobRecord) -> dict:
        return {"job": rec.id, "requester": rec.requester, "targets": list(rec.targets),
                "state": rec.state, "progress": rec.progress, "error": rec.error,
                "created_at": rec.created_at, "updated_at": rec.updated_at}

    def _may_see(self, who: str, rec: JobRecord) -> bool:
        cid = wire.client_id_of(who)
        return who == tls.ADMIN_NAME or rec.requester == who or (cid is not None and cid in rec.targets)

    def _op_job_status(self, who: str, f: dict) -> dict:
        try:
            rec = self.store.job(f["job"])
        except KeyError:
            raise wire.WireError("not_found", f"no unlearning job {f['job']!r}") from None
        if not self._may_see(who, rec):
            raise wire.WireError("unauthorized", f"{who} may not read job {rec.id}")
        out = self._job_dict(rec)
        if rec.state == "done" and rec.result_path:
            summary, model = read_result(rec.result_path)
            out["result"] = {k: summary[k] for k in ("selected_rounds", "flags", "correction_steps",
                                                     "warmup_steps", "wall_seconds", "model_sha256",
                                                     "client_exact_updates", "meters") if k in summary}
            if f.get("with_model"):
                out["model"] = wire.tensor(model)
        return out

    def _op_status(self, who: str, f: dict) -> dict:
        T = self.store.num_rounds
        r = T + 1
        jobs = [self._job_dict(j) for j in self.store.jobs() if self._may_see(who, j)][-100:]
        return {"party": self.party, "T": T, "rounds": self.cfg.fl.rounds,
                "open_round": self._open_round(), "staged": list(self.store.staged(r)),
                "busy_job": self._running_job, "jobs": jobs}

    # ---- correction tasks
    def _op_poll_tasks(self, who: str, f: dict) -> dict:
        cid = wire.client_id_of(who)
        return {"tasks": [{"task": t.id, "job": t.job, "round": t.round, "model_sha256": t.model_sha256}
                          for t in self.board.open_for(cid)]}

    def _op_get_task(self, who: str, f: dict) -> dict:
        t = self.board.get(f["task"], wire.client_id_of(who))
        return {"task": t.id, "job": t.job, "round": t.round, "model": wire.tensor(t.model),
                "model_sha256": t.model_sha256}

    def _op_task_result(self, who: str, f: dict) -> dict:
        cid = wire.client_id_of(who)
        self.board.get(f["task"], cid)  # existence and addressee before decoding
        share = wire.decode_share(f["update"], "update", (self.store.dim,), self.party)
        return {"stored": self.board.submit(f["task"], cid, share)}

    # ------------------------------------------------------------------ rounds (both roles)
    def _share_sum(self, r: int, parts: list[int], sizes: dict[int, int]) -> np.ndarray:
        committed = r <= self.store.num_rounds
        terms = []
        for j in parts:
            share = (self.store.update_share(r, j) if committed
                     else self.store.staged_upload(r, j).update)
            terms.append((sizes[j], share))
        return weighted_share_sum(terms, self.store.dim)

    def _round_model(self, r: int, a0: np.ndarray, a1: np.ndarray, sizes: dict[int, int]) -> np.ndarray:
        total = sum(sizes.values())
        agg = open_aggregate(a0, a1, total, self.store.precision)
        return next_model(self.store.model(r - 1), agg, self.store.server_lr)

    def _commit(self, r: int, model: np.ndarray, parts: list[int], sizes: dict[int, int]) -> bool:
        meta = {"num_samples": {str(j): int(sizes[j]) for j in parts}}
        done = self.store.commit_round(r, model, parts, fedavg_weights(sizes), meta)
        self.state.forget_rounds_before(r + 1)
        self._round_opened = time.monotonic()
        return done

    def _committed_sizes(self, r: int) -> dict[int, int]:
        meta = self.store.metadata(r).get("num_samples", {})
        return {int(k): int(v) for k, v in meta.items()}

    # ------------------------------------------------------------------ server 1: control requests
    def _peer_request(self, op: str, msg: dict) -> dict:
        if op == "state":
            return self._peer_state()
        if op == "close_round":
            return self._peer_close_round(msg)
        if op == "job_start":
            return self._peer_job_start(msg)
        if op == "job_fail":
            rec = self.store.job(str(msg["job"]))
            if rec.state not in FINISHED and rec.id != self._running_job:
                self.store.update_job(rec.id, state="failed", error=str(msg.get("error"))[:2000])
            return {}
        raise ValueError(f"unknown control op {op!r}")

    def _peer_state(self) -> dict:
        T = self.store.num_rounds
        r = T + 1
        sizes = self.state.sizes(r)
        staged = [[j, sizes[j]] for j in self.store.staged(r) if j in sizes]
        last = None
        if T >= 1:
            s = self._committed_sizes(T)
            parts = list(self.store.participants(T))
            last = {"round": T, "participants": parts, "sizes": [s[j] for j in parts]}
        jobs = [[j.id, j.requester, list(j.targets), j.state, json.dumps(dict(j.params), sort_keys=True),
                 j.created_at, j.error] for j in self.store.jobs()[-1000:]]
        return {"T": T, "staged": staged, "last": last, "jobs": jobs, "busy": self._running_job}

    @staticmethod
    def _int_list(v: Any, what: str) -> list[int]:
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise ValueError(f"{what} must be a list of integers")
        return list(v)

    def _peer_close_round(self, msg: dict) -> dict:
        r = int(msg["round"])
        parts = self._int_list(msg["participants"], "participants")
        given = dict(zip(parts, self._int_list(msg["sizes"], "sizes")))
        if parts != sorted(set(parts)) or len(given) != len(parts) or not parts:
            raise ValueError("participants must be sorted, unique, non-empty, one size each")
        a0 = wire.decode_tensor(msg["share"], "share", ("<i8",), (self.store.dim,))
        T = self.store.num_rounds
        if r <= T:
            if list(self.store.participants(r)) != parts or self._committed_sizes(r) != given:
                raise ValueError(f"round {r} is committed here with other participants or sizes")
        elif r == T + 1:
            staged = set(self.store.staged(r))
            mine = self.state.sizes(r)
            missing = [j for j in parts if j not in staged]
            if missing:
                raise ValueError(f"clients {missing} have no staged upload for round {r} here")
            differ = [j for j in parts if mine.get(j) != given[j]]
            if differ:
                raise ValueError(f"clients {differ} reported other data sizes here")
        else:
            raise ValueError(f"round {r} is not the open round {T + 1}")
        a1 = self._share_sum(r, parts, given)
        model = self._round_model(r, a0, a1, given)
        if r == T + 1:
            checkpoint("follower-before-commit")
            self._commit(r, model, parts, given)
            log.info("round %d committed with %d participants", r, len(parts))
        return {"share": wire.tensor(a1), "model_sha256": model_digest(model)}

    def _peer_job_start(self, msg: dict) -> dict:
        jid, rounds = str(msg["job"]), int(msg["rounds"])
        if self._job_thread is not None and self._job_thread.is_alive():
            raise RuntimeError(f"busy with job {self._running_job}")
        rec = self.store.job(jid)
        if rec.state != "queued":
            raise RuntimeError(f"job {jid} is {rec.state} here")
        if self.store.num_rounds < rounds:
            raise RuntimeError(f"job {jid} needs {rounds} rounds, this server has {self.store.num_rounds}")
        self._running_job = jid
        self.store.update_job(jid, state="running", progress=0.0)
        self._job_thread = threading.Thread(target=self._execute_job, args=(rec, rounds),
                                            name=f"job-{jid}", daemon=True)
        self._job_thread.start()
        return {}

    # ------------------------------------------------------------------ jobs (both roles)
    def _job_progress(self, jid: str, fraction: float) -> None:
        now = time.monotonic()
        if fraction >= 1.0 or now - self._progress_at.get(jid, 0.0) > 0.5:
            self._progress_at[jid] = now
            self.store.update_job(jid, progress=min(1.0, max(0.0, fraction)))

    def _execute_job(self, rec: JobRecord, rounds: int) -> None:
        jid = rec.id
        self._running_job = jid
        if self.store.job(jid).state != "running":
            self.store.update_job(jid, state="running", progress=0.0)
        log.info("job %s: unlearning %s from %d rounds (2PC)", jid, list(rec.targets), rounds)
        try:
            path = run_job(rank=self.party, cfg=self.cfg, store=self.store, board=self.board,
                           job_id=jid, targets=list(rec.targets), rounds=rounds,
                           results_dir=self.results_dir, mpc_listener=self._mpc_listener,
                           stop=self.stop_event,
                           progress=lambda fr, info: self._job_progress(jid, fr))
            self.store.update_job(jid, state="done", progress=1.0, result_path=path)
            log.info("job %s done: %s", jid, path)
        except (ChannelError, ConnectionError, TimeoutError) as exc:
            n = self._attempts[jid] = self._attempts.get(jid, 0) + 1
            if n < MAX_JOB_ATTEMPTS and not self.stop_event.is_set():
                log.warning("job %s: session lost (%s); re-queued (attempt %d)", jid, exc, n)
                self.store.update_job(jid, state="queued")
            else:
                self.store.update_job(jid, state="failed", error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded in the job
            log.exception("job %s failed", jid)
            self.store.update_job(jid, state="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            self._running_job = None

    # ------------------------------------------------------------------ server 0: the leader
    def _leader_loop(self) -> None:
        backoff = 0.05
        while not self.stop_event.is_set():
            try:
                busy = self._leader_step()
                backoff = 0.05
                if not busy:
                    with self._wake:
                        self._wake.wait(0.05 if self._open_round() is not None else 0.2)
            except PeerUnavailable as exc:
                log.info("waiting for server 1: %s", exc)
                self.stop_event.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except Exception:  # noqa: BLE001 - keep leading; the log has the cause
                log.exception("leader step failed")
                self.stop_event.wait(1.0)

    def _leader_step(self) -> bool:
        """One decision: finish/replay a round, close the open one, or start a job."""
        assert self.peer is not None
        f = self.peer.call("state")
        T, fT = self.store.num_rounds, int(f["T"])
        if fT > T + 1 or fT < T - 1:
            raise RuntimeError(f"the servers' histories diverged: T = {T} here, {fT} at server 1")
        if fT == T + 1:   # server 1 committed the round we did not: finish it here
            last = f["last"]
            sizes = dict(zip(last["participants"], last["sizes"]))
            self._close_round(T + 1, list(last["participants"]), sizes)
            return True
        if fT == T - 1:   # cannot happen with our commit order; replay for safety
            parts = list(self.store.participants(T))
            self._close_round(T, parts, self._committed_sizes(T))
            return True
        if self._open_round() is not None:
            r = T + 1
            mine = self.state.sizes(r)
            theirs = {int(j): int(n) for j, n in f["staged"]}
            common = sorted(j for j in self.store.staged(r) if j in theirs and mine.get(j) == theirs[j])
            late = time.monotonic() >= self._round_opened + self.cfg.fl.round_deadline
            if len(common) >= self.cfg.fl.clients_expected or (late and len(common) >= self.cfg.fl.min_clients):
                if late and len(common) < self.cfg.fl.clients_expected:
                    log.warning("round %d: deadline passed; closing with %d of %d clients", r,
                                len(common), self.cfg.fl.clients_expected)
                self._close_round(r, common, {j: mine[j] for j in common})
                return True
            if late:
                log.warning("round %d: deadline passed with %d clients at both servers (< %d); "
                            "waiting another %.0fs", r, len(common), self.cfg.fl.min_clients,
                            self.cfg.fl.round_deadline)
                self._round_opened = time.monotonic()
        job = self._pick_job(f["jobs"], f.get("busy"))
        if job is not None:
            self._lead_job(job, T)
            return True
        return False

    def _close_round(self, r: int, parts: list[int], sizes: dict[int, int]) -> None:
        assert self.peer is not None
        a0 = self._share_sum(r, parts, sizes)
        reply = self.peer.call("close_round", round=r, participants=parts,
                               sizes=[sizes[j] for j in parts], share=wire.tensor(a0))
        a1 = wire.decode_tensor(reply["share"], "share", ("<i8",), (self.store.dim,))
        model = self._round_model(r, a0, a1, sizes)
        if reply.get("model_sha256") != model_digest(model):
            raise RuntimeError(f"round {r}: server 1 computed a different model; not committing")
        checkpoint("leader-before-commit")
        if self._commit(r, model, parts, sizes):
            log.info("round %d committed with %d participants", r, len(parts))

    def _pick_job(self, their_rows: list, their_busy: Any) -> JobRecord | None:
        assert self.peer is not None
        theirs = {row[0]: {"requester": row[1], "targets": tuple(row[2]), "state": row[3],
                           "params": row[4], "created_at": row[5], "error": row[6]}
                  for row in their_rows}
        mine = {j.id: j for j in self.store.jobs()}
        now = time.time()
        agree = self.cfg.unlearning.agree_timeout
        for jid, o in theirs.items():   # requests that reached server 1 only, or ended here
            m = mine.get(jid)
            if o["state"] == "queued" and ((m is None and now - o["created_at"] > agree)
                                           or (m is not None and m.state in FINISHED)):
                reason = ("the request reached server 1 only" if m is None
                          else f"server 0 has the job {m.state}: {m.error or ''}")
                self.peer.call("job_fail", job=jid, error=reason)
        for jid, m in mine.items():
            if m.state != "queued":
                continue
            o = theirs.get(jid)
            if o is None:
                if now - m.created_at > agree:
                    self.store.update_job(jid, state="failed", error="the request reached server 0 only")
                continue
            same = (o["requester"] == m.requester and o["targets"] == m.targets
                    and o["params"] == json.dumps(dict(m.params), sort_keys=True))
            if not same:
                self.store.update_job(jid, state="failed", error="the servers hold different requests")
                self.peer.call("job_fail", job=jid, error="the servers hold different requests")
            elif o["state"] in ("failed", "cancelled"):
                self.store.update_job(jid, state="failed", error=f"server 1: {o['error'] or o['state']}")
            elif o["state"] == "queued" and their_busy is None:
                return m
        return None

    def _lead_job(self, rec: JobRecord, T: int) -> None:
        assert self.peer is not None
        try:
            self.peer.call("job_start", job=rec.id, rounds=T)
        except PeerRefused as exc:
            log.warning("job %s: server 1 did not start: %s", rec.id, exc)
            return
        self._execute_job(rec, T)
