"""Cost of keeping one server's stored update shares on K workers' shard directories (issue 30).

One server's store (``servers.store.share_store``) over R FL rounds of N clients' update shares
of D coordinates (random ring elements: only sizes matter here), kept either in the coordinator's
own directory (``--workers 1``, today's single process) or as slices in K workers' shard
directories (``--workers K``: a local Ray cluster, ``servers.workers.shard_store_files``). No
2PC runs: what is measured is the store's part of a round and of a job.

Reported: seconds to stage one upload (the slices made durable at the workers, then the catalog
row), to commit a round, to have every worker read its slices of one round's N updates (what a
check, a vote and Stage II do) against the coordinator reading them whole (joined and checked),
and to erase one client (adoption, every shard swept); bytes on disk at the coordinator and in
each shard directory; peak RSS of the coordinator (this process) and of each worker. Each read
is checked against the array staged (numpy).

    starfish bench shard-store --config mnist --workers 2
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import common_options, progress
from .report import machine_info, write_json
from .synthetic import config

__all__ = ["run", "main"]


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def run(cfg_name: str, workers: int, rounds: int, seed: int, quiet: bool = True) -> dict:
    """One measurement (see the module docstring); raises on a read that differs from numpy."""
    from net import tls
    from servers.store.share_store import ClientShares, ShareStore
    from servers.workers.shard_store_files import WorkerShardFiles
    from servers.workers.worker_group import WorkerGroup

    cfg = config(cfg_name)
    d, n = cfg.num_params, cfg.clients
    rng = np.random.default_rng(seed)
    root = Path(tempfile.mkdtemp(prefix="sfstore-"))
    ray_dir = None
    group = None
    try:
        shards = None
        t0 = time.perf_counter()
        if workers > 1:
            tls.init_keys(root / "keys", workers=workers)
            # short: Ray's sockets live under it (AF_UNIX paths end at 107 bytes)
            ray_dir = tempfile.mkdtemp(prefix="sfray1-")
            group = WorkerGroup(1, root / "keys", workers, d, ray_dir=ray_dir,
                                shard_dirs=[str(root / "shards" / f"w{k}") for k in range(workers)],
                                offline="dealer")
            shards = WorkerShardFiles(lambda step: step(group), d, workers)
        start_s = time.perf_counter() - t0
        store = ShareStore(root / "store", party=1, initial_model=np.zeros(d, np.float32), server_lr=1.0,
                           shards=shards)
        stage, commit, sent = [], [], {}
        with progress.progress(rounds * n, "staging uploads", quiet=quiet, unit="upload") as bar:
            for r in range(1, rounds + 1):
                for j in range(n):
                    u = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, d, dtype=np.int64,
                                     endpoint=True)
                    sent[(r, j)] = u if r == 1 else None      # round 1 is read back below
                    t = time.perf_counter()
                    store.stage_upload(r, j, u, np.int64(1), np.int64(2))
                    stage.append(time.perf_counter() - t)
                    bar.update()
                t = time.perf_counter()
                store.commit_round(r, np.full(d, r, np.float32), list(range(n)), {j: 1 / n for j in range(n)})
                commit.append(time.perf_counter() - t)
        t = time.perf_counter()
        for j in range(n):
            if not np.array_equal(store.update_share(1, j), sent[(1, j)]):
                raise RuntimeError(f"round 1 client {j}: the store read back another update")
        whole_s = time.perf_counter() - t
        load_s = None
        if group is not None:
            t = time.perf_counter()
            for j in range(n):
                group.load(f"u{j}", store.update_ref(1, j))
            load_s = time.perf_counter() - t
            for k, (a, b) in enumerate(group.bounds):
                got = group._ray.get(group.actors[k].share.remote("u0"))
                if not np.array_equal(got, sent[(1, 0)][a:b]):
                    raise RuntimeError(f"worker {k} loaded another slice of round 1 client 0's update")
            group.drop([f"u{j}" for j in range(n)])
        disk = {"coordinator": _bytes(root / "store"),
                "shards": [_bytes(root / "shards" / f"w{k}") for k in range(workers)] if workers > 1 else []}
        t = time.perf_counter()
        report = store.adopt_unlearning(rounds + 1, np.zeros(d, np.float32), job="bench", forgotten=[0])
        erase_s = time.perf_counter() - t
        after = {"coordinator": _bytes(root / "store"),
                 "shards": [_bytes(root / "shards" / f"w{k}") for k in range(workers)] if workers > 1 else []}
        store.close()
        states = group.state() if group is not None else []
        return {"config": cfg.name, "D": d, "N": n, "rounds": rounds, "workers": workers,
                "start_s": start_s, "stage_s": {"median": float(np.median(stage)), "max": float(max(stage))},
                "commit_s": {"median": float(np.median(commit)), "max": float(max(commit))},
                "read_round_whole_s": whole_s, "read_round_at_workers_s": load_s, "erase_s": erase_s,
                "erased_blobs": report.blobs_removed, "disk_bytes": disk, "disk_bytes_after_erasure": after,
                "coordinator_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_peak_rss_mib": [s.get("peak_rss_mib") for s in states]}
    finally:
        if group is not None:
            group.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        if ray_dir is not None:
            shutil.rmtree(ray_dir, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="mnist", help="the synthetic shapes (bench/synthetic.py; default mnist)")
    p.add_argument("--workers", type=int, default=2, metavar="K",
                   help="shard directories at K Ray workers (1: the coordinator's own directory); default 2")
    p.add_argument("--rounds", type=int, default=2, help="FL rounds stored (default 2)")
    common_options.add_seed(p, "the shares")
    common_options.add_out(p, None, shown="out/shard-store-<config>-workers<K>.json")
    common_options.add_quiet(p)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = common_options.parse("starfish bench shard-store", __doc__, add_arguments, argv, args)
    try:
        cfg = config(args.config)
    except ValueError as exc:
        return common_options.refuse("starfish bench shard-store", str(exc))
    if not 1 <= args.workers <= min(64, cfg.num_params) or args.rounds < 1:
        return common_options.refuse("starfish bench shard-store",
                                     f"--workers must be 1..{min(64, cfg.num_params)} and --rounds at least 1")
    try:
        res = run(args.config, args.workers, args.rounds, args.seed, args.quiet)
    except RuntimeError as exc:
        print(f"starfish bench shard-store: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    mib = 2 ** 20
    where = "the coordinator's directory" if args.workers == 1 else f"{args.workers} workers' shard directories"
    text = "\n".join([
        f"## starfish bench shard-store --workers {args.workers}: config {res['config']}: {res['rounds']} rounds x "
        f"{res['N']} clients x {res['D']:,} coordinates, update shares in {where}", "",
        f"stage one upload: median {res['stage_s']['median'] * 1e3:.1f} ms, max {res['stage_s']['max'] * 1e3:.1f} ms; "
        f"commit a round: median {res['commit_s']['median'] * 1e3:.1f} ms",
        f"read one round's {res['N']} updates whole at the coordinator: {res['read_round_whole_s']:.2f} s"
        + (f"; each worker its slices: {res['read_round_at_workers_s']:.2f} s"
           if res["read_round_at_workers_s"] is not None else ""),
        f"erase one client (adoption, {res['erased_blobs']} blobs): {res['erase_s']:.2f} s",
        f"disk: coordinator {res['disk_bytes']['coordinator'] / mib:.1f} MiB"
        + (", shards " + ", ".join(f"{b / mib:.1f}" for b in res["disk_bytes"]["shards"]) + " MiB"
           if res["disk_bytes"]["shards"] else "")
        + f"; after the erasure coordinator {res['disk_bytes_after_erasure']['coordinator'] / mib:.1f} MiB"
        + (", shards " + ", ".join(f"{b / mib:.1f}" for b in res["disk_bytes_after_erasure"]["shards"]) + " MiB"
           if res["disk_bytes_after_erasure"]["shards"] else ""),
        f"peak RSS: coordinator {res['coordinator_peak_rss_mib']:.0f} MiB"
        + (", workers " + ", ".join(f"{m:.0f}" for m in res["worker_peak_rss_mib"]) + " MiB"
           if res["worker_peak_rss_mib"] else ""),
        f"(worker start, Ray cluster included: {res['start_s']:.1f} s)" if args.workers > 1 else ""]).rstrip()
    print(text)
    out = args.out or f"out/shard-store-{res['config']}-workers{args.workers}.json"
    path = write_json(out, {"machine": machine_info(), "benchmark": "shard-store", "result": res, "markdown": text})
    Path(path).with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0
