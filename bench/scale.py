"""What a server of K workers would cost at sizes we cannot run here (``starfish bench scale``).

Why a model: the issue's operator has 11M parameters and 100 clients; this machine runs the
paper's 582,026 x 20. So the measured runs of ``starfish bench unlearning --workers K`` (their
JSON) calibrate a cost model with the per-shard and the cross-shard parts apart, and the model
predicts one Stage II for D up to 100M, N up to 1,000 and K workers:

* work: a Stage II touches about rows = N x T' client-rows (T' = ceil(sigma T) replayed rounds,
  each with its present clients' estimates, checks and corrections); a pair's share of it is
  rows x D / K coordinates;
* traffic per worker pair = b x rows x D / K (per shard); the coordinators' = c x rows (cross
  shard: sums of shares, the small solves, the bits);
* peak memory per worker = m0 + m x N x D / K + q x min(BLOCK, N x D / K): what a worker
  holds grows with the clients' rows of its shard, a 2PC batch's temporaries with the batch
  (``protocols.starfish.shard_steps.BLOCK`` values at most, ``TWO_PARTY_BLOCK`` in two-party
  mode); m0: the process with torch and
  CrypTen;
* peak memory of the coordinator = n0 + n1 x T x D + n2 x K: round selection forms the rounds'
  public model steps and their unit vectors as T x D float64 matrices there, and each worker
  adds its handles and calls;
* time = a x rows x D / p + r x T' + t0: each of the K pairs has rows x D / K coordinates to
  do and p of them run at once (p = min(K, cores per server); the calibration machine's cores
  are shared by both servers' workers, so there p = min(K, cores / 2); a prediction takes
  ``--cores`` per server, default one core per worker: p = K); r is the cost of a replayed round
  that does not grow with D (the coordinators' small solves and checks, the calls to the workers).

b, c, m, m0, q and n0, n1, n2 are least-squares fits over the runs; a, r, t0 a non-negative least-squares fit
(so runs of one D cannot trade a negative a for a larger r: give runs of several D). ``--check
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

from protocols.starfish.shard_steps import BLOCK, block_for

from . import common_options
from .report import machine_info, write_json

DEFAULT_D = (582_026, 5_000_000, 11_000_000, 100_000_000)
DEFAULT_N = (20, 100, 1_000)
DEFAULT_K = (1, 2, 4, 8, 16)


def load_run(path: str) -> dict[str, Any]:
    """The measured quantities of one ``bench unlearning --workers`` JSON."""
    raw = json.loads(Path(path).read_text())
    if raw.get("benchmark") != "unlearning --workers":
        raise ValueError(f"{path}: not the JSON of `starfish bench unlearning --workers K`")
    cfg, res = raw["config"], raw["result"]
    s0 = res["servers"][0]
    workers = s0["workers"]
    rows = cfg["clients"] * math.ceil(cfg["sigma"] * cfg["rounds"])
    return {"file": path, "D": cfg["num_params"], "N": cfg["clients"], "T": cfg["rounds"], "sigma": cfg["sigma"],
            "K": res["workers"], "offline": res["offline"], "rows": rows, "job_s": s0["job_s"],
            "cores": raw["machine"].get("cpu_count") or os.cpu_count() or 1,
            "pair_bytes": float(np.mean([w["online"] + w["offline"] for w in workers])),
            "coordinator_bytes": s0["coordinator"]["online"] + s0["coordinator"]["offline"],
            "worker_peak_mib": float(max(w["peak_rss_mib"] for w in workers)),
            "coordinator_peak_mib": float(max(srv["coordinator"]["peak_rss_mib"] for srv in res["servers"]))}


def _parallel(K: int, cores_per_server: float) -> float:
    return max(1.0, min(float(K), cores_per_server))


def fit(runs: list[dict]) -> dict[str, float]:
    """The model's coefficients (module docstring) from measured runs."""
    if len(runs) < 2:
        raise ValueError("need at least two runs to fit")
    rows = np.array([r["rows"] for r in runs], float)
    per_shard = np.array([r["rows"] * r["D"] / r["K"] for r in runs], float)
    b = float(np.dot(per_shard, [r["pair_bytes"] for r in runs]) / np.dot(per_shard, per_shard))
    c = float(np.dot(rows, [r["coordinator_bytes"] for r in runs]) / np.dot(rows, rows))
    held = np.array([r["N"] * r["D"] / r["K"] for r in runs], float)
    batch = block_for(runs[0]["offline"])
    mem = np.vstack([np.ones_like(held), held, np.minimum(held, batch)]).T
    m0, m, q = np.linalg.lstsq(mem, np.array([r["worker_peak_mib"] for r in runs]), rcond=None)[0]
    coord = np.vstack([np.ones_like(held), [r["T"] * r["D"] for r in runs], [r["K"] for r in runs]]).T
    n0, n1, n2 = np.linalg.lstsq(coord, np.array([r["coordinator_peak_mib"] for r in runs]), rcond=None)[0]
    # both servers' workers share the calibration machine's cores
    work = np.array([r["rows"] * r["D"] / _parallel(r["K"], r["cores"] / 2) for r in runs], float)
    replayed = np.array([math.ceil(r["sigma"] * r["T"]) for r in runs], float)
    A = np.vstack([work, replayed, np.ones_like(rows)]).T
    # columns scaled to 1 so that the solver's tolerance treats them alike (work is ~1e8)
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(A / norms, np.array([r["job_s"] for r in runs], float))
    a, r_, t0 = (float(x) for x in coef / norms)
    return {"bytes_per_shard_coordinate": b, "coordinator_bytes_per_row": c, "worker_base_mib": float(m0),
            "worker_mib_per_held_coordinate": float(m), "worker_mib_per_batch_value": float(q),
            "batch_values": float(batch), "coordinator_base_mib": float(n0),
            "coordinator_mib_per_round_coordinate": float(n1), "coordinator_mib_per_worker": float(n2),
            "seconds_per_shard_coordinate": a,
            "coordinator_seconds_per_round": r_, "fixed_seconds": t0}


def predict(model: dict[str, float], D: int, N: int, K: int, *, T: int = 40, sigma: float = 0.6,
            cores_per_server: float | None = None) -> dict[str, float]:
    replayed = math.ceil(sigma * T)
    rows = N * replayed
    per_shard = rows * D / K
    p = _parallel(K, K if cores_per_server is None else cores_per_server)
    shard_s = model["seconds_per_shard_coordinate"] * rows * D / p
    cross_s = model["coordinator_seconds_per_round"] * replayed
    return {"D": D, "N": N, "K": K, "seconds": shard_s + cross_s + model["fixed_seconds"], "per_shard_seconds": shard_s,
            "cross_shard_seconds": cross_s, "pair_gb": model["bytes_per_shard_coordinate"] * per_shard / 1e9,
            "coordinator_gb": model["coordinator_bytes_per_row"] * rows / 1e9,
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
            pr = predict(fit(rest), got["D"], got["N"], got["K"], T=got["T"], sigma=got["sigma"],
                         cores_per_server=got["cores"] / 2)
            check = {"run": got["file"], "measured": {"seconds": got["job_s"], "pair_gb": got["pair_bytes"] / 1e9,
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
                  f"{p['worker_peak_gib']:.2f} / {m['worker_peak_gib']:.2f}; peak GiB of the coordinator "
                  f"{p['coordinator_peak_gib']:.2f} / {m['coordinator_peak_gib']:.2f}", ""]
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
