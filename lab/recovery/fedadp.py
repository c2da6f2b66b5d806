"""FedADP (Jiang et al., "Efficient Federated Unlearning with Adaptive Differential Privacy
Preservation") in plaintext: DP-noised stored updates, dual selection, projection calibration.

Stage I (the paper's Alg. 1), simulated on the lab's recorded history:

* adaptive budget (eq. 4): eps_1 = eps_0, eps_{t+1} = min(max(eps_t e^{|L(M_{t-1}) - L(M_t)|},
  eps_min), eps_max), L the FedAvg-weighted training loss of the clients;
* clipping and noise (eq. 5, 6): g~ = g / max(1, ||g|| / S) + N(0, (z_t S)^2 I) with the
  noise multiplier z_t = sqrt(2 ln(1.25/delta)) / eps_t. The paper prints the std as
  sigma_t S with sigma_t = S sqrt(2 ln(1.25/delta)) / eps_t, which counts S twice (the noise
  would scale with S^2); the classical Gaussian mechanism it cites is std = Delta *
  sqrt(2 ln(1.25/delta)) / eps with Delta = S, which is what is used;
* global-model selection: d_t = ReLU(cos(M_t, M_{t-1})) (eq. 7, 8). Rounds are gathered in a
  stage until L(M_t) <= (1 - beta) L(end of previous stage); then the ceil(lambda n) rounds of
  the stage's n with the least d_t are stored (ties: earlier round). Alg. 1 never updates
  prev_loss, which would make every round after the first drop a stage of its own; we update
  it at each stage end, and the rounds after the last drop form a final stage;
* update selection, in each stored round: s_j = cos(g~_t^j, G_t) with G_t the FedAvg
  aggregate of the noised updates (eq. 9); the ceil(gamma n_t) clients with the highest s_j are
  stored (ties: smaller client id). Targets are selected like anyone: the selection happens
  during FL, before anyone asks to be forgotten.

Stage II (Alg. 2): from M_0, for each stored round t in order, every stored client of t that
remains trains on the current model (round t's batches) and sends g^; the server calibrates
the stored update onto it (eq. 10, 11),

    U^j = cos(theta) ||g_bar|| / ||g^|| g^ = (<g_bar, g^> / ||g^||^2) g^,

the projection of the stored update on the fresh direction (only one dimension of the stored
noise survives it), aggregates U = sum_j |D_j| U^j / sum_j |D_j| over those clients (eq. 12)
and steps M^ <- M^ - eta U. Alg. 2 starts from "the first stored model M_bar_0"; we start
from M_0, because any later model carries the targets' updates. A stored round without a
remaining stored client is skipped (no step).

Without DP (``dp=False``, the paper's "FedADP without DP") there is no clipping and no
noise; with lambda = gamma = 1 the method is then the deterministic replay

    M^ <- M^ - eta sum_{j remaining in t} w_j (<g_t^j, g^_t^j> / ||g^_t^j||^2) g^_t^j,  t = 1..T,

w_j the FedAvg weights renormalised over the remaining participants of round t.

Lab deviations, all forced by one shared non-private FL history for every method: the
recorded global models come from un-noised updates (in the paper the FL itself runs on the
noised ones), so only the stored updates carry the noise; and the Stage I bookkeeping runs
inside ``unlearn`` (its time is ``cost.extra["stage1_time_s"]``, part of ``wall_time_s``).
The losses L(M_t) are what clients would report during FL: a participant's
``training_loss(model_vec)`` if it has one, else the mean cross-entropy on its own ``x``,
``y`` with its ``model_factory`` (the lab's clients), or a ``loss_fn`` given to the method.

Privacy accounting (``lab.dp_accounting``): each client releases one noised update per
FL round it takes part in (the server sees all of them, stored or not), a Gaussian mechanism
with ratio sensitivity / z_t; their exact composition gives epsilon at ``delta``.
``adjacency="replace"`` (default) bounds the change of a clipped update by 2S (any record of
the client changed); ``"zero-out"`` by S (the paper's calibration: a neighbour zeroes the
update). Not covered: the fresh unlearning updates (Alg. 2 sends them un-noised), the
clipping norm when it is derived from the data (the default median), and the loss-driven
schedule, which reads the clients' data outside the mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from protocols.starfish.params import ceil_rate
from protocols.starfish.ports import History

from lab import dp_accounting
from lab.fl import Participant, ProgressFn
from lab.recovery.base import ClientPool, CostRecord, RecoveryMethod, Timer, data_on_device, remaining_clients

__all__ = ["FedADP", "ADJACENCY", "budget_schedule", "classical_multiplier", "clip_update",
           "cosine", "noise", "project", "reported_loss", "select_rounds", "select_updates",
           "stages"]

#: L2 sensitivity of a clipped update, in units of the clipping norm S, per neighbouring notion.
ADJACENCY = {"replace": 2.0, "zero-out": 1.0}


def classical_multiplier(epsilon: float, delta: float) -> float:
    """z = sqrt(2 ln(1.25/delta)) / epsilon: noise std over sensitivity (paper eq. 6)."""
    if not epsilon > 0.0:
        raise ValueError(f"epsilon must be positive, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def budget_schedule(losses: Sequence[float], eps0: float, eps_min: float,
                    eps_max: float) -> list[float]:
    """eps_1..eps_T from the losses L(M_0)..L(M_{T-1}) (paper eq. 4); eps_1 = eps_0 clamped."""
    if not 0.0 < eps_min <= eps_max:
        raise ValueError(f"need 0 < eps_min <= eps_max, got {eps_min}, {eps_max}")
    if not eps0 > 0.0:
        raise ValueError(f"eps0 must be positive, got {eps0}")
    eps = min(max(eps0, eps_min), eps_max)
    out = []
    for k in range(len(losses)):
        if k > 0:
            eps = min(max(eps * math.exp(abs(losses[k - 1] - losses[k])), eps_min), eps_max)
        out.append(eps)
    return out


def clip_update(g: torch.Tensor, clip: float) -> torch.Tensor:
    """g / max(1, ||g|| / S)."""
    if not clip > 0.0:
        raise ValueError(f"clipping norm must be positive, got {clip}")
    return g / max(1.0, float(g.norm()) / clip)


def noise(seed: int, round_idx: int, client: int, size: int) -> torch.Tensor:
    """Standard normal vector of client ``client`` in round ``round_idx`` (float64).

    One generator per (seed, round, client), as if each client drew its own: a client's noise
    does not depend on who else took part, and any stored update can be regenerated.
    """
    rng = np.random.default_rng([int(seed), int(round_idx), int(client)])
    return torch.from_numpy(rng.standard_normal(size))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """<a, b> / (||a|| ||b||), and 0 when either vector is zero (no direction to agree with)."""
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a.reshape(-1), b.reshape(-1))) / (na * nb)


def project(stored: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Calibrated update (eq. 11): (<stored, fresh> / ||fresh||^2) fresh; zero if fresh is zero."""
    nn2 = float(torch.dot(fresh, fresh))
    if nn2 == 0.0:
        return torch.zeros_like(fresh)
    return fresh * (float(torch.dot(stored, fresh)) / nn2)


