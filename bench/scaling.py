"""How the 2PC cost grows with the number of clients, the model size and the number of rounds.

One *unlearning round* (Alg. 4 lines 15-24, a round with a threshold check) is UE + TC +
aggregate for the n-1 remaining clients; its cost depends on n and m, not on T. The once-per-
request steps TD (SecMax over T thresholds per client) and RS (sorting T rounds, Method 1) depend
on T (and TD on n). Every grid point is one two-party session on a synthetic history of that shape
(``bench/synthetic.py``), dealer material prefetched per step, no emulated link: *seconds* are
online compute on loopback. Then, for every profile of ``--profiles`` (default lan,wan), the same
session runs again with the profile applied to the server link and the dealer link by the
transport's emulation (``net.link.LinkProfile``; one process measures several profiles, so the netem
re-execution of ``steps``/``unlearning`` is not used here), reported beside the analytic time
(rounds x latency + bytes per direction / bandwidth + compute, ``bench/profiles.py``). Three
one-dimensional grids around a base point; PNG plots (bytes, rounds, compute seconds and the
per-profile times against each variable) and a least-squares fit of bytes per client-coordinate.

    starfish bench scaling --out out/scaling.json      # writes out/scaling.png too
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import common_options, costs, offline, profiles, progress
from .report import machine_info, markdown_table, write_json
from .steps import _program
from .synthetic import SyntheticConfig, prepare

ROUND_STEPS = ("UE", "TC", "aggregate")
SETUP_STEPS = ("TD2", "RS1")
DEFAULT_CLIENTS = (5, 10, 20)
DEFAULT_PARAMS = (10_000, 100_000, 582_026)
DEFAULT_ROUNDS = (10, 20, 40, 80)


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def _count(text: str) -> int:
    """A positive count written as an integer or in e-notation (1e3)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(value)


def _profile_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ("lan", "wan", "none")]
    if bad:     # custom needs latency and bandwidth per profile: not offered on a grid
        raise argparse.ArgumentTypeError(f"{text!r}: choose from lan, wan, none (comma list)")
    return names


def grid(clients: list[int], params: list[int], rounds: list[int], base: dict,
         seed: int = 0) -> list[tuple[str, SyntheticConfig]]:
    """(axis, config) points: each axis varies one variable around ``base``."""
    pts = []
    for n in clients:
        pts.append(("clients", dict(base, clients=n)))
    for m in params:
        pts.append(("params", dict(base, num_params=m, clients=base["small_clients"])))
    for T in rounds:
        pts.append(("rounds", dict(base, rounds=T, clients=base["small_clients"], num_params=base["small_params"])))
    out = []
    for axis, d in pts:
        cfg = SyntheticConfig(f"scale-n{d['clients']}-m{d['num_params']}-T{d['rounds']}", d["num_params"],
                              clients=d["clients"], rounds=d["rounds"], seed=seed)
        out.append((axis, cfg))
    return out


LINK_SHAPING = profiles.Shaping("link-emulation", "the transport's LinkProfile on the server link and the dealer link")


def _session(cfg: SyntheticConfig, cache_dir: str, fresh: bool, timeout: float, profile, shaping,
             offline_mode: str = "dealer", quiet: bool = False):
    steps = list(SETUP_STEPS + ROUND_STEPS)
    data = prepare(cfg, cache_dir)
    key = hashlib.sha256(f"{cfg.key()}|{steps}|{offline.code_fingerprint()}".encode()).hexdigest()[:16]
    # no party bars here: the parent's bar over the points holds the terminal line
    return offline.measure(_program, (cfg.to_json(), str(data), steps, []), profile=profile, shaping=shaping,
                           cache_dir=cache_dir, key=key, prefix="scaling", fresh=fresh, timeout=timeout,
                           label=cfg.name, offline=offline_mode, quiet=quiet)


