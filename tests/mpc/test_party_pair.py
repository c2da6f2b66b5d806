"""PartyPair (``mpc.party_pair``): calls share one session until it is older than ``max_age``
or a call failed; then the next call starts a fresh one, and computes as before."""

from __future__ import annotations

import time

import pytest

from mpc.launcher import PartyError
from mpc.party_pair import PartyPair
from tests.helpers import parties

pytestmark = pytest.mark.timeout(120)


def test_a_session_older_than_max_age_is_replaced_before_the_next_call():
    with PartyPair(timeout=30.0, max_age=2.0) as p:
        (pid0, v0), (pid1, v1) = p.call(parties.pid_and_product, 1.5, -2.0)
        again = p.call(parties.pid_and_product, 3.0, 0.25)
        assert [pid for pid, _ in again] == [pid0, pid1]        # young: the same processes
        assert v0 == v1 == pytest.approx(-3.0, abs=1e-3)
        time.sleep(2.2)
        later = p.call(parties.pid_and_product, 0.5, 4.0)
        assert {pid for pid, _ in later}.isdisjoint({pid0, pid1})   # a fresh session
        assert [v for _, v in later] == pytest.approx([2.0, 2.0], abs=1e-3)


def test_a_failed_call_closes_the_session_and_the_next_call_starts_a_fresh_one():
    with PartyPair(timeout=30.0) as p:
        before = p.call(parties.pid_and_product, 1.0, 1.0)
        with pytest.raises(PartyError, match="on purpose"):
            p.call(parties.fail_in_party_1)
        after = p.call(parties.pid_and_product, 2.0, 3.0)
        assert {pid for pid, _ in after}.isdisjoint({pid for pid, _ in before})
        assert [v for _, v in after] == pytest.approx([6.0, 6.0], abs=1e-3)


@pytest.mark.parametrize("timeout, max_age", [(10.0, 0.0), (10.0, -1.0), (10.0, 40.0), (10.0, 55.0)])
def test_max_age_outside_zero_to_four_timeouts_is_refused(timeout, max_age):
    with pytest.raises(ValueError, match="max_age"):
        PartyPair(timeout=timeout, max_age=max_age)
