"""The service under a Byzantine-robust aggregator (``[fl] aggregator``): dealer, two servers, and
clients driven from the test (synthetic updates: no training, so each run takes seconds).

Oracle: the lab's plaintext rules (``lab.aggregators``: FedSECA with server momentum,
BRACE's vote with the step scale / sqrt(t)) run on the updates *reconstructed from the two
servers' stored shares*, each round from the published M_{r-1}. FedSECA's 2PC differs from its
twin by at most the fixed-point bound ``protocols/robust_aggregation.py`` documents
(2 (2**-12 max |g| + 2**-16) + 2**-16 per coordinate of the aggregate); BRACE's vote is exact.

The FedSECA run also has a client with a wrong lambda_k in round 2 (it must be left out, the
round closing with the others) and SIGKILLs server 0 in round 2 between server 1's commit and
its own: the restarted leader must finish the round from the aggregate it kept, with no second
session (a second FedSECA session would open a slightly different aggregate, and the servers'
models would differ).
"""

from __future__ import annotations

import re
import signal
import time

import numpy as np
import pytest
import torch

from clients.fedseca_threshold import upload_threshold
from clients.service_client import ServiceError
from clients.share_seeds import seeded_shares
from net import tls
from common import wire
from net.channel import ChannelError
from common.encoding import decode, encode
from lab.aggregators import BraceSign, FedSECA
from tests.helpers.service_harness import Deployment

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)
N, ROUNDS, PREC, LR = 4, 3, 16, 0.3
WRONG = (2, 3)                  # (round, client): uploads lambda_k one order statistic too high
GAMMA, BETA = 0.9, 0.5


def _updates(r: int, dim: int) -> dict[int, np.ndarray]:
    """Round r's updates: a common direction plus noise, some exact zeros, one large client
    (clipped by FedSECA) and one sign-flipping client."""
    rng = np.random.default_rng(1000 + r)
    base = rng.normal(0, 0.05, dim)
    out = {}
    for j in range(N):
        g = base + rng.normal(0, 0.03, dim)
        g[rng.choice(dim, 20, replace=False)] = 0.0
        out[j] = g
    out[1] = out[1] * 6.0
    out[2] = -out[2]
    return out


def _upload(dep: Deployment, r: int, j: int, g: np.ndarray, *, threshold: float | None,
            drop_threshold: bool = False) -> None:
    values = {"update": g, "norm": np.array(np.linalg.norm(g)),
              "delta": np.array(np.quantile(np.abs(g), 0.6))}
    if threshold is not None:
        values["threshold"] = np.array(threshold)
    key = tls.identity(dep.cfg.keys_dir, f"client-{j}").key.read_bytes()
    shares = seeded_shares(key, f"round/{r}", values, PREC)
    for p in (0, 1):
        fields = {k: wire.share_field(s.seed0 if p == 0 else s.share1) for k, s in shares.items()}
        if drop_threshold:
            fields.pop("threshold", None)
        with dep.client(f"client-{j}", p) as c:
            c.call("upload", round=r, num_samples=10 + j, retry_seconds=60, **fields)


def _wrong_threshold(g: np.ndarray) -> float:
    """The next order statistic above the honest lambda_k (a plausible, wrong claim)."""
    ring = np.sort(np.abs(encode(g, PREC)))
    honest = encode(np.array(upload_threshold(g, GAMMA, PREC)), PREC)
    return float(decode(ring[ring > honest][0], PREC))


def _committed(dep: Deployment, p: int) -> int:
    """Server p's T, or -1 while it does not answer (killed by the crash seam)."""
    try:
        with dep.client("admin", p, connect_timeout=1.0) as c:
            return int(c.call("state")["T"])
    except ChannelError:
        return -1


