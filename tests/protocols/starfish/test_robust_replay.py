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
import torch

from protocols.robust_aggregation import momentum
from protocols.starfish.robust_replay import RoundRule, RuleCombine
from tests.helpers import robust_aggregation_programs as rap
from tests.helpers.fixed_point_strategies import LSB

torch.set_num_threads(1)

RULES = {1: {"aggregator": "brace-sign", "step": 0.5, "lam": 0.0},
         2: {"aggregator": "fedseca", "gamma": 0.5, "beta": 0.5, "restart": True},
         3: {"aggregator": "fedseca", "gamma": 0.5, "beta": 0.5},
         4: {"aggregator": "fedavg"},
         5: {"aggregator": "fedseca", "gamma": 0.9, "beta": 0.5}}


def _rounds() -> list:
    rng = np.random.default_rng(5)
    out = []
    for t in (1, 2, 3, 4, 5):
        K, D = (4, 9) if t != 5 else (3, 11)
        g = np.round(rng.normal(size=(K, D)) * 0.2 / LSB) * LSB
        g[0] *= 8.0                       # one clipped client
        g[1, :2] = 0.0                    # exact zeros vote 0
        out.append({"t": t, "rows": list(g), "wide": [k % 2 == 0 for k in range(K)]})
    return out


def test_the_2pc_combine_equals_the_twin_round_by_round(pair):
    rounds = _rounds()
    got, got1 = pair.call(rap.replay_combine_rounds, rounds, RULES)
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
