"""``starfish server --party 0|1``: one of the two non-colluding servers, as a daemon.

What it runs (docs/design.md 3 and 4.4), each part in its own module:

* the client API (``servers.daemon.client_api``): ``common.wire`` messages over mutually
  authenticated TLS 1.3 from the FL clients and the operator;
* the FL rounds (``servers.daemon.round_coordinator``): server 0 leads (``round_leader``), server 1
  follows (``round_follower``), over the control link to the other server
  (``servers.daemon.peer_link``, messages ``servers.daemon.peer_messages``);
* unlearning jobs (``servers.daemon.job_scheduler``): server 0 starts a job only when server 1 holds
  the same request, then both run Stage II in a fresh 2PC session (``servers.secure.unlearning_jobs``)
  with the correction tasks of ``servers.secure.correction_tasks``.

This module builds them around one history store (``servers.store.share_store``) and sidecar
(``servers.daemon.service_state``), and runs them until :meth:`ServerDaemon.stop`.

Restart: the history store is reopened (committed rounds, staged uploads, forgotten clients),
the sidecar restores nonces and reported data sizes, jobs that were running are re-queued
(their next run gets a new attempt number) and an adoption that committed just before the
stop is recorded as done. Nothing else is needed to resume.

Crash-test seam: ``STARFISH_CRASH_AT=name[:n]`` (``servers.store.crash_points``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import numpy as np

from net import tls
from net.ca import write_private
from net.channel import listen
from net.listening import ListenError
from common.service_config import ServiceConfig

from servers.daemon.client_api import ClientAPI
from servers.secure.correction_tasks import TaskBoard
from servers.store.crash_points import checkpoint, install_crash_points
from servers.daemon.job_scheduler import JobScheduler
from servers.daemon.peer_link import PeerClient, PeerServer
from servers.daemon.peer_messages import (
    AdoptJob,
    AggregateRound,
    CheckRound,
    CloseRobustRound,
    CloseRound,
    GetState,
    JobAgree,
    JobFail,
    JobReceipt,
    JobStart,
    PeerState,
    parse_request,
)
from servers.daemon.round_coordinator import RoundCoordinator
from servers.daemon.round_follower import RoundFollower
from servers.daemon.round_leader import RoundLeader
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore
from servers.workers.server_workers import ServerWorkers, missing_worker_keys
from servers.workers.worker_group import ray_missing_message

__all__ = ["ServerDaemon", "StartupError", "install_crash_points", "checkpoint"]

log = logging.getLogger("starfish.server")

#: seconds between two probes of the dealer's port
PROBE_INTERVAL = 2.0
#: seconds a stop waits for the daemon's threads in all
SHUTDOWN_WAIT = 3.0


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message says what, where and what to do."""


class _WatchedPeer(PeerClient):
    """Server 0's control link, remembering whether its last call reached server 1 (``status``)."""

    reached = False                   # did the last call reach server 1
    last_error = "not contacted yet"
    last_state: dict | None = None    # server 1's last answer to GetState (its staged uploads)

    def call(self, request):  # type: ignore[override]
        try:
            reply = super().call(request)
        except Exception as exc:
            self.reached, self.last_error = False, str(exc)
            raise
        self.reached = True
        if isinstance(request, GetState):
            self.last_state = reply
        return reply


