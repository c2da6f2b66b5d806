"""Shared fixtures: hypothesis profiles and one long-lived 2PC session per offline mode for a test
worker (borrowed by its modules); the order in which the two workers take the test files.

Profiles: ``default`` (20 examples; many properties take a fraction of it) keeps the suite near
its time budget; ``thorough`` (select with
``pytest --hypothesis-profile=thorough``) runs many more examples. Examples are derived from
a fixed seed (``derandomize``), so a run is reproducible.

Order: ``make test`` hands whole files to two workers (``--dist loadfile``) in collection order
(``--no-loadscope-reorder``; xdist's own reorder puts files with many tests first, which left
the heaviest files, with few tests each, to the end: one worker ran them while the other
idled). Here the files that take longest go first (longest-processing-time-first), so the
short ones fill in at the end. Only the order changes; every test runs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from mpc.party_pair import PartyPair

#: seconds each heavy file took in the two workers (``pytest -n 2 --dist loadfile
#: --junitxml``, summed per file; measured at 4c97ffd on 2026-12-06 beside other runs, the
#: three files whose tests grew since then raised by what was added). A file not listed is light and keeps its
#: place after these; a stale figure only changes the order.
_FILE_SECONDS = {
    "tests/servers/test_robust_unlearning.py": 193,
    "tests/protocols/test_robust_aggregation.py": 182,
    "tests/bench/test_unlearning_bench.py": 130,
    "tests/servers/test_robust_service.py": 129,
    "tests/protocols/starfish/test_stage2_2pc.py": 121,
    "tests/servers/test_worker_pairs.py": 110,
    "tests/mpc/test_two_party_mode.py": 110,
    "tests/protocols/test_inverse_division_properties.py": 108,
    "tests/cli/test_cli.py": 108,
    "tests/servers/test_job_crashes.py": 84,
    "tests/mpc/test_crypten_conformance.py": 69,
    "tests/servers/test_service_workers.py": 68,
    "tests/protocols/test_compare_properties.py": 66,
    "tests/protocols/starfish/test_stage2_on_shards.py": 59,
    "tests/protocols/starfish/test_robust_replay.py": 58,
    "tests/cli/test_failure_messages.py": 58,
    "tests/protocols/starfish/test_shard_sums.py": 52,
    "tests/protocols/starfish/test_pair_lengths_2pc.py": 39,
    "tests/protocols/test_sort_properties.py": 30,
    "tests/protocols/test_primitives_2pc.py": 30,
    "tests/servers/test_service_e2e.py": 29,
    "tests/bench/test_lab.py": 28,
    "tests/protocols/starfish/test_round_selection_properties.py": 27,
    "tests/mpc/test_engine_pool.py": 27,
    "tests/servers/test_service_crash.py": 25,
    "tests/servers/test_min_cohort.py": 25,
    "tests/servers/test_service_two_party.py": 24,
    "tests/mpc/test_two_party_link.py": 23,
    "tests/bench/test_shard_store_bench.py": 20,
    "tests/protocols/starfish/test_divergence_guard.py": 19,
    "tests/servers/test_correction_answers.py": 18,
    "tests/servers/test_unlearn_agreement.py": 17,
    "tests/servers/test_share_store.py": 16,
    "tests/servers/test_doc_only_client.py": 16,
    "tests/protocols/test_upload_range_shards.py": 16,
    "tests/protocols/test_upload_range.py": 16,
    "tests/protocols/starfish/test_stage2_properties.py": 16,
    "tests/mpc/test_share_level_properties.py": 16,
    "tests/servers/test_round_cap.py": 15,
    "tests/mpc/test_engine_correlations.py": 15,
    "tests/test_architecture.py": 13,
    "tests/protocols/starfish/test_folded_rounds_2pc.py": 12,
    "tests/protocols/starfish/test_estimate_aggregate.py": 12,
    "tests/cli/test_readme.py": 12,
    "tests/servers/test_service_security.py": 11,
    "tests/protocols/starfish/test_partial_participation_2pc.py": 11,
    "tests/mpc/test_launcher_hygiene.py": 11,
    "tests/protocols/test_max_threshold_inner_properties.py": 10,
    "tests/servers/test_service_abuse.py": 9,
    "tests/mpc/test_table_compare.py": 9,
    "tests/mpc/test_session_matching.py": 8,
}

_COMMON = dict(deadline=None, derandomize=True, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", max_examples=20, **_COMMON)
settings.register_profile("thorough", max_examples=400, **_COMMON)
settings.load_profile("default")


#: the shared sessions' message timeout: the longest any module's calls need (FedSECA's
#: two-party program waits minutes for a peer's engine); their age bound is PartyPair's default
_SHARED_TIMEOUT = 300.0


@pytest.fixture(scope="session")
def _sessions():
    """One session per offline mode for the whole test process, made on first use: a two-party
    session's engine start and the programs its engine compiled are paid once per xdist worker,
    not once per module (the suite's time, issue 24). A call that fails closes the session and
    the next call starts a fresh one (``PartyPair``), so a module cannot leave it broken."""
    made: dict[str, PartyPair] = {}
    yield made
    for p in made.values():
        p.close()


def shared_session(sessions: dict, offline: str) -> PartyPair:
    p = sessions.get(offline)
    if p is None:
        p = sessions[offline] = PartyPair(offline=offline, timeout=_SHARED_TIMEOUT)
    return p


@pytest.fixture(scope="session")
def session_of(_sessions):
    """``session_of(offline)``: the worker's shared session of that mode."""
    return lambda offline: shared_session(_sessions, offline)


@pytest.fixture(scope="module")
def pair(_sessions):
    """Two parties and a dealer (``pair.call(fn, *args)``), shared by the modules of a worker."""
    return shared_session(_sessions, "dealer")


@pytest.fixture(scope="module")
def two_party_pair(_sessions):
    """Two parties without a dealer (the two-party engine), shared by the modules of a worker."""
    return shared_session(_sessions, "two-party")


@pytest.fixture(scope="module", params=["dealer", "two-party"])
def pair_in_each_mode(request, _sessions):
    """As ``pair``, once per offline mode (the dealer's correlations, then the two-party engine's):
    a module's tests run over both modes."""
    return shared_session(_sessions, request.param)


def pytest_collection_modifyitems(session, config, items):
    """Heaviest files first (stable: the tests of a file keep their order)."""
    rank = {path: i for i, path in enumerate(sorted(_FILE_SECONDS, key=lambda p: -_FILE_SECONDS[p]))}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
