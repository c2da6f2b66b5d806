"""A server's coordinator as a test runs it: its own process, its own Ray cluster, K workers.

The two coordinators talk only through ``peer`` (a pipe standing in for the servers' peer link:
server 1 sends its workers' addresses and its own 2PC listener's); each sends its results to the
test through ``out``.
"""

from __future__ import annotations

import socket
import traceback
from typing import Any

import numpy as np
import torch

from mpc.session import open_party
from protocols.upload_range import shard_chunks, verdict_from_partials
from servers.workers.shard_programs import open_weighted_sum, range_partials
from servers.workers.shards import join, split
from servers.workers.worker_group import WorkerGroup


def _ring_sum(parts: list[np.ndarray]) -> torch.Tensor:
    with np.errstate(over="ignore"):
        return torch.from_numpy(np.sum(np.stack(parts), axis=0, dtype=np.int64))


def round_on_shards(rank: int, keys_dir: str, ray_dir: str, workers: int, shares: list, counts: list,
                    norms: np.ndarray, deltas: np.ndarray, options: dict[str, Any], swap_peers: bool,
                    peer, out) -> None:
    """An FL round's 2PC on shards: scatter this server's shares of the client updates, run the
    range check's parts on every shard and decide at the coordinators (their own session), open
    the weighted ring sum shard by shard; send ("ok", bits, joined sum, worker states, bounds,
    dropped) or ("error", text) back."""
    group = listener = party = None
    try:
        group = WorkerGroup(rank, keys_dir, workers, shares[0].shape[-1], ray_dir=ray_dir, **options)
        if rank == 1:
            listener = socket.create_server(("127.0.0.1", 0))
            peer.send((group.addresses, listener.getsockname()[:2]))
            peers, coordinator = None, None
        else:
            peers, coordinator = peer.recv()
            if swap_peers:     # worker k meets the other server's worker k+1: must be refused
                peers = peers[1:] + peers[:1]
        group.open(b"test:round", peers)
        names = [f"u{j}" for j in range(len(shares))]
        for n, s in zip(names, shares):
            group.scatter(n, s)
        _, t = shard_chunks([hi - lo for lo, hi in group.bounds])
        parts = group.run(range_partials, names, t)
        source = {"offline": options["offline"]}
        if options.get("dealer_address"):
            source["dealer_address"] = options["dealer_address"]
        party = open_party(rank, keys_dir, peer_listener=listener, peer_address=coordinator,
                           ticket=b"test:round:verdict", timeout=60.0, **source)
        bits = verdict_from_partials(party, _ring_sum([c for c, _ in parts]), _ring_sum([s for _, s in parts]), t,
                                     party.wrap_share(norms), party.wrap_share(deltas))
        opened = group.run(open_weighted_sum, names, counts)
        states = group.state()
        group.close()
        dropped = group.drop(names)
        out.send(("ok", bits, join(opened), states, group.bounds, dropped))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))
    finally:
        if party is not None:
            party.close()
        if group is not None:
            group.shutdown()
