"""The dealer requests of a round's last 2PC session, kept to fetch the next one's ahead.

Why: in dealer mode a session's material is made by the dealer and fetched by server 1 as the
computation asks for it, so the dealer's link and work add to the round's time (a FedSECA
round on the MNIST shapes: about 4.5 GB of material, 90 s all-in against 45 s online). The
requests depend on the program and its public shapes only, so a round whose session has the
same key as the last one (aggregator, clients, coordinates, precision, gamma) hands the last
one's list to ``Party.fetch_ahead``: server 1 then fetches while both servers compute.
A list is a guess: a request that differs (say, a client whose threshold was refused) ends
the fetching and the rest is made on demand, keyed afresh (``mpc.correlations.request_prg``).

Kept in memory only: a restarted daemon's first round fetches on demand, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["fetched_ahead", "recall", "remember", "forget_all", "AHEAD_BYTES"]

#: dealer material server 1 may hold ahead of use: a FedSECA round on the MNIST shapes ran its
#: steps in 66 s with 256 MB and 58 s with 1 GB (peak RSS 3.7 and 4.3 GB; bench/README.md)
AHEAD_BYTES = 1 << 30
_KEEP = 8
_plans: "OrderedDict[str, list[tuple]]" = OrderedDict()


def recall(key: str) -> list[tuple]:
    """The requests last recorded under ``key`` (empty if none)."""
    plan = _plans.get(key)
    if plan is None:
        return []
    _plans.move_to_end(key)
    return list(plan)


def remember(key: str, plan: list[tuple]) -> None:
    """Keep ``plan`` under ``key`` (the last few keys only)."""
    if not plan:
        return
    _plans[key] = list(plan)
    _plans.move_to_end(key)
    while len(_plans) > _KEEP:
        _plans.popitem(last=False)


def forget_all() -> None:
    _plans.clear()


@contextmanager
def fetched_ahead(party: Any, key: str) -> Iterator[None]:
    """Within this block, ``party``'s session fetches the last plan kept under ``key`` ahead of
    use; once the block completes, the session's own requests become that plan."""
    party.fetch_ahead(recall(key), AHEAD_BYTES)
    yield
    remember(key, party.recorded_plan)
