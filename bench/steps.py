"""Per-step 2PC cost of one unlearning round on the paper's MNIST shapes (the paper's Table I).

Steps, each a top-level metered step of one two-party session (two processes, TLS, dealer):

* ``TD1``  FedRecover's threshold determination in 2PC (secure sort of |g| over all stored
  coordinates of the remaining clients; see ``bench/costs.py``): run on two samples of the
  history and **extrapolated** to the full m (n-1) T entries;
* ``TD2``  Starfish's: SecMax over the T thresholds delta_i^j of each remaining client (batched);
* ``RS1``/``RS2``  round selection with Method 1 (division-free ratio comparator) and Method 2
  (SecDiv, then comparisons): ``protocols.starfish.round_selection.starfish_select`` with method ratio/divide;
* ``UE``   one round's update estimate for all n-1 remaining clients (compact L-BFGS, B pairs),
  reached through Stage II's replay loop (``protocols.starfish.replay``) after its warm-up;
* ``TC``   one threshold check for all n-1 remaining clients (n-1 x m coordinates);
* ``aggregate`` (not in Table I) sum_j w_j g^j and its opening, the rest of a replayed round.

History: synthetic, of the real shapes (``bench/synthetic.py``; MNIST files are absent and the
cost depends on shapes only). Offline = dealer material of the step fetched right before it
(``bench/offline.py``); online = the step itself with no dealer traffic. Runs: record the dealer
schedule, a compute run (no emulated link), and with ``--profile lan|wan|custom`` a run with
the profile applied; the analytic time is computed from the compute run and reported beside the
measured one.

    starfish bench steps --profile lan --config mnist --out out/steps-lan.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from mpc.crypten_compat import crypten
from protocols.backend import cat, stack
from protocols.inverse import inverse_masked
from protocols.maximum import max as secure_max
from protocols.sort import bitonic_sort
from protocols.starfish import (StarfishParams, check_thresholds, determine_thresholds, select_rounds,
                                starfish_select)
from protocols.starfish.replay import Replay
from protocols.threshold import any_exceeds

from . import common_options, costs, offline, profiles, progress
from .report import machine_info, markdown_table, write_json
from .synthetic import SyntheticClients, SyntheticConfig, SyntheticHistory, config, load_data, prepare

STEPS = ("TD1", "TD2", "RS1", "RS2", "UE", "TC", "aggregate")
TD1_SAMPLES = (4, 16)   # coordinates per stored update in the two TD1 samples


def _warm_up() -> None:
    """First calls pay one-off costs (lazy imports, first dispatch: ~2 s for the first ratio
    sort); run each kind of protocol once on tiny inputs, outside every metered step."""
    x = crypten.cryptensor(torch.arange(1.0, 5.0, dtype=torch.float64), src=0)
    (x * x).reveal()
    (x >= 0.5).reveal()
    select_rounds(x, x + 1, 2, method="ratio")
    select_rounds(x, x + 1, 2, method="divide")
    secure_max(x)
    bitonic_sort(x, None, descending=True, stable=False)
    any_exceeds(x.reshape(1, 4), x[:1])
    inverse_masked(crypten.cryptensor(torch.eye(4, dtype=torch.float64).unsqueeze(0) * 2, src=0))


# ----------------------------------------------------------------------------- party side
def party_setup(party, spec: dict, data_path: str, schedule, on_step=None):
    """What every benchmark party program starts with: one thread, the synthetic history of
    this party's shares, its simulated clients, dealer-material instrumentation (``on_step``:
    told of each top-level step, for a progress bar), warm-up."""
    torch.set_num_threads(1)
    cfg = SyntheticConfig.from_json(spec)
    hist = SyntheticHistory(cfg, load_data(data_path), party.rank, party.wrap_share)
    clients = SyntheticClients(hist)
    p = offline.instrument(party, schedule, on_step)
    _warm_up()
    return cfg, hist, clients, p


def top_level_steps(steps: list[str], td1_samples: list[int]) -> int:
    """How many top-level metered steps :func:`_program` runs (the length of its progress bar)."""
    n = int("TD2" in steps or "TC" in steps) + (len(td1_samples) if "TD1" in steps else 0)
    n += sum(name in steps for name in ("RS1", "RS2"))
    if {"UE", "TC", "aggregate"} & set(steps):
        n += 1 + len({"TC", "aggregate"} & set(steps))
    return n


def _program(party, spec: dict, data_path: str, steps: list[str], td1_samples: list[int],
             schedule, bar: progress.PartyBar | None = None) -> dict:
    with (bar or progress.PartyBar("steps")).open(top_level_steps(steps, td1_samples)) as shown:
        shown.set_postfix_str("setup")
        return _run_steps(party, spec, data_path, steps, td1_samples, schedule, progress.step_hook(shown))


def _run_steps(party, spec: dict, data_path: str, steps: list[str], td1_samples: list[int],
               schedule, on_step) -> dict:
    cfg, hist, clients, p = party_setup(party, spec, data_path, schedule, on_step)
    rest, T, out = cfg.remaining, cfg.rounds, {}

    thr = None
    if "TD2" in steps or "TC" in steps:
        deltas = stack([stack([hist.delta(i, j) for i in range(1, T + 1)]) for j in rest])
        with p.meter("TD2"):
            thr = determine_thresholds(deltas)
    for c in td1_samples if "TD1" in steps else ():
        vals = cat([hist.update_prefix(i, j, c) for i in range(1, T + 1) for j in rest])
        with p.meter(f"TD1:{int(vals.shape[0])}"):
            costs.fedrecover_threshold(vals, cfg.alpha, p.meter)
        del vals
    k = StarfishParams(sigma=cfg.sigma).num_selected(T)
    for name, method in (("RS1", "ratio"), ("RS2", "divide")):
        if name in steps:
            with p.meter(name):
                out[name] = starfish_select(hist, list(cfg.targets), k, StarfishParams(method=method))
    if {"UE", "TC", "aggregate"} & set(steps):
        metered = {"UE"} | ({"TC", "aggregate"} & set(steps))
        out.update(_one_estimated_round(p, hist, clients, cfg, thr, metered))
    out["report"] = offline.party_report(p)
    return out


class _OneCheckedRound:
    """Warm-up until the buffers are full (as run_stage2), then one estimated round, checked."""

    def __init__(self, thresholds, check: bool) -> None:
        self.thresholds = thresholds
        self.check = check
        self.flags: list[int] | None = None

    def exact_now(self, step: int, round_index: int, replay: Replay) -> bool:
        return not replay.buffers.all_full()

    def rejected(self, step: int, round_index: int, estimates, replay: Replay) -> list[int]:
        if self.check:
            with replay.meter("TC"):
                self.flags = [int(f) for f in check_thresholds(estimates, self.thresholds)]
        return []  # the table measures one estimated round; corrections are the clients' work


def _one_estimated_round(p, hist, clients, cfg: SyntheticConfig, thresholds, metered: set[str]) -> dict:
    """UE, TC and aggregate of one replayed round, through Stage II's own replay loop.

    The warm-up rounds before it (exact updates filling B pairs per client) run outside
    every meter; the first estimated round is metered step by step.
    """
    schedule = _OneCheckedRound(thresholds, "TC" in metered)
    estimating = False  # decided at the start of a round: the warm-up's last round is not metered

    def meter(name: str):
        return p.meter(name) if estimating and name in metered else contextlib.nullcontext()

    replay = Replay(hist, cfg.remaining, clients, buffer=cfg.buffer, server_lr=hist.server_lr, meter=meter)
    for t in range(1, cfg.rounds + 1):
        estimating = replay.buffers.all_full()
        replay.replay_round(t, schedule)
        if estimating:
            break
    out = {"aggregate_norm": float(replay.last_aggregate.norm())}
    if schedule.flags is not None:
        out["flags"] = schedule.flags
    return out


# ----------------------------------------------------------------------------- parent side
def synthetic_history(cfg: SyntheticConfig, cache_dir: str, quiet: bool = False):
    """``prepare`` with a bar over the rounds it generates (minutes for the MNIST shapes, once)."""
    t0 = time.perf_counter()
    with progress.progress(cfg.rounds, f"synthetic history {cfg.name}", quiet=quiet, unit="round") as bar:
        path = prepare(cfg, cache_dir, lambda _msg: bar.update(1))
    progress.say(f"synthetic history: {path} ({time.perf_counter() - t0:.1f}s)", quiet=quiet)
    return path


def _cache_key(cfg: SyntheticConfig, steps: list[str], samples: list[int]) -> str:
    text = f"{cfg.key()}|{','.join(steps)}|{samples}|{offline.code_fingerprint()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _td1_row(summary: dict[str, dict], full_n: int) -> dict | None:
    pts = {int(k.split(":")[1]): v for k, v in summary.items() if k.startswith("TD1:")}
    if not pts:
        return None
    row = {"extrapolated": True, "samples": sorted(pts), "full_entries": full_n}
    for q in ("online_bytes", "bytes_per_direction", "offline_bytes", "offline_bytes_to_party1",
              "online_s", "offline_s"):
        row[q] = costs.extrapolate([(n, v[q]) for n, v in pts.items()], full_n, "work")
    for q in ("rounds", "offline_rounds"):
        row[q] = costs.extrapolate([(n, v[q]) for n, v in pts.items()], full_n, "rounds")
    row["calls"] = 1
    return row


def build_rows(cfg: SyntheticConfig, runs: offline.Runs, profile: profiles.NetworkProfile) -> list[dict]:
    comp = offline.summarize_steps(runs.compute.meters, offline=runs.offline)
    meas = offline.summarize_steps(runs.link.meters, offline=runs.offline) if runs.link is not None else comp
    full_n = cfg.num_params * len(cfg.remaining) * cfg.rounds
    for summ in (comp, meas):
        td1 = _td1_row(summ, full_n)
        if td1 is not None:
            summ["TD1"] = td1
    rows = []
    samples = sorted((k for k in meas if k.startswith("TD1:")), key=lambda k: int(k.split(":")[1]))
    for name in [*STEPS, *samples]:
        if name not in meas:
            continue
        m, c = meas[name], comp[name]
        row = {
            "step": name if ":" not in name else f"TD1 sample of {int(name.split(':')[1]):,}",
            "sample": ":" in name,
            "extrapolated": bool(m.get("extrapolated")),
            "offline_s": m["offline_s"],
            "online_s": m["online_s"],
            "offline_bytes": m["offline_bytes"],
            "online_bytes": m["online_bytes"],
            "bytes_per_direction": m["bytes_per_direction"],
            "rounds": m["rounds"],
            "offline_rounds": m["offline_rounds"],
            "compute_s": c["online_s"],
            "offline_compute_s": c["offline_s"],
            "inline_offline_bytes": m.get("inline_offline_bytes", 0),
        }
        if runs.link is not None and not row["extrapolated"]:
            row["analytic_online_s"] = profiles.analytic_seconds(m["rounds"], m["bytes_per_direction"],
                                                                 c["online_s"], profile)
            row["analytic_offline_s"] = profiles.analytic_seconds(m["offline_rounds"], m["offline_bytes_to_party1"],
                                                                  c["offline_s"], profile)
            row["online_rel_diff"] = profiles.relative_difference(m["online_s"], row["analytic_online_s"])
            row["overlap_online_s"] = profiles.analytic_overlap_seconds(m["rounds"], m["bytes_per_direction"],
                                                                        c["online_s"], profile)
            row["overlap_rel_diff"] = profiles.relative_difference(m["online_s"], row["overlap_online_s"])
            row["offline_rel_diff"] = profiles.relative_difference(m["offline_s"], row["analytic_offline_s"])
        # the paper measured the MNIST shapes only: a smaller config next to its figures misleads
        paper = costs.PAPER_TABLE1.get(name) if cfg.name == "mnist" else None
        if paper is not None:
            row["paper"] = dict(zip(("offline_s", "online_s", "offline_gb", "online_gb"), paper))
            row["ratio_online_gb"] = costs.ratio(costs.gb(m["online_bytes"]), paper[3])
            row["ratio_offline_gb"] = costs.ratio(costs.gb(m["offline_bytes"]), paper[2])
            row["ratio_online_s"] = costs.ratio(m["online_s"], paper[1])
            row["ratio_offline_s"] = costs.ratio(m["offline_s"], paper[0])
        rows.append(row)
    return rows


def tables(rows: list[dict], linked: bool) -> tuple[str, str]:
    t1 = []
    for r in rows:
        if r["sample"]:
            continue
        p = r.get("paper", {})
        label = r["step"] + (" (extrapolated)" if r["extrapolated"] else "")
        t1.append({
            "step": label,
            "offline s": costs.fmt(r["offline_s"]), "online s": costs.fmt(r["online_s"]),
            "offline GB": costs.fmt(costs.gb(r["offline_bytes"])), "online GB": costs.fmt(costs.gb(r["online_bytes"])),
            "rounds": costs.fmt(int(round(r["rounds"]))),
            "paper offline s": costs.fmt(p.get("offline_s")), "paper online s": costs.fmt(p.get("online_s")),
            "paper offline GB": costs.fmt(p.get("offline_gb")), "paper online GB": costs.fmt(p.get("online_gb")),
            "ratio online GB": costs.fmt(r.get("ratio_online_gb"), 3),
            "ratio online s": costs.fmt(r.get("ratio_online_s"), 3),
        })
    cols1 = ["step", "offline s", "online s", "offline GB", "online GB", "rounds", "paper offline s",
             "paper online s", "paper offline GB", "paper online GB", "ratio online GB", "ratio online s"]
    if not any("paper" in r for r in rows):
        cols1 = cols1[:6]     # a config other than mnist: nothing of the paper's to compare with
    t2 = []
    for r in rows:
        row = {"step": r["step"] + (" (extrapolated)" if r["extrapolated"] else ""),
               "rounds": costs.fmt(int(round(r["rounds"]))),
               "MB per direction": costs.fmt(r["bytes_per_direction"] / 1e6),
               "compute s": costs.fmt(r["compute_s"]), "online s": costs.fmt(r["online_s"])}
        if linked:
            row.update({"analytic online s": costs.fmt(r.get("analytic_online_s")),
                        "online diff": _pct(r.get("online_rel_diff")),
                        "overlap bound s": costs.fmt(r.get("overlap_online_s")),
                        "diff to bound": _pct(r.get("overlap_rel_diff")),
                        "offline s": costs.fmt(r["offline_s"]),
                        "analytic offline s": costs.fmt(r.get("analytic_offline_s")),
                        "offline diff": _pct(r.get("offline_rel_diff"))})
        t2.append(row)
    cols2 = ["step", "rounds", "MB per direction", "compute s", "online s"]
    if linked:
        cols2 += ["analytic online s", "online diff", "overlap bound s", "diff to bound", "offline s",
                  "analytic offline s", "offline diff"]
    return markdown_table(t1, cols1), markdown_table(t2, cols2)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_options.add_profile(p, netem=True)
    common_options.add_offline(p)
    p.add_argument("--config", default="mnist", choices=["mnist", "small", "tiny"],
                   help="synthetic history shapes (default mnist: the paper's 582,026-parameter CNN, "
                        "20 clients, 40 rounds)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--td1-samples", default=",".join(map(str, TD1_SAMPLES)),
                   help="coordinates per stored update in the TD1 samples (two sizes; default 4,16)")
    offline.add_cache_arguments(p)
    common_options.add_seed(p, "the synthetic history")
    common_options.add_out(p, None, shown="out/steps-<config>-<profile>.json", beside=".md and .png beside it")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench steps", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
        shaping = profiles.choose_shaping(profile, args.shaping)
    except (ValueError, RuntimeError) as exc:
        return common_options.refuse("starfish bench steps", str(exc))
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    samples = [int(x) for x in args.td1_samples.split(",") if x.strip()]
    cfg = config(args.config, seed=args.seed)
    data_path = synthetic_history(cfg, args.cache_dir, args.quiet)
    fn_args = (cfg.to_json(), str(data_path), steps, samples)
    label = f"steps/{cfg.name}"
    common = dict(offline=args.offline, cache_dir=args.cache_dir, key=_cache_key(cfg, steps, samples), prefix="steps",
                  fresh=args.fresh, timeout=args.timeout, label=label, quiet=args.quiet,
                  party_args=progress.party_args(label, args.quiet))
    if shaping.method == "netem" and not os.environ.get(profiles.NETEM_ENV):
        # record and compute outside, then the shaped run inside a netem namespace
        offline.measure(_program, fn_args, profile=profiles.resolve("none"), shaping=profiles.Shaping("none", ""),
                        **common)
        return profiles.run_under_netem(profile, profiles.forwarded_argv(["bench", "steps"], argv))
    runs = offline.measure(_program, fn_args, profile=profile, shaping=shaping, **common)
    rows = build_rows(cfg, runs, profile)
    final = runs.link or runs.compute
    reports = [v["report"] for v in final.values]
    mismatches = sum(len(r.get("mismatches", [])) for r in reports)
    rss = ", ".join(f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" for r in reports)
    td1 = next((r for r in rows if r["step"] == "TD1"), None)
    head = [f"## starfish bench steps: config {cfg.name} ({cfg.note}); synthetic history of the real shapes",
            f"network: {profile.describe()}; applied by: {shaping.method} ({shaping.reason})",
            "GB = 1e9 bytes; online = server<->server traffic, both directions; offline = dealer<->servers "
            "material fetched right before each step, both servers. "
            + ("Paper = Table I (MNIST, network not stated); ratio = ours / paper." if cfg.name == "mnist" else
               f"No paper columns: the paper's Table I is for the MNIST shapes, not config {cfg.name}."),
            f"peak RSS per server process: {rss}; dealer-schedule mismatches: {mismatches}"]
    if td1 is not None:
        src = offline.summarize_steps(final.meters, offline=runs.offline)
        samples_n = sorted(int(k.split(':')[1]) for k in src if k.startswith("TD1:"))
        head.append(f"TD1 (FedRecover's global threshold: secure sort of |g| over all "
                    f"{cfg.num_params * len(cfg.remaining) * cfg.rounds:,} stored coordinates) is extrapolated "
                    f"from the same protocol run on samples of {', '.join(f'{n:,}' for n in samples_n)} entries.")
    text = "\n".join(head) + "\n\n" + "\n\n".join(tables(rows, runs.link is not None))
    print(text)
    out = args.out or f"out/steps-{cfg.name}-{profile.name}.json"
    payload = {
        "machine": machine_info(), "load_average_at_end": os.getloadavg(), "benchmark": "steps", "config": cfg.to_json(),
        "history": "synthetic (bench/synthetic.py): values from a seeded generator, real shapes",
        "profile": profile.to_json(), "shaping": shaping.to_json(), "rows": rows,
        "subsample_steps": {k: v for k, v in offline.summarize_steps(final.meters, offline=runs.offline).items() if k.startswith("TD1:")},
        "runs": runs.seconds, "schedule_requests": runs.schedule.num_requests,
        "schedule_meta": runs.schedule.meta,
        "party_reports": reports, "wire": offline.wire_check(final.meters, runs.offline), "markdown": text,
    }
    path = write_json(out, payload)
    Path(path).with_suffix(".md").write_text(text + "\n")
    plot(rows, Path(path).with_suffix(".png"), f"config {cfg.name} ({cfg.note}); {profile.describe()}")
    print(f"wrote {path}, {Path(path).with_suffix('.md')} and {Path(path).with_suffix('.png')}", file=sys.stderr)
    return 0


def plot(rows: list[dict], path: Path, where: str) -> None:
    """Bytes and seconds of each step, online and offline (the paper's beside them for mnist)."""
    # lazy: matplotlib.pyplot costs ~0.45 s, and the command line must not pay it for --help
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in rows if not r["sample"]]
    names = [r["step"] + ("\n(extrapolated)" if r["extrapolated"] else "") for r in rows]
    paper = any("paper" in r for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for ax, (what, unit, key, scale) in zip(axes, (("bytes", "GB (1e9 bytes)", "bytes", 1e9),
                                                  ("time", "seconds", "s", 1.0))):
        bars = [("online", f"online_{key}", "#4477aa"), ("offline", f"offline_{key}", "#ee6677")]
        width = 0.8 / (4 if paper else 2)
        for k, (label, field, color) in enumerate(bars):
            xs = [i + (k - 0.5) * width * (2 if paper else 1) for i in range(len(rows))]
            ax.bar(xs, [r[field] / scale for r in rows], width, label=label, color=color)
            if paper:   # the paper's figure right of ours, hatched, same colour
                ref = "online_gb" if (label, key) == ("online", "bytes") else \
                    "offline_gb" if key == "bytes" else f"{label}_s"
                ax.bar([x + width for x in xs], [r.get("paper", {}).get(ref) or 0.0 for r in rows], width,
                       label=f"{label}, paper (Table I)", color=color, alpha=0.45, hatch="//")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_yscale("log")
        ax.set_title(f"{what} per step (log scale)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"starfish bench steps: {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["main", "add_arguments", "build_rows", "tables", "plot", "STEPS", "party_setup", "top_level_steps",
           "synthetic_history"]


if __name__ == "__main__":
    sys.exit(main())
