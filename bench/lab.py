"""``starfish lab``: plaintext FL, then unlearning with several methods, compared.

Why: before anything runs under 2PC, the unlearning quality of Starfish must be seen next
to the baselines on the same FL history (the paper's Figure 3): test error (TER),
backdoor success on the target's data (BA-ASR), membership inference on it (MIA-ASR),
round saving of the clients (ARP), wall time, client trainings, and the L2 distance of
each unlearned model to the retrained one.

Flow: load data -> split among clients (client 0.. are the targets by default) -> the
targets poison part of their data with a backdoor trigger -> T rounds of FedAvg record a
History -> each method unlearns the targets from that history -> table, JSON, PNG.
With ``--secure``, Starfish also runs under 2PC on the same history and must agree with plaintext
Starfish (same selected rounds and correction flags, models within ``--secure-tolerance``);
otherwise the differing figures are printed and the exit code is 1.

Defaults per dataset are in :data:`lab.experiment.DATASET_DEFAULTS`; the digits defaults were tuned so
the run takes seconds on one core and the backdoor is learned clearly (see README of
``bench`` / the docstring of ``DATASET_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clients.attacks import ALIE_JITTER, ALIE_Z, SCALE
from clients.datasets import DATASET_NAMES
from clients.models import MODEL_NAMES
from clients.training import DEVICES
from protocols.starfish.params import PAPER
from lab.aggregators import (
    AGGREGATORS,
    BRACE_CLIENTS,
    BRACE_DECAY,
    BRACE_LAMBDA,
    BRACE_SCALE,
    FEDSECA_BETA,
    FEDSECA_GAMMA,
    build_aggregator,
)
from lab.fl import run_federated
from lab.metrics import arp, l2_distance, stored_history
from lab.recovery import METHODS, CostRecord, FedEraser, FedRecover, RandomSelection, Retrain, Starfish
from lab.recovery.crab import Crab
from lab.recovery.fedadp import ADJACENCY, FedADP

from . import common_options, progress
from lab.experiment import ATTACK_NAMES, CLIENT_TRAINING_MODES, build_setup, starfish_params
from .report import human_bytes
from .secure_lab import run_secure_starfish, step_table

__all__ = ["main", "add_arguments", "make_aggregator", "run", "run_lab", "format_table", "compare_secure",
           "SECURE_TOLERANCE", "EXIT_DISAGREE"]

#: ``--secure``: default bound on max |2PC model - plaintext model| over the parameters. The
#: fixed-point error of a digits run is ~1e-4 (docs/unlearning.md); 1e-2 leaves room for longer
#: replays while still catching a wrong estimate, correction or selection.
SECURE_TOLERANCE = 1e-2
#: Exit code of ``starfish lab --secure`` when 2PC and plaintext Starfish disagree (2: usage/data error).
EXIT_DISAGREE = 1


def add_arguments(parser: argparse.ArgumentParser, secure: bool = True) -> None:
    """Options of ``starfish lab`` (the CLI wires this into its sub-command); ``secure=False``
    leaves out the 2PC group, for a plaintext runner that would ignore it."""
    g = parser.add_argument_group("data and federation")
    g.add_argument("--dataset", choices=DATASET_NAMES, default="digits",
                   help="the data set (digits, embedded; the others read --data-dir)")
    g.add_argument("--data-dir", help="directory with the dataset files (not for digits)")
    g.add_argument("--clients", type=int, default=20, help="number of FL clients (20)")
    g.add_argument("--rounds", type=int, default=40, help="FL rounds T (40)")
    g.add_argument("--epochs", type=float, help="local epochs E (dataset default)")
    g.add_argument("--lr", type=float, help="local SGD learning rate (dataset default)")
    g.add_argument("--batch-size", type=int, help="local batch size (dataset default)")
    g.add_argument("--model", choices=MODEL_NAMES, help="architecture (dataset default)")
    g.add_argument("--l2", type=float, help="L2 regularisation of logreg/mlp (dataset default)")
    g.add_argument("--image-size", type=int,
                   help="resize images to this side (bilinear); default: 28 for the CNNs on "
                        "images smaller than 28 (the digits), else the native size")
    g.add_argument("--partition", choices=("iid", "dirichlet", "label-bias"), default="iid",
                   help="how the training data is split among the clients (iid)")
    g.add_argument("--q", type=float, default=0.5, help="label-bias probability (0.5)")
    g.add_argument("--concentration", type=float, default=0.5, help="Dirichlet parameter")
    g.add_argument("--train-limit", type=int, help="use only this many training samples")
    g.add_argument("--test-limit", type=int, help="use only this many test samples")
    common_options.add_seed(g, "the data split, M_0 and batch orders")
    a = parser.add_argument_group("target and backdoor")
    a.add_argument("--targets", default="0", help="comma-separated client ids to unlearn (0)")
    a.add_argument("--no-backdoor", action="store_true", help="targets train honestly")
    a.add_argument("--target-label", type=int, default=0, help="backdoor label (0)")
    a.add_argument("--poison-fraction", type=float, help="share of target samples poisoned")
    a.add_argument("--boost", type=float,
                   help="scale the targets' updates (dataset default; digits 5)")
    r = parser.add_argument_group("attacks and robust aggregation (docs/lab.md)")
    r.add_argument("--aggregator", choices=tuple(AGGREGATORS), default="fedavg",
                   help="server rule of the FL run and of Retrain (fedavg)")
    r.add_argument("--starfish-replay", choices=("fedavg", "aggregator"), default="aggregator",
                   help="the step of Starfish's and random selection's replay: the FL run's "
                        "--aggregator, as the service's 2PC job replays a robust history (default; "
                        "the paper's FedAvg step under --aggregator fedavg), or FedAvg whatever the rule")
    r.add_argument("--attack", choices=ATTACK_NAMES, default="backdoor",
                   help="what the attackers do (backdoor: the targets' poisoned data)")
    r.add_argument("--attackers", type=int,
                   help="clients 0..N-1 attack (default: the targets attack)")
    r.add_argument("--scale", type=float, default=SCALE,
                   help=f"scaling attack factor ({SCALE:g}, FedSECA app. D.6)")
    r.add_argument("--alie-z", type=float, default=ALIE_Z,
                   help=f"ALIE deviation z_max ({ALIE_Z:g}, FedSECA app. D.2)")
    r.add_argument("--alie-jitter", type=float, default=ALIE_JITTER,
                   help=f"ALIE per-attacker jitter of z, uniform +- ({ALIE_JITTER:g})")
    r.add_argument("--fedseca-gamma", type=float, default=FEDSECA_GAMMA,
                   help=f"FedSECA sparsification factor ({FEDSECA_GAMMA:g})")
    r.add_argument("--fedseca-beta", type=float, default=FEDSECA_BETA,
                   help=f"FedSECA server momentum ({FEDSECA_BETA:g})")
    r.add_argument("--brace-lambda", type=float,
                   help=f"BRACE vote threshold lambda (default {BRACE_LAMBDA:g} per "
                        f"{BRACE_CLIENTS} clients, the paper's share: 1 for 20)")
    r.add_argument("--brace-scale", type=float, default=BRACE_SCALE,
                   help=f"BRACE step: direction of round t = scale / t^decay * sign vote ({BRACE_SCALE:g})")
    r.add_argument("--brace-decay", type=float, default=BRACE_DECAY,
                   help=f"BRACE step decay exponent, 0 = the paper's fixed step ({BRACE_DECAY:g})")
    u = parser.add_argument_group("unlearning")
    u.add_argument("--method", default="retrain,federaser,fedrecover,crab,fedadp,starfish,random",
                   help="comma-separated: " + ",".join(METHODS))
    u.add_argument("--sigma", type=float,
                   help=f"Starfish selection rate (the paper's {PAPER.sigma}; 0.8 for the MLP on "
                        "the digits, see docs/lab.md \"Deep models\")")
    u.add_argument("--alpha", type=float, default=PAPER.alpha,
                   help=f"tolerance rate of delta ({PAPER.alpha})")
    u.add_argument("--beta", type=float, default=PAPER.beta,
                   help=f"interval rate, T_c=ceil(beta T) ({PAPER.beta})")
    u.add_argument("--buffer", type=int, default=PAPER.buffer,
                   help=f"L-BFGS buffer size B ({PAPER.buffer})")
    u.add_argument("--guard", type=float, default=PAPER.guard,
                   help=f"Starfish's divergence guard: an estimated replay round whose step is longer "
                        f"than GUARD x the history's longest is redone exactly; 0 = off "
                        f"({PAPER.guard:g}; docs/unlearning.md)")
    u.add_argument("--rs-method", choices=("auto", "ratio", "divide"), default="auto",
                   help="round-selection comparison: Method 1 (ratio) or 2 (divide)")
    u.add_argument("--fedrecover-alpha", type=float, default=0.001,
                   help="FedRecover abnormality tolerance (global threshold) (0.001)")
    u.add_argument("--fedrecover-final", type=int, default=2, help="FedRecover final tuning")
    u.add_argument("--federaser-interval", type=int, default=2, help="FedEraser interval")
    u.add_argument("--crab-alpha", type=float, default=0.1,
                   help="Crab loss reduction that closes a storage window (paper: 0.1)")
    u.add_argument("--crab-lambda", type=float, default=0.6,
                   help="Crab share of a window's rounds kept, by KL divergence (paper: 0.6)")
    u.add_argument("--crab-delta", type=float, default=0.7,
                   help="Crab share of a kept round's clients kept, by cosine (paper: 0.7)")
    u.add_argument("--crab-beta", type=float, default=0.3,
                   help="Crab sensitivity ratio of the adaptive rollback (paper: 0.3)")
    u.add_argument("--fedadp-lambda", type=float, default=0.6,
                   help="FedADP global-model selection ratio (paper: 0.6)")
    u.add_argument("--fedadp-gamma", type=float, default=0.7,
                   help="FedADP update selection ratio (paper: 0.7)")
    u.add_argument("--fedadp-beta", type=float, default=0.1,
                   help="FedADP loss reduction that closes a storage stage (paper: 0.1)")
    u.add_argument("--fedadp-eps-max", type=float, default=3.0,
                   help="FedADP maximum per-round budget eps_max (paper: 3.0)")
    u.add_argument("--fedadp-eps-min", type=float, default=1.0,
                   help="FedADP minimum per-round budget eps_min (not in the paper; 1.0)")
    u.add_argument("--fedadp-eps0", type=float,
                   help="FedADP first-round budget (not in the paper; default eps_min)")
    u.add_argument("--fedadp-delta", type=float, default=1e-5,
                   help="FedADP delta of each round and of the reported budget (not in the paper; 1e-5)")
    u.add_argument("--fedadp-clip", type=float,
                   help="FedADP clipping norm S (not in the paper; default the median stored ||g||)")
    u.add_argument("--fedadp-adjacency", choices=tuple(ADJACENCY), default="replace",
                   help="FedADP accounting: a neighbour replaces a client's record (sensitivity 2S, "
                        "default) or zeroes the update (S, the paper's calibration)")
    u.add_argument("--fedadp-no-dp", action="store_true",
                   help="FedADP without clipping and noise (the paper's 'FedADP without DP')")
    if secure:
        _add_secure_arguments(parser.add_argument_group("2PC (--secure)"))
    o = parser.add_argument_group("output")
    # a directory, not the benches' JSON file: the lab writes lab.json and lab.png, and only when asked
    o.add_argument("--out", help="directory for lab.json and lab.png")
    common_options.add_quiet(o)
    t = parser.add_argument_group("client training")
    t.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the clients' local SGD runs (auto: CUDA when torch sees a GPU, else "
                        "the CPU); models, histories and the 2PC run stay on the CPU")
    t.add_argument("--client-training", choices=CLIENT_TRAINING_MODES, default="auto",
                   help="auto: a round's clients trained together as one batched program where the "
                        "model allows (no buffers, dropout or normalisation layers), else one after "
                        "another; batched / sequential force one way (docs/lab.md, round times)")
    o.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: the lab's small models gain nothing from "
                        "more, and spinning threads stall on a shared machine)")


def _add_secure_arguments(sec) -> None:
    sec.add_argument("--secure", action="store_true",
                     help="also run Starfish under 2PC (two server processes, TLS, --offline) on the "
                          "same history, print its per-step online/offline bytes, rounds, seconds, "
                          "and compare it with plaintext Starfish (run too if --method lacks it): "
                          "exit 1 if the selected rounds or correction flags differ or the models "
                          "differ by more than --secure-tolerance")
    common_options.add_offline(sec)
    common_options.add_profile(sec)
    sec.add_argument("--secure-tolerance", type=float, default=SECURE_TOLERANCE,
                     help="largest accepted max |2PC - plaintext| parameter difference for "
                          f"--secure ({SECURE_TOLERANCE})")


def make_aggregator(args: argparse.Namespace):
    """The FL run's aggregator from ``--aggregator`` and its parameters."""
    name = getattr(args, "aggregator", "fedavg")
    if name == "fedseca":
        return build_aggregator(name, gamma=args.fedseca_gamma, beta=args.fedseca_beta)
    if name == "brace-sign":
        return build_aggregator(name, lam=args.brace_lambda, scale=args.brace_scale,
                                decay=args.brace_decay)
    return build_aggregator(name)


