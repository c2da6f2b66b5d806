"""Stage II with each server a coordinator and 2 Ray workers, and a worker killed mid-job (issue 30).

``bench/worker_unlearning.py``'s job on the ``tiny`` synthetic history: every update, secant and
estimate on 2 coordinate shards per server, the pairs on their own TLS links and dealer streams.
Server 0's worker 1 is SIGKILLed just before the job's 6th program on the shards (its pair's
session open, its shares held). Oracles: both servers' first run fails within seconds of the
kill, server 0 naming its dead worker and server 1 a worker of its own that lost its peer; the
next run (new workers) completes, both servers' models are equal, and they equal the plaintext
twin's rounds, flags and model (within 1e-3).
"""

from __future__ import annotations

import re
import threading

import pytest

from bench.profiles import resolve
from bench.synthetic import config, prepare
from bench.twin_check import plaintext_check
from bench.unlearning import _method
from bench.worker_unlearning import run_job
from mpc.dealer import DealerServer
from net import tls

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage2-workers")
    cfg = config("tiny")
    data = prepare(cfg, root / "cache")
    method, t_delta, _ = _method(resolve("none"), "auto", cfg.rounds)
    tls.init_keys(root / "keys", workers=2)
    dealer = DealerServer(tls.identity(root / "keys", tls.DEALER_NAME))
    threading.Thread(target=dealer.serve_forever, daemon=True).start()
    try:
        out = run_job(str(root / "keys"), 2, cfg.to_json(), str(data), method, t_delta, offline="dealer",
                      dealer_address=dealer.address, timeout=60.0, wait=500.0, kill_at=6)
    finally:
        dealer.stop()
    return cfg, data, method, t_delta, out


def test_the_run_with_a_killed_worker_fails_fast_on_both_servers(killed_run):
    *_, out = killed_run
    assert [o[0] for o in out] == ["ok", "ok"], out
    v0, v1 = out[0][1], out[1][1]
    assert len(v0["failed_runs"]) == len(v1["failed_runs"]) == 1
    first0, first1 = v0["failed_runs"][0], v1["failed_runs"][0]
    assert "server0-w1 is gone" in first0["error"], first0
    # server 1 names the first of its workers to lose its peer: the killed one's, or the other,
    # whose peer server 0 ends as it gives the run up (which comes first is a race)
    assert re.search(r"server1-w\d: WorkerError: (PeerDisconnected|PeerTimeout|ChannelError)", first1["error"]), first1
    killed = first0["killed_at"]
    assert killed is not None
    assert first0["failed_at"] - killed < 10 and first1["failed_at"] - killed < 30


def test_the_next_run_equals_the_plaintext_twin(killed_run):
    cfg, data, method, t_delta, out = killed_run
    v0, v1 = out[0][1], out[1][1]
    assert (v0["model"] == v1["model"]).all()
    twin = plaintext_check(cfg, str(data), method, t_delta, v0)
    assert twin["selected_rounds_equal"] and twin["flags_equal"]
    assert twin["max_abs_diff"] <= 1e-3
    assert len(v0["workers"]) == 2 and all(w["online"] > 0 for w in v0["workers"])
