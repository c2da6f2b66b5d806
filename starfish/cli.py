"""The `starfish` command: one parser, each subcommand's arguments from the module that runs it.

Why the lazy tables: the lab, the benchmarks and the demo import torch (and CrypTen) at module
level, which costs seconds. ``starfish --help``, ``status`` or ``server`` must not pay for them,
so a command's module is imported (and its arguments added) only when that command is the one
being run, or when the whole parser is asked for (``build_parser()``, used by tests and docs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from common.gc_pause import collector_paused
from starfish import key_commands, service_commands

#: command -> (help, module, name of its entry point); the module has ``add_arguments(parser)``
_TOP: dict[str, tuple[str, str, str]] = {
    "demo": ("the service end to end: dealer, two servers, 20 clients, 2PC unlearning of a backdoor "
             "client (--runtime: the 2PC runtime alone)", "starfish.demo", "main"),
    "lab": ("plaintext FL + unlearning comparison (retrain, FedEraser, FedRecover, Starfish, random)",
            "bench.lab", "run"),
}
_BENCH: dict[str, tuple[str, str, str]] = {
    "runtime": ("N multiplications and comparisons: rounds, bytes, seconds", "bench.runtime", "main"),
    "primitives": ("per primitive and size: rounds, online/offline bytes, seconds", "bench.primitives", "main"),
    "rs-switch": ("measure round-selection Methods 1 and 2 on loopback; derive T_delta (each link profile's time "
                  "predicted, so no --profile)", "bench.rs_switch", "main"),
    "steps": ("per unlearning step on the paper's MNIST shapes (Table I): offline/online time and bytes, "
              "rounds; LAN/WAN profiles, analytic time", "bench.steps", "main"),
    "unlearning": ("one full Stage II on the paper's MNIST shapes (Table II): totals, per step, memory, "
                   "socket bytes, targets", "bench.unlearning", "main"),
    "truncation": ("audit of one Stage II: local truncations, their magnitudes and the expected number of "
                   "wraps (no --profile: the link changes no count)", "bench.truncation", "main"),
    "range-check": ("one round's 2PC range check of the uploads (one bit per client), MNIST shapes: "
                    "online/offline bytes, rounds, seconds", "bench.range_check", "main"),
    "scaling": ("cost of one unlearning round vs clients, model size and rounds; PNG plots",
                "bench.scaling", "main"),
    "scale": ("a model of one Stage II on K workers per server, calibrated on `bench unlearning --workers` "
              "runs: time, traffic, memory per worker up to D = 100M, N = 1,000; JSON and PNG", "bench.scale", "main"),
    "shard-store": ("one server's stored update shares on K workers' shard directories (issue 30): staging, "
                    "commit, reads at the workers vs the coordinator, erasure, disk and memory", "bench.shard_store",
                    "main"),
    "aggregation": ("one FL round's Byzantine-robust aggregation in 2PC (FedSECA or BRACE's sign vote), "
                    "MNIST shapes: bytes, rounds, seconds per step", "bench.robust_aggregation", "main"),
    "training": ("one FL round's local training, clients batched (vmap) vs one after another: seconds, "
                 "speed-up, difference; Fashion-MNIST CNN by default (plaintext: no --profile or --offline)",
                 "bench.batched_training", "main"),
}


def _entry(module: str, attr: str) -> Any:
    def run(args: argparse.Namespace) -> Any:
        with collector_paused():
            fn = getattr(importlib.import_module(module), attr)
        return fn(args) if attr == "run" else fn(args=args)
    return run


def _lazy(sub: Any, name: str, spec: tuple[str, str, str], populate: bool) -> None:
    help_text, module, attr = spec
    # the one-line summary heads the command's own --help too, where a user looks for a missing option
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(func=_entry(module, attr))
    if populate:
        with collector_paused():
            module_obj = importlib.import_module(module)
        module_obj.add_arguments(p)


def _selected(argv: list[str]) -> list[str]:
    """The positional words of ``argv`` before the first option (command, bench name)."""
    words = []
    for a in argv:
        if a.startswith("-"):
            break
        words.append(a)
    return words


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the command it names gets its (possibly heavy) arguments."""
    words = None if argv is None else _selected(argv)
    parser = argparse.ArgumentParser(
        prog="starfish",
        description="Secure two-party federated unlearning (Starfish): service daemons, demo, lab, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    key_commands.add_commands(sub)
    _lazy(sub, "demo", _TOP["demo"], words is None or words[:1] == ["demo"])
    service_commands.add_commands(sub)
    _lazy(sub, "lab", _TOP["lab"], words is None or words[:1] == ["lab"])

    bench = sub.add_parser("bench", help="benchmarks (JSON + Markdown output)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, spec in _BENCH.items():
        _lazy(bsub, name, spec, words is None or words[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