def _run(root, aggregator: str, crash: str | None, *, rounds: int = ROUNDS, offline: str = "dealer",
         restart_server1_before: int | None = None, workers: int = 1) -> dict:
    """Start a deployment, upload ``rounds`` rounds (restarting a server the crash seam killed,
    and server 1 before round ``restart_server1_before``), stop it and return what the oracles need."""
    dep = Deployment(root, clients=N, offline=offline, workers=workers, overrides={"fl": {
        "rounds": rounds, "aggregator": aggregator, "server_lr": LR, "round_deadline": 120.0,
        "fedseca_gamma": GAMMA, "fedseca_beta": BETA}})
    out: dict = {"refusals": {}, "sent": {}, "restarted": False}
    try:
        if offline == "dealer":
            dep.start("dealer", ["dealer"])
        dep.start_server(1)
        dep.start_server(0, crash)
        dep.wait_ready()
        dim = int(dep.client("admin", 0).call("state")["dim"])
        for r in range(1, rounds + 1):
            if r == restart_server1_before:
                dep.procs.stop("server1")
                dep.start_server(1)
                dep.wait_ready((1,))
            ups = _updates(r, dim)
            out["sent"][r] = ups
            for j, g in ups.items():
                thr = None
                if aggregator == "fedseca":
                    thr = _wrong_threshold(g) if (r, j) == WRONG else upload_threshold(g, GAMMA, PREC)
                if r == 1 and j == 0:   # validation first: the same upload without / with a threshold
                    with pytest.raises(ServiceError) as err:
                        _upload(dep, r, j, g, threshold=thr if thr is not None else 0.5,
                                drop_threshold=thr is not None)
                    out["refusals"][aggregator] = (err.value.code, err.value.message)
                _upload(dep, r, j, g, threshold=thr)
            deadline = time.monotonic() + (120 if offline == "dealer" else 300)
            while True:
                assert time.monotonic() < deadline, dep.log("server0") + dep.log("server1")
                rc = dep.procs.procs["server0"].poll()
                if rc is not None:
                    assert rc == -signal.SIGKILL, dep.log("server0")
                    dep.start_server(0)
                    dep.wait_ready((0,))
                    out["restarted"] = True
                if min(_committed(dep, p) for p in (0, 1)) >= r:
                    break
                time.sleep(0.1)   # nothing to poll but the servers' state and process
        with dep.client("admin", 0) as c:
            out["info"] = {r: c.call("round_info", round=r) for r in range(1, rounds + 1)}
        out["logs"] = {p: (root / "logs" / f"server{p}.log").read_text() for p in (0, 1)}
    finally:
        dep.close()
    stores = [dep.store(p) for p in (0, 1)]
    try:
        out["models"] = [np.array(stores[0].model(r)) for r in range(rounds + 1)]
        out["same"] = all(np.array_equal(stores[0].model(r), stores[1].model(r)) and
                          stores[0].metadata(r) == stores[1].metadata(r) for r in range(1, rounds + 1))
        out["meta"] = {r: stores[0].metadata(r) for r in range(1, rounds + 1)}
        out["parts"] = {r: stores[0].participants(r) for r in range(1, rounds + 1)}
        # the updates the servers hold: share 0 + share 1, decoded
        out["rows"] = {r: {j: decode(stores[0].update_share(r, j) + stores[1].update_share(r, j), PREC)
                           for j in stores[0].participants(r)} for r in range(1, rounds + 1)}
        out["staged"] = [st.staged(rounds + 1) for st in stores]
    finally:
        for st in stores:
            st.close()
    return out


@pytest.fixture(scope="module")
def fedseca_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fedseca"), "fedseca", "leader-before-commit:2")


@pytest.fixture(scope="module")
def brace_run(tmp_path_factory):
    # server 1 restarts before the last round: its dealer plans come back from its store
    return _run(tmp_path_factory.mktemp("brace"), "brace-sign", None, restart_server1_before=ROUNDS)


