"""The replay's folded rounds with the divergence guard and an absent client, in 2PC and in the
clear (tests/protocols/starfish/test_folded_rounds_2pc.py; importable by the party processes).

Both sides replay every round with the same schedule (warm-up, then estimated rounds that no
check reads: two-party mode folds them), a guard that is made to fire in every estimated round
(a public decision, forced here so that the test does not hang on how large an estimate grows),
and a clients port that never answers for ``absent``: the redone round then needs the absent
client's own estimate, which a folded round had not formed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from protocols.starfish.replay import Replay


class FoldEverything:
    """Exact updates while a buffer is not full; after that no estimate is read."""

    def exact_now(self, step, round_index, replay):
        return not replay.buffers.all_full(replay.present)

    def reads_estimates(self, step, round_index, replay):
        return False

    def rejected(self, step, round_index, estimates, replay):
        return []


class AlwaysDiverging(Replay):
    def _diverging(self, aggregate: torch.Tensor) -> bool:
        return True


class WithoutAnswer:
    """A CorrectionClients port that stops answering for ``absent`` from round ``since`` on (the
    warm-up before it fills the client's buffer); the others answer as ``inner`` does."""

    def __init__(self, inner: Any, absent: int, since: int) -> None:
        self.inner, self.absent, self.since = inner, absent, since

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Any]:
        asked = [j for j in client_ids if j != self.absent or round_index < self.since]
        return self.inner.exact_updates(round_index, model, asked) if asked else {}


def replay_all(history, rest: list[int], clients: Any) -> dict:
    replay = AlwaysDiverging(history, rest, clients, buffer=2, server_lr=history.server_lr, guard=1.0)
    schedule = FoldEverything()
    for t in range(1, history.num_rounds + 1):
        replay.replay_round(t, schedule)
    return {"model": replay.model.double().numpy(), "guard_steps": replay.guard_steps,
            "absent": replay.absent_answers, "exact": replay.exact_requests}


def secure_program(party, both_rounds, lab_args: dict, client_key: bytes, m0, server_lr: float,
                   rest: list[int], absent: int, since: int) -> dict:
    from bench.secure_lab import SimulatedShareClients
    from lab.experiment import build_setup
    from servers.secure.share_history import ShareHistory
    from servers.store.share_store import ClientShares, ShareStore

    setup = build_setup(argparse.Namespace(**{**lab_args, "device": "cpu"}))
    with tempfile.TemporaryDirectory(prefix="starfish-folded-") as tmp:
        store = ShareStore(Path(tmp) / f"server{party.rank}", party=party.rank, initial_model=m0,
                           server_lr=server_lr)
        for i, rnd in enumerate(both_rounds[party.rank], 1):
            store.append_round(i, rnd["model"], rnd["participants"], rnd["weights"],
                               {j: ClientShares(*v) for j, v in rnd["shares"].items()})
        history = ShareHistory(store, wrap=party.wrap_share)
        clients = WithoutAnswer(SimulatedShareClients(party, setup.participants, client_key, setup.trainer), absent, since)
        out = replay_all(history, rest, clients)
        store.close()
    return out
