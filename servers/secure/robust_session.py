"""The robust aggregation of a round's uploads: one 2PC session of both servers at round close.

Why: under ``[fl] aggregator = "fedseca" | "brace-sign"`` the next model is not the FedAvg sum
(which the servers open from their local share sums, ``servers.secure.ring_aggregation``) but a
Byzantine-robust rule, which needs comparisons on the shares. So, after the range check
(``servers.secure.round_checks``, the template of this module), both servers open a fresh 2PC session
(ticket ``round:<r>:aggregate:<digest of the participants>``; server 1 accepts on
``mpc_port``; correlated randomness from the dealer or made between the servers, as
``[deployment] offline`` says) and run on the staged shares of the round's participants:

* ``fedseca``: ``fedseca_checked`` on every participant's update and the lambda_k share it
  uploaded: one bit per client is opened (is lambda_k exactly the gamma-quantile of its
  |g_k|?), the clients whose bit is 0 are left out, FedSECA runs on the others' updates with
  their thresholds (the check and the rule share one call of sign tests), and the aggregate
  g_tilde (D values) is opened;
* ``brace-sign``: ``brace_sign`` on the participants' updates; the +-1 vote is opened.

With ``[deployment] workers`` > 1 the rule's coordinate-wise work runs on the workers' coordinate
shards: BRACE's vote entirely (``ServerWorkers.brace_vote``: each pair votes on its shard and
opens it); FedSECA's sign tests, elected signs, agreement, clamping and division per shard, its
three sums over coordinates (the check's counts, CRISE's S S^T, the norms) added at the
coordinators, which decide the verdict, CRISE's weights and the clip factors in the session
above (``ServerWorkers.fedseca_round``, ``protocols.fedseca_shards``); each pair opens its shard
of the aggregate.

Nothing else is opened (``protocols/robust_aggregation.py``, "What is opened"); both servers
get the same vector. The step rule that turns it into M_r is ``servers.secure.robust_steps``.
Rounds, range checks and unlearning jobs never overlap, so the sessions never compete for
``mpc_port`` or CrypTen's process-wide communicator.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from common.service_config import ServiceConfig
from protocols.backend import reveal, stack
from protocols.robust_aggregation import brace_sign, fedseca_checked

from servers.secure import dealer_plans
from servers.secure.robust_steps import brace_vote_lambda
from servers.secure.round_checks import open_round_session
from servers.store.share_store import ShareStore

__all__ = ["OpenedAggregate", "VoteWorkers", "aggregate_round_uploads", "aggregate_digest", "with_pairs"]


@dataclass(frozen=True)
class OpenedAggregate:
    """What a robust round's session opened: who entered the aggregate, whose threshold was
    wrong, the aggregate itself (None if no client was left), the session's meters, and how
    many dealer corrections came from the background fetch (``dealer_plans``)."""

    checked: tuple[int, ...]
    participants: tuple[int, ...]
    threshold_refused: tuple[int, ...]
    vector: np.ndarray | None
    meters: dict
    served_ahead: int = 0


class VoteWorkers(Protocol):
    """A server's workers as a robust round uses them (``servers.workers.server_workers.ServerWorkers``)."""

    def brace_vote(self, store: ShareStore, r: int, participants: Sequence[int], party: Any, ticket: bytes,
                   lam: float) -> tuple[np.ndarray, list[dict]]:
        """The round's opened vote, its shards voted by the worker pairs; the pairs' meters."""

    def fedseca_round(self, store: ShareStore, r: int, participants: Sequence[int], thresholds: Sequence[np.ndarray],
                      party: Any, ticket: bytes, gamma: float) -> tuple[list[bool], np.ndarray | None, list[dict]]:
        """FedSECA's checked round with its coordinate-wise work on the worker pairs' shards
        (``thresholds``: this server's shares of the claimed lambda_k): the verdict per
        participant, the opened aggregate of the kept (None if none), the pairs' meters."""


def aggregate_digest(vector: np.ndarray) -> str:
    """SHA-256 of the opened aggregate's float64 bytes (the servers compare it at the close)."""
    return hashlib.sha256(np.ascontiguousarray(vector, dtype="<f8").tobytes()).hexdigest()