def link_times(cfg: SyntheticConfig, profile, cache_dir: str, timeout: float, offline_mode: str = "dealer",
               quiet: bool = False) -> dict:
    """Measured (emulated link) and analytic seconds of one round and of TD+RS on ``profile``;
    the compute run and schedule come from the cache that ``measure_point`` filled."""
    runs = _session(cfg, cache_dir, False, timeout, profile, LINK_SHAPING, offline_mode, quiet)
    comp = offline.summarize_steps(runs.compute.meters, offline=runs.offline)
    link = offline.summarize_steps(runs.link.meters, offline=runs.offline)
    out = {}
    for group, names in (("round", ROUND_STEPS), ("setup", SETUP_STEPS)):
        out[f"{group}_s"] = sum(link[k]["online_s"] for k in names)
        out[f"{group}_analytic_s"] = sum(profiles.analytic_seconds(comp[k]["rounds"], comp[k]["bytes_per_direction"],
                                                                   comp[k]["online_s"], profile) for k in names)
    return out


def measure_point(cfg: SyntheticConfig, cache_dir: str, fresh: bool, timeout: float,
                  offline_mode: str = "dealer", quiet: bool = False) -> dict:
    steps = list(SETUP_STEPS + ROUND_STEPS)
    runs = _session(cfg, cache_dir, fresh, timeout, profiles.resolve("none"), profiles.Shaping("none", "loopback"),
                    offline_mode, quiet)
    summ = offline.summarize_steps(runs.compute.meters, offline=runs.offline)
    row = {"clients": cfg.clients, "params": cfg.num_params, "rounds": cfg.rounds,
           "steps": {k: summ[k] for k in steps if k in summ}}
    for group, names in (("round", ROUND_STEPS), ("setup", SETUP_STEPS)):
        row[f"{group}_online_bytes"] = sum(summ[k]["online_bytes"] for k in names)
        row[f"{group}_offline_bytes"] = sum(summ[k]["offline_bytes"] for k in names)
        row[f"{group}_rounds"] = sum(summ[k]["rounds"] for k in names)
        row[f"{group}_s"] = sum(summ[k]["online_s"] for k in names)
    row["peak_rss_bytes"] = max(v["report"]["peak_rss_bytes"] for v in runs.compute.values)
    return row


