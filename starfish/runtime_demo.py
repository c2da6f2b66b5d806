"""`starfish demo --runtime`: the two-party runtime at work, without the service.

The runtime alone (the service demo is ``starfish demo``): a client splits two
vectors into additive shares (numpy only), two server processes receive one share each
over the launcher, multiply and compare them under 2PC with a dealer process supplying
Beaver triples over TLS, and open only the results. It prints what each party computed
next to the plaintext answer, and what it cost per step.
"""

from __future__ import annotations

import argparse

import numpy as np

from common import encoding, sharing
from mpc.launcher import run_parties


def _servers(party, x_shares, y_shares):
    mine = 0 if party.rank == 0 else 1
    with party.meter("load shares"):
        x = party.wrap_share(x_shares[mine])
        y = party.wrap_share(y_shares[mine])
    with party.meter("x*y"):
        prod = x * y
    with party.meter("x>=y"):
        ge = x >= y
    with party.meter("open"):
        return prod.reveal().numpy().copy(), ge.get_plain_text().numpy().copy()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=8, help="vector length (default 8)")
    p.add_argument("--seed", type=int, default=4, help="seed of the demo input values (default 4)")


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="starfish demo --runtime", description=__doc__)
        add_arguments(parser)
        args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    x = np.round(rng.normal(size=args.n) * 10, 3)
    y = np.round(rng.normal(size=args.n) * 10, 3)
    y[0] = x[0]  # a tie, to show >= on equal values
    print("client: splitting x and y into additive shares over Z_2^64 (share 0 as a 16-byte seed)")
    xs, ys = sharing.share(x, compress=True), sharing.share(y, compress=True)
    res = run_parties(_servers, (xs.materialize_share0(), xs.share1), (ys.materialize_share0(), ys.share1))
    np.set_printoptions(precision=3, suppress=True, linewidth=120)
    print(f"x           = {x}\ny           = {y}")
    for rank, (prod_ring, ge) in enumerate(res.values):
        print(f"server{rank}: x*y  = {encoding.decode(prod_ring)}")
        print(f"server{rank}: x>=y = {ge.astype(int)}")
    print(f"numpy:   x*y  = {x * y}\nnumpy:   x>=y = {(x >= y).astype(int)}")
    print("\ncost (per step; bytes summed over both directions of the server<->server link;")
    print("offline = dealer->server1 corrections; server0 derives its triples from a seed):")
    print(f"{'step':<12}{'rounds':>8}{'online bytes':>15}{'offline bytes':>15}{'seconds':>10}")
    m0, m1 = res.meters
    for step in ("load shares", "x*y", "x>=y", "open"):
        a, b = m0["steps"][step], m1["steps"][step]
        online = a["online_bytes_sent"] + a["online_bytes_received"]
        offline = sum(r["offline_bytes_sent"] + r["offline_bytes_received"] for r in (a, b))
        print(f"{step:<12}{a['online_rounds']:>8}{online:>15,}{offline:>15,}{max(a['seconds'], b['seconds']):>10.3f}")
    ok = np.allclose(encoding.decode(res.values[0][0]), x * y, atol=1e-3) and np.array_equal(
        res.values[0][1].astype(bool), x >= y)
    print("\nresult matches numpy:", "yes" if ok else "NO")
    return 0 if ok else 1
