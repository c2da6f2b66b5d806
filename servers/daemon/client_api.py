"""The client API of a server: ``common.wire`` requests over mutually authenticated TLS 1.3.

A client is the certificate name ``client-<id>``, the operator ``admin`` (who may read state
and jobs and request unlearning, nothing else). Every connection is served in its own
thread; until TLS says who it is, it holds one of ``limits.max_handshakes`` short-lived
handshake slots, then one of ``limits.max_connections`` (at most
``limits.max_connections_per_identity`` per identity; over a cap the connection gets an
``unavailable`` reply saying why, ``net.admission``); every request gets one reply frame,
never an exception. A state-changing request (``wire.MUTATING_OPS``) carries a nonce larger
than the identity's last accepted one (durable in ``servers.daemon.service_state``), so a replay is
refused, also after a restart. The operations:

* public state and models: ``state``, ``get_model``, ``round_info``, ``status``;
* ``upload``: a client's shares for the open FL round (``servers.daemon.round_coordinator``);
  refused with ``paused`` while an unlearning job is pending (FL waits for it);
* ``unlearn``, ``job_status``: unlearning requests and their jobs (``servers.daemon.job_scheduler``),
  with the erasure receipt once a job is adopted;
* admin only: ``cancel_job`` (a job not yet adopted), ``reenrol`` (a forgotten client);
* ``poll_tasks``, ``get_task``, ``task_result``: Stage II correction tasks
  (``servers.secure.correction_tasks``).

A forgotten client (its data erased by an adopted job) gets ``forgotten`` for everything but
public state and its own jobs' status, until the operator re-enrols it (recorded).
"""

from __future__ import annotations

import errno
import logging
import socket
import sqlite3
import ssl
import threading
import time
from collections.abc import Callable

import numpy as np

from net import tls
from common import wire
from net.admission import Admission, Refused, refuse
from net.channel import KIND_OBJECT, Channel, ChannelError, PeerTimeout, ProtocolError, accept_loop
from common.sample_count import counts_from_metadata
from common.service_config import ServiceConfig

from servers.secure.correction_tasks import TaskBoard
from servers.store.crash_points import checkpoint
from servers.daemon.job_scheduler import (
    MAX_REQUESTED,
    PENDING,
    SUPERSEDED,
    JobScheduler,
    job_quota,
)
from servers.daemon.rate_limits import TokenBucket
from servers.secure.ring_aggregation import max_total_samples
from servers.workers.shard_worker import WorkerError
from servers.daemon.round_coordinator import RoundCoordinator
from servers.daemon.service_state import ServiceState
from servers.store.job_records import JobRecord, JobState
from servers.store.share_store import (
    ForgottenClientError,
    JobError,
    ShareStore,
    StagingConflictError,
    StagingError,
)
from servers.secure.unlearning_jobs import read_result

__all__ = ["ClientAPI"]

log = logging.getLogger("starfish.server")

#: What the operator (``admin``) may do; FL clients may do everything else.
ADMIN_OPS = frozenset({"state", "get_model", "round_info", "unlearn", "job_status", "status",
                       "cancel_job", "reenrol", "staged", "drop_staged"})
#: Admin-only operations.
ONLY_ADMIN_OPS = frozenset({"cancel_job", "reenrol", "staged", "drop_staged"})
#: What a forgotten client may still do: read public state and its own jobs (the receipt).
FORGOTTEN_OPS = frozenset({"state", "get_model", "round_info", "job_status", "status"})
#: Seconds between two looks at ``crl.pem`` for open connections (issue 25, finding 6): a revoked
#: identity's open connections are closed within this (plus the close itself) of the file changing.
REVOCATION_POLL = 1.0
#: The result fields ``job_status`` shows of a finished job.
RESULT_FIELDS = ("rounds", "attempt", "selected_rounds", "flags", "correction_steps", "warmup_steps", "wall_seconds",
                 "model_sha256", "client_exact_updates", "absent_answers", "client_missed_answers",
                 "client_refused_answers", "correction_wait_seconds", "replay_rules", "meters", "worker_meters")


