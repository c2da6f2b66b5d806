"""What a server of K workers would cost at sizes we cannot run here (``starfish bench scale``).

Why a model: the issue's operator has 11M parameters and 100 clients; this machine runs the
paper's 582,026 x 20. So the measured runs of ``starfish bench unlearning --workers K`` (their
JSON) calibrate a cost model with the per-shard and the cross-shard parts apart, and the model
predicts one Stage II for D up to 100M, N up to 1,000 and K workers:

* work: a Stage II does two kinds of m-long work per client row, counted from the replay's
  schedule (``replay_work``): e estimated rows (UE: the remaining clients in each replayed round
  after the warm-up) and c checked rows (SecTC with the corrections and pair updates it sets off:
  the remaining clients at each check, every T_c replayed rounds). A pair does (its part of) them
  on D / K coordinates. (Counting N x T' rows instead missed the 5,000,000-parameter run's
  traffic by 40%: a check comes every ceil(beta T) rounds, so the checks do not grow with T.)
  A prediction assumes every checked row flagged and corrected, as in every run measured here;
* traffic per worker pair = (b_e e + b_c c) x D / K (per shard); the coordinators' = c_e e + c_c c
  (cross shard: sums of shares, the small solves, the bits);
* peak memory per worker = m0 + m x N x D / K + q x min(BLOCK, N x D / K): what a worker
  holds grows with the clients' rows of its shard, a 2PC batch's temporaries with the batch
  (``protocols.starfish.shard_steps.BLOCK`` values at most, ``TWO_PARTY_BLOCK`` in two-party
  mode); m0: the process with torch and
  CrypTen;
* peak memory of the coordinator = n0 + n1 x T x D + n2 x K: round selection forms the rounds'
  public model steps and their unit vectors as T x D float64 matrices there, and each worker
  adds its handles and calls;
* time = (a_e e + a_c c + a_g T' + a_s T) x D / p + r x T' + t0, each term fitted on the
  coordinator's own step meters (``STEP_GROUPS``: UE on the estimated rows; SecTC, the pair
  updates and the corrections on the checked rows; the replayed rounds' aggregates on T';
  round selection and TD on the T rounds), the rest of the job's seconds on r x T' + t0: each of
  the K pairs has its D / K coordinates of every row to do and p of them run at once
  (p = min(K, cores per server); the calibration machine's cores are shared by both servers'
  workers, so there p = min(K, cores / 2); a prediction takes ``--cores`` per server, default
  one core per worker: p = K); r is the cost of a replayed round
  that does not grow with D (the coordinators' small solves and checks, the calls to the workers).

m, m0, q and n0, n1, n2 are least-squares fits over the runs (the worker's memory only over runs
that kept their shares in memory: with ``--worker-spill-mib`` they lie in files); b, c, a, r, t0
non-negative least-squares fits (so runs of one D cannot trade a negative a for a larger r: give
runs of several D and of several T). ``--check
RUN.json`` fits without that run and compares its prediction with it (the closing note's check).

    starfish bench scale out/unlearning-*-workers*-dealer.json --out out/scale.json   # and out/scale.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from common.starfish_params import PAPER, StarfishParams
from protocols.starfish.shard_steps import BLOCK, block_for

from . import common_options
from .report import machine_info, write_json

DEFAULT_D = (582_026, 5_000_000, 11_000_000, 100_000_000)
DEFAULT_N = (20, 100, 1_000)
DEFAULT_K = (1, 2, 4, 8, 16)

#: the coordinator's step meters (``Party.meter`` names) whose seconds each kind of work explains
STEP_GROUPS = {"estimated": ("UE", "offline:UE"), "checked": ("TC", "pairs", "correction"),
               "replayed": ("aggregate",), "rounds": ("RS", "TD")}


def replay_work(N: int, T: int, *, sigma: float = PAPER.sigma, beta: float = PAPER.beta,
                buffer: int = PAPER.buffer, targets: int = 1, warmup: int | None = None) -> dict[str, int]:
    """What one Stage II replays (``protocols.starfish.stage2``, every client in every round):
    T' rounds; a warm-up of ``warmup`` steps (B + 1 by default: until every buffer holds B
    pairs) with exact updates; then the remaining clients' estimates each round (``estimated``
    rows) and a check every T_c-th step (``checked`` rows)."""
    p = StarfishParams(sigma=sigma, beta=beta, buffer=buffer)
    replayed, interval = p.num_selected(T), p.correction_interval(T)
    w = min(replayed, buffer + 1 if warmup is None else warmup)
    rest = max(0, N - targets)
    checks = replayed // interval - w // interval
    return {"replayed": replayed, "estimated": rest * (replayed - w), "checked": rest * checks}


def load_run(path: str) -> dict[str, Any]:
    """The measured quantities of one ``bench unlearning --workers`` JSON."""
    raw = json.loads(Path(path).read_text())
    if raw.get("benchmark") != "unlearning --workers":
        raise ValueError(f"{path}: not the JSON of `starfish bench unlearning --workers K`")
    cfg, res = raw["config"], raw["result"]
    s0 = res["servers"][0]
    workers = s0["workers"]
    rest = cfg["clients"] - len(cfg.get("targets", [0]))
    # the replay's own counts where the run reports them (they are what it did)
    work = replay_work(cfg["clients"], cfg["rounds"], sigma=cfg["sigma"], beta=cfg.get("beta", PAPER.beta),
                       buffer=cfg.get("buffer", PAPER.buffer), targets=len(cfg.get("targets", [0])),
                       warmup=res.get("warmup_steps"))
    if "estimated_updates" in res:
        work["estimated"] = res["estimated_updates"]
    if "correction_steps" in res:
        work["checked"] = rest * len(res["correction_steps"])
    return {"file": path, "D": cfg["num_params"], "N": cfg["clients"], "T": cfg["rounds"], "sigma": cfg["sigma"],
            "beta": cfg.get("beta", PAPER.beta), "buffer": cfg.get("buffer", PAPER.buffer),
            "K": res["workers"], "offline": res["offline"], **work, "job_s": s0["job_s"],
            "cores": raw["machine"].get("cpu_count") or os.cpu_count() or 1,
            "step_s": {g: sum(s0["coordinator"].get("steps", {}).get(n, {}).get("seconds", 0.0) for n in names)
                       for g, names in STEP_GROUPS.items()},
            "pair_bytes": float(np.mean([w["online"] + w["offline"] for w in workers])),
            "coordinator_bytes": s0["coordinator"]["online"] + s0["coordinator"]["offline"],
            "worker_peak_mib": float(max(w["peak_rss_mib"] for w in workers)),
            "spilled": any(w.get("peak_spilled_mib", 0) > 0 for srv in res["servers"] for w in srv["workers"]),
            "coordinator_peak_mib": float(max(srv["coordinator"]["peak_rss_mib"] for srv in res["servers"]))}


def _parallel(K: int, cores_per_server: float) -> float:
    return max(1.0, min(float(K), cores_per_server))


def _nnls(columns: list[np.ndarray], y: list[float]) -> list[float]:
    A = np.vstack(columns).T
    # columns scaled to 1 so that the solver's tolerance treats them alike (work is ~1e8)
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(A / norms, np.array(y, float))
    return [float(x) for x in coef / norms]


def fit(runs: list[dict]) -> dict[str, float]:
    """The model's coefficients (module docstring) from measured runs."""
    if len(runs) < 2:
        raise ValueError("need at least two runs to fit")
    est = np.array([r["estimated"] for r in runs], float)
    chk = np.array([r["checked"] for r in runs], float)
    shard = np.array([r["D"] / r["K"] for r in runs], float)
    b_e, b_c = _nnls([est * shard, chk * shard], [r["pair_bytes"] for r in runs])
    c_e, c_c = _nnls([est, chk], [r["coordinator_bytes"] for r in runs])
    in_memory = [r for r in runs if not r.get("spilled")] or runs
    held = np.array([r["N"] * r["D"] / r["K"] for r in in_memory], float)
    batch = block_for(runs[0]["offline"])
    mem = np.vstack([np.ones_like(held), held, np.minimum(held, batch)]).T
    m0, m, q = np.linalg.lstsq(mem, np.array([r["worker_peak_mib"] for r in in_memory]), rcond=None)[0]
    coord = np.vstack([np.ones(len(runs)), [r["T"] * r["D"] for r in runs], [r["K"] for r in runs]]).T
    n0, n1, n2 = np.linalg.lstsq(coord, np.array([r["coordinator_peak_mib"] for r in runs]), rcond=None)[0]
    # both servers' workers share the calibration machine's cores
    per_core = np.array([r["D"] / _parallel(r["K"], r["cores"] / 2) for r in runs], float)
    replayed = np.array([r["replayed"] for r in runs], float)
    units = {"estimated": est, "checked": chk, "replayed": replayed, "rounds": np.array([r["T"] for r in runs], float)}
    a = {g: _nnls([units[g] * per_core], [r["step_s"][g] for r in runs])[0] for g in STEP_GROUPS}
    rest_s = [r["job_s"] - sum(r["step_s"].values()) for r in runs]
    r_, t0 = _nnls([replayed, np.ones_like(est)], rest_s)
    return {"bytes_per_estimated_coordinate": b_e, "bytes_per_checked_coordinate": b_c,
            "coordinator_bytes_per_estimated_row": c_e, "coordinator_bytes_per_checked_row": c_c,
            "worker_base_mib": float(m0), "worker_mib_per_held_coordinate": float(m),
            "worker_mib_per_batch_value": float(q), "batch_values": float(batch),
            "coordinator_base_mib": float(n0), "coordinator_mib_per_round_coordinate": float(n1),
            "coordinator_mib_per_worker": float(n2),
            **{f"seconds_per_{g}_coordinate": a[g] for g in STEP_GROUPS},
            "coordinator_seconds_per_round": r_, "fixed_seconds": t0}


