"""The range check of a round's uploads, run by both servers in a 2PC session before it closes.

Why: the servers never see an upload, so a client can send shares of any ring element (2**62
per coordinate blew the model up to 2.1e13, issue 14). Before a round is aggregated, both
servers open a fresh 2PC session (ticket ``round:<r>:check``; server 1 accepts on
``mpc_port``, both use the dealer) and run ``protocols.upload_range.uploads_in_range`` on the
staged shares of the round's participants: coordinates, norm and delta in their windows,
and the norm consistent with the update. One bit per client is opened; a client whose bit
is 0 is left out of the round (both servers hold the same bits), its upload is dropped and
the round's public metadata lists it under ``refused``. Rounds and unlearning jobs never
overlap (FL waits while a job is pending), so the two never compete for ``mpc_port`` or
CrypTen's process-wide communicator.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence
from typing import Any

from common.service_config import ServiceConfig
from mpc.session import open_party, session_source
from protocols.backend import stack
from protocols.upload_range import uploads_in_range

from servers.secure import dealer_plans
from servers.store.share_store import ShareStore

__all__ = ["check_round_uploads", "open_round_session", "check_task_answers", "ANSWER_NORM_FACTOR"]

#: An exact update a client sends for a correction task may have a norm of at most this many
#: times the largest norm the client reported for its own rounds (docs/service.md, "Correction
#: answers"): an honest update on the recovered model is of the size of the client's updates in
#: FL; the factor leaves room for M_hat being less trained than M_(t-1).
ANSWER_NORM_FACTOR = 2


def _digest(parts: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, parts)).encode()).hexdigest()[:16]


def open_round_session(rank: int, cfg: ServiceConfig, round_no: int, step: str,
                       participants: Sequence[int], mpc_listener: socket.socket | None) -> Any:
    """This server's end of a 2PC session of the open round (server 1 accepts on ``mpc_port``).

    The ticket ``round:<r>:<step>:<digest of the participants>`` keeps each step's session apart
    and makes the two servers meet only when they agree on who is in the round.
    """
    return open_party(
        rank, cfg.keys_dir,
        peer_listener=mpc_listener if rank == 1 else None,
        peer_address=cfg.server1.mpc().address if rank == 0 else None,
        **session_source(cfg),
        timeout=cfg.limits.peer_timeout,
        ticket=f"round:{round_no}:{step}:{_digest(participants)}".encode(),
    )


def check_round_uploads(rank: int, cfg: ServiceConfig, store: ShareStore, round_no: int,
                        participants: Sequence[int], mpc_listener: socket.socket | None) -> list[int]:
    """The participants whose staged upload for ``round_no`` is in range (same on both servers)."""
    parts = list(participants)
    if not parts:
        return []
    party = open_round_session(rank, cfg, round_no, "check", parts, mpc_listener)
    try:
        prec = store.precision
        ups = [store.staged_upload(round_no, j) for j in parts]
        # the requests depend on these public values only (servers/secure/dealer_plans.py)
        plans = store.root / dealer_plans.PLANS_DIR
        with dealer_plans.fetched_ahead(party, f"check:{len(parts)}:{store.dim}:{prec}", plans), party.meter("range"):
            bits = uploads_in_range(
                party,
                stack([party.wrap_share(u.update, precision=prec) for u in ups]),
                stack([party.wrap_share(u.norm.reshape(1), precision=prec) for u in ups]).reshape(-1),
                stack([party.wrap_share(u.delta.reshape(1), precision=prec) for u in ups]).reshape(-1),
                precision=prec)
    finally:
        party.close()
    return [j for j, ok in zip(parts, bits) if ok]


def check_task_answers(answers: Any, norm_bounds: Any, precision: int) -> list[bool]:
    """One bit per correction-task answer, inside the job's running 2PC session (same on both
    servers): every coordinate in the upload window (|g| < 1024) and ||g|| at most
    ``norm_bounds`` (1 + 2**-10) + 16 units, by the range check of uploads
    (``protocols.upload_range.uploads_in_range``) with the bound in place of a reported norm.

    ``answers``: (n, d) shares; ``norm_bounds``: (n,) shares, or None for the window test only.
    Why before Stage II reads them: an answer becomes the client's exact update at full weight
    (issue 25: 512 per coordinate moved the adopted model's largest weight from 1.59 to 222.6;
    2**62 crashed both servers). Not metered on its own (``party=None``): its bytes count in the
    job's ``correction`` step.
    """
    return uploads_in_range(None, answers, norm_bounds, None, consistency=norm_bounds is not None,
                            precision=precision)
