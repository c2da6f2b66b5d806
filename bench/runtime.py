"""Cost of the runtime's basic operations: N multiplications and N comparisons.

``ge`` is CrypTen's own comparison (``x >= y`` on MPCTensors); ``ge_planes`` is ours
(``protocols.compare.ge``: the sign test of ``mpc.nonnegative``), which every protocol of
this project uses.

``--offline`` is a list: each mode is measured in turn and reported side by side. With the
dealer each operation runs twice: once to record the (data-independent) request plan, then
again with the plan's material fetched beforehand, so that the reported seconds are online
time only, as in the paper's tables. ``two-party`` makes everything between the two servers
(``mpc/spu_engine.py``): no plan, no prefill; the Beaver triples it makes inside the step are
its offline bytes (one link: party 0's count, both directions), and its seconds include making
them. ``tfp`` is a reference only (no dealer, insecure: party 0 knows every triple). The
``--profile`` link is emulated by the transport on the server link and the dealer link.

    starfish bench runtime --n 1e6 --offline dealer,two-party,tfp --profile none --out out/runtime.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from mpc.launcher import run_parties
from mpc.crypten_compat import crypten
from net.channel import NO_LINK
from protocols.compare import ge

from . import common_options, progress
from .report import machine_info, markdown_table, write_json

OPS = ("mul", "ge", "ge_planes")


def _program(party, op: str, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = crypten.cryptensor(torch.randn(n, generator=gen), src=0)
    y = crypten.cryptensor(torch.randn(n, generator=gen), src=1)
    with party.meter(op):
        z = x * y if op == "mul" else (x >= y if op == "ge" else ge(x, y))
    return float(z.get_plain_text()[:1].item())


def measure(op: str, n: int, provider: str, link=NO_LINK, seed: int = 0) -> dict:
    plan = None
    links = {"link": link, "dealer_link": link}
    if provider == "dealer":
        plan = run_parties(_program, op, n, seed, timeout=600, **links).plans[1]
    if provider == "two-party":
        res = run_parties(_program, op, n, seed, offline="two-party", timeout=3600, **links)
    else:
        res = run_parties(_program, op, n, seed, insecure_tfp=provider == "tfp", plan=plan, timeout=600, **links)
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
    common_options.add_profile(p)
    common_options.add_offline(p, several="dealer", tfp=True)
    common_options.add_seed(p, "the input values")
    common_options.add_out(p, "out/runtime.json")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench runtime", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
    except ValueError as exc:
        return common_options.refuse("starfish bench runtime", str(exc))
    n = int(args.n)
    link = profile.link()
    rows = []
    with progress.progress(len(args.offline) * len(OPS), f"runtime, n = {n:,}", quiet=args.quiet,
                           unit="measurement") as bar:
        for provider in args.offline:
            for op in OPS:
                bar.set_postfix_str(f"{op} with {provider}")
                rows.append(measure(op, n, provider, link, args.seed))
                bar.update(1)
    cols = ["op", "n", "provider", "rounds", "online_bytes", "offline_bytes", "online_seconds", "dealer_requests"]
    print(markdown_table(rows, cols))
    path = write_json(args.out, {"machine": machine_info(), "profile": profile.to_json(),
                                 "link": dataclasses.asdict(link), "rows": rows})
    print(f"wrote {path}", file=sys.stderr)
    return 0
