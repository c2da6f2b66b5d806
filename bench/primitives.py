"""Cost of the secure primitives in ``protocols/``: rounds, online/offline bytes, seconds.

Every primitive runs in a real two-party session (two processes, TLS) on inputs of each
requested size; each (primitive, size) is metered as its own step, once per mode of
``--offline``. With the dealer the session runs twice: a dry run records the (data-independent)
dealer request plan and yields the per-step offline (dealer<->servers) bytes; the measured run
fetches that material first, so its seconds are online time only, as in the paper's tables.
``two-party`` runs once without a dealer: the step makes its correlations itself (its offline
bytes, party 0's count of the one server link) and its seconds include making them. ``tfp`` is
an insecure reference. The ``--profile`` link is emulated by the transport on the server link
and the dealer link.

Sizes are element counts: comparisons for ``ge``/``ge_ratio``/``select``/``reciprocal``/
``divide``, vector length for ``inner`` (one inner product), row length for ``max`` and
``any_exceeds`` (one row), matrix entries for the inverses (``n / 16`` matrices of 4 x 4, the
size of the L-BFGS ``W`` with buffer 2), list length for the sorts.

    starfish bench primitives --primitives ge,sort --sizes 1e3,1e5 --profile none --out out/primitives.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable

import torch

from mpc.launcher import run_parties
from mpc.crypten_compat import crypten
from protocols.compare import ge, ge_ratio, select
from protocols.division import divide, reciprocal
from protocols.inner_product import inner
from protocols.inverse import inverse_masked, inverse_newton
from protocols.maximum import max as secure_max
from protocols.sort import bitonic_sort, ratio_comparator, top_k
from protocols.threshold import any_exceeds

from . import common_options, progress
from .report import machine_info, markdown_table, write_json

ELEMENTWISE_SIZES = (1_000, 100_000, 1_000_000)
# 67 comparisons per element: 1e6 elements would hold ~67e6-element comparison circuits
DIVISION_SIZES = (1_000, 100_000)
SORT_SIZES = (64, 128, 256, 512, 1024)

PRIMITIVES: dict[str, tuple[str, tuple[int, ...]]] = {
    "inner": ("inner product, shared x shared", ELEMENTWISE_SIZES),
    "inner_public": ("inner product, shared x public", ELEMENTWISE_SIZES),
    "ge": ("SecGE", ELEMENTWISE_SIZES),
    "ge_ratio": ("SecGE2 (division-free ratio comparison)", ELEMENTWISE_SIZES),
    "select": ("SecSel", ELEMENTWISE_SIZES),
    "max": ("SecMax over one row", ELEMENTWISE_SIZES),
    "any_exceeds": ("SecTC core over one row", ELEMENTWISE_SIZES),
    "reciprocal": ("reciprocal, normalised (default)", DIVISION_SIZES),
    "reciprocal_crypten": ("reciprocal, CrypTen's", ELEMENTWISE_SIZES),
    "divide": ("division, shared / shared (normalised)", DIVISION_SIZES),
    "inverse_masked": ("SecMI by masking (Alg. 7), 4x4 batch", ELEMENTWISE_SIZES),
    "inverse_newton": ("SecMI by Newton-Schulz, 4x4 batch", ELEMENTWISE_SIZES),
    "sort": ("bitonic sort, single key, stable", SORT_SIZES),
    "sort_ratio": ("bitonic sort, (u, v) keys with SecGE2, stable", SORT_SIZES),
    "top_k_ratio": ("top-k of (u, v) keys, k = ceil(0.6 n), opened", SORT_SIZES),
}


# ----------------------------------------------------------------------------- party side
def _cases() -> dict[str, Callable]:
    """Per primitive: ``case(n, gen, shared)`` shares the inputs (no traffic: pseudo-random
    zero sharings) and returns a thunk doing exactly the work that is metered."""
    f64 = torch.float64

    def normal(shape, g):
        return torch.randn(shape, generator=g, dtype=f64)

    def positive(n, g):
        return torch.rand(n, generator=g, dtype=f64) * 10 + 0.1

    def two(n, g, sh):
        return sh(normal(n, g), 0), sh(normal(n, g), 1)

    def ratio_keys(n, g, sh):
        return sh(normal(n, g), 0), sh(positive(n, g), 1)

    def matrices(n, g, sh):
        return sh(normal((max(1, n // 16), 4, 4), g) + 3 * torch.eye(4, dtype=f64), 0)

    def case_inner(n, g, sh):
        a, b = two(n, g, sh)
        return lambda: inner(a, b)

    def case_inner_public(n, g, sh):
        a, b = sh(normal(n, g), 0), normal(n, g) * 1e-3  # public model-difference scale
        return lambda: inner(a, b)

    def case_ge(n, g, sh):
        a, b = two(n, g, sh)
        return lambda: ge(a, b)

    def case_ge_ratio(n, g, sh):
        (u1, v1), (u2, v2) = ratio_keys(n, g, sh), ratio_keys(n, g, sh)
        return lambda: ge_ratio(u1, v1, u2, v2)

    def case_select(n, g, sh):
        a, b = two(n, g, sh)
        c = a >= b
        return lambda: select(c, a, b)

    def case_max(n, g, sh):
        a = sh(normal(n, g), 0)
        return lambda: secure_max(a)

    def case_any_exceeds(n, g, sh):
        a, d = sh(normal((1, n), g), 0), sh(torch.full((1,), 4.5, dtype=f64), 1)
        return lambda: any_exceeds(a, d)

    def case_reciprocal(n, g, sh):
        a = sh(positive(n, g), 0)
        return lambda: reciprocal(a)

    def case_reciprocal_crypten(n, g, sh):
        a = sh(positive(n, g), 0)
        return lambda: reciprocal(a, method="crypten")

    def case_divide(n, g, sh):
        a, b = sh(normal(n, g), 0), sh(positive(n, g), 1)
        return lambda: divide(a, b)

    def case_inverse_masked(n, g, sh):
        a = matrices(n, g, sh)
        return lambda: inverse_masked(a)

    def case_inverse_newton(n, g, sh):
        a = matrices(n, g, sh)
        return lambda: inverse_newton(a)

    def case_sort(n, g, sh):
        a = sh(normal(n, g), 0)
        return lambda: bitonic_sort(a, torch.arange(n), descending=True)

    def case_sort_ratio(n, g, sh):
        keys = ratio_keys(n, g, sh)
        return lambda: bitonic_sort(keys, torch.arange(n), descending=True,
                                    comparator=ratio_comparator)

    def case_top_k_ratio(n, g, sh):
        keys = ratio_keys(n, g, sh)
        return lambda: top_k(keys, None, math.ceil(0.6 * n), comparator=ratio_comparator)

    return {name[len("case_"):]: fn for name, fn in locals().items() if name.startswith("case_")}


def _program(party, primitive: str, sizes: list[int], seed: int = 0) -> dict:
    def shared(t, src):
        return crypten.cryptensor(t.to(torch.float64), src=src)

    case = _cases()[primitive]
    # First calls pay one-off costs (lazy torch/CrypTen initialisation, ~0.5 s); keep them
    # out of the smallest size's seconds.
    case(min(sizes), torch.Generator().manual_seed(seed), shared)()
    for n in sizes:
        # seed 0 draws the inputs measured before --seed existed
        gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
        work = case(n, gen, shared)  # inputs are shared here, outside the meter (no traffic)
        with party.meter(f"{primitive}:{n}"):
            work()
    return {}


# ----------------------------------------------------------------------------- parent side
def measure(primitive: str, sizes: list[int], provider: str, link, prefill: bool,
            timeout: float, seed: int = 0) -> list[dict]:
    kw = {"insecure_tfp": provider == "tfp", "link": link, "dealer_link": link, "timeout": timeout,
          "offline": "two-party" if provider == "two-party" else "dealer"}
    dry = run_parties(_program, primitive, sizes, seed, **kw)
    res = dry
    if provider == "dealer" and prefill:
        res = run_parties(_program, primitive, sizes, seed, plan=dry.plans[1], **kw)
    rows = []
    for n in sizes:
        step = f"{primitive}:{n}"
        d0, d1 = (m["steps"][step] for m in dry.meters)
        s0, s1 = (m["steps"][step] for m in res.meters)
        rows.append({
            "primitive": primitive,
            "n": n,
            "rounds": s0["online_rounds"],
            "online_bytes": s0["online_bytes_sent"] + s0["online_bytes_received"],
            # two-party: one server link, so party 0's count is all of it
            "offline_bytes": sum(d["offline_bytes_sent"] + d["offline_bytes_received"]
                                 for d in ((d0,) if provider == "two-party" else (d0, d1))),
            "seconds": max(s0["seconds"], s1["seconds"]),
            "online_only": res is not dry,
            "provider": provider,
        })
    return rows


def _sizes(text: str | None) -> list[int] | None:
    if not text:
        return None
    return [int(float(s)) for s in text.split(",") if s.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--primitives", default=",".join(PRIMITIVES),
                   help=f"comma list of {', '.join(PRIMITIVES)} (default all)")
    p.add_argument("--sizes", default=None,
                   help="comma list of element counts for the non-sort primitives "
                        "(default 1e3,1e5,1e6; 1e3,1e5 for reciprocal/divide)")
    p.add_argument("--sort-sizes", default=None, help="comma list of list lengths for the sorts "
                   "(default 64,128,256,512,1024)")
    common_options.add_profile(p)
    common_options.add_offline(p, several="dealer", tfp=True)
    p.add_argument("--no-prefill", action="store_true",
                   help="dealer: one run per primitive; seconds then include fetching dealer material")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per session (default 1800)")
    common_options.add_seed(p, "the input values")
    common_options.add_out(p, "out/primitives.json")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench primitives", __doc__, add_arguments, argv, args)
    try:
        profile = common_options.profile_of(args)
    except ValueError as exc:
        return common_options.refuse("starfish bench primitives", str(exc))
    link = profile.link()
    names = [s.strip() for s in args.primitives.split(",") if s.strip()]
    unknown = [s for s in names if s not in PRIMITIVES]
    if unknown:
        print(f"unknown primitive(s): {', '.join(unknown)}; known: {', '.join(PRIMITIVES)}",
              file=sys.stderr)
        return 2
    rows, failures = [], []
    with progress.progress(len(names) * len(args.offline), f"primitives ({','.join(args.offline)})",
                           quiet=args.quiet, unit="primitive") as bar:
        for provider in args.offline:
            for name in names:
                default = PRIMITIVES[name][1]
                override = _sizes(args.sort_sizes if default is SORT_SIZES else args.sizes)
                sizes = override or list(default)
                bar.set_postfix_str(f"{name} with {provider} at sizes {sizes}")
                try:
                    rows.extend(measure(name, sizes, provider, link, not args.no_prefill, args.timeout,
                                        args.seed))
                except Exception as exc:  # noqa: BLE001 - one primitive failing must not lose the others
                    progress.say(f"  {name} ({provider}) failed: {exc}")
                    failures.append({"primitive": name, "provider": provider, "sizes": sizes, "error": str(exc)})
                bar.update(1)
    cols = ["primitive", "n", "provider", "rounds", "online_bytes", "offline_bytes", "seconds"]
    print(markdown_table(rows, cols))
    path = write_json(args.out, {
        "machine": machine_info(), "profile": profile.to_json(), "link": dataclasses.asdict(link),
        "providers": args.offline,
        "descriptions": {k: v[0] for k, v in PRIMITIVES.items()},
        "rows": rows, "failures": failures,
    })
    print(f"wrote {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