def _disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or quota is full:
    ENOSPC/EDQUOT from a file write, SQLITE_FULL from the catalog or the sidecar."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                                               or "database or disk is full" in str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class ClientAPI:
    """Serves the clients and the operator on ``listener`` until ``stop`` is set."""

    def __init__(self, cfg: ServiceConfig, party: int, listener: socket.socket, ctx: ssl.SSLContext,
                 *, store: ShareStore, state: ServiceState, board: TaskBoard,
                 rounds: RoundCoordinator, jobs: JobScheduler, stop: threading.Event,
                 health: Callable[[], dict] | None = None, published: dict | None = None) -> None:
        """``health``: what ``status`` adds about the daemon (what it waits for, clients left out);
        ``published``: what ``state`` adds for clients (alpha, the model's layout)."""
        self.cfg = cfg
        self._health = health or dict
        self._published = dict(published or {})
        self.party = party
        self.max_bytes = cfg.limits.max_message_bytes
        self.store = store
        self.state = state
        self.board = board
        self.rounds = rounds
        self.jobs = jobs
        self.stop_event = stop
        self._listener = listener
        self._ctx = ctx
        self._id_locks: dict[str, threading.Lock] = {}
        self._id_guard = threading.Lock()
        self._admission = Admission.from_limits("client API", cfg.limits)
        self._clients_cache: tuple[int, frozenset[int]] = (-1, frozenset())
        self._ops: dict[str, Callable[[str, dict], dict]] = {
            "state": self._op_state, "get_model": self._op_get_model,
            "round_info": self._op_round_info, "upload": self._op_upload,
            "unlearn": self._op_unlearn, "job_status": self._op_job_status,
            "status": self._op_status, "poll_tasks": self._op_poll_tasks,
            "get_task": self._op_get_task, "task_result": self._op_task_result,
            "cancel_job": self._op_cancel_job, "reenrol": self._op_reenrol,
            "staged": self._op_staged, "drop_staged": self._op_drop_staged,
        }
        self._buckets: dict[str, TokenBucket] = {}
        # open authenticated connections, so that a revocation reaches them too (net.tls checks
        # the CRL inside new handshakes only)
        self._revocations = tls.RevocationWatch(cfg.keys_dir)
        self._open: set[Channel] = set()
        self._open_guard = threading.Lock()

    # ------------------------------------------------------------------ connections
    def serve_forever(self) -> None:
        threading.Thread(target=self._watch_revocations, name="revocations", daemon=True).start()
        accept_loop(self._listener, self._serve_client, self.stop_event, name="client",
                    admission=self._admission)

    @staticmethod
    def _allowed(name: str) -> bool:
        return name == tls.ADMIN_NAME or wire.client_id_of(name) is not None

    def _serve_client(self, sock: socket.socket) -> None:
        try:
            ch = Channel.wrap_accepted(sock, self._ctx, self._allowed, kind="online",
                                       timeout=self.cfg.limits.idle_timeout,
                                       max_frame=self.cfg.limits.max_frame_bytes,
                                       **self._admission.channel_options())
        except ChannelError as exc:
            self._admission.handshake_failed(exc)   # anyone can cause this: rate-limited
            return
        who = ch.peer
        try:
            slot = self._admission.connection(sock, who)
        except Refused as exc:
            log.warning("refused a connection of %s: %s", who, exc)
            refuse(ch, wire.error_reply(None, "unavailable", str(exc)),
                   wait=self._admission.handshake_timeout)
            return
        with self._open_guard:
            self._open.add(ch)
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
                self._revocations.refresh()   # one stat: no request is served past a revocation
                if self._revocations.revoked(ch.peer_cert):
                    log.warning("%s: certificate revoked; request refused, connection closed", who)
                    ch.send_frame(KIND_OBJECT, wire.error_reply(
                        None, "unauthorized", f"the certificate of {who} is revoked"))
                    break
                ch.send_frame(KIND_OBJECT, self.handle(who, buf))
        except PeerTimeout:
            log.debug("%s: idle connection closed", who)
        except ChannelError as exc:
            log.debug("%s: connection ended: %s", who, exc)
        finally:
            with self._open_guard:
                self._open.discard(ch)
            ch.close()
            slot.close()

    def _watch_revocations(self) -> None:
        """Close the open connections of revoked certificates when ``crl.pem`` changes."""
        seen = self._revocations.generation
        while not self.stop_event.wait(REVOCATION_POLL):
            try:
                self._revocations.refresh()
                if self._revocations.generation == seen:   # a request may have read it first
                    continue
                seen = self._revocations.generation
                with self._open_guard:
                    gone = [ch for ch in self._open if self._revocations.revoked(ch.peer_cert)]
                for ch in gone:
                    log.warning("%s: certificate revoked; open connection closed", ch.peer)
                    ch.close()   # its serving thread ends on the closed channel
            except Exception:  # noqa: BLE001 - keep watching; the log has the cause
                log.exception("revocation watch failed")

    # ------------------------------------------------------------------ requests
    def _identity_lock(self, who: str) -> threading.Lock:
        with self._id_guard:
            return self._id_locks.setdefault(who, threading.Lock())

    def handle(self, who: str, buf: bytes | bytearray) -> bytes:
        """Answer one request of identity ``who``: a reply frame, never an exception."""
        msg_id = None
        req = None
        try:
            if not self._bucket(who).take():
                raise wire.WireError("rate_limited", f"more than {self.cfg.limits.requests_per_second:g} "
                                                     f"requests per second from {who}; slow down")
            req = wire.parse_request(buf, self.max_bytes)
            msg_id = req.id
            self._authorize(who, req)
            fn = self._ops[req.op]
            if req.op in wire.MUTATING_OPS:
                wire.check_nonce_window(req.fields["nonce"])  # at most NONCE_WINDOW_NS ahead of our clock
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
        except ForgottenClientError as exc:
            return wire.error_reply(msg_id, "forgotten", str(exc))
        except StagingConflictError as exc:
            return wire.error_reply(msg_id, "conflict", str(exc))
        except StagingError as exc:
            return wire.error_reply(msg_id, "closed", str(exc))
        except JobError as exc:
            return wire.error_reply(msg_id, "conflict", str(exc))
        except Exception as exc:  # noqa: BLE001 - the client gets a reply, the log the traceback
            if _disk_full(exc):
                # retryable (issue 25, finding 8: was `internal`, and the simulated clients exited):
                # the store's transactions and blob writes leave nothing half-written behind
                log.error("request %s from %s: the disk is full (%s); answered unavailable",
                          getattr(req, "op", "?"), who, exc)
                return wire.error_reply(msg_id, "unavailable", f"server {self.party} is out of disk "
                                        "space; nothing was stored; retry later")
            if isinstance(exc, WorkerError):
                # retryable: the workers were ended with the failure and the next call starts new
                # ones; the store wrote no catalog row, so nothing was staged
                line = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                log.error("request %s from %s: this server's workers failed (%s); answered unavailable",
                          getattr(req, "op", "?"), who, line)
                return wire.error_reply(msg_id, "unavailable", f"server {self.party}'s workers failed ({line}); "
                                        "the request was not carried out; retry (new workers start)")
            if isinstance(exc, (ValueError, TypeError)):
                return wire.error_reply(msg_id, "bad_request", str(exc))
            log.exception("request from %s failed", who)
            return wire.error_reply(msg_id, "internal", "internal error (see the server log)")

    def _bucket(self, who: str) -> TokenBucket:
        with self._id_guard:   # identities are certificate holders: the table stays small
            b = self._buckets.get(who)
            if b is None:
                lim = self.cfg.limits
                b = self._buckets[who] = TokenBucket(lim.requests_per_second, lim.request_burst)
            return b

    def _authorize(self, who: str, req: wire.Request) -> None:
        if who == tls.ADMIN_NAME:
            if req.op not in ADMIN_OPS:
                raise wire.WireError("unauthorized", f"{req.op} is for FL clients; admin may use "
                                                     f"{sorted(ADMIN_OPS)}")
            return
        cid = wire.client_id_of(who)
        if cid is None:  # the TLS layer lets no one else in; belt and braces
            raise wire.WireError("unauthorized", f"{who} is not a client of this deployment")
        if req.op in ONLY_ADMIN_OPS:
            raise wire.WireError("unauthorized", f"{req.op} is for the operator (admin)")
        if req.op not in FORGOTTEN_OPS and self.store.is_forgotten(cid):
            raise wire.WireError("forgotten", f"client {cid} was forgotten (its data erased by an "
                                              "unlearning job); the operator must re-enrol it first")

    # ------------------------------------------------------------------ public state
    def _op_state(self, who: str, f: dict) -> dict:
        T = self.store.num_rounds
        cid = wire.client_id_of(who)
        open_round = self.rounds.open_round()
        return {"party": self.party, "T": T, "rounds": self.cfg.fl.rounds,
                "fl_rounds": self.store.fl_rounds, "open_round": open_round,
                "training": open_round is not None, "paused": self.jobs.pending(),
                "dim": self.store.dim, "precision": self.store.precision,
                "server_lr": self.store.server_lr, "busy_job": self.jobs.running,
                "forgotten": cid is not None and self.store.is_forgotten(cid),
                "max_num_samples": self.max_num_samples(), **self._published}

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
        meta = self.store.metadata(i)
        sizes = counts_from_metadata(meta, f"round {i}'s metadata")
        return {"round": i, "kind": self.store.round_kind(i), "job": meta.get("job"),
                "participants": parts, "weights": [w[j] for j in parts],
                "num_samples": [int(sizes.get(j, 0)) for j in parts],
                "erased": list(meta.get("erased", [])), "refused": list(meta.get("refused", [])),
                # rounds committed before the key existed were FedAvg
                "aggregator": meta.get("aggregator", "fedavg") if self.store.round_kind(i) == "fl" else None,
                "threshold_refused": list(meta.get("threshold_refused", []))}

    def _op_status(self, who: str, f: dict) -> dict:
        T = self.store.num_rounds
        jobs = [self._job_dict(j) for j in self.store.jobs() if self._may_see(who, j)][-100:]
        out = {"party": self.party, "T": T, "rounds": self.cfg.fl.rounds,
               "fl_rounds": self.store.fl_rounds, "open_round": self.rounds.open_round(),
               "staged": list(self.store.staged(T + 1)), "busy_job": self.jobs.running,
               "paused": self.jobs.pending(), "jobs": jobs, **self._health()}
        if who != tls.ADMIN_NAME:
            out.pop("workers", None)     # the operator's business (processes, addresses)
        if who == tls.ADMIN_NAME:
            out["forgotten"] = [{"client": c, **{k: v for k, v in rec.items() if v is not None}}
                                for c, rec in sorted(self.store.forgotten().items())]
        return out

    # ------------------------------------------------------------------ uploads
    def max_num_samples(self) -> int:
        """The cap on |D_j|: the configured one, never above what keeps a full round of
        ``clients_expected`` uploads inside the exact ring aggregation's bound."""
        fits = max_total_samples(self.store.precision) // max(1, self.cfg.fl.clients_expected)
        configured = self.cfg.limits.max_num_samples
        return max(1, min(fits, configured) if configured else fits)

    def _op_upload(self, who: str, f: dict) -> dict:
        cid = wire.client_id_of(who)
        assert cid is not None
        r, T = f["round"], self.store.num_rounds
        if self.rounds.open_round() is None:
            raise wire.WireError("closed", f"training finished ({self.store.fl_rounds} FL rounds); "
                                           "no round is open")
        if self.jobs.pending():
            raise wire.WireError("paused", "an unlearning job is pending; FL resumes from the "
                                           "model it adopts (retry then, on the new model)")
        if r != T + 1:
            raise wire.WireError("closed", f"round {r} is not open; the open round is {T + 1}")
        dim = self.store.dim
        update = wire.decode_share(f["update"], "update", (dim,), self.party)
        norm = wire.decode_share(f["norm"], "norm", (), self.party)
        delta = wire.decode_share(f["delta"], "delta", (), self.party)
        threshold = self._threshold_share(f.get("threshold"))
        n = f["num_samples"]
        cap = self.max_num_samples()
        if n > cap:
            raise wire.WireError("bad_request", f"num_samples {n} is above this deployment's cap "
                                                f"of {cap} per upload (limits.max_num_samples)")
        staged = cid in self.store.staged(r)
        prev = self.state.size(r, cid)
        if staged and prev is not None and prev != n:
            raise wire.WireError("conflict", f"client {cid} already uploaded for round {r} with "
                                             f"num_samples {prev}, not {n}")
        if prev != n:
            self.state.set_size(r, cid, n)
        stored = self.store.stage_upload(r, cid, update, norm, delta, threshold=threshold)
        checkpoint("upload-staged")
        self.rounds.wake()
        return {"round": r, "stored": stored}

    def _threshold_share(self, field: dict | None) -> np.ndarray | bytes | None:
        """FedSECA's lambda_k share: required where ``fl.aggregator`` is fedseca, refused elsewhere
        (so every other deployment's uploads are what they always were)."""
        aggregator = self.cfg.fl.aggregator
        if aggregator == "fedseca":
            if field is None:
                raise wire.WireError("bad_request", "this deployment aggregates with fedseca "
                                     "(fl.aggregator): an upload needs `threshold`, the client's share "
                                     f"of lambda_k (the {self.cfg.fl.fedseca_gamma:g}-quantile of its "
                                     "encoded |g|)")
            return wire.decode_share(field, "threshold", (), self.party)
        if field is not None:
            raise wire.WireError("bad_request", f"this deployment aggregates with {aggregator} "
                                 "(fl.aggregator) and takes no `threshold`")
        return None

    # ------------------------------------------------------------------ unlearning requests and jobs
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
        self._admit_request(who, f["job"])
        gone = sorted(t for t in targets if self.store.is_forgotten(t))
        if gone:
            raise wire.WireError("forgotten", f"clients {gone} are already forgotten")
        unknown = sorted(set(targets) - self._fl_clients())
        if unknown:
            raise wire.WireError("not_found", f"clients {unknown} took part in no committed round")
        rec = self.jobs.submit(who, targets, f["job"])
        self.rounds.wake()
        return {"job": rec.id, "state": rec.state}

    def _admit_request(self, who: str, job: str) -> None:
        """Refuse (``rate_limited``) a new request of ``who`` over its quotas; a replay of one of
        its requests is answered as before (idempotent).

        Three bounds (issue 25, finding 2): agreed jobs pending (``limits.max_pending_jobs``;
        admin 16), requests waiting for the other server (``MAX_REQUESTED``; they pause nothing,
        but each is a record), and, for a client, ``unlearning.request_cooldown`` seconds after a
        request of its ended without adoption (failed, expired at one server, cancelled), so that
        neither a cancelled job nor a stream of one-sided requests can be renewed at once.
        """
        mine = [j for j in self.store.jobs() if j.requester == who]
        if any(j.id == job for j in mine):   # a replay records nothing new
            return
        pending = [j.id for j in mine if j.state in PENDING]
        quota = job_quota(self.cfg, who)
        if len(pending) >= quota:
            raise wire.WireError("rate_limited", f"{who} has {len(pending)} unlearning jobs pending "
                                                 f"(at most {quota}): {pending}")
        waiting = [j.id for j in mine if j.state == JobState.REQUESTED]
        if len(waiting) >= MAX_REQUESTED:
            raise wire.WireError("rate_limited", f"{who} has {len(waiting)} unlearning requests that "
                                 f"the other server has not received yet (at most {MAX_REQUESTED}): "
                                 f"{waiting}; send them to both servers")
        cooldown = self.cfg.unlearning.request_cooldown
        if who != tls.ADMIN_NAME and cooldown > 0:
            ended = [j for j in mine if j.state in (JobState.FAILED, JobState.CANCELLED)
                     and not (j.error or "").startswith(SUPERSEDED)]
            last = max((j.updated_at for j in ended), default=None)
            if last is not None and time.time() < last + cooldown:
                raise wire.WireError("rate_limited", f"{who}'s last unlearning request ended without "
                                     f"adoption {time.time() - last:.0f} s ago; a new one is accepted "
                                     f"{cooldown:g} s after that (unlearning.request_cooldown)")

    @staticmethod
    def _job_dict(rec: JobRecord) -> dict:
        return {"job": rec.id, "requester": rec.requester, "targets": list(rec.targets),
                "state": rec.state, "progress": rec.progress, "error": rec.error,
                "attempts": rec.attempts, "created_at": rec.created_at, "updated_at": rec.updated_at}

    @staticmethod
    def _may_see(who: str, rec: JobRecord) -> bool:
        cid = wire.client_id_of(who)
        return who == tls.ADMIN_NAME or rec.requester == who or (cid is not None and cid in rec.targets)

    def _op_job_status(self, who: str, f: dict) -> dict:
        rec = self._visible_job(who, f["job"])
        out = self._job_dict(rec)
        erasure = self.store.erasure(rec.id)
        if erasure is not None:
            out["erasure"] = erasure.to_json()       # this server's own confirmation
        if rec.receipt is not None:
            out["receipt"] = dict(rec.receipt)        # both servers' confirmations
        if rec.state in (JobState.COMPUTED, JobState.DONE) and rec.result_path:
            summary, model = read_result(rec.result_path)
            out["result"] = {k: summary[k] for k in RESULT_FIELDS if k in summary}
            if f.get("with_model"):
                out["model"] = wire.tensor(model)
        return out

    def _visible_job(self, who: str, job: str) -> JobRecord:
        """The job, if ``who`` may see it; one answer for "absent" and "not yours", so a
        client cannot learn which job ids exist."""
        try:
            rec = self.store.job(job)
        except KeyError:
            rec = None
        if rec is None or not self._may_see(who, rec):
            raise wire.WireError("not_found", f"no unlearning job {job!r} visible to {who}")
        return rec

    def _op_cancel_job(self, who: str, f: dict) -> dict:
        rec = self._visible_job(who, f["job"])
        rec = self.jobs.cancel(rec.id, who)
        self.rounds.wake()
        return {"job": rec.id, "state": rec.state,
                "note": "the run stops at its next round" if rec.state == JobState.RUNNING else ""}

    def _op_staged(self, who: str, f: dict) -> dict:
        r = self.store.num_rounds + 1
        sizes = self.state.sizes(r)
        rows = [{**row, "num_samples": sizes.get(row["client"])} for row in self.store.staged_summary(r)]
        return {"round": r, "uploads": rows}

    def _op_drop_staged(self, who: str, f: dict) -> dict:
        r = self.store.num_rounds + 1
        dropped = self.store.drop_staged(r, f["client"])
        if not dropped:
            raise wire.WireError("not_found", f"client {f['client']} has no upload staged for round {r}")
        log.warning("%s dropped the staged upload of client %d for round %d", who, f["client"], r)
        return {"round": r, "dropped": list(dropped)}

    def _op_reenrol(self, who: str, f: dict) -> dict:
        try:
            self.store.reenrol(f["client"], who)
        except KeyError:
            raise wire.WireError("not_found", f"client {f['client']} is not forgotten") from None
        return {"client": f["client"], "reenrolled": True}

    # ------------------------------------------------------------------ correction tasks
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