def aggregate_round_uploads(rank: int, cfg: ServiceConfig, store: ShareStore, round_no: int,
                            participants: Sequence[int],
                            mpc_listener: socket.socket | None,
                            workers: VoteWorkers | None = None) -> OpenedAggregate:
    """Run this server's side of round ``round_no``'s robust aggregation (see the module doc);
    ``workers``: this server's ``ServerWorkers`` (BRACE's vote then runs on their shards)."""
    parts = list(participants)
    fl = cfg.fl
    if fl.aggregator not in ("fedseca", "brace-sign"):
        raise ValueError(f"{fl.aggregator!r} is not a robust aggregator")
    if not parts:
        raise ValueError("a robust aggregation needs at least one participant")
    lams = _staged_thresholds(store, round_no, parts) if fl.aggregator == "fedseca" else []
    party = open_round_session(rank, cfg, round_no, "aggregate", parts, mpc_listener)
    if workers is not None:
        try:
            ticket = f"round:{round_no}:{fl.aggregator}-shards:{party.extras['session_id']}".encode()
            if fl.aggregator == "brace-sign":
                vector, pairs = workers.brace_vote(store, round_no, parts, party, ticket,
                                                   brace_vote_lambda(fl, len(parts)))
                ok = [True] * len(parts)
            else:
                ok, vector, pairs = workers.fedseca_round(store, round_no, parts, lams, party, ticket,
                                                             fl.fedseca_gamma)
            meters = with_pairs(party.meters(), pairs)
        finally:
            party.close()
        return OpenedAggregate(tuple(parts), tuple(j for j, good in zip(parts, ok) if good),
                               tuple(j for j, good in zip(parts, ok) if not good),
                               None if vector is None else vector.astype(np.float64).reshape(-1), meters)
    try:
        prec = store.precision
        rows = [party.wrap_share(store.staged_upload(round_no, j).update, precision=prec) for j in parts]
        # the requests depend on these public values only (module doc of dealer_plans)
        plan_key = (f"aggregate:{fl.aggregator}:{len(parts)}:{store.dim}:{prec}:"
                    f"{fl.fedseca_gamma}:{brace_vote_lambda(fl, len(parts))}")
        with dealer_plans.fetched_ahead(party, plan_key, store.root / dealer_plans.PLANS_DIR):
            kept, vector = _aggregate(party, fl, parts, rows, lams, prec)
        meters = party.meters()
        served = party.served_ahead
    finally:
        party.close()
    return OpenedAggregate(tuple(parts), tuple(parts[k] for k in kept),
                           tuple(j for k, j in enumerate(parts) if k not in kept), vector, meters, served)


def _staged_thresholds(store: ShareStore, round_no: int, parts: Sequence[int]) -> list[np.ndarray]:
    """This server's shares of the participants' claimed lambda_k (FedSECA), each int64 of shape ()."""
    thresholds = [store.staged_threshold(round_no, j) for j in parts]
    missing = [j for j, t in zip(parts, thresholds) if t is None]
    if missing:
        # cannot happen through the client API, which requires the threshold here
        raise ValueError(f"round {round_no}: clients {missing} staged no threshold")
    return thresholds


def with_pairs(meters: dict, pairs: Sequence[dict]) -> dict:
    """A session's meters with its worker pairs' added to its totals (a round's cost): bytes add
    over the pairs; rounds and seconds add the slowest pair's, since the pairs run side by side."""
    total = dict(meters["total"])
    slowest: dict = {}
    for m in pairs:
        for k, v in m.get("total", {}).items():
            if not isinstance(v, (int, float)):
                continue
            if "bytes" in k:
                total[k] = total.get(k, 0) + v
            else:
                slowest[k] = max(slowest.get(k, 0), v)
    for k, v in slowest.items():
        total[k] = total.get(k, 0) + v
    return dict(meters, total=total, pairs=list(pairs))


def _aggregate(party, fl, parts: list[int], rows: list, thresholds: list[np.ndarray],
               prec: int) -> tuple[list[int], np.ndarray | None]:
    """The rule on the shares: (the kept participants' positions, the opened vector or None);
    ``thresholds``: this server's shares of FedSECA's claimed lambda_k (``_staged_thresholds``)."""
    kept = list(range(len(parts)))
    if fl.aggregator == "fedseca":
        lams = [party.wrap_share(t.reshape(1), precision=prec) for t in thresholds]
        with party.meter("aggregate"):
            ok, agg = fedseca_checked(stack(rows), stack(lams).reshape(-1),
                                      gamma=fl.fedseca_gamma, meter=party.meter)
        kept = [k for k, good in enumerate(ok.tolist()) if good]
    else:
        with party.meter("aggregate"):
            agg = brace_sign(stack(rows), lam=brace_vote_lambda(fl, len(parts)))
    if not kept:
        return kept, None
    with party.meter("open"):
        return kept, reveal(agg).numpy().astype(np.float64).reshape(-1)