class ServerDaemon:
    """One server process; ``serve_forever()`` until ``stop()`` (or SIGTERM in the CLI)."""

    def __init__(self, cfg: ServiceConfig, party: int, initial_model: np.ndarray,
                 model_info: dict | None = None) -> None:
        """``initial_model``: M_0 as drawn from ``cfg.model`` (``clients.initial_model``); a
        restarted server must pass the same one (its store refuses another). ``model_info``:
        the model's architecture and parameter layout (``clients.initial_model.model_layout``),
        published in ``state`` so that a client needs no copy of the config to train."""
        self.cfg = cfg
        self.party = party
        self.name = tls.PARTY_NAMES[party]
        for problem in tls.check_key_dir(cfg.keys_dir):   # raises tls.KeyDirError if ca.key is there
            log.warning("%s", problem)
        self.data_dir = cfg.data_dir(party)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        api_ctx = tls.server_context(tls.identity(cfg.keys_dir, self.name))
        # with workers, the store's update shares live in the workers' shard directories: the
        # workers come first (the store's open sweeps what a crash left there)
        self.workers = self._workers(int(np.asarray(initial_model).size))
        try:
            self.store = ShareStore(self.data_dir / "store", party=party,
                                    initial_model=initial_model,
                                    server_lr=cfg.fl.server_lr, precision=cfg.fl.precision,
                                    shards=self.workers.files() if self.workers is not None else None)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            raise
        self.state = ServiceState(self.data_dir / "service.sqlite3")
        self.board = TaskBoard()
        self.stop_event = threading.Event()
        me = cfg.server(party)
        self._api_listener = self._listen("api_port", me.api_port)
        self._peer_listener: socket.socket | None = None
        self._mpc_listener: socket.socket | None = None
        self.peer: _WatchedPeer | None = None
        self._peer_seen = 0.0          # server 1: when server 0 last asked something
        self._dealer_up: bool | None = None
        self._left_out: dict[int, str] = {}
        if party == 1:
            # a burst of strangers must not fill the kernel's queue before admission sees them
            self._peer_listener = self._listen("peer_port", me.peer_port)
            self._mpc_listener = self._listen("mpc_port", me.mpc_port)
        else:
            self.peer = _WatchedPeer(cfg.keys_dir, cfg.server1.peer().address,
                                     timeout=cfg.limits.peer_timeout, max_bytes=cfg.limits.max_frame_bytes)
        self.rounds: RoundCoordinator = (
            RoundLeader(cfg, self.store, self.state, peer=self.peer, stop=self.stop_event, workers=self.workers)
            if self.peer is not None else
            RoundFollower(cfg, self.store, self.state, stop=self.stop_event, mpc_listener=self._mpc_listener,
                          workers=self.workers))
        self.jobs = JobScheduler(cfg, party, self.store, self.state, self.board,
                                 results_dir=self.data_dir / "results",
                                 mpc_listener=self._mpc_listener, peer=self.peer, stop=self.stop_event,
                                 workers=self.workers)
        self.jobs.requeue_interrupted()
        self.api = ClientAPI(cfg, party, self._api_listener, api_ctx, store=self.store, state=self.state,
                             board=self.board, rounds=self.rounds, jobs=self.jobs, stop=self.stop_event,
                             health=self.health, published=self._published(model_info))
        log.info("%s: history with %d committed rounds, %d staged uploads for round %d",
                 self.name, self.store.num_rounds, len(self.store.staged(self.store.num_rounds + 1)),
                 self.store.num_rounds + 1)

    def _workers(self, dim: int) -> ServerWorkers | None:
        """``[deployment] workers`` > 1: this server's workers (started by ``serve_forever``)."""
        if self.cfg.workers == 1:
            return None
        missing = missing_worker_keys(self.cfg, self.party)
        if missing:
            raise StartupError(
                f"{self.name}: [deployment] workers = {self.cfg.workers} in {self.cfg.path}, but "
                f"{self.cfg.keys_dir} has no certificate for {', '.join(missing)}: issue them with "
                f"`starfish keys issue --name {missing[0]}` (one per worker) or set workers = 1")
        try:
            import ray  # noqa: F401, PLC0415 - only to fail at start, not at the first round
        except ImportError:
            raise StartupError(f"{self.name}: {ray_missing_message()}") from None
        workers = ServerWorkers(self.cfg, self.party, dim)
        try:
            workers.connect()     # here, in the main thread (``connect_cluster`` says why)
        except Exception as exc:  # noqa: BLE001 - one line: what, where, what to do
            where = f"ray_address = {self.cfg.ray_address!r}" if self.cfg.ray_address else "a local cluster"
            raise StartupError(f"{self.name}: cannot reach its Ray cluster ({where}, [deployment] in "
                               f"{self.cfg.path}): {str(exc).splitlines()[0][:300]}; start the cluster "
                               "(`ray start --head` on this server's machines) or fix the address") from None
        return workers

    def _start_workers(self) -> None:
        """Start the workers now rather than at the first round (a failure is logged; each round
        tries again)."""
        try:
            assert self.workers is not None
            self.workers.ensure()
        except Exception as exc:  # noqa: BLE001 - the round's attempt reports it again
            log.warning("%s: the workers did not start: %s", self.name, str(exc).splitlines()[0][:300])

    def _listen(self, key: str, port: int) -> socket.socket:
        host = self.cfg.server(self.party).host
        try:
            return listen(host, port, backlog=128)
        except ListenError as exc:
            raise StartupError(
                f"{self.name}: {exc} ([{self.name}] {key} = {port} in {self.cfg.path}); stop the "
                f"process that holds it (`ss -ltnp 'sport = :{port}'` names it) or choose another "
                f"port in the config") from None

    def _published(self, model_info: dict | None) -> dict:
        """What ``state`` adds for clients: the parameters of their upload (docs/protocol.md)."""
        out: dict = {"alpha": self.cfg.unlearning.alpha, "aggregator": self.cfg.fl.aggregator}
        if self.cfg.fl.aggregator == "fedseca":
            out["fedseca_gamma"] = self.cfg.fl.fedseca_gamma
        if model_info is not None:
            out["model"] = model_info
        return out

    # ------------------------------------------------------------------ what it waits for
    def _needs_dealer(self) -> bool:
        return self.cfg.offline == "dealer"

    def waiting_for(self) -> list[str]:
        """What this daemon waits for now, one phrase each (``status``, the start-up line)."""
        out = []
        now = time.monotonic()
        if self.party == 0:
            assert self.peer is not None
            if not self.peer.reached:
                out.append(f"server 1 at {self.cfg.server1.host}:{self.cfg.server1.peer_port} "
                           f"(control link; {self.peer.last_error}): start `starfish server --party 1`")
        # the leader asks every 50 ms, but not while it runs a round's 2PC session: only a
        # silence longer than its own request timeout means server 0 is gone
        elif not self._peer_seen or now - self._peer_seen > self.cfg.limits.peer_timeout:
            out.append(f"server 0 to connect to the control link on port {self.cfg.server1.peer_port}: "
                       f"start `starfish server --party 0`")
        if self._needs_dealer() and not self._dealer_up:
            d = self.cfg.dealer
            out.append(f"the dealer at {d.host}:{d.port} ([dealer] in {self.cfg.path}): FL rounds "
                       f"(range check) and unlearning jobs need it: start `starfish dealer --config "
                       f"{self.cfg.path}`")
        return out

    def health(self) -> dict:
        """What ``status`` adds: what this daemon waits for, why clients are left out of the open round."""
        out = {"waiting_for": self.waiting_for(),
               "left_out": {str(j): why for j, why in sorted(self._left_out.items())}}
        if self.workers is not None:
            out["workers"] = self.workers.state()
        return out

    def _one_sided(self) -> dict[int, str]:
        """Server 0: the clients of the open round that the round cannot take, and why.

        A round takes only clients staged at both servers with the same |D_j|
        (``RoundCoordinator``); the others used to be dropped without a word.
        """
        view = self.peer.last_state if self.peer is not None else None
        if view is None:
            return {}
        r = self.store.num_rounds + 1
        peer = PeerState.from_wire(view)
        if peer.T != r - 1:
            return {}
        mine, theirs = self.state.sizes(r), dict(peer.staged)
        out = {}
        for j in sorted(set(mine) | set(theirs)):
            if j not in theirs:
                out[j] = f"its upload for round {r} reached server 0 only: it must upload to server 1 too"
            elif j not in mine:
                out[j] = f"its upload for round {r} reached server 1 only: it must upload to server 0 too"
            elif mine[j] != theirs[j]:
                out[j] = (f"it reported num_samples {mine[j]} to server 0 and {theirs[j]} to server 1 "
                          f"for round {r}: both uploads must report the same |D_j|")
        return out

    def _watch_rounds(self) -> None:
        """Server 0: log (once) each client the open round cannot take, and name it again if the
        round commits without it; ``status`` shows the current list."""
        seen: dict[tuple[int, int], float] = {}
        logged: set[tuple[int, int, str]] = set()
        T = self.store.num_rounds
        while not self.stop_event.wait(0.5):
            try:
                now, T_now = time.monotonic(), self.store.num_rounds
                if T_now != T:       # the round committed: who was left out of it
                    parts = set(self.store.participants(T_now)) if T_now == T + 1 else set()
                    for j, why in self._left_out.items():
                        if j not in parts:
                            log.warning("round %d committed without client %d: %s", T + 1, j, why)
                    self._left_out, seen, T = {}, {}, T_now
                    continue
                current = self._one_sided()
                for j, why in current.items():
                    first = seen.setdefault((T + 1, j), now)
                    # an upload on its way to the second server is one-sided for milliseconds
                    if now - first >= 2.0 and (T + 1, j, why) not in logged:
                        logged.add((T + 1, j, why))
                        log.warning("round %d: client %d is not taken: %s", T + 1, j, why)
                self._left_out = {j: why for j, why in current.items()
                                  if now - seen[(T + 1, j)] >= 2.0}
            except Exception as exc:  # noqa: BLE001 - a store closing at shutdown; bookkeeping only
                log.debug("round watch: %s", exc)

    def _probe_dealer(self) -> None:
        """Watch the dealer's port (dealer mode): a line when it goes away or comes back.

        Why a probe: a session connects to the dealer only when a round closes or a job runs;
        without it a missing dealer showed only as a round that never closed.
        """
        addr = (self.cfg.dealer.host, self.cfg.dealer.port)
        while not self.stop_event.is_set():
            try:
                socket.create_connection(addr, timeout=1.0).close()
                up = True
            except OSError:
                up = False
            if up != self._dealer_up:
                if up:
                    log.info("%s: the dealer at %s:%d answers", self.name, *addr)
                elif self._dealer_up is not None:
                    log.warning("%s: the dealer at %s:%d stopped answering; FL rounds and unlearning "
                                "jobs wait for it (start `starfish dealer --config %s`)", self.name,
                                *addr, self.cfg.path)
                self._dealer_up = up
            self.stop_event.wait(PROBE_INTERVAL)

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        threads = [threading.Thread(target=self.api.serve_forever, name="api", daemon=True)]
        if self._needs_dealer():
            threads.append(threading.Thread(target=self._probe_dealer, name="dealer-probe", daemon=True))
        if self.party == 1:
            assert self._peer_listener is not None
            peer = PeerServer(self.cfg.keys_dir, self._peer_listener, self._answer_peer,
                              timeout=self.cfg.limits.peer_timeout,
                              max_bytes=self.cfg.limits.max_frame_bytes, stop=self.stop_event,
                              handshake_timeout=self.cfg.limits.handshake_timeout)
            threads.append(threading.Thread(target=peer.serve_forever, name="peer", daemon=True))
        else:
            assert isinstance(self.rounds, RoundLeader)
            threads.append(threading.Thread(target=self.rounds.lead_forever, args=(self.jobs,),
                                            name="leader", daemon=True))
            threads.append(threading.Thread(target=self._watch_rounds, name="round-watch", daemon=True))
        if self.workers is not None:
            threads.append(threading.Thread(target=self._start_workers, name="workers-start", daemon=True))
        for t in threads:
            t.start()
        write_private(self.data_dir / "ready.json", json.dumps({"pid": os.getpid(), "party": self.party}).encode())
        log.info("%s ready: client API on %s:%d", self.name, *self._api_listener.getsockname()[:2])
        self.stop_event.wait(0.3)   # the first probes; a peer already up is not reported as awaited
        for what in self.waiting_for():
            log.info("%s waits for %s", self.name, what)
        try:
            while not self.stop_event.wait(0.5):
                pass
        finally:
            self._shutdown(threads)

    def stop(self) -> None:
        self.stop_event.set()
        self.rounds.wake()

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        for s in (self._api_listener, self._peer_listener, self._mpc_listener):
            if s is not None:
                s.close()
        if self.peer is not None:
            self.peer.close()
        # one deadline for all, not 5 s each (a stop took 7.5 s): a thread inside a 2PC session
        # does not notice the stop until its peer or its own timeout ends the session
        deadline = time.monotonic() + SHUTDOWN_WAIT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.jobs.join(max(0.0, deadline - time.monotonic()))
        if self.workers is not None:
            self.workers.shutdown()
        busy = [t.name for t in threading.enumerate()
                if t.name.startswith(("check-", "aggregate-", "job"))] \
            + [t.name for t in threads if t.is_alive()]
        if busy:
            # closing the store under them made them log StoreClosedError after "stopped"; the
            # store is crash-safe (docs/share_store.md), so the process may end with it open
            log.info("%s stopped (%s still inside a session; the store recovers at the next start)",
                     self.name, ", ".join(sorted(set(busy))))
            return
        self.state.close()
        self.store.close()
        log.info("%s stopped", self.name)

    # ------------------------------------------------------------------ server 1: control requests
    def _answer_peer(self, op: str, msg: dict) -> dict:
        """Server 1's answer to one control request of the leader (reply fields)."""
        self._peer_seen = time.monotonic()
        req = parse_request(op, msg, self.store.dim)
        rounds = self.rounds
        assert isinstance(rounds, RoundFollower)
        if isinstance(req, GetState):
            return rounds.peer_state(self.jobs.rows(), self.jobs.running).to_wire()
        if isinstance(req, CloseRound):
            return rounds.follow_close(req).to_wire()
        if isinstance(req, CheckRound):
            return rounds.follow_check(req).to_wire()
        if isinstance(req, AggregateRound):
            rounds.follow_aggregate(req)
            return {}
        if isinstance(req, CloseRobustRound):
            return rounds.follow_close_robust(req).to_wire()
        if isinstance(req, JobAgree):
            self.jobs.follow_agree(req)
        elif isinstance(req, JobStart):
            self.jobs.follow_start(req)
        elif isinstance(req, JobFail):
            self.jobs.follow_fail(req)
        elif isinstance(req, AdoptJob):
            return self.jobs.follow_adopt(req).to_wire()
        elif isinstance(req, JobReceipt):
            self.jobs.follow_receipt(req)
        return {}
