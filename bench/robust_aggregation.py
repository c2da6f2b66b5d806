"""Cost of one robust aggregation on shares: FedSECA or BRACE's sign vote, K clients x D coordinates.

One two-party session (two processes, TLS, dealer) aggregates a random K x D matrix of updates
held as shares (``protocols.robust_aggregation``) and opens the aggregate; every step of the rule
is metered on its own (FedSECA: signs, crise, agree, clip, clamp, divide; BRACE: signs, vote;
then ``open``; with ``--check-thresholds`` the servers' round, ``fedseca_checked``: the
verification of the clients' lambda_k shares the rule's sign-test call ``signs`` and adds the
step ``check``, its verdict). The updates are synthetic (N(0, 0.01) on the 16-bit grid, two clients
scaled by 10 as in FedSECA's scaling attack): the cost depends on K and D only.

Runs (``--runs``):

* ``one`` (default): a single run; the dealer material of each step is fetched *inside* the
  step (its bytes are reported as the step's offline bytes, its time is in the step's seconds);
  the profile's link is applied to the server link and to the dealer link;
* ``ahead``: a loopback run records the dealer's requests, then the measured run (the
  profile's link on both links) has them fetched by a background thread while it computes,
  as a daemon does from a robust round's second session on (``servers.secure.dealer_plans``);
* ``three``: ``bench.offline.run_three``: a recording run, a compute run (material prefetched
  before each step, no emulated link: the seconds are online compute) and, with an emulated
  profile, a link run (prefetched, link applied). Closest to the paper's online/offline split,
  three times the work.

The link is emulated by the transport (``net.link.LinkProfile``): this machine's kernel has no
netem. The analytic LAN time of a step is rounds x one-way latency + bytes per direction x 8 /
bandwidth + seconds of a run without emulated link (``bench.profiles``).

    python -m bench.robust_aggregation --clients 20 --dim 582026 --aggregator fedseca --profile lan
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from mpc.launcher import run_parties
from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.robust_aggregation import (brace_sign, check_thresholds, fedseca, fedseca_checked,
                                          quantile_thresholds)

from . import common_options, offline, profiles
from .report import human_bytes, machine_info, markdown_table, write_json

AGGREGATORS = ("fedseca", "brace-sign")
LSB = 2.0 ** -16


def synthetic_updates(clients: int, dim: int, seed: int) -> np.ndarray:
    """K x D updates on the 16-bit grid; the first two clients scaled by 10 (scaling attack)."""
    rng = np.random.default_rng(seed)
    g = np.round(rng.normal(scale=0.01, size=(clients, dim)) / LSB) * LSB
    g[: min(2, clients)] *= 10.0
    return g


def _shared(a: np.ndarray):
    # party 0 plays the clients: its input is shared by a pseudo-random zero sharing (no traffic)
    return crypten.cryptensor(torch.from_numpy(np.ascontiguousarray(a)), src=0)


def _warm_up() -> None:
    """One-off costs (lazy imports, first dispatch) outside every metered step."""
    g = _shared(synthetic_updates(3, 5, 0))
    lam = _shared(np.full(3, 0.01))
    B.reveal(fedseca(g, thresholds=lam))
    B.reveal(brace_sign(g))
    fedseca_checked(g, lam)


def _program(party, spec: dict, schedule) -> dict:
    torch.set_num_threads(1)
    if spec.get("plan"):
        party.fetch_ahead(spec["plan"], spec["ahead_bytes"])   # a daemon's second round on
    proxy = offline.instrument(party, schedule)
    g = synthetic_updates(spec["clients"], spec["dim"], spec["seed"])
    lam = quantile_thresholds(torch.from_numpy(g), spec["gamma"]).numpy()
    _warm_up()
    G = _shared(g)
    out: dict = {}
    if spec["aggregator"] == "fedseca":
        L = _shared(lam)
        if spec["check"]:   # as the servers' round does: the check shares the rule's sign tests
            ok, agg = fedseca_checked(G, L, gamma=spec["gamma"], meter=proxy.meter)
            out["check"] = ok.numpy()
        else:
            agg = fedseca(G, gamma=spec["gamma"], thresholds=L, meter=proxy.meter)
    else:
        agg = brace_sign(G, lam=spec["lam"], meter=proxy.meter)
    with proxy.meter("open"):
        opened = B.reveal(agg)
    out["aggregate"] = opened.numpy() if party.rank == 0 else None
    out["report"] = offline.party_report(proxy)
    out["plan"] = party.recorded_plan if party.rank == 1 else None
    out["served_ahead"] = getattr(crypten.mpc.get_default_provider(), "served_ahead", 0)
    return out


def _twin(spec: dict) -> np.ndarray:
    g = torch.from_numpy(synthetic_updates(spec["clients"], spec["dim"], spec["seed"]))
    if spec["aggregator"] == "fedseca":
        return fedseca(g, gamma=spec["gamma"]).numpy()
    return brace_sign(g, lam=spec["lam"]).numpy()


def _rows(meters: list[dict], compute: dict | None) -> list[dict]:
    """Per-step table rows; with a compute run, the analytic LAN time of each step."""
    steps = offline.summarize_steps(meters)
    rows = []
    for name, s in steps.items():
        row = {"step": name, "rounds": s["rounds"], "online": human_bytes(s["online_bytes"]),
               "per_direction": human_bytes(s["bytes_per_direction"]),
               "offline": human_bytes(s["offline_bytes"]), "seconds": round(s["online_s"], 3),
               "online_bytes": s["online_bytes"], "bytes_per_direction": s["bytes_per_direction"],
               "offline_bytes": s["offline_bytes"], "online_s": s["online_s"]}
        if compute is not None and name in compute:
            lan = profiles.resolve("lan")
            row["lan_model_s"] = round(profiles.analytic_seconds(
                s["rounds"], s["bytes_per_direction"], compute[name]["online_s"], lan), 3)
        rows.append(row)
    total = {"step": "total"}
    for key in ("rounds", "online_bytes", "bytes_per_direction", "offline_bytes", "online_s", "lan_model_s"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            total[key] = sum(vals)
    total.update(online=human_bytes(total["online_bytes"]), per_direction=human_bytes(total["bytes_per_direction"]),
                 offline=human_bytes(total["offline_bytes"]), seconds=round(total["online_s"], 3))
    if "lan_model_s" in total:
        total["lan_model_s"] = round(total["lan_model_s"], 3)
    return rows + [total]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=20, help="K, clients per round (default 20)")
    p.add_argument("--dim", type=int, default=582026, help="D, coordinates per update (default 582,026: "
                                                             "the paper's MNIST CNN)")
    p.add_argument("--aggregator", choices=AGGREGATORS, default="fedseca",
                   help="the rule measured: fedseca (default; CRISE + RoCA) or brace-sign (BRACE's sign vote)")
    p.add_argument("--gamma", type=float, default=0.9, help="FedSECA sparsification factor (default 0.9)")
    p.add_argument("--lam", type=float, default=5.0, help="BRACE threshold lambda (default 5, its paper's)")
    p.add_argument("--check-thresholds", action="store_true",
                   help="FedSECA: also run the servers' check of the clients' lambda_k (step 'check')")
    common_options.add_profile(p)
    common_options.add_offline(p)
    p.add_argument("--runs", choices=("one", "ahead", "three"), default="one",
                   help="one: material fetched inside each step (default; a daemon's first round); ahead: a "
                        "loopback run records the dealer requests, then the measured run fetches them in the "
                        "background while it computes (a daemon's later rounds, servers/secure/dealer_plans.py); "
                        "three: record, compute, link runs with per-step prefetch (bench.offline.run_three)")
    p.add_argument("--ahead-mb", type=int, default=256,
                   help="--runs ahead: MB of dealer material the background fetch may hold (default 256, "
                        "the daemon's)")
    common_options.add_seed(p, "the synthetic updates")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the plaintext twin")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a party waits for its peer")
    common_options.add_out(p, None, shown="out/robust-aggregation-<aggregator>-<K>x<D>-<profile>.json")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="python -m bench.robust_aggregation", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    if args.clients < 1 or args.dim < 1:
        raise SystemExit("--clients and --dim must be at least 1")
    try:
        profile = common_options.profile_of(args)
    except ValueError as exc:
        return common_options.refuse("starfish bench aggregation", str(exc))
    link = profile.link() if profile.emulated else None
    spec = {"clients": args.clients, "dim": args.dim, "aggregator": args.aggregator, "gamma": args.gamma,
            "lam": args.lam, "seed": args.seed,
            "check": bool(args.check_thresholds and args.aggregator == "fedseca"),
            "ahead_bytes": args.ahead_mb << 20}
    t0 = time.perf_counter()
    compute = None
    if args.runs in ("one", "ahead"):
        kw = {"link": link, "dealer_link": link} if link is not None else {}
        if args.runs == "ahead" and args.offline == "dealer":
            first = run_parties(_program, spec, None, timeout=args.timeout, offline=args.offline)
            spec = dict(spec, plan=first.values[1]["plan"])
            t0 = time.perf_counter()   # the measured run is the second one
        res = run_parties(_program, spec, None, timeout=args.timeout, offline=args.offline, **kw)
        meters, values = res.meters, res.values
        if spec.pop("plan", None) is not None:
            # the background thread's bytes belong to no step: the recording run made the same requests
            recorded = {name: st["offline_bytes"] for name, st in offline.summarize_steps(first.meters).items()}
    else:
        runs = offline.run_three(_program, (spec,), link=link, timeout=args.timeout,
                                 label=f"{args.aggregator} {args.clients}x{args.dim}",
                                 offline=args.offline, quiet=args.quiet)
        compute = offline.summarize_steps(runs.compute.meters)
        final = runs.link if runs.link is not None else runs.compute
        meters, values = final.meters, final.values
    wall = time.perf_counter() - t0
    if compute is None and not profile.emulated:
        compute = offline.summarize_steps(meters)   # a loopback run is the compute run
    rows = _rows(meters, compute)
    if args.runs == "ahead" and args.offline == "dealer":
        for row in rows:
            if row["step"] in recorded:
                row["offline_bytes"] = recorded[row["step"]]
                row["offline"] = human_bytes(row["offline_bytes"]) + " (ahead)"
        total = rows[-1]
        total["offline_bytes"] = sum(recorded.values())
        total["offline"] = human_bytes(total["offline_bytes"]) + " (ahead)"
    result = {"machine": machine_info(), "spec": spec, "profile": profile.to_json(), "runs": args.runs,
              "link": "transport emulation (net.link.LinkProfile)" if link is not None else "loopback",
              "wall_s": wall, "steps": rows,
              "peak_rss_bytes": [v["report"]["peak_rss_bytes"] for v in values],
              "served_ahead": values[1]["served_ahead"]}
    if spec["check"]:
        result["thresholds_accepted"] = int(np.sum(values[0]["check"]))
    if not args.no_check:
        twin = _twin(spec)
        got = values[0]["aggregate"]
        if args.aggregator == "fedseca":
            g = synthetic_updates(args.clients, args.dim, args.seed)
            bound = 2 * (2.0 ** -12 * np.abs(g).max(axis=0) + LSB) + LSB
            err = np.abs(got - twin)
            result["twin_max_error"] = float(err.max())
            result["twin_within_bound"] = bool(np.all(err <= bound))
        else:
            result["twin_equal"] = bool(np.array_equal(got, twin))
    cols = ["step", "rounds", "online", "per_direction", "offline", "seconds"]
    if any("lan_model_s" in r for r in rows):
        cols.append("lan_model_s")
    print(f"{args.aggregator}, K = {args.clients}, D = {args.dim:,}, {profile.describe()}, runs: {args.runs}")
    print(markdown_table(rows, cols))
    if args.runs == "ahead":
        print(f"dealer corrections served by the background fetch: {result['served_ahead']}")
    print(f"wall {wall:.1f} s; peak RSS per party "
          + ", ".join(human_bytes(b) for b in result["peak_rss_bytes"]))
    for key in ("twin_max_error", "twin_within_bound", "twin_equal", "thresholds_accepted"):
        if key in result:
            print(f"{key}: {result[key]}")
    out = args.out or f"out/robust-aggregation-{args.aggregator}-{args.clients}x{args.dim}-{profile.name}.json"
    path = write_json(out, result)
    print(f"wrote {path}", file=sys.stderr)
    ok = result.get("twin_within_bound", result.get("twin_equal", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
