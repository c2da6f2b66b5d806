"""The dealer requests of a round's last 2PC session, kept to fetch the next one's ahead.

Why: in dealer mode a session's material is made by the dealer and fetched by server 1 as the
computation asks for it, so the dealer's link and work add to the round's time (a FedSECA
round on the MNIST shapes: about 4.5 GB of material, 90 s all-in against 45 s online). The
requests depend on the program and its public shapes only, so a round whose session has the
same key as the last one (aggregator, clients, coordinates, precision, gamma) hands the last
one's list to ``Party.fetch_ahead``: server 1 then fetches while both servers compute.
A list is a guess: a request that differs (say, a client whose threshold was refused) ends
the fetching and the rest is made on demand, keyed afresh (``mpc.correlations.request_prg``).

Kept in memory and, when the caller names a directory (the daemons pass their history store's
``dealer-plans/``), as one JSON file per key, written atomically: a restarted daemon's first round
of a known shape fetches ahead too. A plan holds public shapes only (request kinds and sizes,
no share, no seed); a file that is unreadable, of another key or with a request the dealer link
would refuse (``mpc.correlations.validate``) is ignored with one warning, and that round
fetches on demand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mpc.correlations import RequestError, validate

__all__ = ["fetched_ahead", "recall", "remember", "forget_all", "AHEAD_BYTES", "PLANS_DIR"]

log = logging.getLogger(__name__)

#: the plans' folder inside a server's history store
PLANS_DIR = "dealer-plans"

#: dealer material server 1 may hold ahead of use: a FedSECA round on the MNIST shapes ran its
#: steps in 66 s with 256 MB and 58 s with 1 GB (peak RSS 3.7 and 4.3 GB; bench/README.md)
AHEAD_BYTES = 1 << 30
_KEEP = 8
_plans: "OrderedDict[str, list[tuple]]" = OrderedDict()


def recall(key: str, directory: str | os.PathLike | None = None) -> list[tuple]:
    """The requests last recorded under ``key`` (empty if none): in memory, else from ``directory``."""
    plan = _plans.get(key)
    if plan is None and directory is not None:
        plan = _load(Path(directory), key)
        if plan:
            _plans[key] = plan
    if plan is None:
        return []
    _plans.move_to_end(key)
    return list(plan)


def remember(key: str, plan: list[tuple], directory: str | os.PathLike | None = None) -> None:
    """Keep ``plan`` under ``key`` (the last few keys in memory; every key in ``directory``)."""
    if not plan:
        return
    _plans[key] = list(plan)
    _plans.move_to_end(key)
    while len(_plans) > _KEEP:
        _plans.popitem(last=False)
    if directory is not None:
        _save(Path(directory), key, plan)


def forget_all() -> None:
    """Forget the plans held in memory (the files stay)."""
    _plans.clear()


def _file(directory: Path, key: str) -> Path:
    return directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _save(directory: Path, key: str, plan: list[tuple]) -> None:
    # a plan only saves time: failing to write one must not fail the round that made it
    path = _file(directory, key)
    tmp = path.with_suffix(".tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "requests": plan}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("dealer plan %s not saved in %s (%s): the next restart fetches that round on demand",
                    key, directory, exc)


def _load(directory: Path, key: str) -> list[tuple] | None:
    path = _file(directory, key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            raise ValueError(f"it holds the plan of {data.get('key')!r:.80}")
        return [validate(r) for r in data["requests"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RequestError) as exc:
        log.warning("dealer plan %s ignored (%s: %s): that round fetches its material on demand",
                    path, type(exc).__name__, str(exc)[:200])
        return None


@contextmanager
def fetched_ahead(party: Any, key: str, directory: str | os.PathLike | None = None) -> Iterator[None]:
    """Within this block, ``party``'s session fetches the last plan kept under ``key`` ahead of
    use; once the block completes, the session's own requests become that plan (also in
    ``directory``, if given)."""
    party.fetch_ahead(recall(key, directory), AHEAD_BYTES)
    yield
    remember(key, party.recorded_plan, directory)
