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


# The modules that take longest (seconds on 2 cores, `--durations`, 2026-11-27), collected
# first: `make test` runs two xdist workers that take whole modules (`--dist loadfile`) in
# collection order, and a long module taken last leaves one worker idle while it runs.
LONGEST_FIRST = (
    "tests/protocols/starfish/test_stage2_properties.py",     # 83
    "tests/servers/test_job_crashes.py",                      # 68
    "tests/mpc/test_two_party_mode.py",                       # 59
    "tests/servers/test_robust_unlearning.py",                # 50
    "tests/protocols/test_robust_aggregation.py",             # 48
    "tests/protocols/starfish/test_stage2_2pc.py",            # 46
    "tests/protocols/test_compare_properties.py",             # 45
    "tests/bench/test_unlearning_bench.py",                   # 39
    "tests/protocols/test_inverse_division_properties.py",    # 34
    "tests/protocols/test_primitives_2pc.py",                 # 33
    "tests/cli/test_cli.py",                                  # 31
    "tests/servers/test_robust_service.py",                   # 28
    "tests/cli/test_failure_messages.py",                     # 28
    "tests/mpc/test_engine_pool.py",                          # 27
    "tests/mpc/test_two_party_link.py",                       # 25
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # stable: a module's tests stay together and in their own order
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
