"""Attack x aggregator table: how much each server rule suffers from N attackers.

Why a runner of its own: the lab (``bench.lab``) runs one FL history and unlearns from it; the
question here is the FL run itself under attack, for every aggregator and several numbers of
attackers, on equal terms (same data, same clients, same seeds). Each cell is one FL run of
the lab (``lab.experiment.build_setup`` + ``run_federated``) with clients 0..N-1 attacking,
evaluated on the final model: test error (TER) and backdoor attack success (BA-ASR, on the
targets' clean samples with the trigger; for attacks other than the backdoor it shows the
trigger's base rate, i.e. that nothing was planted). No unlearning runs.

    python -m bench.robust_lab --attack sign-flip --out /tmp/robust   # digits, 20 clients, 40 rounds

takes the ``starfish lab`` options (data, FL, attack and aggregator parameters) plus
``--aggregators`` and ``--attacker-counts``, but not the lab's 2PC group (``--secure``,
``--offline``, ``--profile``): every cell is a plaintext FL run; writes ``robust_lab.json`` and ``robust_lab.png``
(two annotated grids, TER and BA-ASR, rows aggregators, columns attacker counts) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lab.aggregators import AGGREGATORS
from lab.fl import run_federated

from . import progress
from .lab import add_arguments as add_lab_arguments
from .lab import make_aggregator
from lab.experiment import build_setup

__all__ = ["main", "run_table", "format_grid"]


def _ids(text: str, what: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise ValueError(f"no {what} given")
    return out


def run_table(args: argparse.Namespace) -> dict[str, Any]:
    """One FL run per (aggregator, attacker count); returns the JSON-able table."""
    aggregators = _ids(args.aggregators, "aggregators")
    for name in aggregators:
        if name not in AGGREGATORS:
            raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(AGGREGATORS)}")
    counts = [int(c) for c in _ids(args.attacker_counts, "attacker counts")]
    cells: list[dict[str, Any]] = []
    for name in aggregators:
        for n in counts:
            cell = copy.copy(args)
            cell.aggregator, cell.attackers, cell.method = name, n, ""
            setup = build_setup(cell)
            aggregator = make_aggregator(cell)
            t0 = time.perf_counter()
            hist = run_federated(setup.participants, setup.m0, cell.rounds, setup.cfg.get("lr"),
                                 aggregator=aggregator)
            seconds = time.perf_counter() - t0
            metrics = setup.evaluate(hist.model(hist.num_rounds))
            cells.append({"aggregator": name, "aggregator_params": aggregator.params(),
                          "attackers": n, "attack": setup.attack,
                          "attacker_ids": list(setup.attackers), **metrics, "seconds": seconds})
            progress.say(f"robust lab: {name:<10} {n} x {setup.attack:<9} TER {100 * metrics['ter']:5.1f}%  "
                         f"BA-ASR {100 * metrics['ba_asr']:5.1f}%  ({seconds:.1f} s)", quiet=args.quiet)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    return {"config": config, "attack": args.attack, "aggregators": aggregators,
            "attacker_counts": counts, "cells": cells}


def _grid(result: dict[str, Any], key: str) -> list[list[float]]:
    by = {(c["aggregator"], c["attackers"]): c[key] for c in result["cells"]}
    return [[by[(a, n)] for n in result["attacker_counts"]] for a in result["aggregators"]]


def format_grid(result: dict[str, Any]) -> str:
    """Plain text: one line per aggregator, TER% and BA-ASR% per attacker count."""
    counts = result["attacker_counts"]
    head = ["aggregator"] + [f"TER% N={n}" for n in counts] + [f"BA-ASR% N={n}" for n in counts]
    rows = []
    for a, ter, asr in zip(result["aggregators"], _grid(result, "ter"), _grid(result, "ba_asr")):
        rows.append([a] + [f"{100 * v:.1f}" for v in ter] + [f"{100 * v:.1f}" for v in asr])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return f"attack: {result['attack']}\n" + "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Two annotated grids (TER, BA-ASR): rows aggregators, columns attacker counts."""
    import matplotlib  # noqa: PLC0415  (lazy: only when a figure is written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(9, 0.8 + 0.7 * len(result["aggregators"])))
    for ax, (key, title) in zip(axes, [("ter", "test error (%)"), ("ba_asr", "backdoor ASR (%)")]):
        grid = [[100 * v for v in row] for row in _grid(result, key)]
        ax.imshow(grid, cmap="Reds", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=9,
                        color="white" if v > 50 else "black")
        ax.set_xticks(range(len(result["attacker_counts"])))
        ax.set_xticklabels([str(n) for n in result["attacker_counts"]])
        ax.set_yticks(range(len(result["aggregators"])))
        ax.set_yticklabels(result["aggregators"])
        ax.set_xlabel("attackers")
        ax.set_title(title)
    cfg = result["config"]
    fig.suptitle(f"attack {result['attack']}: {cfg['dataset']}, {cfg['clients']} clients, "
                 f"{cfg['rounds']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the table, print it, write JSON + PNG to ``--out``; exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench.robust_lab",
                                     description=__doc__.split("\n\n")[0])
    add_lab_arguments(parser, secure=False)
    t = parser.add_argument_group("table")
    t.add_argument("--aggregators", default=",".join(AGGREGATORS),
                   help="comma-separated rows (" + ",".join(AGGREGATORS) + ")")
    t.add_argument("--attacker-counts", default="0,2,4", help="comma-separated columns (0,2,4)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    try:
        result = run_table(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"robust lab: error: {exc}", file=sys.stderr)
        return 2
    print(format_grid(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "robust_lab.json").write_text(json.dumps(result, indent=2, default=str))
        plot(result, out / "robust_lab.png")
        print(f"wrote {out / 'robust_lab.json'} and {out / 'robust_lab.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