def test_fedseca_models_equal_the_plaintext_twin(fedseca_run):
    run = fedseca_run
    assert run["same"] and run["staged"] == [(), ()]
    twin = FedSECA(gamma=GAMMA, beta=BETA)
    for r in range(1, ROUNDS + 1):
        rows = run["rows"][r]
        for j, g in rows.items():   # the stored shares are the uploads, encoded
            assert np.array_equal(g, decode(encode(run["sent"][r][j], PREC), PREC))
        direction = twin.direction({j: torch.from_numpy(g) for j, g in rows.items()}, {}).numpy()
        expect = run["models"][r - 1] - LR * direction
        g_max = max(np.abs(g).max() for g in rows.values())
        # the aggregate's documented bound; momentum carries earlier rounds' errors at weight
        # beta^k (1 - beta), which the factor 1 / (1 - beta) covers
        bound = LR * (2 * (2.0 ** -12 * g_max + 2.0 ** -16) + 2.0 ** -16)
        assert np.abs(run["models"][r] - expect).max() <= bound, r
        assert run["meta"][r]["aggregator"] == "fedseca"
        assert run["meta"][r]["rule"]["momentum"] == ("restarted" if r == 1 else "continued")
        assert run["info"][r]["aggregator"] == "fedseca"


def test_fedseca_leaves_out_a_wrong_threshold_and_the_round_closes(fedseca_run):
    run = fedseca_run
    r, bad = WRONG
    assert run["parts"][r] == tuple(j for j in range(N) if j != bad)
    assert run["meta"][r]["threshold_refused"] == [bad] and "refused" not in run["meta"][r]
    assert run["info"][r]["threshold_refused"] == [bad]
    for other in set(range(1, ROUNDS + 1)) - {r}:
        assert run["parts"][other] == tuple(range(N)) and "threshold_refused" not in run["meta"][other]


def test_fedseca_leader_crash_after_the_follower_commit_needs_no_second_session(fedseca_run):
    run = fedseca_run
    assert run["restarted"] and "SIGKILL at leader-before-commit" in run["logs"][0]
    for p in (0, 1):
        sessions = re.findall(r"round 2 aggregated by fedseca", run["logs"][p])
        assert len(sessions) == 1, (p, sessions)


def test_brace_sign_models_equal_the_plaintext_twin_exactly(brace_run):
    run = brace_run
    assert run["same"]
    twin = BraceSign(lam=None, scale=0.5, decay=0.5)   # lambda = 5 K / 100, the service default
    for r in range(1, ROUNDS + 1):
        rows = run["rows"][r]
        assert run["parts"][r] == tuple(range(N))
        direction = twin.direction({j: torch.from_numpy(g) for j, g in rows.items()}, {}).numpy()
        assert np.array_equal(run["models"][r], run["models"][r - 1] - LR * direction), r
        assert run["meta"][r]["rule"]["t"] == r and run["info"][r]["aggregator"] == "brace-sign"


def test_later_rounds_fetch_the_dealer_material_ahead(fedseca_run, brace_run):
    """A round's 2PC session with the same shapes as the last one has server 1 fetch the last
    one's dealer requests in the background (``servers.secure.dealer_plans``): nothing in round 1,
    all of it from round 2 on when the participants are the same (BRACE; its server 1 restarts
    before round 3, which fetches ahead from the plans kept in the store), some of it when the
    round's requests part from the plan (FedSECA's round 2 leaves a wrong threshold out). The
    models equal the twins' in the tests above, so what was fetched ahead was right."""
    def served(run, aggregator):
        found = re.findall(rf"round (\d+) aggregated by {aggregator} in 2PC: .* served_ahead=(\d+)",
                           run["logs"][1])
        return {int(r): int(n) for r, n in found}

    brace = served(brace_run, "brace-sign")
    assert brace[1] == 0 and all(brace[r] > 0 for r in range(2, ROUNDS + 1)), brace
    fed = served(fedseca_run, "fedseca")
    assert fed[1] == 0 and fed[2] > 0, fed
    assert all(re.search(r"served_ahead=0\b", line) for line in fedseca_run["logs"][0].splitlines()
               if "aggregated by" in line)   # server 0 derives its shares: it fetches nothing


