"""The plaintext comparisons of ``starfish demo``'s report, computed on the clients' twin history.

Why a module of its own: the demo runs the service and reads its results (``starfish.demo``); what
it sets them beside (Starfish replayed in the clear with the deployment's rule, retraining under
that rule, FedRecover, the FedAvg replay of a robust history, and the FL models against the rule
run in the clear on the decoded uploads) is lab work on the twin, not process handling.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from bench import progress
from clients.metrics import Evaluator
from clients.simulator import build_federation
from common.encoding import decode, encode
from common.service_config import BRACE_CLIENTS
from lab.aggregators import BraceSign, FedSECA, replay_rule
from lab.metrics import l2_distance
from lab.recovery import FedRecover, Retrain
from protocols.robust_aggregation import brace_sign
from protocols.starfish import run_stage2
from protocols.starfish.ports import History, history_prefix
from servers.secure.unlearning_jobs import starfish_params
from starfish.service_commands import federation_spec

__all__ = ["baselines", "lab_rule", "robust_twin_error", "sim_args"]


def baselines(cfg: Any, full: History, rounds: int, n: int, target: int, model_2pc: Any,
               quiet: bool = False, backdoor: str | None = None) -> tuple[list, dict]:
    """Plaintext retrain, FedRecover and Starfish on the twin of the history the job read
    (its first ``rounds`` rounds); metrics of every model and of the final M_T. With a robust
    rule, also Starfish's plaintext FedAvg replay of the same history."""

    spec = federation_spec(cfg, sim_args(n, backdoor or str(target)))
    fed = build_federation(spec)
    twin = history_prefix(full, rounds)
    tc = fed.clients[target]
    evaluate = Evaluator(fed.factory, fed.data.x_test, fed.data.y_test, tc.clean_x, tc.clean_y,
                         fed.trigger, spec.target_label)

    class _Plain:
        def exact_updates(self, r: int, model: torch.Tensor, ids: list[int]) -> dict:
            return {j: fed.clients[j].train(model, r).update.to(torch.float64) for j in ids}

    def bar(desc: str):
        return progress.progress(None, desc, quiet=quiet, unit="round", leave=False)

    t = time.perf_counter()
    with bar("Starfish, plaintext twin") as b:
        # the servers replay each round with the rule that made it; so does the twin
        plain = run_stage2(None, twin, [target], starfish_params(cfg), _Plain(), progress=progress.callback(b),
                           combine=replay_rule(lab_rule(cfg.fl)))
    t_plain = time.perf_counter() - t
    with bar("retrain, plaintext") as b:   # with the rule FL used: what FL without the target gives
        retrained, c_re = Retrain(aggregator=lab_rule(cfg.fl)).unlearn(twin, [target], fed.clients,
                                                                       progress=progress.callback(b))
    with bar("FedRecover, plaintext") as b:
        recovered, c_fr = FedRecover(buffer=cfg.unlearning.buffer, beta=cfg.unlearning.beta,
                                     warmup=cfg.unlearning.buffer).unlearn(twin, [target], fed.clients,
                                                                           progress=progress.callback(b))
    fedavg_replay = None
    if lab_rule(cfg.fl) is not None:
        with bar("Starfish, plaintext FedAvg replay") as b:
            fedavg_replay = run_stage2(None, twin, [target], starfish_params(cfg), _Plain(),
                                       progress=progress.callback(b)).model
    m2pc = torch.from_numpy(np.asarray(model_2pc))
    rows = [
        (f"M_{rounds} (with client {target})", twin.model(twin.num_rounds), float("nan")),
        ("Starfish, 2PC (the servers)", m2pc, None),
        ("Starfish, plaintext twin", plain.model, t_plain),
        *([("Starfish, FedAvg replay (plain)", fedavg_replay, float("nan"))] if fedavg_replay is not None else []),
        ("retrain, plaintext", retrained, c_re.wall_time_s),
        ("FedRecover, plaintext", recovered, c_fr.wall_time_s),
        (f"M_{full.num_rounds}: {full.num_rounds - rounds - 1} FL rounds later", full.model(full.num_rounds),
         float("nan")),
    ]
    table = []
    for name, model, secs in rows:
        m = evaluate(model.to(torch.float64))
        table.append((name, m["ter"], m["ba_asr"], l2_distance(model, retrained), secs))
    extra = {"plain_selected": plain.selected_rounds,
             "max_abs_2pc_vs_plain": float((m2pc - plain.model.to(torch.float64)).abs().max())}
    return table, extra


def lab_rule(fl: Any) -> FedSECA | BraceSign | None:
    """The lab's plaintext rule for the deployment's aggregator (None: FedAvg), for retraining.

    The lab's BRACE uses lambda = 5 K / 100 for K voters: the service's with the demo's default
    ``brace_lambda`` (5).
    """
    if fl.aggregator == "fedseca":
        return FedSECA(gamma=fl.fedseca_gamma, beta=fl.fedseca_beta)
    if fl.aggregator == "brace-sign":
        return BraceSign(lam=None, scale=fl.brace_scale, decay=fl.brace_decay)
    return None


def robust_twin_error(cfg: Any, twin: History) -> float:
    """Max |published M_i - M_{i-1} + eta d_i| over the FL rounds, d_i the deployment's robust rule
    run in the clear on the clients' *decoded uploads* (what the servers' shares add up to):
    FedSECA with its momentum (restarted after an unlearning round), or BRACE's vote with the step
    of FL round t. Each round starts from the published M_{i-1}, so errors do not compound."""
    fl = cfg.fl
    seca = FedSECA(gamma=fl.fedseca_gamma, beta=fl.fedseca_beta)
    brace = BraceSign(scale=fl.brace_scale, decay=fl.brace_decay)
    worst, t = 0.0, 0
    prev = twin.model(0).to(torch.float64)
    for i in range(1, twin.num_rounds + 1):
        model = twin.model(i).to(torch.float64)
        parts = list(twin.participants(i))
        if not parts:            # an unlearning round: the adopted model, no momentum step
            seca.reset()
            prev = model
            continue
        t += 1
        rows = {j: torch.from_numpy(decode(encode(twin.update(i, j).numpy(), fl.precision), fl.precision))
                for j in parts}
        if fl.aggregator == "fedseca":
            direction = seca.direction(rows, {})
        else:
            g = torch.stack([rows[j] for j in parts])
            vote = brace_sign(g, lam=fl.brace_lambda * len(parts) / BRACE_CLIENTS)
            direction = brace.step_scale(t) * vote
        worst = max(worst, float((model - (prev - twin.server_lr * direction)).abs().max()))
        prev = model
    return worst


def sim_args(n: int, backdoor: str) -> argparse.Namespace:
    return argparse.Namespace(dataset=None, data_dir=None, n=n, seed=None, backdoor=backdoor,
                              epochs=None, lr=None, train_limit=None)
