"""One full Stage II with each server a coordinator and K Ray workers (``starfish bench unlearning --workers K``).

Why a harness of its own (beside ``bench/unlearning.py``): here each server is two kinds of
process, a coordinator (``run_stage2`` on ``protocols.starfish.on_shards``'s values, the small
solves in its session with the other coordinator) and K Ray workers in that server's own
cluster (worker k holds coordinate shard k of every update, secant and estimate and computes on
it with worker k of the other server). The two coordinators meet over a pipe as in
``bench/worker_round.py``. The history is ``bench/synthetic.py``'s (the same shares and exact
updates as ``bench unlearning``; with ``--aggregator brace-sign`` made and replayed by BRACE's
vote, each shard voted by its pair), and the result is checked against the plaintext twin.

Reported per server: the whole job's seconds (workers started and sessions opened apart), each
worker's peak RSS and traffic, the coordinator's peak RSS and traffic. The dealer mode's material
is fetched online (no recorded schedule), so its bytes count as each session's offline bytes.
"""

from __future__ import annotations

import resource
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

from . import progress
from .synthetic import SyntheticClients, SyntheticConfig, SyntheticHistory, load_data
from .twin_check import plaintext_check, replay_combine
from .worker_round import answer_with_retries, run_pair

__all__ = ["run_job", "bench"]


def _traffic(meters: dict) -> dict:
    tot = meters["total"]
    return {k: tot.get(f"{k}_bytes_sent", 0) + tot.get(f"{k}_bytes_received", 0) for k in ("online", "offline")} | \
        {"rounds": tot.get("online_rounds", 0)}


