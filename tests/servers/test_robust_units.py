"""The pieces of robust aggregation in the service that need no processes: the config keys, the
client's lambda_k, the threshold staged with an upload, the step rules, the control messages.

Oracles: ``protocols.robust_aggregation`` (quantile_thresholds, check_thresholds) for the
client's numpy lambda_k, hand computation for the step rules, the lab's constants for the
config defaults.
"""

from __future__ import annotations

import math
import re
import sqlite3

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.fedseca_threshold import upload_threshold
from common import prg
from common.encoding import decode, encode
from common.robust_rules import fedseca_threshold
from common.service_config import ConfigError, FLSection, load_config, write_scratch_deployment
from protocols.robust_aggregation import (BRACE_LAMBDA, FEDSECA_BETA, FEDSECA_GAMMA, check_thresholds,
                                          quantile_thresholds)
from lab import aggregators
from servers.daemon.peer_messages import AggregateRound, CloseRobustRound, ModelDigest, parse_request
from servers.secure.robust_steps import brace_vote_lambda, robust_model
from servers.store.share_store import ShareStore, StagingConflictError
from tests.helpers.store_helpers import DIM, new_store, ring, uploads

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ config
def test_fl_defaults_are_the_papers_and_the_labs():
    fl = FLSection()
    assert fl.aggregator == "fedavg"
    assert (fl.fedseca_gamma, fl.fedseca_beta, fl.brace_lambda) == (FEDSECA_GAMMA, FEDSECA_BETA, BRACE_LAMBDA)
    assert (fl.brace_scale, fl.brace_decay) == (aggregators.BRACE_SCALE, aggregators.BRACE_DECAY)


@pytest.mark.parametrize("values, message", [
    ({"aggregator": "krum"}, "aggregator must be one of fedavg, fedseca, brace-sign"),
    ({"aggregator": "fedseca", "range_check": False}, "needs range_check = true"),
    ({"aggregator": "brace-sign", "precision": 12}, "needs precision = 16"),
    ({"fedseca_gamma": 1.0}, "fedseca_gamma must be in [0, 1)"),
    ({"fedseca_beta": -0.1}, "fedseca_beta must be in [0, 1)"),
    ({"brace_lambda": math.inf}, "brace_lambda must be a finite number"),
    ({"brace_scale": 0.0}, "brace_scale must be > 0"),
    ({"brace_decay": -1.0}, "brace_decay must be >= 0"),
])
def test_bad_robust_settings_are_refused_with_the_key_named(tmp_path, values, message):
    # write_scratch_deployment renders the TOML and loads it back, so this is the file's path
    with pytest.raises(ConfigError, match=re.escape(message)):
        write_scratch_deployment(tmp_path, clients=2, overrides={"fl": values})


def test_a_robust_deployment_config_round_trips(tmp_path):
    path = write_scratch_deployment(tmp_path, clients=2, overrides={"fl": {
        "aggregator": "brace-sign", "brace_lambda": 2.5, "brace_decay": 0.0}})
    fl = load_config(path).fl
    assert (fl.aggregator, fl.brace_lambda, fl.brace_decay) == ("brace-sign", 2.5, 0.0)


# ---------------------------------------------------------------------- the client's lambda_k
@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 40), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), st.integers(0, 2**31))
def test_the_quantile_rule_of_common_is_quantile_thresholds(K, D, gamma, seed):
    """``common.robust_rules.fedseca_threshold`` (numpy, what a client runs) against the 2PC
    rules' plaintext twin, row by row, ties included."""
    G = np.random.default_rng(seed).integers(-6, 7, size=(K, D)) / 4.0
    want = quantile_thresholds(torch.from_numpy(G), gamma)
    assert [float(fedseca_threshold(row, gamma)) for row in G] == want.tolist()


