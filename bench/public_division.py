"""Cost and error of dividing a sharing by a public integer (``mpc.public_division``).

    python -m bench.public_division [--n 10000] [--offline dealer,two-party] [--seed 0]

Per offline mode, on n fixed-point values spread log-uniformly over the whole ring range
(|x| < 2**62): CrypTen's ``x.div(N)`` for divisors that are not powers of two, next to a power of
two (one wrap-free truncation) and a product of two sharings as yardsticks. Prints online bytes
per element (party 0 sent + received), online rounds, seconds and the error against the exact
quotient (``fractions.Fraction``), in units of the ring (2**-16 at CrypTen's precision). A
warm-up truncation and product run first (the engine's one-time set-up is not counted); the
engine's later OT extensions land on whichever operation needs them, so two-party figures vary
from run to run.
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import numpy as np
import torch

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


def measure(n: int, offline: str, seed: int) -> list[dict]:
    from mpc import run_parties

    rng = np.random.default_rng(seed)
    bits = rng.integers(1, 62, size=n)
    x = (rng.random(n) * 2.0**bits).astype(np.int64) * rng.choice([-1, 1], size=n)
    mask = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64, endpoint=True)
    share0 = (x.view(np.uint64) - mask.view(np.uint64)).view(np.int64)
    res = run_parties(_program, DIVISORS, party_args=((share0,), (mask,)), offline=offline, timeout=600)
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--offline", default="dealer,two-party")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cols = ["op", "offline", "online B/elt", "rounds", "seconds", "max err (units)", "mean err (units)"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for mode in args.offline.split(","):
        for row in measure(args.n, mode, args.seed):
            print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                    for c in cols) + " |")


if __name__ == "__main__":
    main()
