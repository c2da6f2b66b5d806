"""A server's coordinator as a test runs it: its own process, its own Ray cluster, K workers.

The two coordinators talk only through ``peer`` (a pipe standing in for the servers' peer link:
server 1 sends its workers' addresses); each sends its results to the test through ``out``.
"""

from __future__ import annotations

import traceback
from typing import Any

from servers.workers.shard_programs import open_weighted_sum
from servers.workers.shards import join
from servers.workers.worker_group import WorkerGroup


def aggregate(rank: int, keys_dir: str, ray_dir: str, workers: int, shares: list, counts: list,
              options: dict[str, Any], swap_peers: bool, peer, out) -> None:
    """Scatter this server's shares of the client updates, open the weighted ring sum shard by
    shard, send (joined sum, worker states, bounds) or ("error", text) back."""
    group = None
    try:
        group = WorkerGroup(rank, keys_dir, workers, shares[0].shape[-1], ray_dir=ray_dir, **options)
        if rank == 1:
            peer.send(group.addresses)
            peers = None
        else:
            peers = peer.recv()
            if swap_peers:     # worker k meets the other server's worker k+1: must be refused
                peers = peers[1:] + peers[:1]
        group.open(b"test:aggregate", peers)
        for j, s in enumerate(shares):
            group.scatter(f"u{j}", s)
        parts = group.run(open_weighted_sum, [f"u{j}" for j in range(len(shares))], counts)
        states = group.state()
        group.close()
        dropped = group.drop([f"u{j}" for j in range(len(shares))])
        out.send(("ok", join(parts), states, group.bounds, dropped))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))
    finally:
        if group is not None:
            group.shutdown()