@settings(max_examples=40)
@given(st.lists(st.floats(-50, 50, allow_nan=False, width=64), min_size=1, max_size=60),
       st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
def test_upload_threshold_is_quantile_thresholds_on_the_encoded_update(values, gamma):
    g = np.array(values)
    lam = upload_threshold(g, gamma, 16)
    decoded = torch.from_numpy(decode(encode(g, 16), 16)).unsqueeze(0)
    assert float(lam) == float(quantile_thresholds(decoded, gamma)[0])
    assert encode(np.array(lam), 16) * 1.0 == float(lam) * 2 ** 16           # on the grid: exact
    assert bool(check_thresholds(decoded, torch.tensor([float(lam)]), gamma)[0])


def test_upload_threshold_by_hand():
    # |g| encoded: 0.5, 0.25, 0, 1, 2 -> sorted 0, 0.25, 0.5, 1, 2; f = floor(0.9 * 4) = 3 -> 1
    assert float(upload_threshold(np.array([-0.5, 0.25, 0.0, 1.0, -2.0]), 0.9, 16)) == 1.0
    # the 2**-16 grid truncates toward zero: 1.00001 encodes as 1 + 0 units (1.00001 * 2**16 = 65536.66)
    assert float(upload_threshold(np.array([1.00001]), 0.5, 16)) == 1.0
    with pytest.raises(ValueError, match="gamma"):
        upload_threshold(np.ones(3), 1.5, 16)


# ------------------------------------------------------------------ the staged threshold
def test_a_threshold_is_staged_with_the_upload_and_not_kept_by_the_commit(tmp_path):
    rng = np.random.default_rng(3)
    up = uploads(rng, [4])[4]
    lam, other = ring(rng, ()), ring(rng, ())
    with new_store(tmp_path / "s", 1) as store:
        assert store.stage_upload(1, 4, up.update, up.norm, up.delta, lam)
        assert store.stage_upload(1, 4, up.update, up.norm, up.delta, lam) is False   # a retry
        with pytest.raises(StagingConflictError):
            store.stage_upload(1, 4, up.update, up.norm, up.delta, other)
        with pytest.raises(StagingConflictError):   # the same shares without it: another upload
            store.stage_upload(1, 4, up.update, up.norm, up.delta)
        assert int(store.staged_threshold(1, 4)) == int(lam)
        assert np.array_equal(store.staged_upload(1, 4).update, up.update)
        store.commit_round(1, np.zeros(DIM), [4], {4: 1.0})
        assert np.array_equal(store.update_share(1, 4), up.update) and store.staged(2) == ()
        assert store.verify() == []
    conn = sqlite3.connect(tmp_path / "s" / "catalog.sqlite3")
    assert conn.execute("SELECT COUNT(*) FROM staged").fetchone()[0] == 0
    conn.close()


def test_party_0_may_stage_the_threshold_as_a_seed_and_an_upload_without_one_reads_none(tmp_path):
    rng = np.random.default_rng(4)
    up = uploads(rng, [1, 2])
    with new_store(tmp_path / "s", 0) as store:
        seed = bytes(range(16))
        store.stage_upload(1, 1, *up[1].__dict__.values(), seed)
        store.stage_upload(1, 2, *up[2].__dict__.values())
        assert int(store.staged_threshold(1, 1)) == int(prg.expand(seed, ()))
        assert store.staged_threshold(1, 2) is None
        with pytest.raises(ValueError, match="same seed"):
            store.stage_upload(1, 3, up[1].update, seed, up[1].delta, seed)


def test_a_staging_table_of_the_previous_release_is_migrated(tmp_path):
    root = tmp_path / "s"
    rng = np.random.default_rng(5)
    up = uploads(rng, [0])[0]
    with new_store(root, 1) as store:
        store.stage_upload(1, 0, up.update, up.norm, up.delta)
    conn = sqlite3.connect(root / "catalog.sqlite3")
    with conn:   # what the previous release created: no threshold_ref column
        conn.executescript(
            "CREATE TABLE staged_old AS SELECT round, client, update_ref, norm_ref, delta_ref, "
            "upload_hash, staged_at FROM staged; DROP TABLE staged; "
            "ALTER TABLE staged_old RENAME TO staged;")
    conn.close()
    with ShareStore(root, party=1) as store:
        assert store.staged(1) == (0,) and store.staged_threshold(1, 0) is None
        assert store.stage_upload(1, 5, up.update, up.norm, up.delta, ring(rng, ()))
        assert store.staged_threshold(1, 5) is not None


# ---------------------------------------------------------------------------- step rules
def _fl(**kw) -> FLSection:
    return FLSection(**kw)


def test_fedseca_step_uses_the_momentum_of_the_committed_models_and_restarts_after_unlearning(tmp_path):
    fl = _fl(aggregator="fedseca", fedseca_beta=0.5)
    with new_store(tmp_path / "s", 1, m0=np.zeros(DIM)) as store:   # server_lr 0.25
        g1 = np.full(DIM, 2.0)
        m1, meta1 = robust_model(fl, store, 1, g1, 3)
        # round 1: zero buffer, d = 0.5 * 2 = 1, M_1 = 0 - 0.25 * 1
        assert np.array_equal(m1, np.full(DIM, -0.25)) and meta1["rule"]["momentum"] == "restarted"
        store.stage_upload(1, 0, *uploads(np.random.default_rng(0), [0])[0].__dict__.values())
        store.commit_round(1, m1, [0], {0: 1.0}, meta1)
        m2, meta2 = robust_model(fl, store, 2, np.full(DIM, 4.0), 3)
        # d_1 = (M_0 - M_1) / 0.25 = 1; d_2 = 0.5 * 1 + 0.5 * 4 = 2.5; M_2 = -0.25 - 0.625
        assert np.allclose(m2, -0.875, rtol=0, atol=1e-15) and meta2["rule"]["momentum"] == "continued"
        store.adopt_unlearning(2, np.full(DIM, 3.0), job="j1", forgotten=[0])
        m3, meta3 = robust_model(fl, store, 3, np.full(DIM, 4.0), 3)
        # after the unlearning round the buffer restarts: d = 0.5 * 4 = 2; M_3 = 3 - 0.5
        assert np.array_equal(m3, np.full(DIM, 2.5)) and meta3["rule"]["momentum"] == "restarted"


def test_brace_step_counts_fl_rounds_only_and_scales_lambda_with_the_voters(tmp_path):
    fl = _fl(aggregator="brace-sign", brace_scale=0.5, brace_decay=0.5, brace_lambda=5.0)
    assert brace_vote_lambda(fl, 20) == 1.0 and brace_vote_lambda(fl, 100) == 5.0
    vote = np.where(np.arange(DIM) % 2 == 0, 1.0, -1.0)
    with new_store(tmp_path / "s", 0, m0=np.zeros(DIM)) as store:
        m1, meta = robust_model(fl, store, 1, vote, 20)
        assert np.array_equal(m1, -0.25 * 0.5 * vote) and meta["rule"]["t"] == 1
        assert meta["rule"]["lambda"] == 1.0
        store.stage_upload(1, 0, *uploads(np.random.default_rng(0), [0])[0].__dict__.values())
        store.commit_round(1, m1, [0], {0: 1.0}, meta)
        store.adopt_unlearning(2, m1, job="j1", forgotten=[0])
        m3, meta = robust_model(fl, store, 3, vote, 4)
        # round 3 is FL round 2: step 0.5 / sqrt(2)
        assert meta["rule"]["t"] == 2 and meta["rule"]["step"] == 0.5 / math.sqrt(2)
        assert np.array_equal(m3, m1 - 0.25 * (0.5 / math.sqrt(2) * vote))
        with pytest.raises(ValueError, match="open round"):
            robust_model(fl, store, 2, vote, 4)
        with pytest.raises(ValueError, match="not a robust aggregator"):
            robust_model(_fl(), store, 3, vote, 4)


# ---------------------------------------------------------------------- control messages
def test_robust_round_messages_round_trip_and_refuse_malformed_fields():
    a = AggregateRound(3, (1, 4))
    assert parse_request(a.OP, a.to_wire(), 8) == a
    c = CloseRobustRound(3, (1, 4), (10, 12), "ab" * 32, (2,), (5,))
    assert parse_request(c.OP, c.to_wire(), 8) == c
    assert ModelDigest.from_wire(ModelDigest("f" * 64).to_wire()).model_sha256 == "f" * 64
    with pytest.raises(ValueError, match="sorted, unique"):
        CloseRobustRound(3, (4, 1), (10, 12), "x")
    bad = {**c.to_wire(), "threshold_refused": [1.5]}
    with pytest.raises(ValueError, match="threshold_refused"):
        parse_request(c.OP, bad, 8)
    with pytest.raises(ValueError, match="aggregate_sha256"):
        parse_request(c.OP, {k: v for k, v in c.to_wire().items() if k != "aggregate_sha256"}, 8)


# ------------------------------------------------------------------------------------ on shards
def test_a_rounds_cost_adds_the_pairs_bytes_and_the_slowest_pairs_rounds():
    """``with_pairs``: the round's log line counts every pair's bytes, and rounds as the pairs run:
    side by side (the coordinators' own, plus the slowest pair's)."""
    from servers.secure.robust_session import with_pairs

    own = {"total": {"online_bytes_sent": 10, "online_rounds": 3, "offline_bytes_received": 0}, "steps": {}}
    pairs = [{"total": {"online_bytes_sent": 100, "online_rounds": 40, "offline_bytes_received": 7}},
             {"total": {"online_bytes_sent": 120, "online_rounds": 45, "offline_bytes_received": 9}}]
    got = with_pairs(own, pairs)
    assert got["total"] == {"online_bytes_sent": 230, "online_rounds": 48, "offline_bytes_received": 16}
    assert len(got["pairs"]) == 2 and own["total"]["online_bytes_sent"] == 10   # the session's own untouched
    assert with_pairs(own, [])["total"] == own["total"]
