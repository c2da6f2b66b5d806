"""One FL round's local training, the clients batched vs one after another (``starfish bench training``).

What it measures: the wall time of one round of local training (every client E epochs of SGD
from the same global model, ``clients.training``) computed two ways on the same clients, seeds
and device:

* ``sequential``: ``LocalClient.train`` one client after another (the reference loop);
* ``batched``: ``clients.batched_training.ClientTrainer``, all clients as one ``vmap``-ed program.

It prints seconds per round and per local step, the speed-up, and the largest difference between
the two rounds' updates (relative to the largest update coordinate: float rounding, amplified by
the ReLU/max-pool kinks of the CNN over many steps). Both modes run a short warm-up first (the
first ``vmap`` call traces the model), so the figures are steady-state. ``--repeat R`` runs the
modes alternately R times and reports the fastest and the median run of each: on a machine shared
with other work the fastest run is the one least disturbed by it, and alternating exposes both
modes to the same load.

The default is the paper's Fashion-MNIST CNN (643,850 parameters), 20 clients, batch 64, lr
0.005, on a seeded subset of the real data (``--per-client`` images each, ``--epochs`` local
epochs). A full round (3,000 images and 5 epochs per client, 4,700 local steps in all) takes
25-45 minutes per mode on two CPU cores (docs/lab.md); ``--per-client 3000 --epochs 5`` runs it.

Plaintext local training, no 2PC and no link: so neither ``--profile`` nor ``--offline``.

    python -m bench.batched_training --per-client 256 --epochs 1 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from clients.batched_training import ClientTrainer
from clients.datasets import DATASET_NAMES, load_dataset
from clients.models import MODEL_NAMES, build_model, default_model_name, flatten_params, num_params
from clients.training import DEVICES, LocalClient, resolve_device, steps_for

from . import common_options, progress
from .report import write_json

__all__ = ["add_arguments", "main", "measure"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=DATASET_NAMES, default="fmnist",
                        help="fmnist (default; Debian's dataset-fashion-mnist) or another dataset")
    parser.add_argument("--data-dir", help="dataset directory (fmnist: the system package's)")
    parser.add_argument("--model", choices=MODEL_NAMES, help="architecture (dataset default: "
                                                              "the paper's CNN with the extra FC)")
    parser.add_argument("--clients", type=int, default=20, help="clients in the round (20)")
    parser.add_argument("--per-client", type=int, default=256,
                        help="training images per client, a seeded subset (256; the full split "
                             "gives each of 20 clients 3,000)")
    parser.add_argument("--epochs", type=float, default=1.0, help="local epochs (1; the paper: 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="local batch (64, the paper's)")
    parser.add_argument("--lr", type=float, default=0.005, help="local SGD lr (0.005, the paper's)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the clients train (auto: CUDA when present)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (2)")
    parser.add_argument("--modes", default="sequential,batched",
                        help="comma-separated: sequential, batched (both)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs per mode, alternating (1); the fastest and the median reported")
    common_options.add_seed(parser, "the training subset, the model and the batch orders")
    common_options.add_out(parser, "out/training.json")
    common_options.add_quiet(parser)


def _clients(args: argparse.Namespace) -> tuple[list[LocalClient], Any, str]:
    data = load_dataset(args.dataset, args.data_dir)
    need = args.clients * args.per_client
    if need > len(data.y_train):
        raise SystemExit(f"{args.clients} x {args.per_client} images > the {len(data.y_train)} "
                         f"training images of {args.dataset}")
    data = data.subset_train(need, args.seed)
    name = args.model or default_model_name(args.dataset)
    factory = build_model(name, data.input_shape, data.num_classes, l2=0.0)
    device = str(resolve_device(args.device))
    clients = []
    for j in range(args.clients):
        rows = slice(j * args.per_client, (j + 1) * args.per_client)
        clients.append(LocalClient(j, data.x_train[rows], data.y_train[rows], factory,
                                   epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                                   seed=args.seed, device=device))
    return clients, factory, name


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both modes on the same clients; the JSON-able result."""
    torch.set_num_threads(max(1, args.threads))
    clients, factory, name = _clients(args)
    torch.manual_seed(args.seed)
    start = flatten_params(factory()).to(torch.float64)
    steps = sum(steps_for(c.num_samples, c.batch_size, c.epochs) for c in clients)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    trainers = {mode: ClientTrainer(mode) for mode in modes}
    for trainer in trainers.values():
        trainer.train(clients, start, 0, epochs=1e-9)          # warm-up: one step per client
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    updates = {}
    for r in range(max(1, args.repeat)):
        for mode, trainer in trainers.items():
            with progress.progress(steps, f"{mode} {r + 1}/{args.repeat}", quiet=args.quiet,
                                   unit="step") as bar:
                t0 = time.perf_counter()
                updates[mode] = trainer.train(
                    clients, start, 1,
                    progress=lambda d, t, info: (bar.set_postfix_str(info, refresh=False),
                                                 bar.update(d - bar.n)))
                times[mode].append(time.perf_counter() - t0)
    rows = []
    for mode in modes:
        ts = sorted(times[mode])
        rows.append({"mode": mode, "seconds": ts[0], "median_seconds": ts[len(ts) // 2],
                     "runs": times[mode], "seconds_per_step": ts[0] / steps})
    base = next((r["seconds"] for r in rows if r["mode"] == "sequential"), None)
    for r in rows:
        r["speedup"] = None if base is None else base / r["seconds"]
    diff = None
    if {"sequential", "batched"} <= set(updates):
        a, b = updates["sequential"], updates["batched"]
        scale = max(float(a[j].update.abs().max()) for j in a)
        diff = max(float((a[j].update - b[j].update).abs().max()) for j in a) / scale
    dev = getattr(clients[0], "device", "cpu")
    return {"config": {"dataset": args.dataset, "model": name, "params": num_params(factory()),
                       "clients": args.clients, "per_client": args.per_client, "epochs": args.epochs,
                       "batch_size": args.batch_size, "lr": args.lr, "device": str(dev),
                       "threads": torch.get_num_threads(), "local_steps": steps,
                       "repeat": args.repeat,
                       "cuda": torch.cuda.get_device_name() if str(dev).startswith("cuda") else None},
            "results": rows, "max_rel_diff_batched_vs_sequential": diff}


def format_result(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"one FL round: {c['dataset']} {c['model']} ({c['params']:,} parameters), "
             f"{c['clients']} clients x {c['per_client']} images, {c['epochs']:g} epoch(s), batch "
             f"{c['batch_size']}: {c['local_steps']} local steps; device {c['device']}"
             f"{' (' + c['cuda'] + ')' if c['cuda'] else ''}, {c['threads']} threads",
             f"{'mode':<12}{'fastest s':>10}{'median s':>10}{'ms/step':>10}{'speed-up':>10}"]
    for r in res["results"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"{r['mode']:<12}{r['seconds']:>10.1f}{r['median_seconds']:>10.1f}"
                     f"{1000 * r['seconds_per_step']:>10.1f}{sp:>10}")
    if res["max_rel_diff_batched_vs_sequential"] is not None:
        lines.append(f"max |batched - sequential| / max |g|: {res['max_rel_diff_batched_vs_sequential']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="python -m bench.batched_training", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(argv)
    if args.clients < 1 or args.per_client < 1 or args.batch_size < 1:
        raise SystemExit("--clients, --per-client and --batch-size must be at least 1")
    res = measure(args)
    print(format_result(res))
    print(f"wrote {write_json(args.out, res)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