def stages(rounds: Sequence[int], losses: Mapping[int, float], initial_loss: float,
           beta: float) -> list[list[int]]:
    """Split ``rounds`` into stages: a stage ends at the first round t with
    L(M_t) <= (1 - beta) * (loss at the end of the previous stage, L(M_0) at first)."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    out: list[list[int]] = []
    current: list[int] = []
    prev = initial_loss
    for t in rounds:
        current.append(t)
        if losses[t] <= (1.0 - beta) * prev:
            out.append(current)
            current, prev = [], losses[t]
    if current:
        out.append(current)
    return out


def select_rounds(stage_list: Sequence[Sequence[int]], alignment: Mapping[int, float],
                  lam: float) -> list[int]:
    """Per stage, the ceil(lambda n) rounds with the least alignment d_t (ties: earlier), sorted."""
    if not 0.0 < lam <= 1.0:
        raise ValueError(f"lambda must be in (0, 1], got {lam}")
    chosen: list[int] = []
    for stage in stage_list:
        k = min(len(stage), ceil_rate(lam, len(stage)))
        chosen += sorted(stage, key=lambda t: (alignment[t], t))[:k]
    return sorted(chosen)


def select_updates(scores: Mapping[int, float], gamma: float) -> list[int]:
    """The ceil(gamma n) clients with the highest score (ties: smaller id), sorted."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    k = min(len(scores), ceil_rate(gamma, len(scores)))
    return sorted(sorted(scores, key=lambda j: (-scores[j], j))[:k])


def reported_loss(participant: Any, model_vec: torch.Tensor) -> float:
    """The training loss ``participant`` reports for ``model_vec`` (see the module docstring)."""
    fn = getattr(participant, "training_loss", None)
    if callable(fn):
        return float(fn(model_vec))
    x, y = getattr(participant, "x", None), getattr(participant, "y", None)
    factory = getattr(participant, "model_factory", None)
    if x is None or y is None or factory is None:
        raise ValueError(f"client {getattr(participant, 'client_id', '?')} reports no training "
                         "loss (no training_loss(), no x/y/model_factory); give FedADP a loss_fn")
    x, y, dev = data_on_device(participant)
    model = factory().to(dev)
    params = list(model.parameters())
    torch.nn.utils.vector_to_parameters(model_vec.detach().reshape(-1).to(dev, params[0].dtype), params)
    model.eval()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


