"""The report of ``starfish bench unlearning``: Table II beside the paper, per-step rows, targets.

Split from ``bench/unlearning.py`` (which runs the benchmark) so each file has one job.
"""

from __future__ import annotations

from . import costs, profiles
from .report import markdown_table
from .synthetic import SyntheticConfig

__all__ = ["paper_row", "render", "target_rows", "TARGET_ONLINE_BYTES", "TARGET_ONLINE_S", "TARGET_RSS"]

TARGET_ONLINE_BYTES = 22e9
TARGET_ONLINE_S = 20 * 60.0
TARGET_RSS = 6 * 2**30


def paper_row(profile: profiles.NetworkProfile, tot: dict) -> dict | None:
    paper = costs.PAPER_TABLE2.get(profile.name) or (costs.PAPER_TABLE2["lan"] if profile.name == "none" else None)
    if paper is None:
        return None
    return {"paper_profile": profile.name if profile.name in costs.PAPER_TABLE2 else "lan",
            "offline_s": paper[0], "online_s": paper[1], "offline_gb": paper[2], "online_gb": paper[3],
            "ratio_offline_s": costs.ratio(tot["offline_s"], paper[0]),
            "ratio_online_s": costs.ratio(tot["online_s"], paper[1]),
            "ratio_offline_gb": costs.ratio(costs.gb(tot["offline_bytes"]), paper[2]),
            "ratio_online_gb": costs.ratio(costs.gb(tot["online_bytes"]), paper[3])}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def render(cfg: SyntheticConfig, profile, shaping, method_run: str, rows: list[dict], tot: dict,
           paper: dict | None, rss: list[int], wire: dict, extra: list[str], linked: bool,
           targets: list[dict], estimated: bool = False) -> str:
    label = f"{profile.name} (estimate, additive)" if estimated else profile.name
    t2 = [{"": label, "offline s": costs.fmt(tot["offline_s"]), "online s": costs.fmt(tot["online_s"]),
           "offline GB": costs.fmt(costs.gb(tot["offline_bytes"])), "online GB": costs.fmt(costs.gb(tot["online_bytes"]))}]
    if estimated and tot.get("overlap_online_s") is not None:
        t2.append({"": f"{profile.name} (estimate, overlap bound)", "online s": costs.fmt(tot["overlap_online_s"]),
                   "offline s": "", "offline GB": "", "online GB": ""})
    if estimated and tot.get("calibrated_online_s") is not None:
        t2.append({"": f"{profile.name} (estimate, calibrated)", "online s": costs.fmt(tot["calibrated_online_s"]),
                   "offline s": "", "offline GB": "", "online GB": ""})
    if paper is not None:
        t2.append({"": f"paper ({paper['paper_profile'].upper()})", "offline s": costs.fmt(paper["offline_s"]),
                   "online s": costs.fmt(paper["online_s"]), "offline GB": costs.fmt(paper["offline_gb"]),
                   "online GB": costs.fmt(paper["online_gb"])})
        t2.append({"": "ratio ours / paper", "offline s": costs.fmt(paper["ratio_offline_s"], 3),
                   "online s": costs.fmt(paper["ratio_online_s"], 3),
                   "offline GB": costs.fmt(paper["ratio_offline_gb"], 3),
                   "online GB": costs.fmt(paper["ratio_online_gb"], 3)})
    table2 = markdown_table(t2, ["", "offline s", "online s", "offline GB", "online GB"])
    def cells(step: str, calls, r: dict) -> dict:
        d = {"step": step, "calls": calls, "rounds": costs.fmt(r["rounds"]),
             "online GB": costs.fmt(costs.gb(r["online_bytes"])), "offline GB": costs.fmt(costs.gb(r["offline_bytes"])),
             "compute s": costs.fmt(r["compute_s"]), "online s": costs.fmt(r["online_s"]),
             "offline s": costs.fmt(r["offline_s"])}
        if r.get("calibrated_online_s") is not None:
            d["calibrated s"] = costs.fmt(r["calibrated_online_s"])
        if linked:
            d["analytic online s"] = costs.fmt(r["analytic_online_s"])
            d["diff"] = _pct(r["online_rel_diff"])
            d["overlap bound s"] = costs.fmt(r.get("overlap_online_s"))
            d["diff to bound"] = _pct(r.get("overlap_rel_diff"))
        return d

    srows = [cells(r["step"] + (" (clients)" if r["client_side"] else ""), r["calls"], r) for r in rows]
    srows.append(cells("total (online steps)", "", tot))
    cols = ["step", "calls", "rounds", "online GB", "offline GB", "compute s", "online s", "offline s"]
    if any("calibrated_online_s" in r for r in rows):
        cols.append("calibrated s")
    if linked:
        cols += ["analytic online s", "diff", "overlap bound s", "diff to bound"]
    tstep = markdown_table(srows, cols)
    wrows = [{"traffic": k, "metered bytes": costs.fmt(v["metered_bytes"]), "socket (TLS) bytes": costs.fmt(v["socket_bytes"]),
              "difference": _pct(v["relative_difference"])} for k, v in wire.items()]
    twire = markdown_table(wrows, ["traffic", "metered bytes", "socket (TLS) bytes", "difference"])
    ttarget = markdown_table([{**t, "met": "yes" if t["met"] else "NO"} for t in targets],
                             ["target", "limit", "reached", "met"]) if targets else ""
    head = [f"## starfish bench unlearning: config {cfg.name} ({cfg.note}); synthetic history of the real shapes",
            f"network: {profile.describe()}; applied by: {shaping.method} ({shaping.reason})",
            f"round selection: {method_run}; targets {list(cfg.targets)}; GB = 1e9 bytes; online = server<->server "
            "(both directions); offline = dealer<->servers material, fetched right before each step (both servers); "
            "times are the larger of the two servers'. Online s sums the online steps (the simulated clients' "
            "exact updates are listed apart). Analytic = rounds x one-way latency + bytes per direction x 8 / "
            "bandwidth + compute (compute run); overlap bound = rounds x latency + max(compute, transfer).",
            f"peak resident memory: server 0 {rss[0] / 2**30:.2f} GiB, server 1 {rss[1] / 2**30:.2f} GiB",
            *extra]
    parts = ["\n".join(head), table2, tstep, twire]
    if ttarget:
        parts.append(ttarget)
    return "\n\n".join(parts)


def target_rows(tot: dict, rss: list[int], profile) -> list[dict]:
    if profile.name != "lan":
        return []
    return [
        {"target": "online communication", "limit": "22 GB", "reached": f"{costs.gb(tot['online_bytes']):.2f} GB",
         "met": tot["online_bytes"] <= TARGET_ONLINE_BYTES},
        {"target": "online wall time", "limit": "20 min", "reached": f"{tot['online_s']:.0f} s = {tot['online_s'] / 60:.1f} min",
         "met": tot["online_s"] <= TARGET_ONLINE_S},
        {"target": "peak RSS per server", "limit": "6 GiB", "reached": f"{max(rss) / 2**30:.2f} GiB",
         "met": max(rss) <= TARGET_RSS},
    ]
