"""|D_j|'s one definition (common/sample_count.py): its bound and message, as the client API's
field, in a round's metadata and in FedAvg's weights."""

import numpy as np
import pytest

from common import wire
from common.fedavg import fedavg_weights
from common.sample_count import (
    MAX_SAMPLE_COUNT,
    METADATA_KEY,
    SampleCountError,
    check_sample_count,
    counts_from_metadata,
    counts_to_metadata,
    sample_counts,
)


def test_the_bound_is_the_uploads_historic_one_and_the_check_names_where():
    assert MAX_SAMPLE_COUNT == 2**31 - 1
    assert check_sample_count(1, "x") == 1 and check_sample_count(MAX_SAMPLE_COUNT, "x") == MAX_SAMPLE_COUNT
    n = check_sample_count(np.int64(7), "x")
    assert n == 7 and type(n) is int              # numpy's counts (the lab's) become plain ints
    for bad, msg in [(0, "x must be in 1..2147483647, got 0"), (2**31, "got 2147483648"),
                     (-3, "got -3"), (True, "must be an integer, got bool"),
                     (2.0, "must be an integer, got float"), ("5", "got str")]:
        with pytest.raises(SampleCountError, match=msg):
            check_sample_count(bad, "x")
    assert issubclass(SampleCountError, ValueError)
    with pytest.raises(SampleCountError, match=r"sizes\[1\] must be in"):
        sample_counts([3, 0], "sizes")


def test_the_wire_field_refuses_as_the_old_integer_validator_did():
    """Same code and message as ``integer(1, 2**31 - 1)`` gave before the shared definition."""
    schema = wire.REQUESTS["upload"]
    assert schema.required["num_samples"] is wire.sample_count
    for bad in (0, 2**31, True, 1.0):
        with pytest.raises(wire.WireError) as got:
            wire.sample_count("num_samples", bad)
        with pytest.raises(wire.WireError) as old:
            wire.integer(1, 2**31 - 1)("num_samples", bad)
        assert (got.value.code, got.value.message) == (old.value.code, old.value.message)
    assert wire.sample_count_sequence("sizes", [1, 2]) == (1, 2)
    with pytest.raises(wire.WireError, match=r"field 'sizes'\[1\] must be in 1\.\."):
        wire.sample_count_sequence("sizes", [1, 0])


def test_metadata_round_trips_as_string_keys_and_plain_ints():
    meta = {METADATA_KEY: counts_to_metadata({3: 10, 1: 4, 9: 1}, [1, 3])}
    assert meta == {"num_samples": {"1": 4, "3": 10}}
    assert counts_from_metadata(meta, "round 2") == {1: 4, 3: 10}
    assert counts_from_metadata({"job": "j"}, "round 2") == {}       # an unlearning round
    for bad, msg in [({"1": 0}, "round 2: num_samples of client 1 must be in"),
                     ({"x": 1}, "client id 'x'"), ([1], "must be a map")]:
        with pytest.raises(SampleCountError, match=msg):
            counts_from_metadata({METADATA_KEY: bad}, "round 2")


def test_fedavg_weights_take_only_counts():
    assert fedavg_weights({2: 3, 1: np.int64(1)}) == {1: 0.25, 2: 0.75}
    with pytest.raises(SampleCountError, match=r"\|D_2\| must be in"):
        fedavg_weights({1: 5, 2: 0})
    with pytest.raises(SampleCountError, match="got float"):
        fedavg_weights({1: 2.5})
    with pytest.raises(ValueError, match="hold no data"):
        fedavg_weights({})
