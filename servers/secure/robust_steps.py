"""From the aggregate a robust round opened to the next model: the step rules, in the clear.

Why a module of its own: after a robustly aggregated round's 2PC session
(``servers.secure.robust_session``) both servers hold the same public D-vector, FedSECA's g_tilde or
BRACE's +-1 vote, and each must turn it into the *same* M_i, bit for bit, so that the
digest agreement of the round close holds; and the lab's plaintext rules
(``lab.aggregators``) must be the same rules, so the service's models equal the
plaintext twin's. This module is that turn; it is plain float64 arithmetic in a fixed order.

* ``fedseca``: d_i = beta d_{i-1} + (1 - beta) g_tilde_i (server momentum, FedSECA eq. 11,
  ``protocols.robust_aggregation.momentum``), M_i = M_{i-1} - eta d_i, as the lab's
  ``FedSECA``. The buffer d_{i-1} is not kept anywhere: it is (M_{i-2} - M_{i-1}) / eta, read
  from the committed models, so it survives every restart and both servers read the same
  value (it differs from the float64 buffer of an uninterrupted run by rounding only,
  ~1e-16 relative). It starts from zero when round i-1 is not a FedSECA FL round: round 1,
  the round after an unlearning round (the adopted model is no momentum step), or after
  rounds of another aggregator.
* ``brace-sign``: d_i = scale / t**decay * vote with t the FL round's number (unlearning
  rounds do not count; ``common.robust_rules.brace_step_scale``), and the vote's lambda =
  brace_lambda K / 100 for the round's K voters (the lab's default: BRACE's 5 of 100).

Every value that fixes the step goes into the round's public metadata (:func:`robust_model`),
so a reader of the history knows how each model was made, and Stage II replays each round with
the rule that made it (:func:`replay_rule`, ``protocols.starfish.robust_replay``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.robust_rules import brace_lambda, brace_step_scale
from common.service_config import FLSection
from protocols.robust_aggregation import momentum
from protocols.starfish.robust_replay import FEDAVG, RoundRule

from servers.secure.ring_aggregation import next_model
from servers.store.share_store import ShareStore

__all__ = ["brace_vote_lambda", "momentum_buffer", "robust_model", "replay_rule"]


def brace_vote_lambda(fl: FLSection, voters: int) -> float:
    """BRACE's lambda for a round of ``voters`` clients: ``brace_lambda`` per 100 clients."""
    return brace_lambda(fl.brace_lambda, voters)


def momentum_buffer(store: ShareStore, r: int) -> np.ndarray | None:
    """FedSECA's d_{r-1} from the committed models, or None (a zero buffer)."""
    prev = r - 1
    if prev < 1 or store.round_kind(prev) != "fl" or \
            store.metadata(prev).get("aggregator") != "fedseca":
        return None
    return (store.model(prev - 1) - store.model(prev)) / store.server_lr


def robust_model(fl: FLSection, store: ShareStore, r: int, opened: np.ndarray,
                 voters: int) -> tuple[np.ndarray, dict[str, Any]]:
    """M_r from the opened aggregate of round ``r`` (the open round) and its public metadata.

    ``voters``: the K clients whose shares entered the aggregate.
    """
    if r != store.num_rounds + 1:
        raise ValueError(f"round {r} is not the open round {store.num_rounds + 1}")
    opened = np.asarray(opened, dtype=np.float64)
    if opened.shape != (store.dim,):
        raise ValueError(f"the opened aggregate has shape {opened.shape}, the model ({store.dim},)")
    meta: dict[str, Any] = {"aggregator": fl.aggregator}
    if fl.aggregator == "fedseca":
        prev = momentum_buffer(store, r)
        direction = momentum(None if prev is None else torch.from_numpy(prev),
                             torch.from_numpy(opened), beta=fl.fedseca_beta).numpy()
        meta["rule"] = {"gamma": fl.fedseca_gamma, "beta": fl.fedseca_beta,
                        "momentum": "restarted" if prev is None else "continued"}
    elif fl.aggregator == "brace-sign":
        t = store.fl_rounds + 1
        scale = brace_step_scale(t, fl.brace_scale, fl.brace_decay)
        direction = scale * opened
        meta["rule"] = {"lambda": brace_vote_lambda(fl, voters), "lambda_per_100": fl.brace_lambda,
                        "scale": fl.brace_scale,
                        "decay": fl.brace_decay, "t": t, "step": scale}
    else:
        raise ValueError(f"{fl.aggregator!r} is not a robust aggregator")
    return next_model(store.model(r - 1), direction, store.server_lr), meta


def replay_rule(fl: FLSection, metadata: dict[str, Any]) -> RoundRule:
    """How Stage II replays a round: the rule its metadata says made it (FedAvg without one).

    BRACE: the FL round's step (``rule.step``) and its lambda per 100 voters (rounds committed
    before it was recorded: the deployment's ``brace_lambda``), applied to the replay's voters.
    FedSECA: gamma and beta of the round, and whether its momentum restarted in FL.
    """
    name = metadata.get("aggregator", "fedavg")
    rule = metadata.get("rule") or {}
    if name == "brace-sign":
        return RoundRule("brace-sign", step=float(rule["step"]),
                         lam_per_100=float(rule.get("lambda_per_100", fl.brace_lambda)))
    if name == "fedseca":
        return RoundRule("fedseca", gamma=float(rule["gamma"]), beta=float(rule["beta"]),
                         restart=rule.get("momentum") == "restarted")
    if name != "fedavg":
        raise ValueError(f"round made by unknown aggregator {name!r}")
    return FEDAVG
