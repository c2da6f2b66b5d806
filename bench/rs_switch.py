"""The switching threshold T_delta of secure round selection, from our measured costs.

Method 1 sorts (u, v) pairs with the division-free comparator (two extra multiplications
per comparison, one extra round per sorting layer); Method 2 divides once per round and
sorts plain keys. Which is cheaper depends on T and on the link: rounds cost latency,
bytes cost bandwidth. This benchmark measures both methods under 2PC (dealer, TLS, no
emulated link) for several T, then predicts each method's time on a link as

    rounds x one-way latency + bytes per direction x 8 / bandwidth + measured compute

and reports, per link profile, T_delta = the smallest measured T from which Method 2 is
predicted faster (None: Method 1 at every measured T); the formula and profiles live in
``protocols/starfish/round_selection.py``. ``--write-default`` stores the measured table in
``protocols/starfish/data/t_delta.json`` (package data), from which ``method="auto"`` takes its default
T_delta (LAN profile).

No ``--profile``: the methods are measured on loopback and each profile's time is predicted from
that (a shaped link during the measurement would count its latency twice). ``--offline
two-party`` measures both methods without a dealer (correlations made inside each step, so in
its seconds); ``--write-default`` keeps to the dealer, whose table ``method="auto"`` reads.

    starfish bench rs-switch --T 8,16,32,64,128,256 --out out/rs_switch.json
"""

from __future__ import annotations

import argparse

import torch

from mpc.launcher import run_parties
from mpc.crypten_compat import crypten
from protocols.starfish import num_selected, select_rounds
from protocols.starfish.round_selection import LINK_PROFILES as PROFILES
from protocols.starfish.round_selection import T_DELTA_TABLE as DEFAULT_FILE
from protocols.starfish.round_selection import predicted_seconds, t_delta_from

from . import common_options, progress
from .report import machine_info, markdown_table, write_json


def _program(party, T: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + T)   # seed 0: the inputs of earlier tables
    u = crypten.cryptensor(torch.randn(T, generator=gen, dtype=torch.float64), src=0)
    v = crypten.cryptensor(torch.rand(T, generator=gen, dtype=torch.float64) + 0.5, src=0)
    k = num_selected(T, 0.6)
    # warm-up: the first secure comparison in a process pays one-off import/dispatch costs
    # (about 0.6 s here) that would otherwise be charged to whichever method runs first
    w = crypten.cryptensor(torch.ones(2, dtype=torch.float64), src=0)
    select_rounds(w, w + 1, 1, method="ratio")
    select_rounds(w, w + 1, 1, method="divide")
    out = {}
    for method in ("ratio", "divide"):
        with party.meter(method):
            out[method] = select_rounds(u, v, k, method=method)
    return out


def measure(Ts: list[int], quiet: bool = False, offline: str = "dealer", seed: int = 0) -> list[dict]:
    rows = []
    with progress.progress(len(Ts), "round selection", quiet=quiet, unit="T") as bar:
        for T in Ts:
            bar.set_postfix_str(f"T = {T}")
            if offline == "two-party":   # nothing to record or prefetch
                res = run_parties(_program, T, seed, offline="two-party", timeout=1800)
            else:
                first = run_parties(_program, T, seed, timeout=1800)
                res = run_parties(_program, T, seed, plan=first.plans[1], timeout=1800)  # online phase only
            if res.values[0]["ratio"] != res.values[0]["divide"]:
                progress.say(f"  note: methods chose different rounds at T={T} (fixed-point ties)")
            for method in ("ratio", "divide"):
                a, b = (m["steps"][method] for m in res.meters)
                rows.append({"T": T, "method": method, "rounds": a["online_rounds"],
                             "online_bytes": a["online_bytes_sent"] + a["online_bytes_received"],
                             "seconds": max(a["seconds"], b["seconds"])})
            bar.update(1)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", default="8,16,32,64,128,256", help="numbers of rounds to measure")
    common_options.add_offline(p)
    common_options.add_seed(p, "the keys sorted")
    common_options.add_out(p, "out/rs_switch.json")
    p.add_argument("--write-default", action="store_true",
                   help=f"also store the measurement as the package default ({DEFAULT_FILE.name}); dealer only")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish bench rs-switch", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    if args.write_default and args.offline != "dealer":
        return common_options.refuse("starfish bench rs-switch", "--write-default replaces the table method='auto' "
                                     "takes T_delta from, measured with the service's default dealer: drop "
                                     "--offline two-party")
    Ts = [int(float(t)) for t in args.T.split(",")]
    rows = measure(Ts, args.quiet, args.offline, args.seed)
    for r in rows:
        for name, (lat, bw) in PROFILES.items():
            r[f"{name}_s"] = round(predicted_seconds(r, lat, bw), 4)
    print(markdown_table(rows, ["T", "method", "rounds", "online_bytes", "seconds", "lan_s", "wan_s"]))
    deltas = {name: t_delta_from(rows, *prof) for name, prof in PROFILES.items()}
    for name, d in deltas.items():
        verdict = f"T_delta = {d}" if d is not None else "Method 1 at every measured T"
        print(f"{name}: {verdict}")
    payload = {"machine": machine_info(), "offline": args.offline,
               "profiles": {k: {"one_way_latency_s": v[0], "bandwidth_bps": v[1]} for k, v in PROFILES.items()},
               "rows": rows, "t_delta": deltas}
    write_json(args.out, payload)
    if args.write_default:
        write_json(DEFAULT_FILE, payload)
    return 0


__all__ = ["measure", "main", "add_arguments"]
