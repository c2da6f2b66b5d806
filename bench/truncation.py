"""How likely a full Stage II is to return a coordinate with a local-truncation wrap.

CrypTen truncates a two-party sharing by dividing each share locally. With x = s0 + s1 and s0
uniform, the two shares cross the ring boundary with probability (|x| + 1) / 2**64, and then
the result is wrong by about 2**64 / 2**d (2**48 for d = 16). This benchmark runs one Stage II
on a synthetic history of the chosen shapes with every local truncation *opened* before it
happens (an audit hook in ``mpc.crypten_compat``: the values are revealed, so this is a
measurement, never a deployment), and reports per step how many elements were truncated, the
largest |ring value| seen, and the expected number of wraps sum (|x| + 1) / 2**64, which bounds
the probability that the run returns a wrong coordinate (a wrap in a value that is opened or
compared anyway is one too).

In two-party mode (``--offline two-party``) the engine truncates the products of the default
wrap-free truncation; with ``--truncation local`` the products are divided locally as with the
dealer and counted the same way (comparisons are the engine's and truncate nothing locally).
No ``--profile``: the counts do not depend on the link, and the audit's opened truncations make
its seconds meaningless as a cost.

    starfish bench truncation --config mnist --truncation local   # CrypTen's local truncation
    starfish bench truncation --config mnist                      # the default: wrap-free
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from mpc.launcher import run_parties
from mpc.crypten_compat import observe_truncations
from protocols.starfish import StarfishParams, run_stage2

from . import common_options, progress
from . import steps as steps_bench
from .report import machine_info, markdown_table, write_json
from .synthetic import config

TARGET_PROBABILITY = 2.0 ** -40


class _Tally:
    """Per top-level step: elements truncated, calls, max |x|, sum of (|x| + 1) / 2**64."""

    def __init__(self, meter) -> None:
        self.meter = meter
        self.rows: dict[str, dict] = defaultdict(lambda: {"calls": 0, "elements": 0, "max_abs_log2": -1.0,
                                                          "expected_wraps": 0.0, "log2_histogram": [0] * 65})

    def __call__(self, ring: torch.Tensor, divisor) -> None:
        steps = self.meter.open_steps()
        row = self.rows[steps[0].split("/")[0] if steps else "(outside steps)"]
        a = ring.reshape(-1).numpy().astype(np.float64)
        mag = np.abs(a)  # -2**63 becomes 2**63 exactly in float64
        row["calls"] += 1
        row["elements"] += int(mag.size)
        row["expected_wraps"] += float((mag + 1.0).sum() / 2.0 ** 64)
        if mag.size:
            row["max_abs_log2"] = max(row["max_abs_log2"], float(np.log2(mag.max() + 1.0)))
            bits = np.ceil(np.log2(mag + 1.0)).astype(np.int64)
            hist = np.bincount(bits, minlength=65)
            row["log2_histogram"] = [int(x + y) for x, y in zip(row["log2_histogram"], hist)]


def _program(party, spec: dict, data_path: str, method: str, bar: progress.PartyBar | None = None) -> dict:
    with (bar or progress.PartyBar("Stage II")).open(unit="round") as shown:
        shown.set_postfix_str("setup")
        cfg, hist, clients, p = steps_bench.party_setup(party, spec, data_path, None,
                                                        progress.step_hook(shown, count=False))
        tally = _Tally(party.metering)
        params = StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer, method=method)
        with observe_truncations(tally):
            res = run_stage2(p, hist, list(cfg.targets), params, clients, progress=progress.callback(shown))
    return {"rows": dict(tally.rows), "selected_rounds": res.selected_rounds}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="mnist", choices=["mnist", "small", "tiny"],
                   help="synthetic history shapes (default mnist: the paper's CNN, 20 clients, 40 rounds)")
    p.add_argument("--rs-method", default="auto", choices=("auto", "ratio", "divide"),
                   help="round-selection method (auto: the LAN T_delta)")
    p.add_argument("--truncation", default="wrapfree", choices=("wrapfree", "local"),
                   help="the parties' truncation: wrapfree (the default everywhere: none is local, so "
                        "nothing can wrap) or local (CrypTen's share division, to measure its risk)")
    common_options.add_offline(p)
    p.add_argument("--cache-dir", default="out/bench-cache", help="where the synthetic history is kept")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a party waits for its peer")
    common_options.add_seed(p, "the synthetic history")
    common_options.add_out(p, None, shown="out/truncation-<config>.json", beside=".md beside it")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish bench truncation", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    cfg = config(args.config, seed=args.seed)
    data_path = steps_bench.synthetic_history(cfg, args.cache_dir, args.quiet)
    progress.say(f"truncation audit: one Stage II on {cfg.name} ({cfg.note}), every truncation opened ...",
                 quiet=args.quiet)
    t0 = time.perf_counter()
    res = run_parties(_program, cfg.to_json(), str(data_path), args.rs_method, timeout=args.timeout,
                      truncation=args.truncation, offline=args.offline,
                      party_args=progress.party_args("truncation audit", args.quiet))
    seconds = time.perf_counter() - t0
    rows = res.values[0]["rows"]
    table, total_el, total_wraps = [], 0, 0.0
    for step, r in sorted(rows.items(), key=lambda kv: -kv[1]["expected_wraps"]):
        total_el += r["elements"]
        total_wraps += r["expected_wraps"]
        table.append({"step": step, "calls": f"{r['calls']:,}", "elements": f"{r['elements']:,}",
                      "max |x| (bits)": f"{r['max_abs_log2']:.1f}",
                      "expected wraps": f"{r['expected_wraps']:.3g}",
                      "log2 expected": f"{math.log2(r['expected_wraps']):.1f}" if r["expected_wraps"] else "-"})
    p_run = min(1.0, total_wraps)
    verdict = "above" if total_wraps > TARGET_PROBABILITY else "below"
    text = "\n".join([
        f"## starfish bench truncation: config {cfg.name}; local two-party truncations of one Stage II "
        f"(--truncation {args.truncation}, --offline {args.offline})",
        "expected wraps = sum over truncated elements of (|x| + 1) / 2**64 (x: the ring integer), an upper "
        "bound on the probability that the run contains a wrapped value",
        "",
        markdown_table(table, ["step", "calls", "elements", "max |x| (bits)", "expected wraps", "log2 expected"]),
        "",
        f"total: {total_el:,} truncated elements; expected wraps {total_wraps:.3g} "
        f"(2**{math.log2(total_wraps):.1f}); {verdict} the 2**-40 target" if total_wraps else
        f"total: {total_el:,} truncated elements; no local truncation",
    ])
    print(text)
    out = args.out or f"out/truncation-{cfg.name}.json"
    path = write_json(out, {"machine": machine_info(), "benchmark": "truncation", "config": cfg.to_json(),
                            "truncation": args.truncation, "offline": args.offline, "rows": rows,
                            "total_elements": total_el, "expected_wraps": total_wraps,
                            "probability_bound": p_run, "seconds": seconds,
                            "selected_rounds": res.values[0]["selected_rounds"], "markdown": text})
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["main", "add_arguments"]


if __name__ == "__main__":
    sys.exit(main())