def predict(model: dict[str, float], D: int, N: int, K: int, *, T: int = 40, sigma: float = PAPER.sigma,
            beta: float = PAPER.beta, buffer: int = PAPER.buffer,
            cores_per_server: float | None = None) -> dict[str, float]:
    """One Stage II of D parameters, N clients (one forgotten) and T rounds on K workers per
    server (``cores_per_server``: default one per worker); the worker's memory with its shares in
    memory."""
    work = replay_work(N, T, sigma=sigma, beta=beta, buffer=buffer)
    est, chk = work["estimated"], work["checked"]
    p = _parallel(K, K if cores_per_server is None else cores_per_server)
    units = {"estimated": est, "checked": chk, "replayed": work["replayed"], "rounds": T}
    shard_s = sum(model[f"seconds_per_{g}_coordinate"] * units[g] for g in STEP_GROUPS) * D / p
    cross_s = model["coordinator_seconds_per_round"] * work["replayed"]
    pair = (model["bytes_per_estimated_coordinate"] * est + model["bytes_per_checked_coordinate"] * chk) * D / K
    return {"D": D, "N": N, "K": K, "T": T, "estimated_rows": est, "checked_rows": chk,
            "seconds": shard_s + cross_s + model["fixed_seconds"], "per_shard_seconds": shard_s,
            "cross_shard_seconds": cross_s, "pair_gb": pair / 1e9,
            "coordinator_gb": (model["coordinator_bytes_per_estimated_row"] * est
                               + model["coordinator_bytes_per_checked_row"] * chk) / 1e9,
            "worker_peak_gib": (model["worker_base_mib"] + model["worker_mib_per_held_coordinate"] * N * D / K
                                + model.get("worker_mib_per_batch_value", 0.0)
                                * min(model.get("batch_values", BLOCK), N * D / K)) / 1024,
            "coordinator_peak_gib": (model.get("coordinator_base_mib", 0.0)
                                     + model.get("coordinator_mib_per_round_coordinate", 0.0) * T * D
                                     + model.get("coordinator_mib_per_worker", 0.0) * K) / 1024}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="JSON of `starfish bench unlearning --workers K` runs")
    p.add_argument("--check", default=None, metavar="RUN.json",
                   help="fit without this run (one of RUN.json) and compare its prediction with it")
    p.add_argument("--cores", type=float, default=None,
                   help="cores per server for the predictions (default: one per worker)")
    common_options.add_out(p, "out/scale.json", beside="a PNG beside it")
    common_options.add_quiet(p)


