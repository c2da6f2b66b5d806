"""One server's store as the ``History`` port of Stage II (docs/design.md 4.1).

Why a module of its own: Stage II (``protocols.starfish``) reads the FL history through
the :class:`protocols.starfish.ports.History` port, in plaintext in the lab and on shares on
a server. :class:`ShareHistory` is the server's implementation over its
:class:`servers.store.share_store.ShareStore`; it needs torch (public models are tensors), the
store does not, so it lives apart and the store imports fast.

Public values come back in the clear; per-client values are this party's *share*, wrapped
into CrypTen tensors if a ``wrap`` is given. With ``rounds=T`` the view is pinned to rounds
1..T and read-only: an unlearning job reads exactly the rounds both servers agreed on when
it started, whatever is committed meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from protocols.starfish.ports import History, RoundRecord, Secret

from servers.store.share_store import ClientShares, ShareStore

__all__ = ["ShareHistory"]


class ShareHistory(History):
    """:class:`History` over one party's :class:`ShareStore`.

    Public values come back in the clear: ``model(i)`` is a torch tensor (float32 or
    float64, as stored), ``participants``/``weights`` as stored. Per-client values are
    this party's *share*: ``update(i, j)`` a numpy int64 array of shape (dim,),
    ``norm``/``delta`` numpy int64 arrays of shape (). Give ``wrap`` (e.g.
    ``party.wrap_share``; called as ``wrap(share, precision=store.precision)``) to get
    CrypTen tensors instead, which is what the Starfish sub-protocols expect.

    A raw share is not a value: never feed this history, unwrapped, to a plaintext
    recovery method (FedRecover, FedEraser, ...).

    ``rounds`` pins the view to rounds 1..rounds (models 0..rounds), which must be
    committed already; a pinned view is read-only. Unpinned, ``append_round(record,
    round_index=i)`` detects replays (identical content is a no-op, different content
    raises RoundConflictError); without ``round_index`` it appends T+1 and cannot tell a
    replay from a new round.
    """

    def __init__(self, store: ShareStore, wrap: Callable[..., Any] | None = None,
                 rounds: int | None = None) -> None:
        if rounds is not None and rounds > store.num_rounds:
            raise ValueError(f"history has {store.num_rounds} rounds, job needs {rounds}")
        self.store = store
        self._wrap = wrap
        self._pinned = rounds

    @property
    def party(self) -> int:
        return self.store.party

    @property
    def num_rounds(self) -> int:
        return self.store.num_rounds if self._pinned is None else self._pinned

    @property
    def server_lr(self) -> float:
        return self.store.server_lr

    def _check_round(self, i: int) -> None:
        if self._pinned is not None and not 1 <= i <= self._pinned:
            raise IndexError(f"round {i} not in 1..{self._pinned}")

    def model(self, i: int) -> torch.Tensor:
        if self._pinned is not None and not 0 <= i <= self._pinned:
            raise IndexError(f"model {i} not in 0..{self._pinned}")
        return torch.from_numpy(self.store.model(i))

    def participants(self, i: int) -> tuple[int, ...]:
        self._check_round(i)
        return self.store.participants(i)

    def weights(self, i: int) -> Mapping[int, float]:
        self._check_round(i)
        return self.store.weights(i)

    def _out(self, share: np.ndarray) -> Secret:
        return share if self._wrap is None else self._wrap(share, precision=self.store.precision)

    def update(self, i: int, client: int) -> Secret:
        self._check_round(i)
        return self._out(self.store.update_share(i, client))

    def stored_update(self, i: int, client: int) -> tuple[str, int] | None:
        if self.store.shards is None:
            return None
        self._check_round(i)
        return self.store.update_ref(i, client), self.store.precision

    def norm(self, i: int, client: int) -> Secret:
        self._check_round(i)
        return self._out(self.store.norm_share(i, client))

    def delta(self, i: int, client: int) -> Secret:
        self._check_round(i)
        return self._out(self.store.delta_share(i, client))

    def append_round(self, record: RoundRecord, *, round_index: int | None = None,
                     metadata: Mapping[str, Any] | None = None) -> None:
        if self._pinned is not None:
            raise RuntimeError("a pinned history is read-only")
        clients = set(record.updates) | set(record.norms) | set(record.deltas)
        shares = {}
        for j in clients:
            if j not in record.updates or j not in record.norms or j not in record.deltas:
                raise ValueError(f"client {j} needs an update, a norm and a delta share")
            shares[j] = ClientShares(record.updates[j], record.norms[j], record.deltas[j])
        i = self.store.num_rounds + 1 if round_index is None else round_index
        self.store.append_round(i, record.model, record.participants, record.weights,
                                shares, metadata)
