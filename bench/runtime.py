"""Cost of the runtime's basic operations: N multiplications and N comparisons.

``ge`` is CrypTen's own comparison (``x >= y`` on MPCTensors); ``ge_planes`` is ours
(``protocols.compare.ge``: the sign test of ``mpc.nonnegative``), which every protocol of
this project uses.

For the dealer provider each operation runs twice: once to record the (data-independent)
request plan, then again with the plan's material fetched beforehand, so that the
reported seconds are online time only, as in the paper's tables. TFP is shown for
reference (it needs no dealer and is insecure: party 0 knows every triple). ``two-party``
makes everything between the two servers (``mpc/spu_engine.py``): no plan, no prefill; the
Beaver triples it makes inside the step are its offline bytes (one link: party 0's count,
both directions), and its seconds include making them.

    starfish bench runtime --n 1000000 --providers dealer,tfp,two-party --out out/runtime.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from mpc import LinkProfile, run_parties
from mpc.crypten_compat import crypten
from protocols.compare import ge

from . import progress
from .report import machine_info, markdown_table, write_json

OPS = ("mul", "ge", "ge_planes")


def _program(party, op: str, n: int):
    gen = torch.Generator().manual_seed(0)
    x = crypten.cryptensor(torch.randn(n, generator=gen), src=0)
    y = crypten.cryptensor(torch.randn(n, generator=gen), src=1)
    with party.meter(op):
        z = x * y if op == "mul" else (x >= y if op == "ge" else ge(x, y))
    return float(z.get_plain_text()[:1].item())


def measure(op: str, n: int, provider: str, link) -> dict:
    plan = None
    if provider == "dealer":
        plan = run_parties(_program, op, n, link=link, timeout=600).plans[1]
    if provider == "two-party":
        res = run_parties(_program, op, n, offline="two-party", link=link, timeout=3600)
    else:
        res = run_parties(_program, op, n, insecure_tfp=provider == "tfp", link=link, plan=plan, timeout=600)
    s0, s1 = (m["steps"][op] for m in res.meters)
    if provider == "two-party":   # made inside the step, over the one server link
        offline = s0["offline_bytes_sent"] + s0["offline_bytes_received"]
    else:
        offline = sum(m["steps"].get("prefill", {}).get("offline_bytes_received", 0)
                      + m["steps"].get("prefill", {}).get("offline_bytes_sent", 0) for m in res.meters)
    return {
        "op": op,
        "n": n,
        "provider": provider,
        "rounds": s0["online_rounds"],
        "online_bytes": s0["online_bytes_sent"] + s0["online_bytes_received"],
        "offline_bytes": offline,
        "online_seconds": max(s0["seconds"], s1["seconds"]),
        "dealer_requests": len(plan) if plan else 0,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=float, default=1e6, help="elements per operation (default 1e6)")
    p.add_argument("--providers", default="dealer,tfp", help="comma list of dealer,tfp,two-party (default dealer,tfp)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="emulated one-way latency (default 0)")
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="emulated bandwidth, 0 = unlimited")
    p.add_argument("--out", default="out/runtime.json", help="JSON output path (default out/runtime.json)")
    progress.add_quiet_argument(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish bench runtime", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    n = int(args.n)
    link = LinkProfile(args.latency_ms / 1000.0, args.bandwidth_mbps * 1e6)
    rows = []
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    with progress.progress(len(providers) * len(OPS), f"runtime, n = {n:,}", quiet=args.quiet,
                           unit="measurement") as bar:
        for provider in providers:
            for op in OPS:
                bar.set_postfix_str(f"{op} with {provider}")
                rows.append(measure(op, n, provider, link))
                bar.update(1)
    cols = ["op", "n", "provider", "rounds", "online_bytes", "offline_bytes", "online_seconds", "dealer_requests"]
    print(markdown_table(rows, cols))
    path = write_json(args.out, {"machine": machine_info(), "link": dataclasses.asdict(link), "rows": rows})
    print(f"wrote {path}", file=sys.stderr)
    return 0
