"""The dealer plans a daemon keeps in its store (``servers.secure.dealer_plans``): what is saved
comes back after a restart (the in-memory copy forgotten) as the same canonical requests, and a
damaged, foreign or hostile file is ignored, never trusted and never fatal.

Oracle: the plan that was saved (requests built by ``mpc.correlations.make_request``, the
function the provider itself records with). The service-level check, a restarted server 1
fetching ahead in its first round, is in ``tests/servers/test_robust_service.py``.
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpc.correlations import TRIPLE_OPS, make_request
from servers.secure import dealer_plans

sizes = st.lists(st.integers(0, 1000), min_size=0, max_size=3)   # <= 2**31 elements: the bound


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(["triple", "square", "binary_triple", "wrap_rng", "b2a_rng", "mask",
                                 "cmp_tables", "edabit", "trunc_pair", "mask_matvec"]))
    if kind == "triple":
        extra = draw(st.lists(st.one_of(st.integers(-3, 3), st.booleans(), st.none()), max_size=2))
        kw = draw(st.dictionaries(st.sampled_from(["stride", "padding", "groups"]), st.integers(0, 3), max_size=2))
        return make_request("triple", draw(sizes), draw(sizes), draw(st.sampled_from(TRIPLE_OPS)), *extra, **kw)
    if kind == "binary_triple":
        return make_request(kind, draw(sizes), draw(sizes))
    if kind == "edabit":
        return make_request(kind, draw(sizes), draw(st.integers(1, 64)))
    if kind == "trunc_pair":
        lo = draw(st.integers(1, 62))
        return make_request(kind, draw(sizes), lo, draw(st.integers(lo, 62)))
    if kind == "mask_matvec":
        return make_request(kind, draw(st.lists(st.integers(0, 2**62), min_size=1, max_size=64)), draw(sizes))
    return make_request(kind, draw(sizes))


@pytest.fixture(autouse=True)
def _empty_memory():
    dealer_plans.forget_all()
    yield
    dealer_plans.forget_all()


@settings(max_examples=60, deadline=None)
@given(plan=st.lists(requests(), min_size=1, max_size=30), key=st.text(min_size=1, max_size=60))
def test_a_saved_plan_comes_back_after_a_restart_as_the_same_requests(tmp_path_factory, plan, key):
    directory = tmp_path_factory.mktemp("plans")
    dealer_plans.remember(key, plan, directory)
    dealer_plans.forget_all()                      # what a restart loses
    assert dealer_plans.recall(key, directory) == plan
    assert dealer_plans.recall(key + "x", directory) == []
    dealer_plans.forget_all()
    assert dealer_plans.recall(key) == []          # no directory: memory only


def test_damaged_foreign_or_hostile_plan_files_are_ignored_with_a_warning(tmp_path, caplog):
    plan = [make_request("square", (4,)), make_request("cmp_tables", (2, 3))]
    dealer_plans.remember("k", plan, tmp_path)
    (path,) = tmp_path.glob("*.json")
    cases = {
        "truncated": path.read_text()[:-5],
        "another key": json.dumps({"key": "other", "requests": plan}),
        "a request the dealer link refuses": json.dumps({"key": "k", "requests": [["triple", [1], [1], "exec", [], []]]}),
        "a size beyond the bound": json.dumps({"key": "k", "requests": [["mask", [2**40]]]}),
        "not an object": json.dumps(["k"]),
    }
    for why, text in cases.items():
        path.write_text(text)
        dealer_plans.forget_all()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=dealer_plans.__name__):
            assert dealer_plans.recall("k", tmp_path) == [], why
        assert "ignored" in caplog.text and "on demand" in caplog.text, why


def test_a_plan_that_cannot_be_written_does_not_fail_the_round(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    plan = [make_request("square", (4,))]
    with caplog.at_level(logging.WARNING, logger=dealer_plans.__name__):
        dealer_plans.remember("k", plan, blocker)
    assert "not saved" in caplog.text
    assert dealer_plans.recall("k") == plan       # still kept in memory
