"""The lab's Starfish run under 2PC: the same Stage II on the two servers' shares.

Why a harness: to show that the secure path equals its plaintext twin, the lab's FL
history is split into additive shares exactly as clients would upload them (updates, norms
and thresholds encoded in fixed point, share 0 from a CSPRNG), each share set is written to
that server's durable ShareStore in its own process, and ``protocols.starfish.run_stage2``
runs on both under ``mpc.launcher.run_parties`` (TLS, dealer). Each server only ever receives its
own shares (``party_args``).

Simulation shortcut, for this harness only: the remaining clients that Stage II asks for
exact updates are simulated *inside both server processes* (the same deterministic local
training), and their fresh updates are split with a PRG key both simulated copies know.
So here each server process could compute those fresh updates in the clear. The service
(``starfish server`` with real or simulated client processes) has clients upload shares
instead; this harness measures the servers' 2PC cost and checks equality, nothing else.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import encoding
from mpc.launcher import run_parties
from net.channel import NO_LINK
from common.prg import Prg, new_seed
from common.sharing import share
from protocols.starfish import StarfishParams, run_stage2
from protocols.starfish.ports import History
from servers.secure.share_history import ShareHistory
from servers.store.share_store import ClientShares, ShareStore

from . import progress
from lab.experiment import build_setup

NORM_DELTA_PRECISION = encoding.DEFAULT_PRECISION


def split_history(history: History) -> tuple[list[dict], list[dict]]:
    """Per round and party: public model/participants/weights and that party's shares."""
    per_party: tuple[list[dict], list[dict]] = ([], [])
    for i in range(1, history.num_rounds + 1):
        parts = history.participants(i)
        rows: tuple[dict, dict] = ({}, {})
        for j in parts:
            up = share(torch.as_tensor(history.update(i, j)).double().numpy())
            nm = share(np.asarray(float(history.norm(i, j))))
            dl = share(np.asarray(float(history.delta(i, j))))
            rows[0][j] = (up.share0, nm.share0, dl.share0)
            rows[1][j] = (up.share1, nm.share1, dl.share1)
        for r in (0, 1):
            per_party[r].append({"model": history.model(i).double().numpy(), "participants": list(parts),
                                 "weights": dict(history.weights(i)), "shares": rows[r]})
    return per_party


class SimulatedShareClients:
    """CorrectionClients for the harness: train in the clear, hand this party its share."""

    def __init__(self, party, participants: list, key: bytes, trainer: Any = None):
        self._party = party
        self._by_id = {p.client_id: p for p in participants}
        self._key = key
        self._trainer = trainer    # the lab's ClientTrainer: a correction's clients trained together
        self._requests = 0
        self.computations: dict[int, int] = {}

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Any]:
        asked = [self._by_id[j] for j in client_ids]
        if self._trainer is not None:
            ups = self._trainer.train(asked, model, round_index)
        else:
            ups = {p.client_id: p.train(model, round_index) for p in asked}
        out = {}
        for j in client_ids:     # shares drawn in the request order, the same in both parties
            g = ups[j].update
            ring = encoding.encode(torch.as_tensor(g).double().numpy())
            share0 = Prg(self._key, self._requests).ring(ring.shape)
            self._requests += 1
            mine = share0 if self._party.rank == 0 else ring - share0
            out[j] = self._party.wrap_share(mine)
            self.computations[j] = self.computations.get(j, 0) + 1
        return out


