"""Shared fixtures: hypothesis profiles and one long-lived two-party session per test module.

Profiles: ``default`` keeps the suite inside its time budget; ``thorough`` (select with
``pytest --hypothesis-profile=thorough``) runs many more examples. Examples are derived from
a fixed seed (``derandomize``), so a run is reproducible.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from mpc.party_pair import PartyPair

_COMMON = dict(deadline=None, derandomize=True, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", max_examples=30, **_COMMON)
settings.register_profile("thorough", max_examples=400, **_COMMON)
settings.load_profile("default")


@pytest.fixture(scope="module")
def pair():
    """Two parties and a dealer, alive for the whole test module (``pair.call(fn, *args)``)."""
    with PartyPair(timeout=120.0) as p:
        yield p
