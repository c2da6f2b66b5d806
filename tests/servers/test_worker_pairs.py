"""A server as a coordinator and K workers on its own Ray cluster (issue 30): shards, worker
certificates, and one sharded computation (the FL round's exact aggregation) against numpy.

Each coordinator runs in its own process with its own local Ray cluster (never one for both
servers); worker k of server 0 and worker k of server 1 compute shard k over their own TLS link.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import tempfile
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from net import tls
from servers.workers.shards import join, shard_bounds, split

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ the shard plan
@given(d=st.integers(1, 5000), k=st.integers(1, 64))
def test_shards_are_contiguous_balanced_and_cover_every_coordinate(d, k):
    if k > d:
        with pytest.raises(ValueError, match="number of shards"):
            shard_bounds(d, k)
        return
    b = shard_bounds(d, k)
    assert len(b) == k and b[0][0] == 0 and b[-1][1] == d
    assert all(b[i][1] == b[i + 1][0] for i in range(k - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)
    x = np.arange(2 * d).reshape(2, d)
    assert np.array_equal(join(split(x, b)), x)


@pytest.mark.parametrize("d, k", [(0, 1), (5, 0), (3, 4), (True, 1), (5, 2.0)])
def test_a_plan_outside_its_domain_is_refused(d, k):
    with pytest.raises(ValueError):
        shard_bounds(d, k)


# ------------------------------------------------------------------ worker names
@given(rank=st.integers(0, 1), k=st.integers(0, tls.MAX_WORKERS - 1))
def test_worker_names_round_trip_and_never_equal_a_servers(rank, k):
    name = tls.party_name(rank, k)
    assert tls.worker_of(name) == (rank, k)
    assert name not in tls.PARTY_NAMES and tls.default_days(name) == tls.SERVICE_DAYS


@pytest.mark.parametrize("name", ["server0", "server1", "dealer", "client-3", "server0-w", "server0-w01",
                                  "server2-w1", "server0-w64", "server0-w-1", "xserver0-w1"])
def test_other_names_are_not_workers(name):
    assert tls.worker_of(name) is None


# ------------------------------------------------------------------ two servers, K workers each
def _tag(keys) -> str:
    """The key directory's tag in a worker's temporary directory (``ShardWorker``)."""
    return hashlib.sha256(os.path.abspath(keys).encode()).hexdigest()[:8]


def _run(tmp_path, workers, counts, updates, norms, deltas, swap_peers=False, offline="two-party", kill=False):
    pytest.importorskip("ray")
    from bench.worker_round import run_round

    keys = tmp_path / "keys"
    tls.init_keys(keys, workers=workers)
    dealer = None
    if offline == "dealer":     # one dealer for the deployment, each pair its own stream
        from mpc.dealer import DealerServer

        dealer = DealerServer(tls.identity(keys, tls.DEALER_NAME))
        threading.Thread(target=dealer.serve_forever, daemon=True).start()
    enc = lambda v: np.trunc(np.asarray(v) * 2**16).astype(np.int64)   # noqa: E731
    ring = enc(updates)
    try:
        out = run_round(str(keys), workers, ring, counts, enc(norms), enc(deltas), offline=offline,
                        dealer_address=dealer.address if dealer else None, swap_peers=swap_peers,
                        kill_worker=kill, timeout=4.0 if swap_peers else 120.0, wait=240.0)
    finally:
        if dealer is not None:
            dealer.stop()
    return ring, out


@pytest.mark.parametrize("offline, kill", [("two-party", False), ("dealer", True)],
                         ids=["two-party", "dealer-with-a-killed-worker"])
def test_two_workers_per_server_check_and_aggregate_each_shard_exactly(tmp_path, offline, kill):
    """A round on shards: the range check's bits equal the unsharded twin's (client 1 lies about
    its norm, client 3 has one coordinate out of the window, in shard 1), and the opened
    weighted ring sum equals numpy's exactly.

    ``kill``: server 0's worker 1 is killed first, with its pair's session open and its shares
    held: both coordinators' first attempt fails within seconds of the check's start (its
    session's timeout is 120 s), each naming a worker of its own and why, and the retry with new
    workers gives the results above."""
    from protocols.upload_range import uploads_in_range

    rng = np.random.default_rng(3)
    n, d, workers = 4, 1001, 2
    updates = rng.normal(size=(n, d))
    updates[3, 900] = 5000.0
    norms = np.linalg.norm(updates, axis=1)
    norms[1] /= 2
    deltas = np.quantile(np.abs(updates), 0.9, axis=1)
    counts = [5, 17, 2, 9]
    ring, out = _run(tmp_path, workers, counts, updates, norms, deltas, offline=offline, kill=kill)
    assert all(o[0] == "ok" for o in out), out
    for rank, (_, o) in enumerate(out):
        failed = o["failed_attempts"]
        assert len(failed) == (1 if kill else 0), failed
        if kill:
            assert failed[0]["check_failed_after_s"] < 30, failed
    if kill:
        # server 0 names its dead worker; server 1 the first of its workers to lose its peer (the
        # killed one's, or the other's, which server 0 ends when it gives the attempt up)
        assert "server0-w1 is gone" in out[0][1]["failed_attempts"][0]["error"]
        assert re.search(r"server1-w\d: WorkerError: (PeerDisconnected|EngineError|ChannelError)",
                         out[1][1]["failed_attempts"][0]["error"]), out[1][1]["failed_attempts"]
    want_bits = uploads_in_range(None, torch.from_numpy(updates), torch.from_numpy(norms), torch.from_numpy(deltas))
    assert want_bits == [True, False, True, False]
    with np.errstate(over="ignore"):
        want = sum(np.int64(c) * ring[j] for j, c in enumerate(counts))
    for rank, (_, o) in enumerate(out):
        bits, opened, states, bounds, dropped = (o[k] for k in ("bits", "opened", "workers", "bounds", "dropped"))
        assert bits == want_bits
        assert np.array_equal(opened, want)         # both servers open the same exact sum
        assert bounds == shard_bounds(d, workers)
        assert [s["name"] for s in states] == [f"server{rank}-w{k}" for k in range(workers)]
        assert [s["shares"] for s in states] == [n] * workers
        assert dropped == [n] * workers             # every shard's shares dropped
    # no worker left its files (its engine's per-link key) behind, the killed one's included
    left = sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"starfish-server?-w?-{_tag(tmp_path / 'keys')}")))
    assert left == []
    # the workers are separate processes, and each server's are in its own cluster
    pids = [s["pid"] for _, o in out for s in o["workers"]]
    assert len(set(pids)) == 2 * workers


def test_a_worker_of_another_pair_is_refused(tmp_path):
    updates = np.ones((1, 10))
    _, out = _run(tmp_path, 2, [1], updates, [4.0], [1.0], swap_peers=True)
    assert all(o[0] == "error" for o in out), out
    # server 0's worker k reached server 1's worker k+1 and refused its certificate (not its own
    # pair's name); server 1's workers saw no connection of their own pair (the TLS handshake pins
    # the pair's name)
    # (the group answers at its first failing worker: one or both are named)
    first0, first1 = out[0][1].splitlines()[0], out[1][1].splitlines()[0]
    assert re.search(r"server0-w(\d): WorkerError: HandshakeError: online channel to server1-w\1: .*Hostname mismatch, "
                     r"certificate is not valid for 'server1-w\1'", first0), first0
    assert re.search(r"server1-w(\d): WorkerError: PeerTimeout: no server0-w\1 with this session's ticket", first1), first1


def test_a_worker_without_its_certificate_fails_in_one_line_naming_the_file(tmp_path):
    pytest.importorskip("ray")
    from bench.worker_round import run_round

    keys = tmp_path / "keys"
    tls.init_keys(keys)              # the servers' certificates, no worker's
    z = np.zeros(1, np.int64)
    out = run_round(str(keys), 1, np.zeros((1, 8), np.int64), [1], z, z, offline="two-party", wait=120)
    for rank, (status, text) in enumerate(out):
        first = text.splitlines()[0]
        assert status == "error"
        assert f"server{rank}-w0 is gone: MissingCredential: missing credential {keys}/server{rank}-w0.pem" in first
        assert f"starfish keys issue --ca-dir CA --keys-dir {keys} --name server{rank}-w0" in first

