"""One FL round's 2PC on coordinate shards by two servers, each a coordinator and K Ray workers.

Why a harness of its own: a sharded round needs two coordinator processes (one per server, each
with its own Ray cluster: never one for both) that meet as the daemons do. Here they meet over a
pipe (server 1 sends its workers' and its own 2PC listener's addresses), so that the benchmark
(``starfish bench range-check --workers K``) and the tests run exactly what the daemon will:
``servers.workers.sharded_round``'s check and aggregate.

Reported per server: seconds of the scatter, the range check and the aggregate; each worker's
peak RSS (the worker process; a two-party engine is a child process of its own, not counted).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from mpc.session import open_party
from servers.workers.sharded_round import aggregate_on_shards, check_on_shards, vote_on_shards
from servers.workers.worker_group import WorkerGroup

__all__ = ["run_round", "coordinator", "run_pair"]


def _attempt(rank: int, keys_dir: str, ray_dir: str, workers: int, shares: np.ndarray, counts: list,
             norms: np.ndarray, deltas: np.ndarray, options: dict[str, Any], peer,
             attempt: int, kill: bool, groups: list, marks: dict, vote_lambda: float | None = None) -> dict:
    t0 = time.perf_counter()
    group = WorkerGroup(rank, keys_dir, workers, shares.shape[-1], ray_dir=ray_dir, **options)
    groups.append(group)
    listener = party = None
    try:
        if rank == 1:
            listener = socket.create_server(("127.0.0.1", 0))
            peer.send((group.addresses, listener.getsockname()[:2]))
            peers, address = None, None
        else:
            peers, address = peer.recv()
        group.open(f"round:on-shards:attempt:{attempt}".encode(), peers)
        source = {k: v for k, v in options.items() if k in ("offline", "dealer_address") and v}
        party = open_party(rank, keys_dir, peer_listener=listener, peer_address=address,
                           ticket=f"round:on-shards:verdict:{attempt}".encode(),
                           timeout=options.get("timeout", 120.0), **source)
        t1 = time.perf_counter()
        names = [f"u{j}" for j in range(shares.shape[0])]
        for j, n in enumerate(names):
            group.scatter(n, shares[j])
        t2 = time.perf_counter()
        if kill:      # the last worker dies with its pair's session open and its shares held
            os.kill(group.state()[-1]["pid"], signal.SIGKILL)
        marks["check"] = time.perf_counter()
        bits = check_on_shards(group, party, names, norms, deltas)
        t3 = time.perf_counter()
        opened = aggregate_on_shards(group, names, counts)
        t4 = time.perf_counter()
        vote = None if vote_lambda is None else vote_on_shards(group, names, vote_lambda)
        t5 = time.perf_counter()
        states = group.state()
        group.close()
        dropped = group.drop(names)
        return {"bits": bits, "opened": opened, "vote": vote, "workers": states, "bounds": group.bounds,
                "dropped": dropped, "seconds": {"start": t1 - t0, "scatter": t2 - t1, "check": t3 - t2,
                                                "aggregate": t4 - t3, "vote": t5 - t4}}
    finally:
        if party is not None:
            party.close()
        if listener is not None:
            listener.close()


def coordinator(rank: int, keys_dir: str, ray_dir: str, workers: int, shares: np.ndarray, counts: list,
                norms: np.ndarray, deltas: np.ndarray, options: dict[str, Any],
                peer, out, kill_worker: bool = False, vote_lambda: float | None = None) -> None:
    """Server ``rank``'s side: scatter its shares of the updates, check and aggregate on shards
    (and, with ``vote_lambda``, BRACE's vote of every update with that lambda);
    sends ("ok", report) or ("error", text) through ``out``. ``kill_worker`` (a fault test):
    server 0 kills its last worker before the first attempt's check; each server then reports
    the failed attempt (its one-line error and the seconds from the check's start to the failure) and tries once
    more with new workers, as a round's close is retried."""
    groups: list[WorkerGroup] = []
    marks: dict = {}

    def attempt(n: int) -> dict:
        marks.clear()
        return _attempt(rank, keys_dir, ray_dir, workers, shares, counts, norms, deltas, options, peer,
                        n, kill_worker and n == 1 and rank == 0, groups, marks, vote_lambda)

    def failure(exc: BaseException) -> dict:
        return {"check_failed_after_s": time.perf_counter() - marks["check"] if "check" in marks else None}

    answer_with_retries(out, 2 if kill_worker else 1, attempt, failure, groups, "failed_attempts")


def answer_with_retries(out, attempts: int, attempt: Callable[[int], dict],
                        failure: Callable[[BaseException], dict], groups: list, key: str) -> None:
    """A coordinator's answer: ``attempt(n)`` for n = 1, 2, ... until one returns its report or
    ``attempts`` have failed, as the daemon retries a round's close or a job's run on new workers
    (each failed attempt's last group is stopped first). Sends ("ok", report with the failed
    attempts under ``key``: each one's one-line error and ``failure(exc)``) or ("error", text)
    through ``out``; the last group is shut down in the end."""
    failed: list[dict] = []
    try:
        for n in range(1, attempts + 1):
            try:
                report = attempt(n)
            except Exception as exc:  # noqa: BLE001 - the attempt failed: reported, then retried
                failed.append({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:1000], **failure(exc)})
                if groups:
                    groups[-1].stop_workers()
                continue
            out.send(("ok", dict(report, **{key: failed})))
            return
        raise RuntimeError(failed[-1]["error"] if failed else "no attempt ran")
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        out.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))
    finally:
        if groups:
            groups[-1].shutdown()


