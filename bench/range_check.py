"""Cost of one FL round's range check of the uploads (``protocols.upload_range``), MNIST shapes.

Each server holds its shares of 20 clients' uploads (update of the paper CNN's 582,026
parameters, ||g||, delta) of one round; the check opens one bit per client. Values: round 0 of
the synthetic history's generator (``bench/synthetic.py``: ~1e-3 per coordinate), encoded at 16
fractional bits and split with a seeded mask (a cost benchmark: both servers could recompute
the other's share); client ``--attacker`` uploads 2**62 in one coordinate, so the expected
verdict is every client but that one, and the run checks it.

Steps (each metered on its own, its dealer material fetched right before it, ``bench/offline.py``):

* ``range``: the windows of the coordinates, the deltas and the norms, the default method
  (``top-bits``: one masked opening, borrow and top-bit equality per element);
* ``range+norm``: the same plus the norm consistency (sum of squares against the norm); the
  difference to ``range`` is the consistency's cost (its online part is also the sub-step
  ``range+norm/norm``);
* ``range-signtests``: the windows by two sign tests per element (the reference method).

Runs: record the dealer schedule, a compute run (no emulated link), a link run with the profile
(LAN by default), as ``starfish bench steps``; schedule and compute run are cached.

    starfish bench range-check --profile lan
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mpc.crypten_compat import crypten
from common.encoding import encode
from protocols.upload_range import DEFAULT_BOUND_BITS, uploads_in_range

from . import common_options, offline, profiles, progress
from .report import machine_info, markdown_table, write_json
from .synthetic import SyntheticConfig, config, tolerance_delta, update_values

STEPS = {
    "range": dict(method="top-bits", consistency=False),
    "range+norm": dict(method="top-bits", consistency=True),
    "range-signtests": dict(method="sign-tests", consistency=False),
}
SUBSTEPS = ("window", "norm", "verdict")


# ----------------------------------------------------------------------------- party side
def _uploads(cfg: SyntheticConfig, attacker: int | None) -> list[np.ndarray]:
    """Ring encodings of (updates (n, d), norms (n,), deltas (n,)) of one round."""
    g = np.stack([update_values(cfg, 0, j) for j in range(cfg.clients)])
    norms = encode(np.linalg.norm(g, axis=1))
    deltas = encode(np.array([tolerance_delta(row, cfg.alpha) for row in g]))
    x = encode(g)
    if attacker is not None:
        x[attacker, 0] = 1 << 62   # the upload of issue 14
    return [x, norms, deltas]


def _my_share(ring: np.ndarray, rank: int, seed: int) -> torch.Tensor:
    mask = np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=ring.shape, dtype=np.int64,
                                                endpoint=True)
    with np.errstate(over="ignore"):
        mine = mask if rank == 0 else ring - mask
    return crypten.mpc.MPCTensor.from_shares(torch.from_numpy(mine), precision=16)


def _program(party, spec: dict, steps: list[str], attacker: int | None, schedule,
             bar: progress.PartyBar | None = None) -> dict:
    with (bar or progress.PartyBar("range check")).open(len(steps)) as shown:
        shown.set_postfix_str("setup")
        p = offline.instrument(party, schedule, progress.step_hook(shown))
        cfg = SyntheticConfig.from_json(spec)
        shared = [_my_share(r, party.rank, 100 + i) for i, r in enumerate(_uploads(cfg, attacker))]
        # First calls pay one-off costs (torch kernels, allocator growth: ~3 s on the first step here);
        # a small check outside every step takes them (its material is fetched online, unmetered)
        uploads_in_range(None, *(t[:2, :64] if t.dim() == 2 else t[:2] for t in shared))
        verdicts = {}
        for name in steps:
            with p.meter(name):
                verdicts[name] = uploads_in_range(p, *shared, **STEPS[name])
    return {"verdicts": verdicts, "report": offline.party_report(p)}


# ----------------------------------------------------------------------------- parent side
def _cache_key(cfg: SyntheticConfig, steps: list[str], attacker: int | None) -> str:
    text = f"{cfg.key()}|{','.join(steps)}|{attacker}|{offline.code_fingerprint()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sub_rows(meters: list[dict], steps: list[str]) -> list[dict]:
    """Online rounds, bytes and seconds of the sub-steps (window, norm, verdict) of each step."""
    m0, m1 = meters[0]["steps"], meters[1]["steps"]
    rows = []
    for step in steps:
        for sub in SUBSTEPS:
            name = f"{step}/{sub}"
            if name in m0:
                a, b = m0[name], m1[name]
                rows.append({"step": name, "rounds": max(a["online_rounds"], b["online_rounds"]),
                             "online_bytes": a["online_bytes_sent"] + a["online_bytes_received"],
                             "online_s": max(a["seconds"], b["seconds"])})
    return rows


def build_rows(runs: offline.Runs, steps: list[str], profile, coords: int) -> list[dict]:
    comp = offline.summarize_steps(runs.compute.meters, steps, runs.offline)
    meas = offline.summarize_steps(runs.link.meters, steps, runs.offline) if runs.link else comp
    rows = []
    for name in steps:
        m, c = meas[name], comp[name]
        row = {"step": name, **{k: m[k] for k in ("rounds", "online_bytes", "bytes_per_direction", "offline_bytes",
                                                  "offline_bytes_to_party1", "online_s", "offline_s")},
               "compute_s": c["online_s"], "online_bytes_per_coordinate": m["online_bytes"] / coords,
               "offline_bytes_per_coordinate": m["offline_bytes"] / coords}
        if runs.link is not None:
            row["analytic_online_s"] = profiles.analytic_seconds(m["rounds"], m["bytes_per_direction"],
                                                                 c["online_s"], profile)
        rows.append(row)
    return rows


def _table(rows: list[dict], subs: list[dict], linked: bool) -> str:
    t1 = [{"step": r["step"], "rounds": r["rounds"], "online GB": f"{r['online_bytes'] / 1e9:.4g}",
           "B/coord": f"{r['online_bytes_per_coordinate']:.1f}", "offline GB": f"{r['offline_bytes'] / 1e9:.4g}",
           "offline B/coord": f"{r['offline_bytes_per_coordinate']:.1f}", "compute s": f"{r['compute_s']:.3g}",
           "online s": f"{r['online_s']:.3g}", "offline s": f"{r['offline_s']:.3g}",
           "analytic online s": f"{r['analytic_online_s']:.3g}" if linked else "-"} for r in rows]
    t2 = [{"sub-step": s["step"], "rounds": s["rounds"], "online MB": f"{s['online_bytes'] / 1e6:.4g}",
           "online s": f"{s['online_s']:.3g}"} for s in subs]
    if not t1:
        return ""
    return markdown_table(t1, list(t1[0])) + "\n\n" + markdown_table(t2, list(t2[0]) if t2 else ["sub-step"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_options.add_profile(p, netem=True)
    common_options.add_offline(p)
    p.add_argument("--config", default="mnist", choices=["mnist", "small", "tiny"],
                   help="shapes (default mnist: the paper CNN's 582,026 parameters, 20 clients)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--attacker", type=int, default=1, help="client uploading 2**62 (-1: none)")
    offline.add_cache_arguments(p)
    common_options.add_seed(p, "the synthetic uploads")
    common_options.add_out(p, None, shown="out/range-check-<config>-<profile>.json", beside=".md beside it")
    common_options.add_quiet(p)
    p.add_argument("--workers", type=int, default=None, metavar="K",
                   help="each server as a coordinator and K Ray workers (issue 30): the range check "
                        "(range+norm) and the aggregate on K coordinate shards, loopback only; "
                        "default: one process per server, as the daemon runs today")


def _on_workers(args: argparse.Namespace, cfg, attacker: int | None) -> int:
    from .worker_round import bench

    if args.profile != "none":
        return common_options.refuse("starfish bench range-check", "--workers runs on loopback only: "
                                     "add --profile none (the workers' links are not emulated)")
    if not 1 <= args.workers <= min(64, cfg.num_params):
        return common_options.refuse("starfish bench range-check", f"--workers must be 1..{min(64, cfg.num_params)}")
    try:
        res = bench(cfg, attacker, args.workers, args.offline, args.seed, args.quiet)
    except RuntimeError as exc:
        print(f"starfish bench range-check --workers: {exc}", file=sys.stderr)
        return 1
    expected = [j != attacker for j in range(cfg.clients)]
    correct = res["bits"] == expected and res["same_bits"] and res["aggregate_equals_numpy"]
    secs = res["seconds"]
    text = "\n".join([
        f"## starfish bench range-check --workers {args.workers}: config {cfg.name}: {cfg.clients} clients x "
        f"{cfg.num_params:,} coordinates, --offline {args.offline}, loopback; range check (windows and norm) "
        f"and the exact aggregate on {args.workers} coordinate shard(s) per server",
        f"verdicts (client {attacker} uploads 2**62): "
        f"{'as expected' if res['bits'] == expected and res['same_bits'] else 'WRONG: ' + str(res['bits'])}; "
        f"opened aggregate {'equals' if res['aggregate_equals_numpy'] else 'DIFFERS from'} numpy's ring sum",
        "",
        "| server | start s | scatter s | check s | aggregate s | worker peak RSS MiB |",
        "|---|---|---|---|---|---|",
        *(f"| {r} | {secs[r]['start']:.1f} | {secs[r]['scatter']:.1f} | {secs[r]['check']:.1f} | "
          f"{secs[r]['aggregate']:.1f} | {', '.join(f'{m:.0f}' for m in res['worker_peak_rss_mib'][r])} |"
          for r in (0, 1)),
        "",
        f"whole run (both servers' clusters, workers and engines started and stopped): {res['wall_s']:.1f} s"])
    print(text)
    out = args.out or f"out/range-check-{cfg.name}-workers{args.workers}-{args.offline}.json"
    path = write_json(out, {"machine": machine_info(), "benchmark": "range-check --workers",
                            "config": cfg.to_json(), "result": res, "expected": expected, "correct": correct,
                            "markdown": text})
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if correct else 1


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench range-check", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
        shaping = profiles.choose_shaping(profile, args.shaping)
    except (ValueError, RuntimeError) as exc:
        return common_options.refuse("starfish bench range-check", str(exc))
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if not steps or any(s not in STEPS for s in steps):
        print(f"unknown step(s) in {steps}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    cfg = config(args.config, seed=args.seed)
    attacker = None if args.attacker < 0 else args.attacker
    if attacker is not None and attacker >= cfg.clients:
        print(f"--attacker must be below {cfg.clients} (or -1)", file=sys.stderr)
        return 2
    if args.workers is not None:
        return _on_workers(args, cfg, attacker)
    fn_args = (cfg.to_json(), steps, attacker)
    label = f"range-check/{cfg.name}"
    common = dict(offline=args.offline, cache_dir=args.cache_dir, key=_cache_key(cfg, steps, attacker), prefix="range-check",
                  fresh=args.fresh, timeout=args.timeout, label=label, quiet=args.quiet,
                  party_args=progress.party_args(label, args.quiet))
    if shaping.method == "netem" and not os.environ.get(profiles.NETEM_ENV):
        offline.measure(_program, fn_args, profile=profiles.resolve("none"), shaping=profiles.Shaping("none", ""),
                        **common)
        return profiles.run_under_netem(profile, profiles.forwarded_argv(["bench", "range-check"], argv))
    t0 = time.perf_counter()
    runs = offline.measure(_program, fn_args, profile=profile, shaping=shaping, **common)
    final = runs.link or runs.compute
    coords = cfg.clients * cfg.num_params
    rows = build_rows(runs, steps, profile, coords)
    subs = _sub_rows(final.meters, steps)
    expected = [j != attacker for j in range(cfg.clients)]
    verdicts = final.values[0]["verdicts"]
    correct = all(v == expected for v in verdicts.values()) and final.values[1]["verdicts"] == verdicts
    reports = [v["report"] for v in final.values]
    mismatches = sum(len(r.get("mismatches", [])) for r in reports)
    # VmHWM after each step (the peak so far): the sign-test reference holds twice the elements
    peaks = [dict(r["step_peaks"]) for r in reports]
    rss = "; ".join(f"{name} " + " / ".join(f"{pk.get(name, 0) / 2**30:.2f}" for pk in peaks) + " GiB"
                    for name in steps)
    head = [f"## starfish bench range-check: config {cfg.name}: {cfg.clients} clients x {cfg.num_params:,} "
            f"coordinates ({coords:,}), one round's uploads, bound 2**{DEFAULT_BOUND_BITS} (ring units)",
            f"network: {profile.describe()}; applied by: {shaping.method} ({shaping.reason})",
            "GB = 1e9 bytes; online = server<->server, both directions; offline = dealer<->servers, both "
            "servers, fetched right before each step; seconds = the slower server",
            f"verdicts (client {attacker} uploads 2**62): {'as expected' if correct else 'WRONG: ' + str(verdicts)}; "
            f"dealer-schedule mismatches: {mismatches}",
            f"peak RSS of the two servers after each step: {rss}"]
    text = "\n".join(head) + "\n\n" + _table(rows, subs, runs.link is not None)
    print(text)
    out = args.out or f"out/range-check-{cfg.name}-{profile.name}.json"
    path = write_json(out, {
        "machine": machine_info(), "load_average_at_end": os.getloadavg(), "benchmark": "range-check",
        "config": cfg.to_json(), "profile": profile.to_json(), "shaping": shaping.to_json(), "rows": rows,
        "sub_steps": subs, "verdicts": verdicts, "expected": expected, "correct": correct, "runs": runs.seconds,
        "party_reports": reports, "seconds": time.perf_counter() - t0, "markdown": text})
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if correct else 1


__all__ = ["main", "add_arguments", "build_rows", "STEPS"]


if __name__ == "__main__":
    sys.exit(main())