class FedADP(RecoveryMethod):
    """FedADP's Stage I storage (adaptive DP, dual selection) and Stage II calibration."""

    name = "fedadp"

    def __init__(self, lam: float = 0.6, gamma: float = 0.7, beta: float = 0.1,
                 eps_max: float = 3.0, eps_min: float = 1.0, eps0: float | None = None,
                 delta: float = 1e-5, clip: float | None = None, adjacency: str = "replace",
                 dp: bool = True, seed: int = 0, server_lr: float | None = None,
                 loss_fn: Callable[[torch.Tensor], float] | None = None) -> None:
        """Paper defaults (Sec. VI-A, VI-B5): lambda 0.6, gamma 0.7, beta 0.1, eps_max 3.0.
        Not given by the paper (our choices): eps_min 1.0, eps0 = eps_min, delta 1e-5, and the
        clipping norm S (default: the median reported ||g|| over the history's updates)."""
        if not 0.0 < lam <= 1.0:
            raise ValueError(f"lambda must be in (0, 1], got {lam}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if not 0.0 < eps_min <= eps_max or math.isinf(eps_max):
            raise ValueError(f"need 0 < eps_min <= eps_max < inf, got {eps_min}, {eps_max}")
        if eps0 is not None and not eps0 > 0.0:
            raise ValueError(f"eps0 must be positive, got {eps0}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if clip is not None and not (clip > 0.0 and math.isfinite(clip)):
            raise ValueError(f"clipping norm must be positive and finite, got {clip}")
        if adjacency not in ADJACENCY:
            raise ValueError(f"adjacency must be one of {', '.join(ADJACENCY)}, got {adjacency!r}")
        if server_lr is not None and not server_lr > 0.0:
            raise ValueError(f"server_lr must be positive, got {server_lr}")
        self.lam, self.gamma, self.beta = lam, gamma, beta
        self.eps_max, self.eps_min = eps_max, eps_min
        self.eps0 = eps_min if eps0 is None else eps0
        self.delta, self.clip, self.adjacency = delta, clip, adjacency
        self.dp, self.seed, self.server_lr, self.loss_fn = dp, seed, server_lr, loss_fn

    # ---------------------------------------------------------------- Stage I pieces
    def losses(self, history: History, models: Sequence[int],
               participants: Sequence[Participant]) -> dict[int, float]:
        """L(M_t) for t in ``models``: sample-weighted over all the history's clients."""
        if self.loss_fn is not None:
            return {t: float(self.loss_fn(history.model(t))) for t in models}
        by_id = {p.client_id: p for p in participants}
        ids = list(history.clients())
        missing = [j for j in ids if j not in by_id]
        if missing:
            raise ValueError(f"no participant object for clients {missing} to report losses")
        sizes = {j: float(by_id[j].num_samples) for j in ids}
        total = sum(sizes.values())
        return {t: sum(sizes[j] / total * reported_loss(by_id[j], history.model(t)) for j in ids)
                for t in models}

    def clip_norm(self, history: History, rounds: Sequence[int]) -> float:
        """S: as given, else the median reported update norm over the history."""
        if self.clip is not None:
            return float(self.clip)
        norms = [float(history.norm(t, j)) for t in rounds for j in history.participants(t)]
        s = float(np.median(norms))
        if not s > 0.0:
            raise ValueError("every stored update is zero; give FedADP a clipping norm")
        return s

    def privatize(self, g: torch.Tensor, clip: float, multiplier: float, round_idx: int,
                  client: int) -> torch.Tensor:
        """The update client ``client`` sends in round ``round_idx`` (float64)."""
        g = torch.as_tensor(g).reshape(-1).to(torch.float64)
        if not self.dp:
            return g
        return clip_update(g, clip) + (multiplier * clip) * noise(self.seed, round_idx, client, g.numel())

    def stored_updates(self, history: History, t: int, clip: float,
                       multiplier: float) -> tuple[dict[int, torch.Tensor], dict[int, float]]:
        """Round t's stored (noised, selected) updates and every participant's alignment s_j."""
        parts = history.participants(t)
        weights = history.weights(t)
        noised = {j: self.privatize(history.update(t, j), clip, multiplier, t, j) for j in parts}
        agg = sum(float(weights[j]) * noised[j] for j in parts)
        scores = {j: cosine(noised[j], agg) for j in parts}
        return {j: noised[j] for j in select_updates(scores, self.gamma)}, scores

    # ---------------------------------------------------------------- the method
    def unlearn(self, history: History, targets: Sequence[int],
                participants: Sequence[Participant],
                progress: ProgressFn | None = None) -> tuple[torch.Tensor, CostRecord]:
        rest = remaining_clients(history, targets)
        rest_set = set(rest)
        pool = ClientPool(participants, rest, self.trainer)
        eta = self.server_lr if self.server_lr is not None else history.server_lr
        fl_rounds = [t for t in range(1, history.num_rounds + 1) if history.participants(t)]
        cost = CostRecord(self.name, history.num_rounds)
        with Timer() as timer:
            with Timer() as stage1:
                models = sorted({0, *fl_rounds, *(t - 1 for t in fl_rounds)})
                loss = self.losses(history, models, participants)
                # round t's budget follows the loss of the model it starts from, M_{t-1}
                eps = budget_schedule([loss[t - 1] for t in fl_rounds], self.eps0, self.eps_min,
                                      self.eps_max)
                mult = {t: (classical_multiplier(e, self.delta) if self.dp else 0.0)
                        for t, e in zip(fl_rounds, eps)}
                clip = self.clip_norm(history, fl_rounds) if self.dp else math.inf
                align = {t: max(0.0, cosine(history.model(t).double(), history.model(t - 1).double()))
                         for t in fl_rounds}
                stage_list = stages(fl_rounds, loss, loss[0], self.beta)
                stored = select_rounds(stage_list, align, self.lam)
            stage1_time = stage1.elapsed
            m0_dtype = history.model(0).dtype
            model = history.model(0).to(torch.float64).clone()
            kept: dict[int, list[int]] = {}
            used: list[int] = []
            for step, t in enumerate(stored, 1):
                with Timer() as sel:
                    keep, _ = self.stored_updates(history, t, clip, mult[t])
                stage1_time += sel.elapsed
                kept[t] = sorted(keep)
                here = [j for j in kept[t] if j in rest_set]
                if here:
                    sizes = {j: float(pool.num_samples(j)) for j in here}
                    total = sum(sizes.values())
                    agg = torch.zeros_like(model)
                    updates = pool.exact_many(here, model.to(m0_dtype), t)
                    for j in here:
                        fresh = updates[j].reshape(-1).to(torch.float64)
                        agg += (sizes[j] / total) * project(keep[j], fresh)
                    model = model - eta * agg
                    used.append(t)
                if progress is not None:
                    progress(step, len(stored), f"round {t}")
        cost.wall_time_s = timer.elapsed
        cost.rounds_used = len(used)
        cost.selected_rounds = used
        cost.extra.update(self._privacy(history, fl_rounds, mult))
        cost.extra.update({
            "dp": self.dp, "clip_norm": clip if self.dp else None,
            "clip_source": (None if not self.dp else
                            "given" if self.clip is not None else "median update norm"),
            "epsilon_per_round": eps, "noise_multipliers": [mult[t] for t in fl_rounds],
            "lambda": self.lam, "gamma": self.gamma, "beta": self.beta,
            "eps_min": self.eps_min, "eps_max": self.eps_max, "eps0": self.eps0,
            "seed": self.seed, "stages": [[s[0], s[-1]] for s in stage_list],
            "stored_rounds": stored, "stored_updates": {int(t): v for t, v in kept.items()},
            "stored_update_count": sum(len(v) for v in kept.values()),
            "losses": {t: loss[t] for t in models}, "stage1_time_s": stage1_time,
        })
        # the noised updates of the stored rounds, their models and M_0 (where Alg. 2 starts)
        n_updates = sum(len(v) for v in kept.values())
        n_models = len(stored) + 1
        cost.stored = {"rounds": len(stored), "updates": n_updates, "models": n_models,
                       "bytes": 4 * model.numel() * (n_updates + n_models)}
        pool.fill(cost)
        return model.to(m0_dtype), cost

    def _privacy(self, history: History, fl_rounds: Sequence[int],
                 mult: Mapping[int, float]) -> dict[str, Any]:
        """(epsilon, delta) of the worst-off client over all its noised releases."""
        if not self.dp:
            return {"epsilon": None, "delta": None, "epsilon_rdp": None, "mu": None,
                    "adjacency": None, "sensitivity": None}
        sens = ADJACENCY[self.adjacency]
        mu = max(dp_accounting.composed_mu([mult[t] for t in fl_rounds if j in history.participants(t)],
                                           sens)
                 for j in history.clients())
        return {"epsilon": dp_accounting.epsilon_for_delta(self.delta, mu), "delta": self.delta,
                "epsilon_rdp": dp_accounting.rdp_epsilon(self.delta, mu), "mu": mu,
                "adjacency": self.adjacency, "sensitivity": sens}