def _attempt(rank: int, keys_dir: str, ray_dir: str, workers: int, cfg: SyntheticConfig, data_path: str,
             method: str, t_delta: int, options: dict, peer, attempt: int, held: list,
             bar: progress.PartyBar) -> dict:
    from mpc.session import open_party, shared_engine_pool
    from protocols.starfish import StarfishParams, run_stage2
    from protocols.starfish.on_shards import ShardClients, ShardHistory, ShardSpace
    from servers.workers.worker_group import WorkerGroup

    t0 = time.perf_counter()
    group = WorkerGroup(rank, keys_dir, workers, cfg.num_params, ray_dir=ray_dir, **options)
    held.append(group)
    listener = party = None
    try:
        if rank == 1:
            listener = socket.create_server(("127.0.0.1", 0))
            peer.send((group.addresses, listener.getsockname()[:2]))
            peers, address = None, None
        else:
            peers, address = peer.recv()
        group.open(f"stage2:on-shards:pairs:{attempt}".encode(), peers)
        source: dict[str, Any] = {"offline": options["offline"]}
        if options["offline"] == "dealer":
            source["dealer_address"] = options["dealer_address"]
        else:
            source["engine_pool"] = shared_engine_pool()
        party = open_party(rank, keys_dir, peer_listener=listener, peer_address=address,
                           ticket=f"stage2:on-shards:coordinators:{attempt}".encode(), timeout=options["timeout"],
                           **source)
        started = time.perf_counter() - t0
        hist = SyntheticHistory(cfg, load_data(data_path), rank, party.wrap_share)
        clients = SyntheticClients(hist)
        space = ShardSpace(group, cfg.num_params)
        params = StarfishParams(sigma=cfg.sigma, beta=cfg.beta, buffer=cfg.buffer, method=method, t_delta=t_delta)
        t1 = time.perf_counter()
        # the replayed rounds drive the bar, as in the one-process bench (bench/unlearning.py)
        with bar.open(unit="round") as shown:
            res = run_stage2(party, ShardHistory(hist, space), list(cfg.targets), params,
                             ShardClients(clients, space), progress=progress.callback(shown),
                             combine=replay_combine(cfg.aggregator, party.meter))
        job = time.perf_counter() - t1
        space.close()
        report = res.to_json()
        report.update(model=res.model.numpy(), start_s=started, job_s=job,
                      coordinator={"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                   **_traffic(party.meters()), "steps": party.meters()["steps"]},
                      workers=[{"peak_rss_mib": st.get("peak_rss_mib"), "peak_held_mib": st.get("peak_bytes", 0) / 2**20,
                                "peak_spilled_mib": st.get("peak_spilled_bytes", 0) / 2**20,
                                **_traffic(m)}
                               for st, m in zip(group.state(), group.meters())])
        group.close()
        return report
    finally:
        if party is not None:
            party.close()
        if listener is not None:
            listener.close()


def _coordinator(rank: int, keys_dir: str, ray_dir: str, workers: int, spec: dict, data_path: str,
                 method: str, t_delta: int, options: dict, peer, out, bar: progress.PartyBar) -> None:
    """Server ``rank``'s coordinator: its workers, the sessions, Stage II; ("ok", report) or
    ("error", text) through ``out``. (A worker killed mid-job, and the daemon's next run:
    ``tests/servers/test_service_workers.py``.)"""
    torch.set_num_threads(1)
    held: list = []

    def attempt(n: int) -> dict:
        return _attempt(rank, keys_dir, ray_dir, workers, SyntheticConfig.from_json(spec), data_path, method,
                        t_delta, options, peer, n, held, bar)

    answer_with_retries(out, 1, attempt, lambda exc: {"failed_at": time.time()}, held, "failed_runs")


def run_job(keys_dir: str, workers: int, spec: dict, data_path: str, method: str, t_delta: int, *,
            offline: str, dealer_address=None, timeout: float = 600.0, wait: float = 7200.0,
            quiet: bool = True, spill_mib: float = 0.0) -> list[tuple]:
    """Both coordinators' reports (rank 0, rank 1) of one Stage II on ``workers`` pairs; unless
    ``quiet``, coordinator 0 draws the replayed rounds' bar on a terminal. ``spill_mib``: the
    workers' ``ShardWorker`` option (shares from that size up in files)."""
    options = {"offline": offline, "dealer_address": dealer_address, "timeout": timeout, "spill_mib": spill_mib}
    bars = [b[0] for b in progress.party_args("Stage II", quiet)]
    return run_pair(_coordinator, lambda r, ray_dir, peer, out: (
        r, keys_dir, ray_dir, workers, spec, data_path, method, t_delta, options, peer, out, bars[r]), wait)


def bench(cfg: SyntheticConfig, data_path: str, workers: int, offline: str, method: str, t_delta: int,
          quiet: bool, spill_mib: float = 0.0) -> dict:
    """The job on ``workers`` pairs with throw-away keys (worker certificates included; in dealer
    mode a dealer thread in this process), checked against the plaintext twin."""
    from mpc.dealer import DealerServer
    from net import tls


    keys = tempfile.mkdtemp(prefix="sfkeys-")
    dealer = None
    try:
        tls.init_keys(keys, workers=workers)
        if offline == "dealer":
            dealer = DealerServer(tls.identity(keys, tls.DEALER_NAME))
            threading.Thread(target=dealer.serve_forever, daemon=True).start()
        progress.say(f"Stage II of {cfg.clients} clients x {cfg.num_params:,} parameters on {workers} worker "
                     f"pair(s), --offline {offline} ...", quiet=quiet)
        t0 = time.perf_counter()
        out = run_job(keys, workers, cfg.to_json(), data_path, method, t_delta, offline=offline,
                      dealer_address=dealer.address if dealer else None, quiet=quiet, spill_mib=spill_mib)
        wall = time.perf_counter() - t0
    finally:
        if dealer is not None:
            dealer.stop()
        shutil.rmtree(keys, ignore_errors=True)
    failed = [o[1] for o in out if o[0] != "ok"]
    if failed:
        raise RuntimeError(failed[0].splitlines()[0] + "\n" + failed[0][-1500:])
    v0, v1 = (o[1] for o in out)
    progress.say("plaintext twin ...", quiet=quiet)
    twin = plaintext_check(cfg, data_path, method, t_delta, v0, quiet, cfg.aggregator)
    return {"workers": workers, "offline": offline, "wall_s": wall,
            "servers_agree": bool(np.array_equal(v0["model"], v1["model"])),
            "selected_rounds": v0["selected_rounds"], "flags": v0["flags"],
            "estimated_updates": v0["estimated_updates"], "warmup_steps": v0["warmup_steps"],
            "servers": [{k: v for k, v in r.items() if k in ("start_s", "job_s", "coordinator", "workers")}
                        for r in (v0, v1)],
            "plaintext_twin": twin}