def _server(party, lab_args: dict, targets: list[int], params: StarfishParams, store_root: str,
            client_key: bytes, m0: np.ndarray, server_lr: float, my_rounds: list[dict],
            bar: progress.PartyBar | None = None) -> dict:
    """One server: store its shares durably, then run Stage II on them under 2PC."""
    torch.set_num_threads(1)
    # the 2PC path never changes device: the simulated clients train on the CPU here
    setup = build_setup(argparse.Namespace(**{**lab_args, "device": "cpu"}))
    root = Path(store_root) / f"server{party.rank}"
    with party.meter("load"):
        store = ShareStore(root, party=party.rank, initial_model=m0, server_lr=server_lr)
        for i, rnd in enumerate(my_rounds, 1):
            store.append_round(i, rnd["model"], rnd["participants"], rnd["weights"],
                               {j: ClientShares(*v) for j, v in rnd["shares"].items()})
        history = ShareHistory(store, wrap=party.wrap_share)
    clients = SimulatedShareClients(party, setup.participants, client_key, setup.trainer)
    with (bar or progress.PartyBar("starfish (2PC)")).open(unit="round") as shown:
        res = run_stage2(party, history, targets, params, clients, progress=progress.callback(shown))
    store.close()
    out = res.to_json()
    out["model"] = res.model.double().numpy()
    out["meters"] = res.meters
    out["client_computations"] = clients.computations
    return out


def _server_of_pair(party, both_rounds: tuple[list[dict], list[dict]], *args: Any) -> dict:
    """``_server`` on a :class:`mpc.party_pair.PartyPair`, which hands both parties the same
    arguments: each takes its own share of the history."""
    return _server(party, *args, my_rounds=both_rounds[party.rank])


def run_secure_starfish(lab_args: argparse.Namespace, history: History, targets: list[int],
                        params: StarfishParams, link=None, timeout: float = 1800.0,
                        offline: str = "dealer", quiet: bool = True, pair: Any = None) -> dict:
    """Stage II under 2PC on ``history``; returns both servers' outcomes. ``link``: the emulated
    link of the server link and the dealer link (the lab's ``--profile``); ``offline``: "dealer"
    or "two-party" (no dealer, ``mpc/spu_engine.py``); ``quiet=False``: server 0 shows the
    replayed rounds on stderr (when it is a terminal). ``pair``: run on this live
    :class:`mpc.party_pair.PartyPair` instead of new processes (``link``, ``timeout`` and
    ``offline`` are then the pair's; property tests run many Stage IIs on one pair, whose parties
    keep the lab's data loaded between them)."""
    shares0, shares1 = split_history(history)
    args = {k: v for k, v in vars(lab_args).items() if k != "func"}
    if pair is not None:
        with tempfile.TemporaryDirectory(prefix="starfish-secure-lab-") as tmp:
            values = pair.call(_server_of_pair, (shares0, shares1), args, targets, params, tmp, new_seed(),
                               history.model(0).double().numpy(), float(history.server_lr))
        return {"values": values, "seconds": None}
    (bar0,), (bar1,) = progress.party_args("starfish (2PC)", quiet)
    with tempfile.TemporaryDirectory(prefix="starfish-secure-lab-") as tmp:
        res = run_parties(
            _server, args, targets, params, tmp, new_seed(), history.model(0).double().numpy(),
            float(history.server_lr), party_args=((shares0, bar0), (shares1, bar1)), link=link or NO_LINK,
            dealer_link=link or NO_LINK, timeout=timeout, offline=offline,
        )
    return {"values": res.values, "seconds": res.seconds}


def step_table(meters: list[dict], offline: str = "dealer") -> list[dict]:
    """Per step: rounds, online bytes (both directions), offline bytes (dealer mode: both
    servers' dealer links; two-party mode: the correlations made on the one server link, server
    0's count, both directions), seconds."""
    offline_parties = (0,) if offline == "two-party" else (0, 1)
    rows = []
    names = [n for n in ("load", "TD", "RS", "UE", "TC", "correction", "pairs", "aggregate") if n in meters[0]["steps"]]
    for name in names:
        a, b = meters[0]["steps"][name], meters[1]["steps"][name]
        rows.append({
            "step": name,
            "rounds": a["online_rounds"],
            "online_bytes": a["online_bytes_sent"] + a["online_bytes_received"],
            "offline_bytes": sum(r["offline_bytes_sent"] + r["offline_bytes_received"]
                                 for r in ((a, b)[p] for p in offline_parties)),
            "seconds": max(a["seconds"], b["seconds"]),
            "calls": a["calls"],
        })
    return rows


__all__ = ["split_history", "SimulatedShareClients", "run_secure_starfish", "step_table"]
