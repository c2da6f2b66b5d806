"""Cost and error of dividing a sharing by a public integer (``mpc.public_division``).

    python -m bench.public_division [--n 10000] [--offline dealer,two-party] [--profile none] [--seed 0]

Per mode of ``--offline`` (a list: this bench compares the modes, so both by default), on n
fixed-point values spread log-uniformly over the whole ring range (|x| < 2**62): CrypTen's
``x.div(N)`` for divisors that are not powers of two, next to a power of two (one wrap-free
truncation) and a product of two sharings as yardsticks. Prints online bytes
per element (party 0 sent + received), online rounds, seconds and the error against the exact
quotient (``fractions.Fraction``), in units of the ring (2**-16 at CrypTen's precision). A
warm-up truncation and product run first (the engine's one-time set-up is not counted); the
engine's later OT extensions land on whichever operation needs them, so two-party figures vary
from run to run. The ``--profile`` link (default lan, as everywhere) is emulated by the transport
on the server link and the dealer link; ``--profile none`` measures on loopback. Writes the rows
as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction

import numpy as np
import torch

from net.channel import NO_LINK

from . import common_options, progress
from .report import machine_info, markdown_table, write_json

DIVISORS = (3, 9, 120, 65535, 8)


def _program(party, divisors, share):
    """Party side: x.div(d) for each d, and one product, each metered; opened ring integers."""
    from mpc.crypten_compat import crypten

    x = crypten.mpc.MPCTensor.from_shares(torch.from_numpy(share), precision=0)
    # not reported: the two-party engine sets up its OT and HE on first use
    with party.meter("warm-up"):
        x.div(2)
        x * x
    out = {}
    for d in divisors:
        with party.meter(f"div {d}"):
            t0 = time.perf_counter()
            q = x.div(d)
            seconds = time.perf_counter() - t0
        out[d] = (q.reveal().numpy().copy(), seconds)
    y = crypten.mpc.MPCTensor.from_shares(torch.from_numpy(share), precision=16)
    with party.meter("mul"):
        t0 = time.perf_counter()
        y * y
        out["mul"] = (None, time.perf_counter() - t0)
    return out


def measure(n: int, offline: str, seed: int, link=NO_LINK) -> list[dict]:
    from mpc.launcher import run_parties

    rng = np.random.default_rng(seed)
    bits = rng.integers(1, 62, size=n)
    x = (rng.random(n) * 2.0**bits).astype(np.int64) * rng.choice([-1, 1], size=n)
    mask = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64, endpoint=True)
    share0 = (x.view(np.uint64) - mask.view(np.uint64)).view(np.int64)
    res = run_parties(_program, DIVISORS, party_args=((share0,), (mask,)), offline=offline, timeout=600,
                      link=link, dealer_link=link)
    steps = res.meters[0]["steps"]
    rows = []
    for d in (*DIVISORS, "mul"):
        q, seconds = res.values[0][d]
        step = steps[f"div {d}" if d != "mul" else "mul"]
        row = {"op": f"x / {d}" if d != "mul" else "x * y (16 bits)", "offline": offline,
               "online B/elt": (step["online_bytes_sent"] + step["online_bytes_received"]) / n,
               "rounds": step["online_rounds"], "seconds": seconds}
        if q is not None:
            errs = [abs(Fraction(int(qi)) - Fraction(int(xi), d)) for qi, xi in zip(q.tolist(), x.tolist())]
            row["max err (units)"] = float(max(errs))
            row["mean err (units)"] = float(sum(errs) / len(errs))
        rows.append(row)
    return rows


COLUMNS = ["op", "offline", "online B/elt", "rounds", "seconds", "max err (units)", "mean err (units)"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=10_000, help="values divided (default 10,000)")
    common_options.add_profile(p)
    common_options.add_offline(p, several="dealer,two-party")
    common_options.add_seed(p, "the values and their shares")
    common_options.add_out(p, "out/public-division.json")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("python -m bench.public_division", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
    except ValueError as exc:
        return common_options.refuse("python -m bench.public_division", str(exc))
    rows = []
    with progress.progress(len(args.offline), f"x.div(N), n = {args.n:,}", quiet=args.quiet, unit="mode") as bar:
        for mode in args.offline:
            bar.set_postfix_str(mode)
            rows.extend(measure(args.n, mode, args.seed, profile.link()))
            bar.update(1)
    shown = [{c: f"{r[c]:.3g}" if isinstance(r.get(c), float) else r.get(c, "") for c in COLUMNS} for r in rows]
    print(markdown_table(shown, COLUMNS))
    path = write_json(args.out, {"machine": machine_info(), "benchmark": "public-division", "n": args.n,
                                 "seed": args.seed, "profile": profile.to_json(), "rows": rows})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
