"""Stage II's replay with the rule that made each round (``protocols.starfish.robust_replay``):
the 2PC combine against the plaintext twin, over a replay that mixes the rules.

Rows on the 16-bit grid, some of them handed over at 32 fractional bits as Stage II's estimates
are (the combine truncates those once): the opened BRACE votes and FedSECA's signs and bits
are functions of the encoded rows, so the directions equal the twin's exactly for BRACE and
within FedSECA's documented fixed-point bound (its clip factors); momentum runs in the clear
over the opened aggregates, restarting where the rule says.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.backend import weight_integers
from protocols.robust_aggregation import momentum
from protocols.sharded import ShardedValue
from protocols.starfish.robust_replay import RoundRule, RuleCombine
from tests.helpers import robust_aggregation_programs as rap
from tests.helpers.fixed_point_strategies import LSB

torch.set_num_threads(1)

RULES = {1: {"aggregator": "brace-sign", "step": 0.5, "lam": 0.0},
         2: {"aggregator": "fedseca", "gamma": 0.5, "beta": 0.5, "restart": True},
         3: {"aggregator": "fedseca", "gamma": 0.5, "beta": 0.5},
         4: {"aggregator": "fedavg"},
         5: {"aggregator": "fedseca", "gamma": 0.9, "beta": 0.5}}


def _rounds(last_d: int = 11) -> list:
    """Five rounds of 4 clients and 9 coordinates, the last of 3 clients and ``last_d``."""
    rng = np.random.default_rng(5)
    out = []
    for t in (1, 2, 3, 4, 5):
        K, D = (4, 9) if t != 5 else (3, last_d)
        g = np.round(rng.normal(size=(K, D)) * 0.2 / LSB) * LSB
        g[0] *= 8.0                       # one clipped client
        g[1, :2] = 0.0                    # exact zeros vote 0
        out.append({"t": t, "rows": list(g), "wide": [k % 2 == 0 for k in range(K)]})
    return out


def test_the_2pc_combine_equals_the_twin_round_by_round(pair):
    rounds = _rounds()
    got, got1 = pair.call(rap.replay_combine_rounds, rounds, RULES)
    _equal_to_the_twin(rounds, got, got1)


@settings(max_examples=2, deadline=None)
@given(k=st.integers(1, 4), block=st.integers(1, 40))
def test_the_combine_on_coordinate_shards_equals_the_twin_round_by_round(pair_in_each_mode, k, block):
    """The same rounds with each row on ``k`` coordinate slices (issue 30): BRACE's vote per shard,
    FedSECA's quantile search with each digit's counts summed over the shards and its round on
    the shards (``ShardVector.fedseca_with``), the momentum as unsharded. The same oracle as the
    unsharded combine's, and nothing stays on the shards once the rows are released."""
    rounds = _rounds(last_d=9)      # one model: one number of coordinates
    (got, held), (got1, held1) = pair_in_each_mode.call(rap.replay_combine_rounds_on_shards, rounds, RULES, k, block)
    assert held == held1 == 0
    assert not any(isinstance(a, str) for a in got), got
    _equal_to_the_twin(rounds, got, got1)


def _equal_to_the_twin(rounds: list, got: list, got1: list) -> None:
    """Each round's opened direction (both servers') against the twin combine's (module oracle)."""
    twin = RuleCombine(lambda t: RoundRule(**RULES[t]))
    for rnd, a, b in zip(rounds, got, got1):
        np.testing.assert_array_equal(a, b)       # both servers open the same direction
        rows = [torch.from_numpy(g) for g in rnd["rows"]]
        want = twin(rows, [1.0 / len(rows)] * len(rows), list(range(len(rows))), rnd["t"]).numpy()
        rule = RULES[rnd["t"]]["aggregator"]
        if rule == "brace-sign":
            np.testing.assert_array_equal(a, want)
            assert set(np.abs(a).tolist()) == {0.5}
        elif rule == "fedavg":
            np.testing.assert_allclose(a, want, rtol=0, atol=2 * LSB)
        else:
            # the aggregate's bound 2 (2**-12 max|g| + 2**-16) + 2**-16, carried by the momentum
            g_max = np.abs(np.stack(rnd["rows"])).max(axis=0)
            bound = 2 * (2 * (2.0 ** -12 * g_max + LSB) + LSB)
            assert np.all(np.abs(a - want) <= bound), (rnd["t"], a - want)
    # the twin's momentum restarted at round 2 and after the FedAvg round 4
    assert [name for _, name in twin.applied] == [RULES[t]["aggregator"] for t in (1, 2, 3, 4, 5)]
    fresh = RuleCombine(lambda t: RoundRule(**RULES[t]))
    rows5 = [torch.from_numpy(g) for g in rounds[4]["rows"]]
    alone = fresh(rows5, [1 / 3] * 3, [0, 1, 2], 5)
    torch.testing.assert_close(twin.buffer, alone)


