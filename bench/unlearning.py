"""One full Stage II under 2PC on the paper's MNIST shapes (the paper's Table II).

``protocols.starfish.run_stage2`` runs on each server's shares of a synthetic history of the real
shapes (``bench/synthetic.py``: 582,026 parameters, 20 clients, 40 rounds, sigma 0.6, alpha 0.4,
beta 0.1, B 2; target client 0), with the dealer, over TLS, in two processes. Offline = the
dealer material of each step fetched right before it (``bench/offline.py``); online = the
steps themselves. Runs: record the dealer schedule, a compute run without emulated link, a run
with the profile applied (skipped for ``--profile none``); schedule and compute run are cached
per configuration, so ``--profile wan`` after ``--profile lan`` reuses them when the round
selection method is the same.

Reported: totals as in Table II (offline/online time, offline/online GB) with the paper beside
them and the ratio; per step rounds, bytes, compute, measured and analytic time; the peak
resident memory of each server process; the bytes counted at the sockets (TLS) against the
metered frame bytes; the targets of issue 7 (online <= 22 GB, online time <= 20 min, peak RSS
<= 6 GiB per server on the LAN profile).

``--estimate-from OUT.json`` (no run): the analytic time of this profile from the per-step
rounds, bytes and compute seconds measured by an earlier full run (e.g. the LAN one), for
when a direct run would take too long (WAN: ~50 minutes of emulated transfer).

    starfish bench unlearning --profile lan --out out/unlearning-mnist-lan.json

``--aggregator fedseca|brace-sign``: the history is taken as made by that rule in every round,
and the replay steps with it in 2PC as the servers' job does (``protocols.starfish.
robust_replay``; BRACE's step 0.5 / sqrt(t), FedSECA's momentum from round 1); the rule's own
steps are reported as sub-rows of ``aggregate`` (``aggregate/rescale``, ``aggregate/quantile``,
``aggregate/signs``, ...: not added to the totals again). Their dealer material is not in the
recorded schedule (one call of each step, FedAvg's aggregate), so it is fetched online inside
the step: counted as the step's offline bytes, its time in the step's seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import sys
from pathlib import Path

from common.robust_rules import AGGREGATORS
from protocols.starfish import StarfishParams, run_stage2
from protocols.starfish.round_selection import choose_method, default_t_delta

from . import common_options, offline, profiles, progress
from . import steps as steps_bench
from .report import machine_info, write_json
from .unlearning_report import paper_row, render, target_rows
from .step_check import ShareRecorder, prune_records, step_check
from .synthetic import SyntheticConfig, config
from .twin_check import TARGET_PLAINTEXT_DIFF, plaintext_check, replay_combine

ONLINE_STEPS = ("TD", "RS", "UE", "TC", "pairs", "aggregate")
CLIENT_STEPS = ("correction",)   # simulated clients computing exact updates: no 2PC traffic


def _program(party, spec: dict, data_path: str, method: str, t_delta: int, cprofile_dir: str | None,
             aggregator: str, records_root: str | None, schedule, bar: progress.PartyBar | None = None) -> dict:
    # the replayed rounds drive the bar (known once RS has selected them); steps name the phase
    with (bar or progress.PartyBar("Stage II")).open(unit="round") as shown:
        shown.set_postfix_str("setup")
        cfg, hist, clients, p = steps_bench.party_setup(party, spec, data_path, schedule,
                                                        progress.step_hook(shown, count=False))
        params = StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer, method=method, t_delta=t_delta)
        prof = cProfile.Profile() if cprofile_dir else None
        if prof is not None:
            prof.enable()
        # a robust replay records its rows' shares for the step check (bench/step_check.py)
        recorder = ShareRecorder(records_root, party.rank) if records_root else None
        res = run_stage2(p, hist, list(cfg.targets), params, clients, progress=progress.callback(shown),
                         combine=replay_combine(aggregator, p.meter, observe=recorder))
    if prof is not None:
        prof.disable()
        Path(cprofile_dir).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(cprofile_dir) / f"party{party.rank}.pstats"))
    out = res.to_json()
    out["model_sha256"] = hashlib.sha256(res.model.numpy().tobytes()).hexdigest()
    out["model"] = res.model.numpy()
    out["client_computations"] = clients.computations
    out["report"] = offline.party_report(p)
    if recorder is not None:
        out["step_records"] = str(recorder.path)
    return out


def _step_check(cfg: SyntheticConfig, data_path: str, method: str, t_delta: int, runs: offline.Runs,
                aggregator: str, quiet: bool) -> dict:
    """``bench/step_check.py`` on the final run's records; then only the cached compute run's stay."""
    v0, v1 = (runs.link or runs.compute).values
    progress.say("step check: the plaintext twin in lockstep with the servers' opened steps ...", quiet=quiet)
    try:
        res = step_check(cfg, data_path, method, t_delta, v0, v1, aggregator, quiet)
    except (KeyError, OSError, ValueError, IndexError) as exc:
        res = {"met": False, "error": f"{type(exc).__name__}: {exc}"}
        res["line"] = (f"step check NOT run: {res['error']} (the cached compute run has no records: "
                       "add --fresh)")
    else:
        res["line"] = (
            f"step check (the twin in lockstep with the servers' opened steps, {res['seconds']:.0f}s): "
            f"{res['robust_rounds']} of {res['recorded_rounds']} robust rounds checked; rows: max |servers - twin| "
            f"{res['rows_max_diff']:.2e} (<= {res['target']:g}); rule on the servers' rows: "
            f"{('exact' if aggregator == 'brace-sign' else 'within its fixed-point bound') if res['rule_held'] else 'NOT held'} "
            f"(largest excess over the rule's bound "
            f"{res['rule_max_excess']:.2e}); the twin's own decision differs in at most "
            f"{100 * res['twin_decision_differs_max']:.2f}% of a round's coordinates; flags equal: "
            f"{'yes' if res['flags_equal'] else 'NO'}; model max diff {res['max_abs_diff']:.2e}: "
            f"{'met' if res['met'] else 'NOT met'}")
    root = Path(v0.get("step_records", "")).parent if v0.get("step_records") else None
    if root is not None and runs.compute is not None:
        prune_records(root, {v.get("step_records", "") for v in runs.compute.values})
    return res


def _method(profile: profiles.NetworkProfile, requested: str, T: int) -> tuple[str, int, str]:
    """(method for StarfishParams, t_delta, the method that will run) for this profile."""
    name = profile.name if profile.name in ("lan", "wan") else "lan"
    t_delta = default_t_delta(name)
    return requested, t_delta, choose_method(T, requested, t_delta)


def _cache_key(cfg: SyntheticConfig, runs_method: str, aggregator: str = "fedavg") -> str:
    text = f"{cfg.key()}|{runs_method}|{offline.code_fingerprint()}"
    if aggregator != "fedavg":
        text += f"|{aggregator}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def step_rows(runs: offline.Runs, profile: profiles.NetworkProfile) -> list[dict]:
    # the replay rule's own steps, nested in "aggregate" (only with --aggregator)
    subs = tuple(sorted(n for n in runs.compute.meters[0]["steps"] if n.startswith("aggregate/")))
    names = list(ONLINE_STEPS + CLIENT_STEPS + subs)
    comp = offline.summarize_steps(runs.compute.meters, names, runs.offline)
    meas = offline.summarize_steps(runs.link.meters, names, runs.offline) if runs.link else comp
    rows = []
    for name in names:
        if name not in meas:
            continue
        m, c = meas[name], comp[name]
        row = {"step": name, "calls": m["calls"], "rounds": m["rounds"], "online_bytes": m["online_bytes"],
               "bytes_per_direction": m["bytes_per_direction"], "offline_bytes": m["offline_bytes"],
               "offline_bytes_to_party1": m["offline_bytes_to_party1"], "offline_rounds": m["offline_rounds"],
               "online_s": m["online_s"], "offline_s": m["offline_s"], "compute_s": c["online_s"],
               "offline_compute_s": c["offline_s"], "inline_offline_bytes": m["inline_offline_bytes"],
               "client_side": name in CLIENT_STEPS, "sub_step": name in subs}
        if runs.link is not None:
            row["analytic_online_s"] = profiles.analytic_seconds(m["rounds"], m["bytes_per_direction"],
                                                                 c["online_s"], profile)
            row["analytic_offline_s"] = profiles.analytic_seconds(m["offline_rounds"], m["offline_bytes_to_party1"],
                                                                  c["offline_s"], profile)
            row["online_rel_diff"] = profiles.relative_difference(m["online_s"], row["analytic_online_s"])
            row["overlap_online_s"] = profiles.analytic_overlap_seconds(m["rounds"], m["bytes_per_direction"],
                                                                        c["online_s"], profile)
            row["overlap_rel_diff"] = profiles.relative_difference(m["online_s"], row["overlap_online_s"])
            row["offline_rel_diff"] = profiles.relative_difference(m["offline_s"], row["analytic_offline_s"])
        rows.append(row)
    return rows


def totals(rows: list[dict]) -> dict:
    on = [r for r in rows if not r["client_side"] and not r.get("sub_step")]
    t = {k: sum(r[k] for r in on) for k in ("online_bytes", "offline_bytes", "online_s", "offline_s",
                                            "compute_s", "rounds")}
    if on and "analytic_online_s" in on[0]:
        t["analytic_online_s"] = sum(r["analytic_online_s"] for r in on)
        t["analytic_offline_s"] = sum(r["analytic_offline_s"] for r in on)
        t["online_rel_diff"] = profiles.relative_difference(t["online_s"], t["analytic_online_s"])
        if "overlap_online_s" in on[0]:
            t["overlap_online_s"] = sum(r["overlap_online_s"] for r in on)
            t["overlap_rel_diff"] = profiles.relative_difference(t["online_s"], t["overlap_online_s"])
        t["offline_rel_diff"] = profiles.relative_difference(t["offline_s"], t["analytic_offline_s"])
    t["client_s"] = sum(r["online_s"] for r in rows if r["client_side"])
    return t


def estimate(from_json: str, profile: profiles.NetworkProfile,
             calibrate_json: str | None = None) -> tuple[list[dict], dict, str, dict | None]:
    """Analytic per-step times on ``profile`` from an earlier run's rounds, bytes and compute.

    ``calibrate_json``: a *measured* run on this profile (e.g. fewer clients); each step's
    analytic time is also multiplied by that run's measured / analytic ratio for the step.
    """
    src = json.loads(Path(from_json).read_text())
    cal = None
    if calibrate_json:
        c = json.loads(Path(calibrate_json).read_text())
        if c["profile"]["name"] != profile.name or "estimate_from" in c:
            raise ValueError(f"{calibrate_json} is not a measured run on profile {profile.name}")
        cal = {"file": calibrate_json, "clients": c["config"]["clients"],
               "factors": {r["step"]: r["online_s"] / r["analytic_online_s"] for r in c["steps"]
                           if r.get("analytic_online_s")}}
    rows = []
    for r in src["steps"]:
        r = dict(r)
        r["analytic_online_s"] = profiles.analytic_seconds(r["rounds"], r["bytes_per_direction"], r["compute_s"], profile)
        r["analytic_offline_s"] = profiles.analytic_seconds(r["offline_rounds"], r["offline_bytes_to_party1"],
                                                            r["offline_compute_s"], profile)
        r["overlap_online_s"] = profiles.analytic_overlap_seconds(r["rounds"], r["bytes_per_direction"],
                                                                  r["compute_s"], profile)
        r["online_s"], r["offline_s"] = r["analytic_online_s"], r["analytic_offline_s"]
        r["online_rel_diff"] = r["offline_rel_diff"] = r["overlap_rel_diff"] = None
        if cal is not None:
            r["calibration_factor"] = cal["factors"].get(r["step"], 1.0)
            r["calibrated_online_s"] = r["analytic_online_s"] * r["calibration_factor"]
        rows.append(r)
    return rows, src, src["round_selection"], cal


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_options.add_profile(p, netem=True)
    common_options.add_offline(p)
    p.add_argument("--config", default="mnist", choices=["mnist", "small", "tiny", "5m"],
                   help="synthetic history shapes (default mnist: 582,026 parameters, 20 clients, 40 rounds; "
                        "5m: 5,000,000 parameters, 20 clients, 20 rounds, for --workers)")
    p.add_argument("--clients", type=int, default=None,
                   help="override the number of clients (a smaller run to validate a slow profile)")
    p.add_argument("--rs-method", default="auto", choices=["auto", "ratio", "divide"],
                   help="round selection: auto (default) = Method 1 below the profile's T_delta, else Method 2")
    p.add_argument("--aggregator", default="fedavg", choices=AGGREGATORS,
                   help="the rule that made the history: the replay steps with it in 2PC, as the servers' "
                        "job does (default fedavg: the paper's replay)")
    p.add_argument("--estimate-from", default=None, metavar="JSON",
                   help="no run: analytic times on this profile from the steps of an earlier run's JSON")
    p.add_argument("--calibrate-with", default=None, metavar="JSON",
                   help="with --estimate-from: a measured run on this profile (e.g. --clients 5) whose per-step "
                        "measured/analytic ratios also scale the estimate")
    p.add_argument("--cprofile", default=None, metavar="DIR",
                   help="write cProfile statistics of each server (party0/1.pstats) to DIR (slows the run)")
    offline.add_cache_arguments(p)
    common_options.add_seed(p, "the synthetic history")
    common_options.add_out(p, None, shown="out/unlearning-<config>-<profile>.json", beside=".md beside it")
    common_options.add_quiet(p)
    p.add_argument("--workers", type=int, default=None, metavar="K",
                   help="each server as a coordinator and K Ray workers (issue 30): Stage II with every "
                        "m-long value on K coordinate shards, loopback only; default: one process per server")
    p.add_argument("--worker-spill-mib", type=float, default=0.0, metavar="MIB",
                   help="with --workers: each worker keeps its shares of at least MIB MiB in files of its "
                        "temporary directory, mapped when used ([deployment] worker_spill_mib); 0 (default): "
                        "in memory")


def _on_workers(args: argparse.Namespace, cfg: SyntheticConfig) -> int:
    """``--workers K``: bench/worker_unlearning.py's job, a table, the JSON."""
    from .worker_unlearning import bench

    if args.profile != "none":
        return common_options.refuse("starfish bench unlearning", "--workers runs on loopback only: add "
                                     "--profile none (the workers' links are not emulated)")
    if not 1 <= args.workers <= min(64, cfg.num_params):
        return common_options.refuse("starfish bench unlearning", f"--workers must be 1..{min(64, cfg.num_params)}")
    if not 0 <= args.worker_spill_mib < float("inf"):
        return common_options.refuse("starfish bench unlearning", "--worker-spill-mib must be a number >= 0")
    method, t_delta, method_run = _method(profiles.resolve("none"), args.rs_method, cfg.rounds)
    data_path = steps_bench.synthetic_history(cfg, args.cache_dir, args.quiet)
    try:
        res = bench(cfg, str(data_path), args.workers, args.offline, method, t_delta, args.quiet,
                    spill_mib=args.worker_spill_mib)
    except RuntimeError as exc:
        print(f"starfish bench unlearning --workers: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    twin = res["plaintext_twin"]
    # BRACE's opened vote and FedSECA's keep and sign bits may differ from the twin's at a
    # coordinate whose estimate lies within its fixed-point error of 0 or of its threshold
    # (robust_replay); the rows stay at the workers, so the one-process step check cannot run
    # here: rounds and flags decide, the differing fraction is reported
    ok = res["servers_agree"] and twin["selected_rounds_equal"] and twin["flags_equal"] and (
        twin["met"] or cfg.aggregator in ("brace-sign", "fedseca"))
    gib = 1 / 1e9
    rows = []
    for r, srv in enumerate(res["servers"]):
        c = srv["coordinator"]
        rows.append(f"| {r} | coordinator | {c['peak_rss_mib']:.0f} | - | {c['online'] * gib:.3f} "
                    f"| {c['offline'] * gib:.3f} | {c['rounds']} |")
        rows += [f"| {r} | worker {k} | {w['peak_rss_mib']:.0f} | {w.get('peak_held_mib', 0):.0f} "
                 f"({w.get('peak_spilled_mib', 0):.0f} in files) | {w['online'] * gib:.3f} "
                 f"| {w['offline'] * gib:.3f} | {w['rounds']} |" for k, w in enumerate(srv["workers"])]
    text = "\n".join([
        f"## starfish bench unlearning --workers {args.workers}: config {cfg.name}: {cfg.clients} clients x "
        f"{cfg.num_params:,} parameters, {cfg.rounds} rounds, --offline {args.offline}, loopback; every m-long "
        f"value on {args.workers} coordinate shard(s) per server, round selection {method_run}",
        f"Stage II: {res['servers'][0]['job_s']:.1f} s (server 0; server 1 {res['servers'][1]['job_s']:.1f} s); "
        f"workers and sessions started in {res['servers'][0]['start_s']:.1f} s; whole run {res['wall_s']:.1f} s"
        + (f"; shares of >= {args.worker_spill_mib:g} MiB spilled to the workers' files" if args.worker_spill_mib else ""),
        f"replay: {len(res['selected_rounds'])} selected rounds, {res['warmup_steps']} warm-up steps, "
        f"{res['estimated_updates']} estimated updates, flags {sum(len(f) for f in res['flags'].values())}; "
        f"both servers' models identical: {'yes' if res['servers_agree'] else 'NO'}",
        f"plaintext twin: selected rounds equal: {'yes' if twin['selected_rounds_equal'] else 'NO'}; flags equal: "
        f"{'yes' if twin['flags_equal'] else 'NO'}; max |2PC - plaintext| {twin['max_abs_diff']:.2e} "
        f"(target <= {TARGET_PLAINTEXT_DIFF:g}: {'met' if twin['met'] else 'NOT met'}); coordinates differing by "
        f"more: {twin['differing_fraction']:.2%}" + (" (BRACE: votes flipped where an estimate is within its "
                                                    "fixed-point error of 0)" if cfg.aggregator == "brace-sign" else ""),
        "",
        "| server | process | peak RSS MiB | peak shares held MiB | online GB | offline GB | online rounds |",
        "|---|---|---|---|---|---|---|", *rows])
    print(text)
    agg = "" if cfg.aggregator == "fedavg" else f"-{cfg.aggregator}"
    out = args.out or f"out/unlearning-{cfg.name}{agg}-workers{args.workers}-{args.offline}.json"
    path = write_json(out, {"machine": machine_info(), "benchmark": "unlearning --workers", "config": cfg.to_json(),
                            "round_selection": method_run, "result": res, "correct": ok, "markdown": text})
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench unlearning", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
        shaping = (profiles.Shaping("analytic", f"estimated from {args.estimate_from}, not run")
                   if args.estimate_from else profiles.choose_shaping(profile, args.shaping))
    except (ValueError, RuntimeError) as exc:
        return common_options.refuse("starfish bench unlearning", str(exc))
    cfg = config(args.config, seed=args.seed)
    if args.clients is not None:
        cfg = cfg.with_(clients=args.clients, note=f"{cfg.note}; clients overridden to {args.clients}")
    suffix = f"-n{cfg.clients}" if args.clients is not None else ""
    agg = getattr(args, "aggregator", "fedavg")
    if agg != "fedavg":
        suffix += f"-{agg}"
        cfg = cfg.with_(aggregator=agg, note=f"{cfg.note}; every round's model made by {agg}")
    if getattr(args, "workers", None) is not None:
        return _on_workers(args, cfg)
    out_path = args.out or f"out/unlearning-{cfg.name}{suffix}-{profile.name}{'-estimate' if args.estimate_from else ''}.json"

    if args.estimate_from:
        rows, src, method_run, cal = estimate(args.estimate_from, profile, args.calibrate_with)
        tot = totals(rows)
        tot["online_rel_diff"] = tot["overlap_rel_diff"] = None
        if cal is not None:
            tot["calibrated_online_s"] = sum(r["calibrated_online_s"] for r in rows if not r["client_side"])
        rss = src["peak_rss_bytes"]
        wire = src["wire"]
        if src["round_selection"] != _method(profile, "auto", cfg.rounds)[2]:
            method_run = (f"{src['round_selection']} (as in {args.estimate_from}; on {profile.name} auto would pick "
                          f"{_method(profile, 'auto', cfg.rounds)[2]}: same rounds +-2%, bytes < 1.5 MB either way)")
        extra = [f"ESTIMATE, not a run: analytic times (rounds x one-way latency + bytes per direction x 8 / "
                 f"bandwidth + compute) from the per-step rounds, bytes and compute seconds of {args.estimate_from} "
                 f"(profile {src['profile']['name']}, measured {src['machine']['time']}); memory and wire rows "
                 "are that run's."]
        if cal is not None:
            extra.append(f"calibrated: each step's analytic time x (measured / analytic) of the same step in "
                         f"{cal['file']} (a measured {profile.name} run with {cal['clients']} clients): "
                         + ", ".join(f"{k} {v:.3f}" for k, v in cal["factors"].items()))
        text = render(cfg, profile, shaping, method_run, rows, tot, paper_row(profile, tot), rss, wire, extra,
                      True, target_rows(tot, rss, profile), estimated=True)
        print(text)
        payload = {"machine": machine_info(), "load_average_at_end": os.getloadavg(), "benchmark": "unlearning", "estimate_from": args.estimate_from,
                   "config": cfg.to_json(), "profile": profile.to_json(), "shaping": shaping.to_json(),
                   "round_selection": method_run, "steps": rows, "totals": tot, "paper": paper_row(profile, tot),
                   "calibration": cal, "markdown": text}
        path = write_json(out_path, payload)
        Path(path).with_suffix(".md").write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return 0

    method, t_delta, method_run = _method(profile, args.rs_method, cfg.rounds)
    data_path = steps_bench.synthetic_history(cfg, args.cache_dir, args.quiet)
    key = _cache_key(cfg, method_run, agg)
    records_root = (Path(args.cache_dir) / f"unlearning-steps-{key}-{args.offline}") if agg != "fedavg" else None
    fn_args = (cfg.to_json(), str(data_path), method, t_delta, args.cprofile, agg,
               str(records_root) if records_root else None)
    # The dealer requests of TD, RS, UE, TC are the same on every call: record them with one
    # call of each (bench/steps.py's program on the same shapes) instead of a whole Stage II.
    rs = "RS1" if method_run == "ratio" else "RS2"
    record = (steps_bench._program, (cfg.to_json(), str(data_path), ["TD2", rs, "UE", "TC", "aggregate"], []))
    aliases = {"TD": "TD2", "RS": rs, "UE": "UE", "TC": "TC", "aggregate": "aggregate"}
    label = f"unlearning/{cfg.name}"
    common = dict(offline=args.offline, cache_dir=args.cache_dir, key=key, prefix="unlearning",
                  fresh=args.fresh or bool(args.cprofile), timeout=args.timeout, label=label,
                  record=record, aliases=aliases, quiet=args.quiet, party_args=progress.party_args(label, args.quiet))
    if shaping.method == "netem" and not os.environ.get(profiles.NETEM_ENV):
        offline.measure(_program, fn_args, profile=profiles.resolve("none"), shaping=profiles.Shaping("none", ""),
                        **common)
        return profiles.run_under_netem(profile, profiles.forwarded_argv(["bench", "unlearning"], argv))
    runs = offline.measure(_program, fn_args, profile=profile, shaping=shaping, **common)
    final = runs.link or runs.compute
    rows = step_rows(runs, profile)
    tot = totals(rows)
    reports = [v["report"] for v in final.values]
    rss = [r["peak_rss_bytes"] for r in reports]
    wire = offline.wire_check(final.meters, runs.offline)
    v0, v1 = final.values
    agree = v0["model_sha256"] == v1["model_sha256"] and v0["selected_rounds"] == v1["selected_rounds"]
    mismatches = [m for r in reports for m in r.get("mismatches", [])]
    wall = max(m["total"]["seconds"] for m in final.meters)
    extra = [f"replay: {len(v0['selected_rounds'])} selected rounds, {v0['warmup_steps']} warm-up, checks at "
             f"{v0['correction_steps']}, {v0['estimated_updates']} estimated client updates, flags "
             f"{sum(len(f) for f in v0['flags'].values())}; both servers' models identical: {'yes' if agree else 'NO'}; "
             f"whole session {wall:.1f}s (including offline prefetches and history reads); "
             f"dealer-schedule mismatches: {len(mismatches)}"]
    for i, r in enumerate(reports):
        peak = r["peak_rss_bytes"]
        first = next((name for name, hwm in r["step_peaks"] if hwm >= 0.99 * peak), None)
        if first:
            extra.append(f"server {i}: peak resident memory first reached during step {first}")
    rec_rss = runs.schedule.meta.get("record_peak_rss_bytes")
    if rec_rss:
        extra.append("peak resident memory of the recording run (one call of each step, material fetched online "
                     f"per request, no prefetch): {', '.join(f'{x / 2**30:.2f} GiB' for x in rec_rss)}")
    if runs.seconds.get("compute_reused_from"):
        extra.append(f"compute run reused from {runs.seconds['compute_reused_from']}")
    progress.say("plaintext twin: run_stage2 on the same history in the clear ...", quiet=args.quiet)
    twin = plaintext_check(cfg, str(data_path), method, t_delta, v0, args.quiet, agg)
    extra.append(f"plaintext twin (run_stage2 in the clear on the same history, {twin['plaintext_seconds']:.0f}s): "
                 f"selected rounds equal: {'yes' if twin['selected_rounds_equal'] else 'NO'}; flags equal: "
                 f"{'yes' if twin['flags_equal'] else 'NO'}; max |2PC - plaintext| over the model "
                 f"{twin['max_abs_diff']:.2e} (target <= {TARGET_PLAINTEXT_DIFF:g}: "
                 f"{'met' if twin['met'] else 'NOT met'}; coordinates beyond it: "
                 f"{100 * twin['differing_fraction']:.2f}%); largest |g_hat| "
                 + (f"{twin['largest_estimate']:.3g}" if twin["largest_estimate"] is not None else "-")
                 + f" (SecTC's domain: below {twin['sectc_domain']:.0f})")
    steps_check = None
    if records_root is None:
        ok = agree and twin["selected_rounds_equal"] and twin["flags_equal"] and twin["met"]
    else:
        steps_check = _step_check(cfg, str(data_path), method, t_delta, runs, agg, args.quiet)
        extra.append(steps_check["line"])
        # a robust rule's edges make the free-running twin drift (bench/step_check.py): the
        # servers are held to the lockstep twin, the free twin's figures are reported beside it
        ok = agree and twin["selected_rounds_equal"] and steps_check["met"]
    targets = target_rows(tot, rss, profile)
    paper = paper_row(profile, tot)
    text = render(cfg, profile, shaping, method_run, rows, tot, paper, rss, wire, extra,
                  runs.link is not None, targets)
    print(text)
    peaks = {f"server{i}": r["step_peaks"] for i, r in enumerate(reports)}
    payload = {
        "machine": machine_info(), "load_average_at_end": os.getloadavg(), "benchmark": "unlearning", "config": cfg.to_json(),
        "history": "synthetic (bench/synthetic.py): values from a seeded generator, real shapes",
        "profile": profile.to_json(), "shaping": shaping.to_json(), "round_selection": method_run,
        "t_delta": t_delta, "steps": rows, "totals": tot, "paper": paper, "targets": targets,
        "peak_rss_bytes": rss, "step_peaks": peaks, "wire": wire, "runs": runs.seconds,
        "schedule_requests": runs.schedule.num_requests,
        "schedule_meta": runs.schedule.meta, "mismatches": mismatches,
        "stage2": {k: v for k, v in v0.items() if k not in ("report", "model")}, "servers_agree": agree,
        "plaintext_twin": twin, "step_check": steps_check, "aggregator": agg,
        "session_seconds": wall, "markdown": text,
    }
    path = write_json(out_path, payload)
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path} and {Path(path).with_suffix('.md')}", file=sys.stderr)
    return 0 if ok else 1


__all__ = ["main", "add_arguments", "step_rows", "totals", "estimate", "plaintext_check"]


if __name__ == "__main__":
    sys.exit(main())