def _split(ring: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    s0 = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=ring.shape, dtype=np.int64,
                      endpoint=True)
    with np.errstate(over="ignore"):
        return s0, ring - s0


def run_round(keys_dir: str, workers: int, ring: np.ndarray, counts: list, norms: np.ndarray,
              deltas: np.ndarray, *, offline: str, dealer_address=None,
              kill_worker: bool = False, timeout: float = 120.0, seed: int = 7,
              wait: float = 3600.0, vote_lambda: float | None = None) -> list[tuple]:
    """Both servers' reports (rank 0, rank 1) of one round on ``workers`` worker pairs. ``ring``:
    the (n, d) encoded updates, ``norms``, ``deltas``: (n,) encoded; shared here with ``seed``;
    ``vote_lambda``: BRACE's vote of the updates too (``vote_on_shards``)."""
    rng = np.random.default_rng(seed)
    shares = [_split(np.asarray(v, dtype=np.int64), rng) for v in (ring, norms, deltas)]
    options = {"offline": offline, "dealer_address": dealer_address, "timeout": timeout}
    return run_pair(coordinator, lambda r, ray_dir, peer, out: (
        r, str(keys_dir), ray_dir, workers, shares[0][r], list(counts), shares[1][r], shares[2][r], options,
        peer, out, kill_worker, vote_lambda), wait)


def run_pair(target, args_of, wait: float) -> list[tuple]:
    """Two coordinator processes ``target(*args_of(rank, ray_dir, peer, out))`` (spawned), each
    with a Ray directory of its own, ``peer`` the pipe between them and ``out`` where it sends
    ("ok", report) or ("error", text); returns both answers (rank 0, rank 1)."""
    ctx = mp.get_context("spawn")
    peer0, peer1 = ctx.Pipe()
    results = [ctx.Pipe(duplex=False) for _ in (0, 1)]
    # Ray's socket paths must stay under 108 bytes: its directories go under a short /tmp name
    ray_dirs = [tempfile.mkdtemp(prefix=f"sfray{r}-") for r in (0, 1)]
    procs = [ctx.Process(target=target, args=args_of(r, ray_dirs[r], (peer0, peer1)[r], results[r][1]))
             for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        out = [c.recv() if c.poll(wait) else ("error", f"no answer in {wait:.0f} s") for c, _ in results]
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for d in ray_dirs:
            shutil.rmtree(d, ignore_errors=True)
    return out


def bench(cfg, attacker: int | None, workers: int, offline: str, seed: int, quiet: bool) -> dict:
    """``starfish bench range-check --workers K``: the round of ``cfg``'s uploads on K worker pairs
    (throw-away keys with worker certificates; in dealer mode a dealer thread in this process).
    The aggregate (weights 1) is checked against numpy's ring sum, the attacker's upload included."""
    import threading

    from common.encoding import encode
    from mpc.dealer import DealerServer
    from net import tls

    from . import progress
    from .synthetic import tolerance_delta, update_values

    g = np.stack([update_values(cfg, 0, j) for j in range(cfg.clients)])
    ring, norms = encode(g), encode(np.linalg.norm(g, axis=1))
    deltas = encode(np.array([tolerance_delta(row, cfg.alpha) for row in g]))
    if attacker is not None:
        ring[attacker, 0] = 1 << 62
    keys = tempfile.mkdtemp(prefix="sfkeys-")
    dealer = None
    try:
        tls.init_keys(keys, workers=workers)
        if offline == "dealer":
            dealer = DealerServer(tls.identity(keys, tls.DEALER_NAME))
            threading.Thread(target=dealer.serve_forever, daemon=True).start()
        progress.say(f"range check and aggregate of {cfg.clients} x {cfg.num_params:,} on {workers} worker "
                     f"pair(s), --offline {offline} ...", quiet=quiet)
        t0 = time.perf_counter()
        out = run_round(keys, workers, ring, [1] * cfg.clients, norms, deltas, offline=offline,
                        dealer_address=dealer.address if dealer else None, seed=seed, timeout=600.0)
        wall = time.perf_counter() - t0
    finally:
        if dealer is not None:
            dealer.stop()
        shutil.rmtree(keys, ignore_errors=True)
    failed = [o[1] for o in out if o[0] != "ok"]
    if failed:
        raise RuntimeError(failed[0].splitlines()[0])
    reports = [o[1] for o in out]
    exact = all(np.array_equal(r["opened"], ring.sum(0)) for r in reports)   # int64 sums wrap: the ring
    return {"workers": workers, "offline": offline, "wall_s": wall, "bits": reports[0]["bits"],
            "same_bits": reports[0]["bits"] == reports[1]["bits"],
            "seconds": [r["seconds"] for r in reports],
            "worker_peak_rss_mib": [[w["peak_rss_mib"] for w in r["workers"]] for r in reports],
            "aggregate_equals_numpy": exact}
