"""Service building blocks without processes: config, wire schema, exact ring aggregation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from common.encoding import decode, encode
from common.sharing import share
from common import wire
from servers.secure.ring_aggregation import (
    fedavg_weights,
    max_total_samples,
    model_digest,
    next_model,
    open_aggregate,
    weighted_share_sum,
)
from common.service_config import ConfigError, load_config, render_config, ServiceConfig


def test_config_defaults_round_trip_and_validation(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[fl]\nrounds = 5\n")
    cfg = load_config(p)
    assert cfg.fl.rounds == 5 and cfg.unlearning.sigma == 0.6 and cfg.fl.precision == 16
    assert cfg.keys_dir == tmp_path / "keys" and cfg.data_dir(1) == tmp_path / "data/server1"
    full = tmp_path / "full.toml"
    full.write_text(render_config(cfg))
    again = load_config(full)
    assert again.fl == cfg.fl and again.server1 == cfg.server1 and again.limits == cfg.limits
    assert again.unlearning.guard == cfg.unlearning.guard == 3.0
    for text, needle in [("[fl]\nrounds = 0\n", "rounds"), ("[fl]\nbogus = 1\n", "unknown keys"),
                         ("[nope]\n", "unknown sections"), ("[fl]\nrounds = 'x'\n", "must be int"),
                         ("[unlearning]\nrs_method = 'sort'\n", "rs_method"),
                         ("[unlearning]\nguard = 0.5\n", "guard must be 0"), ("x = [", "TOML")]:
        p.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_config(p)
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "missing.toml")


@given(spill=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**40, 2**40),
                       st.booleans(), st.text(alphabet="ab01 ", max_size=5)))
def test_worker_spill_budget_is_a_number_from_zero_and_round_trips(tmp_path_factory, spill):
    """``[deployment] worker_spill_mib``: any finite number >= 0 is taken (0, the default: shares in
    memory) and written back by ``render_config``; anything else is refused in one line naming it."""
    d = tmp_path_factory.mktemp("spill")
    p = d / "c.toml"
    assert load_config(_written(p, "")).worker_spill_mib == 0.0
    value = (repr(spill) if not isinstance(spill, float) or math.isfinite(spill) else
             {True: "inf", False: "-inf"}[spill > 0] if not math.isnan(spill) else "nan")
    value = value.replace("'", '"') if isinstance(spill, str) else value.lower() if isinstance(spill, bool) else value
    ok = not isinstance(spill, (bool, str)) and math.isfinite(spill) and spill >= 0
    if ok:
        cfg = load_config(_written(p, value))
        assert cfg.worker_spill_mib == float(spill)
        assert load_config(_written(d / "full.toml", None, render_config(cfg))).worker_spill_mib == float(spill)
    else:
        try:
            load_config(_written(p, value))
        except ConfigError as exc:
            assert "worker_spill_mib must be a number >= 0" in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"worker_spill_mib = {value} was taken")


def _written(p, spill, text=None):
    p.write_text(text if text is not None else "[deployment]\n" + ("" if not spill else f"worker_spill_mib = {spill}\n"))
    return p


def test_exact_ring_aggregation_equals_integer_fedavg():
    rng = np.random.default_rng(3)
    dim, sizes = 50, {0: 67, 3: 70, 5: 1}
    g = {j: rng.normal(scale=30, size=dim) for j in sizes}
    sh = {j: share(g[j], compress=(j % 2 == 0)) for j in sizes}
    a0 = weighted_share_sum(((sizes[j], sh[j].materialize_share0()) for j in sorted(sizes)), dim)
    a1 = weighted_share_sum(((sizes[j], sh[j].share1) for j in sorted(sizes)), dim)
    total = sum(sizes.values())
    agg = open_aggregate(a0, a1, total, 16)
    exact = sum(sizes[j] * decode(encode(g[j])) for j in sizes) / total   # only encoding error
    assert np.array_equal(agg, exact) or np.abs(agg - exact).max() < 1e-12
    plain = sum(w * g[j] for j, w in fedavg_weights(sizes).items())
    assert np.abs(agg - plain).max() < 2 ** -16
    prev = np.ones(dim)
    assert model_digest(next_model(prev, agg, 0.3)) == model_digest(prev - 0.3 * agg)
    assert max_total_samples(16) == 2**17 - 1
    with pytest.raises(ValueError, match="overflow"):
        open_aggregate(a0, a1, 2**17, 16)


def test_wire_parse_accepts_valid_and_names_the_problem():
    mid, buf = wire.make_request("get_model", round=3)
    req = wire.parse_request(buf, 1 << 20)
    assert req.op == "get_model" and req.id == mid and req.fields == {"round": 3}
    with pytest.raises(wire.WireError) as e:
        wire.parse_request(wire.pack({"v": 1, "op": "unlearn", "id": mid, "job": "a b", "nonce": 1}), 1 << 20)
    assert e.value.code == "bad_request" and "job" in e.value.message and e.value.msg_id == mid
    t = wire.tensor(np.arange(6, dtype=np.int64).reshape(2, 3))
    assert wire.decode_tensor(t, "x", ("<i8",), (2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(wire.WireError, match="NaN"):
        wire.decode_tensor(wire.tensor(np.array([np.nan])), "m", ("<f8",), (1,))
    assert wire.client_id_of("client-12") == 12
    assert wire.client_id_of("client-012") is None and wire.client_id_of("admin") is None
    with pytest.raises(wire.WireError) as e:
        wire.check_reply(wire.error_reply(mid, "replay", "old nonce"), mid, 1 << 20)
    assert e.value.code == "replay"


def test_job_messages_round_trip_and_refuse_malformed_fields():
    from servers.store.job_records import JobState
    from servers.daemon.peer_messages import AdoptJob, Confirmation, JobFail, JobReceipt, JobRow, JobStart

    row = JobRow("j1", "client-3", (3,), JobState.COMPUTED, "{}", 1.5, None, 2, "ab" * 32, False)
    assert JobRow.from_wire(row.to_wire()) == row
    for msg in (JobStart("j1", 7, 3), AdoptJob("j1", 8, "ab" * 32), JobFail("j1", "why", JobState.CANCELLED)):
        assert type(msg).from_wire(msg.to_wire()) == msg
    receipt = {"job": "j1", "clients": [3], "rounds_erased": [1, 2]}
    assert JobReceipt.from_wire(JobReceipt("j1", receipt).to_wire()).receipt == receipt
    assert Confirmation.from_wire(Confirmation({"party": 1}).to_wire()).report == {"party": 1}
    with pytest.raises(ValueError):
        JobFail("j1", "why", JobState.DONE)          # only failed or cancelled
    with pytest.raises(ValueError):
        JobStart.from_wire({"job": "j1", "rounds": 7, "attempt": 0})
    with pytest.raises(ValueError):
        JobReceipt.from_wire({"job": "j1", "receipt": "[1, 2]"})   # not an object
    with pytest.raises(ValueError):
        JobRow.from_wire({**row.to_wire(), "has_receipt": 1})
