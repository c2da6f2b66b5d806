"""The `starfish` command: one parser, each subcommand's arguments from the module that runs it."""

from __future__ import annotations

import argparse
import sys

from bench import (lab, primitives, range_check, robust_aggregation, rs_switch, runtime, scaling, steps,
                   truncation, unlearning)
from starfish import demo, key_commands, service_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="starfish",
        description="Secure two-party federated unlearning (Starfish): service daemons, demo, lab, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    key_commands.add_commands(sub)

    d = sub.add_parser("demo", help="the service end to end: dealer, two servers, 20 clients, 2PC "
                                    "unlearning of a backdoor client (--runtime: the 2PC runtime alone)")
    demo.add_arguments(d)
    d.set_defaults(func=lambda a: demo.main(args=a))

    service_commands.add_commands(sub)

    lp = sub.add_parser("lab", help="plaintext FL + unlearning comparison (retrain, FedEraser, FedRecover, "
                                    "Starfish, random)")
    lab.add_arguments(lp)
    lp.set_defaults(func=lambda a: lab.run(a))

    bench = sub.add_parser("bench", help="benchmarks (JSON + Markdown output)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")

    br = bsub.add_parser("runtime", help="N multiplications and comparisons: rounds, bytes, seconds")
    runtime.add_arguments(br)
    br.set_defaults(func=lambda a: runtime.main(args=a))

    bp = bsub.add_parser("primitives", help="per primitive and size: rounds, online/offline bytes, seconds")
    primitives.add_arguments(bp)
    bp.set_defaults(func=lambda a: primitives.main(args=a))

    bs = bsub.add_parser("rs-switch", help="measure round-selection Methods 1 and 2; derive T_delta")
    rs_switch.add_arguments(bs)
    bs.set_defaults(func=lambda a: rs_switch.main(args=a))

    bst = bsub.add_parser("steps", help="per unlearning step on the paper's MNIST shapes (Table I): offline/online "
                                        "time and bytes, rounds; LAN/WAN profiles, analytic time")
    steps.add_arguments(bst)
    bst.set_defaults(func=lambda a: steps.main(args=a))
    bu = bsub.add_parser("unlearning", help="one full Stage II on the paper's MNIST shapes (Table II): totals, "
                                            "per step, memory, socket bytes, targets")
    unlearning.add_arguments(bu)
    bu.set_defaults(func=lambda a: unlearning.main(args=a))
    btr = bsub.add_parser("truncation", help="audit of one Stage II: local truncations, their magnitudes and "
                                             "the expected number of wraps")
    truncation.add_arguments(btr)
    btr.set_defaults(func=lambda a: truncation.main(args=a))
    brc = bsub.add_parser("range-check", help="one round's 2PC range check of the uploads (one bit per client), "
                                              "MNIST shapes: online/offline bytes, rounds, seconds")
    range_check.add_arguments(brc)
    brc.set_defaults(func=lambda a: range_check.main(args=a))
    bsc = bsub.add_parser("scaling", help="cost of one unlearning round vs clients, model size and rounds; PNG plots")
    scaling.add_arguments(bsc)
    bsc.set_defaults(func=lambda a: scaling.main(args=a))
    bra = bsub.add_parser("aggregation", help="one FL round's Byzantine-robust aggregation in 2PC (FedSECA or "
                                             "BRACE's sign vote), MNIST shapes: bytes, rounds, seconds per step")
    robust_aggregation.add_arguments(bra)
    bra.set_defaults(func=lambda a: robust_aggregation.main(args=a))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