def test_the_lab_rule_and_a_round_rule_name_the_same_step():
    from lab.aggregators import BraceSign, FedSECA, replay_rule
    brace = replay_rule(BraceSign(scale=0.5, decay=0.5))
    assert brace.rule_of(4) == RoundRule("brace-sign", step=0.25)
    fed = replay_rule(FedSECA())
    assert fed.rule_of(1).restart and not fed.rule_of(2).restart
    g = torch.tensor([[1.0, -2.0, 0.5], [2.0, -1.0, 0.25], [1.5, -3.0, -0.5]])
    d1 = fed([*g], [1 / 3] * 3, [0, 1, 2], 1)
    d2 = fed([*g], [1 / 3] * 3, [0, 1, 2], 2)
    torch.testing.assert_close(d2, momentum(d1, d1 / 0.5, 0.5))


@st.composite
def sharded_rounds(draw) -> dict:
    """Replayed rounds of one dimension D, each K rows on the 16-bit grid with |g| < 2**4 (the
    vote's sign tests hold |g| < 2**15), exact zeros among them, some rows at 32 bits; rules
    BRACE (lambda fixed anywhere around -K..K, or per 100 voters) and FedAvg, in any order."""
    d = draw(st.integers(1, 40))
    rounds, rules = [], {}
    for t in range(1, draw(st.integers(1, 4)) + 1):
        n = draw(st.integers(1, 7))
        ints = draw(st.lists(st.lists(st.one_of(st.just(0), st.integers(-(1 << 20), 1 << 20)),
                                      min_size=d, max_size=d), min_size=n, max_size=n))
        rows = list(np.asarray(ints, dtype=np.float64) * LSB)
        rounds.append({"t": t, "rows": rows, "wide": draw(st.lists(st.booleans(), min_size=n, max_size=n))})
        if draw(st.booleans()):
            lam = draw(st.one_of(st.none(), st.floats(-n - 2, n + 2, allow_nan=False)))
            rules[t] = {"aggregator": "brace-sign", "step": draw(st.sampled_from([1.0, 0.5, 0.01])), "lam": lam,
                        "lam_per_100": draw(st.floats(0, 50, allow_nan=False))}
        else:
            rules[t] = {"aggregator": "fedavg"}
    return {"rounds": rounds, "rules": rules, "k": draw(st.integers(1, min(d, 4))),
            "block": draw(st.integers(1, 4 * d))}


@settings(max_examples=max(1, settings.default.max_examples // 3), deadline=None)
@given(case=sharded_rounds())
def test_a_brace_replay_on_coordinate_shards_equals_the_twin(pair_in_each_mode, case):
    """Rows on K coordinate shards (issue 30): each shard's pair votes on its coordinates and
    opens them; the opened direction equals the twin's BRACE vote exactly (a FedAvg round: the
    exact sum with the weights on their public grid), and nothing stays on the shards once the
    rows are released."""
    rounds, rules = case["rounds"], case["rules"]
    (got, held), (got1, held1) = pair_in_each_mode.call(rap.replay_combine_rounds_on_shards, rounds, rules,
                                                        case["k"], case["block"])
    assert held == held1 == 0
    twin = RuleCombine(lambda t: RoundRule(**rules[t]))
    for rnd, a, b in zip(rounds, got, got1):
        np.testing.assert_array_equal(a, b)
        rows = [torch.from_numpy(g) for g in rnd["rows"]]
        want = twin(rows, [1.0 / len(rows)] * len(rows), list(range(len(rows))), rnd["t"]).numpy()
        if rules[rnd["t"]]["aggregator"] == "brace-sign":
            np.testing.assert_array_equal(a, want)
        else:
            # FedAvg's sum is exact in the ring with the weights on their public grid
            # (``backend.weight_integers``): the twin's sum with those weights
            ints, e = weight_integers([1.0 / len(rows)] * len(rows))
            exact = sum(w * g for w, g in zip(ints, rnd["rows"])) / 2.0 ** e
            np.testing.assert_allclose(a, exact, rtol=1e-12, atol=1e-12)


def test_rows_partly_on_coordinate_shards_are_refused_with_one_line(pair):
    """A round's rows are all on the shards or none is (``ShardHistory`` puts every row there)."""
    class Marked(ShardedValue):
        pass

    with pytest.raises(ValueError, match="all on coordinate shards or none is"):
        RuleCombine(lambda t: RoundRule("fedseca"))([Marked(), torch.zeros(3)], [0.5, 0.5], [0, 1], 1)