def fit_per_client_coordinate(rows: list[dict], step: str) -> tuple[float, float]:
    """Least squares online_bytes = a * (n-1) m + b for one step over all grid points."""
    x = np.array([(r["clients"] - 1) * r["params"] for r in rows], dtype=np.float64)
    y = np.array([r["steps"][step]["online_bytes"] for r in rows], dtype=np.float64)
    A = np.stack([x, np.ones_like(x)], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(a), float(b)


#: one colour per step in every panel (a step kept its colour across the columns only by chance)
STEP_COLORS = {"TD2": "#228833", "RS1": "#aa3377", "UE": "#4477aa", "TC": "#ee6677", "aggregate": "#ccbb44"}


def plot(rows: list[tuple[str, dict]], path: Path, where: str) -> None:
    # lazy: the CLI imports this module for every command; matplotlib.pyplot costs ~0.45 s there
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    axes_spec = [("clients", "clients n", ROUND_STEPS), ("params", "model size m (parameters)", ROUND_STEPS),
                 ("rounds", "FL rounds T", SETUP_STEPS + ROUND_STEPS)]
    linked = any(r.get("links") for _, r in rows)
    nrows = 4 if linked else 3            # no empty row when only loopback was measured
    fig, axs = plt.subplots(nrows, 3, figsize=(14, 3.4 * nrows), squeeze=False)
    for col, (axis, label, steps) in enumerate(axes_spec):
        pts = sorted((r for a, r in rows if a == axis), key=lambda r: r[axis])
        if not pts:
            for row_i in range(nrows):
                axs[row_i][col].set_visible(False)
            continue
        xs = [r[axis] for r in pts]

        def x_axis(ax) -> None:
            ax.set_xlabel(label)
            if axis == "params":
                ax.set_xscale("log")
            else:                          # clients and rounds are counts: ticks at the points
                ax.set_xticks(xs)
            ax.grid(True, alpha=0.3)
            # below the panel, so that no line is hidden behind it
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)

        for row_i, (q, ylabel, scale) in enumerate((("online_bytes", "online MB (both directions)", 1e6),
                                                    ("rounds", "rounds", 1),
                                                    ("online_s", "online compute s (loopback)", 1))):
            ax = axs[row_i][col]
            for st in steps:
                ys = [r["steps"][st][q] / scale for r in pts]
                ax.plot(xs, ys, marker="o", label=st, color=STEP_COLORS.get(st))
            if q != "rounds" and axis in ("clients", "params"):
                ax.plot(xs, [sum(r["steps"][st][q] for st in ROUND_STEPS) / scale for r in pts], "k--",
                        marker="s", label="one round (UE+TC+aggregate)")
            ax.set_ylabel(ylabel)
            if q == "online_bytes" and axis != "rounds":
                ax.set_yscale("log")
            if q == "rounds":
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            x_axis(ax)
        if not linked:
            continue
        ax = axs[3][col]
        if not pts[0].get("links"):
            ax.set_visible(False)
            continue
        group, what = ("setup", "TD+RS") if axis == "rounds" else ("round", "one round")
        for name in sorted(pts[0]["links"]):
            line, = ax.plot(xs, [r["links"][name][f"{group}_s"] for r in pts], marker="o", label=f"{what}, {name}")
            ax.plot(xs, [r["links"][name][f"{group}_analytic_s"] for r in pts], "--", color=line.get_color(),
                    label=f"{what}, {name}, analytic")
        ax.set_ylabel("online s, emulated link")
        x_axis(ax)
    fig.suptitle("Starfish 2PC cost (synthetic history, dealer, loopback): one unlearning round vs clients and "
                 f"model size; TD/RS and one round vs T\n({where})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", default=",".join(map(str, DEFAULT_CLIENTS)),
                   help="clients axis (default 5,10,20; at --base-params parameters)")
    p.add_argument("--params", default=",".join(map(str, DEFAULT_PARAMS)),
                   help="model-size axis (default 1e4,1e5,582026; at --small-clients clients)")
    p.add_argument("--rounds", default=",".join(map(str, DEFAULT_ROUNDS)),
                   help="rounds axis (default 10,20,40,80; at --small-clients clients, --small-params parameters)")
    # counts as the axes take them: 1e3 is accepted wherever --params accepts it
    p.add_argument("--base-params", type=_count, default=100_000, help="model size of the clients axis (default 1e5)")
    p.add_argument("--base-rounds", type=_count, default=10, help="T of the clients and model axes (default 10)")
    p.add_argument("--small-clients", type=_count, default=5, help="clients of the model and T axes (default 5)")
    p.add_argument("--small-params", type=_count, default=10_000, help="model size of the T axis (default 1e4)")
    # plural because every point is measured on each; --profile too, so the other benches' spelling works
    p.add_argument("--profiles", "--profile", dest="profiles", type=_profile_names, default="lan,wan",
                   help="comma list of link profiles measured at every point after the loopback run "
                        "(default lan,wan; lan, wan as in --profile of the other benches; 'none' = "
                        "loopback only)")
    common_options.add_offline(p)
    offline.add_cache_arguments(p)
    common_options.add_seed(p, "the synthetic histories")
    common_options.add_out(p, "out/scaling.json", beside=".md and .png beside it")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish bench scaling", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    base = {"num_params": args.base_params, "rounds": args.base_rounds, "clients": 0,
            "small_clients": args.small_clients, "small_params": args.small_params}
    points = grid(_ints(args.clients), _ints(args.params), _ints(args.rounds), base, args.seed)
    rows: list[tuple[str, dict]] = []
    done: dict[str, dict] = {}
    t0 = time.perf_counter()
    links = [profiles.resolve(n) for n in args.profiles if n != "none"]
    unique = len({cfg.name for _, cfg in points})
    with progress.progress(unique * (1 + len(links)), "scaling", quiet=args.quiet, unit="session") as bar:
        for axis, cfg in points:
            if cfg.name not in done:
                bar.set_postfix_str(f"{cfg.name}, loopback")
                row = measure_point(cfg, args.cache_dir, args.fresh, args.timeout, args.offline, args.quiet)
                bar.update(1)
                row["links"] = {}
                for prof in links:
                    bar.set_postfix_str(f"{cfg.name}, {prof.name}")
                    row["links"][prof.name] = link_times(cfg, prof, args.cache_dir, args.timeout, args.offline,
                                                         args.quiet)
                    bar.update(1)
                done[cfg.name] = row
            rows.append((axis, done[cfg.name]))
    table = []
    for axis, r in rows:
        table.append({"axis": axis, "clients": r["clients"], "params": r["params"], "T": r["rounds"],
                      "round MB": costs.fmt(r["round_online_bytes"] / 1e6), "round rounds": r["round_rounds"],
                      "round s": costs.fmt(r["round_s"]), "UE MB": costs.fmt(r["steps"]["UE"]["online_bytes"] / 1e6),
                      "TC MB": costs.fmt(r["steps"]["TC"]["online_bytes"] / 1e6),
                      "TD+RS MB": costs.fmt(r["setup_online_bytes"] / 1e6), "TD+RS rounds": r["setup_rounds"],
                      "TD+RS s": costs.fmt(r["setup_s"])})
    uniq = list(done.values())
    fits = {st: fit_per_client_coordinate(uniq, st) for st in ("UE", "TC")}
    lines = [f"## starfish bench scaling: synthetic histories, dealer (prefetched per step), loopback, "
             f"{time.perf_counter() - t0:.0f}s",
             "one round = UE + TC + aggregate for the n-1 remaining clients; TD+RS = once per request "
             "(SecMax over T, Method 1 round selection). MB = 1e6 bytes, both directions; s = online compute.",
             "fits over all points, online bytes = a (n-1) m + b: " +
             "; ".join(f"{st}: a = {a:.1f} B per client-coordinate, b = {b:,.0f} B" for st, (a, b) in fits.items())]
    cols = ["axis", "clients", "params", "T", "round MB", "round rounds", "round s", "UE MB", "TC MB",
            "TD+RS MB", "TD+RS rounds", "TD+RS s"]
    text = "\n".join(lines) + "\n\n" + markdown_table(table, cols)
    if links:
        ltable = []
        for axis, r in rows:
            d = {"axis": axis, "clients": r["clients"], "params": r["params"], "T": r["rounds"]}
            for prof in links:
                t = r["links"][prof.name]
                for group, label in (("round", "round"), ("setup", "TD+RS")):
                    d[f"{label} s {prof.name}"] = costs.fmt(t[f"{group}_s"])
                    d[f"{label} analytic {prof.name}"] = costs.fmt(t[f"{group}_analytic_s"])
                    diff = profiles.relative_difference(t[f"{group}_s"], t[f"{group}_analytic_s"])
                    d[f"{label} diff {prof.name}"] = "-" if diff is None else f"{diff:+.1%}"
            ltable.append(d)
        lcols = ["axis", "clients", "params", "T"] + [f"{label} {q} {prof.name}" for prof in links
                                                       for label in ("round", "TD+RS")
                                                       for q in ("s", "analytic", "diff")]
        text += ("\n\nwith a link (" + "; ".join(p.describe() for p in links) + "), applied by the transport's "
                 "emulation on the server and dealer links; s = measured online seconds, analytic = rounds x "
                 "one-way latency + bytes per direction x 8 / bandwidth + compute\n\n" + markdown_table(ltable, lcols))
    print(text)
    out = Path(args.out)
    png = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    where = (f"clients axis at m = {args.base_params:,}, T = {args.base_rounds}; model axis at n = "
             f"{args.small_clients}, T = {args.base_rounds}; T axis at n = {args.small_clients}, m = {args.small_params:,}")
    plot(rows, png, where)
    write_json(out, {"machine": machine_info(), "load_average_at_end": os.getloadavg(), "benchmark": "scaling",
                     "history": "synthetic (bench/synthetic.py)", "profile": "none (loopback)",
                     "link_profiles": [{**p.to_json(), "shaping": LINK_SHAPING.to_json()} for p in links],
                     "points": [{"axis": a, **r} for a, r in rows],
                     "fits_bytes_per_client_coordinate": {k: {"a": a, "b": b} for k, (a, b) in fits.items()},
                     "plot": str(png), "markdown": text})
    out.with_suffix(".md").write_text(text + f"\n\n![scaling]({png.name})\n")
    print(f"wrote {out}, {png}, {out.with_suffix('.md')}", file=sys.stderr)
    return 0


__all__ = ["main", "add_arguments", "grid", "fit_per_client_coordinate"]


if __name__ == "__main__":
    sys.exit(main())