def _plot(path: Path, model: dict, cores: float | None) -> Path:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ds = np.logspace(math.log10(582_026), 8, 20)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for K in DEFAULT_K:
        pr = [predict(model, int(d), 20, K, cores_per_server=cores) for d in ds]
        axes[0].loglog(ds, [x["seconds"] for x in pr], label=f"K = {K}")
        axes[1].loglog(ds, [x["worker_peak_gib"] for x in pr], label=f"K = {K}")
    axes[0].set(xlabel="model size D", ylabel="Stage II seconds (N = 20)", title="time")
    axes[1].set(xlabel="model size D", ylabel="peak GiB per worker (N = 20)", title="memory per worker")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench scale", __doc__, add_arguments, argv, args)
    try:
        runs = [load_run(p) for p in args.runs]
        modes = {r["offline"] for r in runs}
        if len(modes) != 1:
            raise ValueError(f"runs of one offline mode only (got {sorted(modes)}): the modes' costs differ")
        check = None
        if args.check is not None:
            held = [r for r in runs if os.path.samefile(r["file"], args.check)]
            if not held:
                raise ValueError(f"--check {args.check} is not one of the runs")
            rest = [r for r in runs if r is not held[0]]
            got = held[0]
            pr = predict(fit(rest), got["D"], got["N"], got["K"], T=got["T"], sigma=got["sigma"], beta=got["beta"],
                         buffer=got["buffer"], cores_per_server=got["cores"] / 2)
            check = {"run": got["file"], "spilled": got["spilled"],
                     "measured": {"seconds": got["job_s"], "pair_gb": got["pair_bytes"] / 1e9,
                                  "worker_peak_gib": got["worker_peak_mib"] / 1024,
                                  "coordinator_peak_gib": got["coordinator_peak_mib"] / 1024},
                     "predicted": {k: pr[k] for k in ("seconds", "pair_gb", "worker_peak_gib", "coordinator_peak_gib")}}
        model = fit(runs)
    except (ValueError, OSError, KeyError) as exc:
        return common_options.refuse("starfish bench scale", str(exc))
    grid = [predict(model, D, N, K, cores_per_server=args.cores) for D in DEFAULT_D for N in DEFAULT_N
            for K in DEFAULT_K]
    lines = [f"## starfish bench scale: a model of one Stage II on K workers per server, from {len(runs)} runs "
             f"({modes.pop()} mode)", "",
             "coefficients: " + ", ".join(f"{k} {v:.4g}" for k, v in model.items()), ""]
    if check:
        m, p = check["measured"], check["predicted"]
        lines += [f"check (fitted without {check['run']}): seconds {p['seconds']:.0f} predicted / {m['seconds']:.0f} "
                  f"measured; pair GB {p['pair_gb']:.2f} / {m['pair_gb']:.2f}; peak GiB per worker "
                  f"{p['worker_peak_gib']:.2f} / {m['worker_peak_gib']:.2f}"
                  + (" (its shares in spill files, the prediction's in memory)" if check["spilled"] else "")
                  + f"; peak GiB of the coordinator {p['coordinator_peak_gib']:.2f} / {m['coordinator_peak_gib']:.2f}", ""]
    lines += ["| D | N | K | seconds | per shard s | cross shard s | GB per pair | GB coordinators | GiB per worker "
              "| GiB coordinator |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {g['D']:,} | {g['N']} | {g['K']} | {g['seconds']:.0f} | {g['per_shard_seconds']:.0f} | "
              f"{g['cross_shard_seconds']:.0f} | {g['pair_gb']:.1f} | {g['coordinator_gb']:.2f} | {g['worker_peak_gib']:.2f} "
              f"| {g['coordinator_peak_gib']:.2f} |" for g in grid if g["N"] in (20, 100)]
    text = "\n".join(lines)
    if not args.quiet:
        print(text)
    path = Path(write_json(args.out, {"machine": machine_info(), "benchmark": "scale", "runs": runs, "model": model,
                                      "check": check, "grid": grid, "markdown": text}))
    png = _plot(path, model, args.cores)
    print(f"wrote {path} and {png}", file=sys.stderr)
    return 0
