"""The servers' link checks each |D_j| as the client API does (``common.sample_count``): a round
is never closed on a count that no upload could have carried."""

import numpy as np
import pytest

from servers.daemon.peer_messages import CloseRobustRound, CloseRound, LastRound, PeerState, parse_request


def test_round_closes_and_peer_state_refuse_counts_out_of_range():
    c = CloseRobustRound(3, (1, 4), (10, 12), "ab" * 32)
    for sizes in ([10, 0], [10, 2**31], [10, 1.5], [10, True]):
        with pytest.raises(ValueError, match=r"sizes"):
            parse_request(c.OP, {**c.to_wire(), "sizes": sizes}, 8)
    r = CloseRound(3, (1, 4), (10, 12), np.zeros(8, dtype=np.int64))
    assert parse_request(r.OP, r.to_wire(), 8).sizes_by_client() == {1: 10, 4: 12}
    with pytest.raises(ValueError, match=r"sizes"):
        parse_request(r.OP, {**r.to_wire(), "sizes": [0, 12]}, 8)
    state = PeerState(5, {2: 7}, LastRound(5, (1,), (3,)))
    assert PeerState.from_wire(state.to_wire()) == state
    with pytest.raises(ValueError, match=r"'staged\[2\]' must be in 1\.\."):
        PeerState.from_wire({**state.to_wire(), "staged": [[2, 0]]})
    with pytest.raises(ValueError, match=r"sizes"):
        PeerState.from_wire({**state.to_wire(), "last": {**state.last.to_wire(), "sizes": [-1]}})
