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

import numpy as np

from net import tls
from net.ca import write_private
from net.channel import listen
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
    JobFail,
    JobReceipt,
    JobStart,
    parse_request,
)
from servers.daemon.round_coordinator import RoundCoordinator
from servers.daemon.round_follower import RoundFollower
from servers.daemon.round_leader import RoundLeader
from servers.daemon.service_state import ServiceState
from servers.store.share_store import ShareStore

__all__ = ["ServerDaemon", "install_crash_points", "checkpoint"]

log = logging.getLogger("starfish.server")


class ServerDaemon:
    """One server process; ``serve_forever()`` until ``stop()`` (or SIGTERM in the CLI)."""

    def __init__(self, cfg: ServiceConfig, party: int, initial_model: np.ndarray) -> None:
        """``initial_model``: M_0 as drawn from ``cfg.model`` (``clients.initial_model``); a
        restarted server must pass the same one (its store refuses another)."""
        self.cfg = cfg
        self.party = party
        self.name = tls.PARTY_NAMES[party]
        for problem in tls.check_key_dir(cfg.keys_dir):   # raises tls.KeyDirError if ca.key is there
            log.warning("%s", problem)
        self.data_dir = cfg.data_dir(party)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        api_ctx = tls.server_context(tls.identity(cfg.keys_dir, self.name))
        self.store = ShareStore(self.data_dir / "store", party=party,
                                initial_model=initial_model,
                                server_lr=cfg.fl.server_lr, precision=cfg.fl.precision)
        self.state = ServiceState(self.data_dir / "service.sqlite3")
        self.board = TaskBoard()
        self.stop_event = threading.Event()
        me = cfg.server(party)
        self._api_listener = listen(me.host, me.api_port, backlog=128)
        self._peer_listener: socket.socket | None = None
        self._mpc_listener: socket.socket | None = None
        self.peer: PeerClient | None = None
        if party == 1:
            # a burst of strangers must not fill the kernel's queue before admission sees them
            self._peer_listener = listen(me.host, me.peer_port, backlog=128)
            self._mpc_listener = listen(me.host, me.mpc_port, backlog=128)
        else:
            self.peer = PeerClient(cfg.keys_dir, cfg.server1.peer().address,
                                   timeout=cfg.limits.peer_timeout, max_bytes=cfg.limits.max_frame_bytes)
        self.rounds: RoundCoordinator = (
            RoundLeader(cfg, self.store, self.state, peer=self.peer, stop=self.stop_event)
            if self.peer is not None else
            RoundFollower(cfg, self.store, self.state, stop=self.stop_event, mpc_listener=self._mpc_listener))
        self.jobs = JobScheduler(cfg, party, self.store, self.state, self.board,
                                 results_dir=self.data_dir / "results",
                                 mpc_listener=self._mpc_listener, peer=self.peer, stop=self.stop_event)
        self.jobs.requeue_interrupted()
        self.api = ClientAPI(cfg, party, self._api_listener, api_ctx, store=self.store, state=self.state,
                             board=self.board, rounds=self.rounds, jobs=self.jobs, stop=self.stop_event)
        log.info("%s: history with %d committed rounds, %d staged uploads for round %d",
                 self.name, self.store.num_rounds, len(self.store.staged(self.store.num_rounds + 1)),
                 self.store.num_rounds + 1)

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        threads = [threading.Thread(target=self.api.serve_forever, name="api", daemon=True)]
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
        for t in threads:
            t.start()
        write_private(self.data_dir / "ready.json", json.dumps({"pid": os.getpid(), "party": self.party}).encode())
        log.info("%s ready: client API on %s:%d", self.name, *self._api_listener.getsockname()[:2])
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
        for t in threads:
            t.join(5)
        self.jobs.join(5)
        self.state.close()
        self.store.close()
        log.info("%s stopped", self.name)

    # ------------------------------------------------------------------ server 1: control requests
    def _answer_peer(self, op: str, msg: dict) -> dict:
        """Server 1's answer to one control request of the leader (reply fields)."""
        req = parse_request(op, msg, self.store.dim)
        rounds = self.rounds
        assert isinstance(rounds, RoundFollower)
        if isinstance(req, GetState):
            return rounds.peer_state(self.jobs.rows(), self.jobs.running).to_wire()
        if isinstance(req, CloseRound):
            return rounds.follow_close(req).to_wire()
        if isinstance(req, CheckRound):
            rounds.follow_check(req)
            return {}
        if isinstance(req, AggregateRound):
            rounds.follow_aggregate(req)
            return {}
        if isinstance(req, CloseRobustRound):
            return rounds.follow_close_robust(req).to_wire()
        if isinstance(req, JobStart):
            self.jobs.follow_start(req)
        elif isinstance(req, JobFail):
            self.jobs.follow_fail(req)
        elif isinstance(req, AdoptJob):
            return self.jobs.follow_adopt(req).to_wire()
        elif isinstance(req, JobReceipt):
            self.jobs.follow_receipt(req)
        return {}