def _make_method(name: str, args: argparse.Namespace):
    if name == "retrain":
        return Retrain(aggregator=make_aggregator(args))
    if name == "federaser":
        return FedEraser(interval=args.federaser_interval)
    if name == "fedrecover":
        return FedRecover(buffer=args.buffer, beta=args.beta, warmup=args.buffer,
                          final_tuning=args.fedrecover_final,
                          abnormal_alpha=args.fedrecover_alpha)
    replay = make_aggregator(args) if getattr(args, "starfish_replay", "aggregator") == "aggregator" else None
    if name == "starfish":
        return Starfish(starfish_params(args), aggregator=replay)
    if name == "random":
        return RandomSelection(starfish_params(args), seed=args.seed, aggregator=replay)
    if name == "crab":
        return Crab(alpha=args.crab_alpha, lam=args.crab_lambda, delta=args.crab_delta,
                    beta=args.crab_beta)
    if name == "fedadp":
        return FedADP(lam=args.fedadp_lambda, gamma=args.fedadp_gamma, beta=args.fedadp_beta,
                      eps_max=args.fedadp_eps_max, eps_min=args.fedadp_eps_min,
                      eps0=args.fedadp_eps0, delta=args.fedadp_delta, clip=args.fedadp_clip,
                      adjacency=args.fedadp_adjacency, dp=not args.fedadp_no_dp, seed=args.seed)
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def run_lab(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole lab and return the JSON-able result (also printed/written by main)."""
    quiet = args.quiet

    def say(msg: str) -> None:
        progress.say(msg, quiet=quiet)

    secure_on = getattr(args, "secure", False)
    tolerance = getattr(args, "secure_tolerance", SECURE_TOLERANCE)
    if secure_on and not (tolerance >= 0.0):
        raise ValueError(f"--secure-tolerance must be >= 0, got {tolerance}")
    if secure_on:
        common_options.profile_of(args)     # a conflicting profile fails now, not after the FL run
    setup = build_setup(args, say)
    cfg, targets, methods = setup.cfg, setup.targets, setup.methods
    if secure_on and "starfish" not in methods:
        say("lab: --secure compares with plaintext Starfish; running method starfish as well")
        methods = methods + ["starfish"]
    participants, evaluate, m0, trigger = setup.participants, setup.evaluate, setup.m0, setup.trigger

    t0 = time.perf_counter()
    aggregator = make_aggregator(args)
    trainer = setup.trainer
    # the in-round bar (clients' local steps, time left in the round) shows only when a round's
    # training lasts long enough to need it: real data with the CNN, not the digits
    with progress.progress(args.rounds, "FL", quiet=quiet, unit="round") as bar, \
            progress.within("clients", quiet=quiet) as in_round:
        trainer.progress = in_round
        history = run_federated(participants, m0, args.rounds, cfg.get("lr"),
                                progress=progress.callback(bar), aggregator=aggregator,
                                trainer=trainer)
    fl_time = time.perf_counter() - t0
    original = history.model(history.num_rounds)
    rows: list[dict[str, Any]] = [{"method": "original (with target)", **evaluate(original),
                                   "arp": None, "wall_time_s": fl_time, "rounds_used": args.rounds,
                                   "client_computations_mean": float(args.rounds),
                                   "l2_to_retrain": None}]
    models: dict[str, torch.Tensor] = {}
    costs: dict[str, CostRecord] = {}
    scores: dict[str, dict[str, Any]] = {}
    _save_partial(args, rows, scores, costs)
    for name in methods:
        method = _make_method(name, args)
        method.trainer = trainer
        # each method reports its own total (rounds retrained or replayed) through the callback
        with progress.progress(None, name, quiet=quiet, unit="round") as bar, \
                progress.within("clients", quiet=quiet) as in_round:
            trainer.progress = in_round
            model, cost = method.unlearn(history, targets, participants, progress=progress.callback(bar))
        trainer.progress = None
        models[name], costs[name] = model, cost
        scores[name] = evaluate(model)
        _save_partial(args, rows, scores, costs)
    secure = None
    if secure_on:
        secure = _run_secure(args, history, targets, costs)
        models["starfish (2PC)"], costs["starfish (2PC)"] = secure["model"], secure["cost"]
        secure["comparison"] = compare_secure(models["starfish"], costs["starfish"],
                                              secure["model"], secure["cost"], tolerance,
                                              servers_differ=secure["servers_differ"])
        methods = methods + ["starfish (2PC)"]
    retrained = models.get("retrain")
    for name in methods:
        cost = costs[name]
        n = max(1, len(cost.client_computations))
        rows.append({
            "method": name, **(scores.get(name) or evaluate(models[name])),
            "arp": arp(cost), "wall_time_s": cost.wall_time_s, "rounds_used": cost.rounds_used,
            "client_computations_mean": cost.total_client_computations() / n,
            "l2_to_retrain": None if retrained is None else l2_distance(models[name], retrained),
            "stored": stored_history(cost, history),
            "diverged": not bool(torch.isfinite(models[name]).all()),
            "epsilon": cost.extra.get("epsilon") if name == "fedadp" else None,
        })
    config = {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()
              if k not in ("func",)}
    config.update({"model": cfg.get("model"), "lr": cfg.get("lr"), "epochs": cfg.get("epochs"),
                   "batch_size": cfg.get("batch_size"), "l2": cfg.get("l2"),
                   "poison_fraction": cfg.get("poison_fraction"), "boost": cfg.get("boost"),
                   "sigma": cfg.get("sigma"),
                   "targets": targets,
                   "num_params": int(m0.numel()), "trigger": vars(trigger),
                   # every FL round of this run (and Retrain's) used this rule
                   "aggregator": {"name": aggregator.name, **aggregator.params()},
                   "attack": setup.attack, "attackers": list(setup.attackers),
                   # where the clients trained (--device auto resolved) and how
                   "training_device": str(getattr(participants[0], "device", "cpu")),
                   "client_training": setup.trainer.mode})
    result = {"config": config, "results": rows,
              "costs": {k: c.to_json() for k, c in costs.items()}}
    if secure is not None:
        cmp = secure["comparison"]
        result["secure"] = {"steps": secure["steps"], "seconds": secure["seconds"],
                            "offline": secure["offline"],
                            "max_abs_diff_to_plaintext": cmp["max_abs_diff"],
                            "selected_rounds_equal": cmp["selected_rounds_equal"],
                            "flags_equal": cmp["flags_equal"], "tolerance": cmp["tolerance"],
                            "agree": cmp["agree"], "disagreements": cmp["disagreements"],
                            "selected_rounds": cmp["selected_rounds"], "flags": cmp["flags"]}
    return result


def _flags(cost: CostRecord) -> dict[int, list[int]]:
    return {int(k): sorted(int(j) for j in v) for k, v in cost.extra.get("flags", {}).items()}


def compare_secure(plain_model: torch.Tensor, plain_cost: CostRecord, secure_model: torch.Tensor,
                   secure_cost: CostRecord, tolerance: float = SECURE_TOLERANCE,
                   servers_differ: list[str] = ()) -> dict[str, Any]:
    """2PC Starfish against plaintext Starfish on the same history.

    They agree iff they select the same rounds, raise the same correction flags (replay step ->
    flagged client ids) and their models differ by at most ``tolerance`` in every parameter
    (and the two servers revealed the same outcome: ``servers_differ`` lists what they did not).
    ``disagreements`` names each difference with its figures.
    """
    diff = float((secure_model.double() - plain_model.double()).abs().max())
    sel = {"secure": list(secure_cost.selected_rounds), "plaintext": list(plain_cost.selected_rounds)}
    flags = {"secure": _flags(secure_cost), "plaintext": _flags(plain_cost)}
    out: list[str] = [f"the two servers revealed different {what}" for what in servers_differ]
    if sel["secure"] != sel["plaintext"]:
        only_s = sorted(set(sel["secure"]) - set(sel["plaintext"]))
        only_p = sorted(set(sel["plaintext"]) - set(sel["secure"]))
        out.append(f"selected rounds differ: 2PC {sel['secure']}, plaintext {sel['plaintext']} "
                   f"(only 2PC: {only_s}, only plaintext: {only_p})")
    if flags["secure"] != flags["plaintext"]:
        steps = sorted(set(flags["secure"]) | set(flags["plaintext"]))
        parts = [f"step {s}: 2PC {flags['secure'].get(s, '-')}, plaintext {flags['plaintext'].get(s, '-')}"
                 for s in steps if flags["secure"].get(s) != flags["plaintext"].get(s)]
        out.append("correction flags differ: " + "; ".join(parts))
    if not diff <= tolerance:  # also catches NaN
        out.append(f"models differ: max |2PC - plaintext| = {diff:.3e} > tolerance {tolerance:g}")
    return {"agree": not out, "disagreements": out, "max_abs_diff": diff, "tolerance": tolerance,
            "selected_rounds_equal": sel["secure"] == sel["plaintext"],
            "flags_equal": flags["secure"] == flags["plaintext"],
            "selected_rounds": sel, "flags": {k: {str(s): v for s, v in f.items()} for k, f in flags.items()}}


def _run_secure(args: argparse.Namespace, history, targets: list[int], costs: dict) -> dict:
    """Starfish under 2PC on ``history`` (bench.secure_lab), compared with the plaintext run."""
    params = starfish_params(args)
    profile = common_options.profile_of(args)
    link = profile.link()
    who = "no dealer" if getattr(args, "offline", "dealer") == "two-party" else "dealer"
    progress.say(f"starfish (2PC): two server processes + {who} over TLS, {profile.describe()} ...",
                 quiet=args.quiet)
    out = run_secure_starfish(args, history, targets, params, link=link,
                              offline=getattr(args, "offline", "dealer"), quiet=args.quiet)
    v0, v1 = out["values"]
    model = torch.from_numpy(v0["model"]).to(history.model(0).dtype)
    cost = CostRecord("starfish (2PC)", history.num_rounds, wall_time_s=out["seconds"],
                      rounds_used=len(v0["selected_rounds"]),
                      client_computations={int(k): v for k, v in v0["client_computations"].items()},
                      selected_rounds=list(v0["selected_rounds"]),
                      correction_steps=list(v0.get("correction_steps", [])),
                      estimated_updates=int(v0.get("estimated_updates", 0)))
    cost.extra.update({"warmup_steps": v0.get("warmup_steps"),
                       "flags": {int(k): list(v) for k, v in v0.get("flags", {}).items()}})
    for j in costs.get("starfish", cost).client_computations:
        cost.client_computations.setdefault(j, 0)
    steps = step_table([v0["meters"], v1["meters"]], getattr(args, "offline", "dealer"))
    differ = [what for what, same in (
        ("selected rounds", v0["selected_rounds"] == v1["selected_rounds"]),
        ("flags", v0.get("flags") == v1.get("flags")),
        ("models", np.array_equal(v0["model"], v1["model"]))) if not same]
    return {"model": model, "cost": cost, "steps": steps, "seconds": out["seconds"],
            "servers_differ": differ, "offline": getattr(args, "offline", "dealer"), "profile": profile.to_json()}


PARTIAL = "lab.partial.json"


def _save_partial(args: argparse.Namespace, rows: list[dict[str, Any]], scores: dict[str, dict[str, Any]],
                  costs: dict[str, CostRecord]) -> None:
    """With ``--out``: the rows finished so far, rewritten after FL and after each method, so a
    run stopped part-way (a long real-data lab) keeps what it measured."""
    if not getattr(args, "out", None):
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = [{"method": name, **score, "wall_time_s": costs[name].wall_time_s,
             "rounds_used": costs[name].rounds_used} for name, score in scores.items()]
    tmp = out / (PARTIAL + ".tmp")
    tmp.write_text(json.dumps({"results": rows + done}, indent=2, default=str))
    tmp.replace(out / PARTIAL)


def _fmt(v: Any, pct: bool = False, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if pct:
        return f"{100.0 * v:.1f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _stored(s: dict[str, int] | None) -> str:
    """Bytes kept of the history, with the rounds and updates they hold."""
    if s is None:
        return "-"
    return f"{human_bytes(s['bytes'])} ({s['rounds']} rounds, {s['updates']} updates)"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table: one line per method, percentages for the rates."""
    header = ["method", "TER%", "BA-ASR%", "MIA-ASR%", "ARP%", "client trainings",
              "rounds", "L2 to retrain", "time s", "stored", "DP eps"]
    body = []
    for r in rows:
        body.append([
            r["method"] + (" (diverged)" if r.get("diverged") else ""), _fmt(r.get("ter"), True), _fmt(r.get("ba_asr"), True),
            _fmt(r.get("mia_asr"), True),
            "-" if r.get("arp") is None else f"{r['arp']:.1f}",
            _fmt(r.get("client_computations_mean"), digits=1), str(r.get("rounds_used", "-")),
            _fmt(r.get("l2_to_retrain"), digits=4), _fmt(r.get("wall_time_s"), digits=1),
            _stored(r.get("stored")), _fmt(r.get("epsilon"), digits=1),
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Four bar charts (TER, BA-ASR, MIA-ASR, ARP) like the paper's Figure 3."""
    # lazy: the CLI imports this module for every command; matplotlib.pyplot costs ~0.45 s there
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = result["results"]
    names = [r["method"].replace(" (with target)", "\n(with target)")
             + ("\n(diverged)" if r.get("diverged") else "") for r in rows]
    # (key, title, percent, which way is better): a reader of one panel should not need the docs
    panels = [("ter", "TER: test error rate (%)", True, "lower is better"),
              ("ba_asr", "BA-ASR: backdoor success (%)", True, "lower is better"),
              ("mia_asr", "MIA-ASR: membership inference (%)", True, "nearer 50% (chance) is better"),
              ("arp", "ARP: client work saved (%)", False, "higher is better")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.4))
    for ax, (key, title, pct, better) in zip(axes, panels):
        vals = [r.get(key) for r in rows]
        vals = [None if v is None else (100 * v if pct else v) for v in vals]
        ax.bar(range(len(vals)), [0.0 if v is None else v for v in vals], color="#4477aa")
        top = max([v for v in vals if v is not None] + [1.0])
        for i, v in enumerate(vals):
            # a metric that does not apply is no zero: say so where the bar would be; a value
            # is printed on its bar, so a true 0 is seen as one
            ax.text(i, (0.0 if v is None else v) + 0.01 * top, "n/a" if v is None else f"{v:.1f}",
                    ha="center", va="bottom", fontsize=7, color="#777777" if v is None else "black")
        ax.set_ylim(0, 1.12 * top)   # room for the value labels
        if key == "mia_asr":
            ax.axhline(50.0, color="#cc3311", linestyle="--", linewidth=1, label="chance (50%)")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{title}\n({better})", fontsize=10)
    cfg = result["config"]
    fig.suptitle(f"starfish lab: {cfg['dataset']}, {cfg.get('model')}, {cfg['clients']} clients, "
                 f"{cfg['rounds']} rounds, targets {cfg['targets']}. ARP = mean over remaining clients "
                 "of (T - exact trainings asked) / T (docs/lab.md, Metrics)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the lab for already-parsed arguments (for a CLI that used :func:`add_arguments`)."""
    torch.set_num_threads(max(1, args.threads))
    try:
        result = run_lab(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"starfish lab: error: {exc}", file=sys.stderr)
        return 2
    rc = 0
    print(format_table(result["results"]))
    if "secure" in result:
        offline_what = ("made between the servers" if result["secure"].get("offline") == "two-party"
                        else "dealer")
        print(f"\nstarfish (2PC) per step (online: server<->server, both directions; offline: {offline_what}):")
        print(f"{'step':<12}{'rounds':>8}{'online':>12}{'offline':>12}{'seconds':>9}")
        for r in result["secure"]["steps"]:
            print(f"{r['step']:<12}{r['rounds']:>8}{human_bytes(r['online_bytes']):>12}"
                  f"{human_bytes(r['offline_bytes']):>12}{r['seconds']:>9.2f}")
        sec = result["secure"]
        print(f"2PC total {sec['seconds']:.1f} s; selected rounds equal to plaintext: "
              f"{sec['selected_rounds_equal']}; flags equal: {sec['flags_equal']}; "
              f"max |2PC - plaintext| parameter difference: {sec['max_abs_diff_to_plaintext']:.3e} "
              f"(tolerance {sec['tolerance']:g})")
        if not sec["agree"]:
            print("2PC and plaintext Starfish DISAGREE:")
            for line in sec["disagreements"]:
                print(f"  {line}")
            print("starfish lab: error: 2PC Starfish disagrees with plaintext Starfish: "
                  + "; ".join(sec["disagreements"]), file=sys.stderr)
            rc = EXIT_DISAGREE
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lab.json").write_text(json.dumps(result, indent=2, default=str))
        plot(result, out / "lab.png")
        (out / PARTIAL).unlink(missing_ok=True)
        print(f"wrote {out / 'lab.json'} and {out / 'lab.png'}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    """``starfish lab`` entry point: parse ``argv`` and :func:`run`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="starfish lab", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