def test_uploads_carry_a_threshold_exactly_where_fedseca_needs_one(fedseca_run, brace_run):
    code, msg = fedseca_run["refusals"]["fedseca"]
    assert code == "bad_request" and "needs `threshold`" in msg
    code, msg = brace_run["refusals"]["brace-sign"]
    assert code == "bad_request" and "takes no `threshold`" in msg


def test_brace_sign_in_two_party_mode_makes_its_correlations_without_a_dealer(tmp_path):
    """The aggregation session takes its randomness where the range check does: here from the
    two-party engine (no dealer process is started). One round: an engine per session is slow."""
    run = _run(tmp_path, "brace-sign", None, rounds=1, offline="two-party")
    assert run["same"] and run["parts"][1] == tuple(range(N))
    vote = BraceSign(lam=None, scale=0.5, decay=0.5).direction(
        {j: torch.from_numpy(g) for j, g in run["rows"][1].items()}, {}).numpy()
    assert np.array_equal(run["models"][1], run["models"][0] - LR * vote)
    assert "round 1 aggregated by brace-sign in 2PC" in run["logs"][0]


def test_brace_sign_on_two_workers_per_server_votes_shard_by_shard_and_equals_the_twin(tmp_path):
    """``[deployment] workers = 2`` (issue 30): each round's range check and BRACE's vote run on
    the worker pairs' coordinate shards (the vote is coordinate-wise: each pair opens its shard's
    +-1 values), and the models equal the plaintext BRACE rounds on the stored updates exactly."""
    pytest.importorskip("ray")
    run = _run(tmp_path, "brace-sign", None, rounds=2, workers=2)
    assert run["same"]
    twin = BraceSign(lam=None, scale=0.5, decay=0.5)
    for r in (1, 2):
        assert run["parts"][r] == tuple(range(N))
        direction = twin.direction({j: torch.from_numpy(g) for j, g in run["rows"][r].items()}, {}).numpy()
        assert np.array_equal(run["models"][r], run["models"][r - 1] - LR * direction), r
        for p in (0, 1):
            assert re.search(rf"round {r} aggregated by brace-sign in 2PC: .* pairs=2\b", run["logs"][p]), run["logs"][p]


def test_fedseca_on_two_workers_per_server_equals_the_twin_and_leaves_out_the_wrong_threshold(tmp_path):
    """``[deployment] workers = 2`` under FedSECA (issue 30): each pair computes its shard's sign
    tests, elected signs, agreement, clamped sum and division and opens its shard of the aggregate;
    the check's counts, CRISE's S S^T and the norms are added at the coordinators, which decide.
    Round 2's wrong lambda_k is refused; each model is within the aggregate's documented bound of the
    plaintext FedSECA round on the stored updates; both servers log ``pairs=2``."""
    pytest.importorskip("ray")
    r_bad, bad = WRONG
    run = _run(tmp_path, "fedseca", None, rounds=r_bad, workers=2)
    assert run["same"]
    twin = FedSECA(gamma=GAMMA, beta=BETA)
    for r in range(1, r_bad + 1):
        assert run["parts"][r] == tuple(j for j in range(N) if (r, j) != WRONG)
        rows = run["rows"][r]
        direction = twin.direction({j: torch.from_numpy(g) for j, g in rows.items()}, {}).numpy()
        g_max = max(np.abs(g).max() for g in rows.values())
        bound = LR * (2 * (2.0 ** -12 * g_max + 2.0 ** -16) + 2.0 ** -16)
        assert np.abs(run["models"][r] - (run["models"][r - 1] - LR * direction)).max() <= bound, r
        for p in (0, 1):
            assert re.search(rf"round {r} aggregated by fedseca in 2PC: .* pairs=2\b", run["logs"][p]), run["logs"][p]
    assert run["meta"][r_bad]["threshold_refused"] == [bad]
