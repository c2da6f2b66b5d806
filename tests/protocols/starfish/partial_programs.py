"""Histories with partial participation, erased clients and unlearning rounds, for the tests of
Stage II on them; and the party program that runs Stage II on such a history's shares.

Module-level (the party processes of the ``pair`` fixture import it by name):

* :class:`ToyClient`: a client whose local update on M is the gradient of a closed-form,
  separable, convex loss, g(M) = a * (M - c) + b * tanh(M - c) (a, c per coordinate; b >= 0:
  not quadratic, yet Lipschitz with constant a + b, so FedAvg at step eta < 2 / (a + b) stays put),
  times the local epochs asked for (1 by default);
  deterministic, so the plaintext run and both server processes compute the same exact updates;
* :func:`build_history`: FedAvg on given participation (the round's FedAvg weights from the
  participants' sizes), with unlearning rounds (no participants, a given model) where asked;
* :func:`split_rounds`: per round the public part and both parties' ring shares of every
  update, norm and threshold (shares made here with a numpy generator: a test, not a privacy
  setting: both parties receive both share sets and keep their own);
* :func:`stage2_on_shares`: ``run_stage2`` in a party on its shares, exact updates of the toy
  clients split as ``bench.secure_lab.SimulatedShareClients`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common import encoding
from protocols.starfish.ports import History, RoundRecord, Secret
from lab.history import InMemoryHistory
from tests.helpers.toy_clients import ToyUpdate


@dataclass
class ToyClient:
    """g(M) = a (M - c) + b tanh(M - c), elementwise; ``alpha``: delta is the value a fraction
    alpha of |g| exceeds (the clients' convention); ``delta_override`` fixes it per round."""

    client_id: int
    center: np.ndarray
    scale: np.ndarray
    bend: float = 0.0
    num_samples: int = 1
    alpha: float = 0.4
    delta_override: Mapping[int, float] | None = None

    def gradient(self, model: np.ndarray) -> np.ndarray:
        d = np.asarray(model, dtype=np.float64) - self.center
        return self.scale * d + self.bend * np.tanh(d)

    def train(self, model_vec: torch.Tensor, round_idx: int, epochs: float | None = None) -> ToyUpdate:
        # ``epochs`` local epochs of one gradient step each (FedEraser's calibration asks for 0.5)
        g = (1.0 if epochs is None else epochs) * self.gradient(torch.as_tensor(model_vec).double().numpy())
        if self.delta_override is not None and round_idx in self.delta_override:
            delta = float(self.delta_override[round_idx])
        else:
            delta = float(np.quantile(np.abs(g), 1.0 - self.alpha))
        return ToyUpdate(torch.from_numpy(g), float(np.linalg.norm(g)), delta, self.num_samples)


def build_history(clients: Sequence[ToyClient], pattern: Sequence[Sequence[int]], m0: np.ndarray,
                  server_lr: float, unlearned: Mapping[int, np.ndarray] | None = None) -> InMemoryHistory:
    """FL with ``pattern[t-1]`` the participants of round t; an empty entry is an unlearning round
    whose model is ``unlearned[t]`` (FL continues from it)."""
    by_id = {c.client_id: c for c in clients}
    hist = InMemoryHistory(torch.from_numpy(np.asarray(m0, dtype=np.float64)), server_lr)
    model = np.asarray(m0, dtype=np.float64)
    for t, parts in enumerate(pattern, 1):
        parts = tuple(sorted(parts))
        if not parts:
            model = np.asarray(unlearned[t], dtype=np.float64)
            hist.append_round(RoundRecord(torch.from_numpy(model.copy()), (), {}, {}, {}, {}))
            continue
        total = sum(by_id[j].num_samples for j in parts)
        weights = {j: by_id[j].num_samples / total for j in parts}
        ups = {j: by_id[j].train(torch.from_numpy(model), t) for j in parts}
        step = sum(weights[j] * ups[j].update.numpy() for j in parts)
        model = model - server_lr * step
        hist.append_round(RoundRecord(
            torch.from_numpy(model.copy()), parts, weights, {j: ups[j].update for j in parts},
            {j: torch.tensor(ups[j].norm, dtype=torch.float64) for j in parts},
            {j: torch.tensor(ups[j].delta, dtype=torch.float64) for j in parts}))
    return hist


def _split(x: Any, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ring = encoding.encode(np.asarray(x, dtype=np.float64))
    share0 = gen.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=ring.shape,
                          dtype=np.int64, endpoint=True)
    share0 = np.asarray(share0, dtype=np.int64)
    with np.errstate(over="ignore"):
        return share0, np.asarray(ring - share0, dtype=np.int64)   # 0-d arrays, not numpy scalars


def split_rounds(history: History, seed: int = 0) -> list[dict]:
    """Per round: model, participants, weights and {client: ((up0, nm0, dl0), (up1, nm1, dl1))}."""
    gen = np.random.default_rng(seed)
    out = []
    for i in range(1, history.num_rounds + 1):
        shares = {}
        for j in history.participants(i):
            up = _split(torch.as_tensor(history.update(i, j)).double().numpy(), gen)
            nm = _split(float(history.norm(i, j)), gen)
            dl = _split(float(history.delta(i, j)), gen)
            shares[j] = ((up[0], nm[0], dl[0]), (up[1], nm[1], dl[1]))
        out.append({"model": history.model(i).double().numpy(), "participants": tuple(history.participants(i)),
                    "weights": dict(history.weights(i)), "shares": shares})
    return out


class MemoryShareHistory(History):
    """One party's shares of a history, in RAM, as CrypTen tensors (``wrap``)."""

    def __init__(self, m0: np.ndarray, server_lr: float, rounds: list[dict], rank: int, wrap) -> None:
        self._models = [torch.from_numpy(np.asarray(m0, dtype=np.float64))]
        self._models += [torch.from_numpy(r["model"]) for r in rounds]
        self._rounds = rounds
        self._rank = rank
        self._wrap = wrap
        self._lr = server_lr

    @property
    def num_rounds(self) -> int:
        return len(self._rounds)

    @property
    def server_lr(self) -> float:
        return self._lr

    def model(self, i: int) -> torch.Tensor:
        return self._models[i]

    def participants(self, i: int) -> tuple[int, ...]:
        return tuple(self._rounds[i - 1]["participants"])

    def weights(self, i: int) -> Mapping[int, float]:
        return self._rounds[i - 1]["weights"]

    def _mine(self, i: int, j: int, k: int) -> Secret:
        return self._wrap(self._rounds[i - 1]["shares"][j][self._rank][k])

    def update(self, i: int, client: int) -> Secret:
        return self._mine(i, client, 0)

    def norm(self, i: int, client: int) -> Secret:
        return self._mine(i, client, 1)

    def delta(self, i: int, client: int) -> Secret:
        return self._mine(i, client, 2)

    def append_round(self, record: RoundRecord) -> None:
        raise TypeError("read-only")


def stage2_on_shares(party, m0: np.ndarray, server_lr: float, rounds: list[dict], targets: list[int],
                     params, clients: list[ToyClient], key: bytes, hidden: Sequence[int] = (),
                     shards: int = 0, block: int | None = None) -> dict:
    """``run_stage2`` on this party's shares (``hidden``: erased clients, ``without_clients``);
    ``shards`` = K > 0: on K coordinate slices (``tests.helpers.shard_slices``), the values on
    them as a server's workers would hold them (``protocols.starfish.on_shards``), computed
    ``block`` values at a time (default ``shard_steps.BLOCK``)."""
    from bench.secure_lab import SimulatedShareClients
    from protocols.starfish import run_stage2
    from protocols.starfish.on_shards import ShardClients, ShardHistory, ShardSpace
    from protocols.starfish.ports import without_clients
    from tests.helpers.shard_slices import SliceShards

    torch.set_num_threads(1)
    hist: History = MemoryShareHistory(m0, server_lr, rounds, party.rank, party.wrap_share)
    if hidden:
        hist = without_clients(hist, hidden)
    clients_port = SimulatedShareClients(party, clients, key)
    held = None
    if shards:
        slices = SliceShards(party, len(m0), shards)
        space = ShardSpace(slices, len(m0)) if block is None else ShardSpace(slices, len(m0), block)
        hist, clients_port = ShardHistory(hist, space), ShardClients(clients_port, space)
    res = run_stage2(party, hist, targets, params, clients_port)
    if shards:
        del hist, clients_port
        space.close()
        held = slices.held()
    return {"held_after": held, "model": res.model.double().numpy(), "selected_rounds": res.selected_rounds,
            "candidate_rounds": res.candidate_rounds, "flags": res.flags,
            "exact_requests": res.exact_requests, "warmup_steps": res.warmup_steps,
            "estimated_updates": res.estimated_updates}


def shard_exceed_counts(party, x_shares: tuple, d_shares: tuple, k: int, block: int) -> tuple[np.ndarray, bool]:
    """SecTC's counts (``shard_steps.counts_program``) on ``k`` coordinate slices of this party's
    share of x (rows, m) with one threshold per row, both at 16 fractional bits; each slice's
    count shares added as a coordinator adds them (mod 2**32 where they are the two-party
    engine's), then opened; and whether they were the engine's."""
    from protocols.starfish import shard_steps as steps
    from protocols.starfish.threshold_check import session_engine
    from tests.helpers.shard_slices import SliceShards

    x, d = x_shares[party.rank], d_shares[party.rank]
    slices = SliceShards(party, x.shape[-1], k)
    slices.scatter("x", x)
    refs = [("x", r) for r in range(x.shape[0])]
    parts = slices.run(steps.counts_program, refs, 16, (d, 16), block)
    engine = bool(parts[0][1])
    if engine:
        with np.errstate(over="ignore"):
            total = np.sum(np.stack([c for c, _ in parts]).astype(np.uint32), axis=0, dtype=np.uint32)
        opened = session_engine().open_public(total.view(np.int32)).astype(np.int64) if total.size else total
        return np.asarray(opened, dtype=np.int64), engine
    total = np.sum(np.stack([c for c, _ in parts]), axis=0, dtype=np.int64)
    return (steps.wrap(total, 0).get_plain_text().numpy() if total.size else total), engine


def estimates_on_slices(party, Y: np.ndarray, S: np.ndarray, v: np.ndarray, stored: np.ndarray, coef: tuple,
                        k: int) -> dict:
    """UE's products (``shard_steps.hvp_apply_program``) on ``k`` coordinate slices, twice with the
    same Y (as a replay's consecutive estimates), beside the unsharded ``hvp_apply`` with an
    ordinary product; each opened as ring values (2F bits, no truncation anywhere). Also each
    sharded call's online bytes, and the shares the slices keep once every name is dropped."""
    from mpc.crypten_compat import crypten
    from protocols import backend as B
    from protocols.starfish import shard_steps as steps
    from protocols.starfish.update_estimation import HvpCoefficients, hvp_apply
    from tests.helpers.shard_slices import SliceShards

    def share(x):
        return crypten.cryptensor(torch.as_tensor(x, dtype=torch.float64), src=0)

    def online() -> int:
        t = party.meters()["total"]
        return t.get("online_bytes_sent", 0) + t.get("online_bytes_received", 0)

    n, m, b = Y.shape
    slices = SliceShards(party, m, k)
    Ys, gs = share(Y), share(stored)
    for j in range(n):
        for c in range(b):
            slices.scatter(f"y{j}.{c}", Ys[j, :, c].share.numpy())
            slices.scatter(f"s{j}.{c}", np.ascontiguousarray(S[j, :, c], dtype=np.float64).view(np.int64))
    slices.scatter("v", np.ascontiguousarray(v, dtype=np.float64).view(np.int64))
    slices.scatter("g", gs.share.numpy())
    cs = HvpCoefficients(*(share(x) for x in coef))
    y_refs = [("cols", [(f"y{j}.{c}", None) for c in range(b)]) for j in range(n)]
    s_names = [[f"s{j}.{c}" for c in range(b)] for j in range(n)]
    out = {"bytes": [], "sharded": []}
    for r in range(2):
        before = online()
        bits = slices.run(steps.hvp_apply_program, f"e{r}", y_refs, B.bits_of(Ys), [("g", j) for j in range(n)],
                          B.bits_of(gs), [steps.share_of(x) for x in (cs.sigma, cs.sigma_z1, cs.z2)], s_names,
                          "v")[0]
        out["bytes"].append(online() - before)
        out["sharded"].append(np.concatenate([steps.wrap(slot.share(f"e{r}"), bits).reveal().numpy()
                                              for slot in slices.slots], axis=-1))
    hv = hvp_apply(torch.as_tensor(S), Ys, torch.as_tensor(v), cs)
    out["whole"] = (hv + B.lift(gs, B.bits_of(hv))).reveal().numpy()
    out["masks_kept"] = sum(key.startswith("y") and "#mask" in key for key in slices.slots[0].shares)
    slices.drop([f"y{j}.{c}" for j in range(n) for c in range(b)] + ["e0", "e1"])
    out["y_left"] = sum(key.startswith("y") for slot in slices.slots for key in slot.shares)
    return out
