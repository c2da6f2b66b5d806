"""The two ports of Stage II: what Starfish reads (History) and whom it asks (CorrectionClients).

Why ports: Stage II (``protocols.starfish.stage2``) runs unchanged on the plaintext lab and on
the two secure servers (docs/design.md 4.1). It needs, per round i = 1..T, the public global
models M_{i-1} and M_i, the participants and their FedAvg weights, and each participant's
update g_i^j, norm ||g_i^j|| and tolerance threshold delta_i^j; and during the replay, exact
updates from the remaining clients. The lab implements both ports on plain tensors
(``lab``); each server implements them on its shares (``servers.secure.share_history``,
``servers.secure.correction_tasks``). Per-client values are typed :data:`Secret`: a plain torch
tensor in the lab, this party's CrypTen tensor on a server.

Conventions: rounds are 1-based; ``model(0)`` is the initial model M_0; ``model(i)`` is the
model published after round i, M_i = M_{i-1} - server_lr * sum_j w_i^j g_i^j, and the
updates of round i were computed on M_{i-1}.

Participation is partial and public (docs/unlearning.md, "Partial participation, erased clients
and unlearning rounds"): a client may miss rounds; an erased client's entries are gone from the
rounds it took part in (the other participants' stored weights are *not* renormalised, so the
weights of such a round may sum to less than 1); and an *unlearning round* (the servers adopted
an unlearned model) has no participants at all: participants == (), weights == {}, and its model
is the unlearned one. :func:`present_clients` and :func:`candidate_rounds` say which rounds a
replay for a set of clients can use; :func:`without_clients` is the view of a history whose
store erased some clients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["Secret", "RoundRecord", "History", "CorrectionClients", "check_record",
           "remaining_clients", "present_clients", "candidate_rounds", "rounds_of",
           "without_clients", "history_prefix", "HistoryView"]

#: A plain torch tensor (plaintext lab) or a secret-shared tensor (CrypTen MPCTensor).
Secret = Any


@dataclass(frozen=True)
class RoundRecord:
    """Everything stored for one FL round (what ``History.append_round`` accepts).

    An unlearning round (an adopted unlearned model) is ``RoundRecord(model, (), {}, {}, {}, {})``.
    """

    model: torch.Tensor                   # M_i, public
    participants: tuple[int, ...]         # clients whose updates reached the servers
    weights: Mapping[int, float]          # FedAvg weights of this round, sum to 1 (if any)
    updates: Mapping[int, Secret]         # g_i^j
    norms: Mapping[int, Secret]           # ||g_i^j||_2
    deltas: Mapping[int, Secret]          # delta_i^j


class History(ABC):
    """Read access to T rounds of FL, plus appending a round (Stage I)."""

    @property
    @abstractmethod
    def num_rounds(self) -> int:
        """T, the number of completed rounds."""

    @property
    @abstractmethod
    def server_lr(self) -> float:
        """eta in M_i = M_{i-1} - eta * sum_j w_j g_i^j."""

    @abstractmethod
    def model(self, i: int) -> torch.Tensor:
        """Public global model M_i, i = 0..T."""

    @abstractmethod
    def participants(self, i: int) -> tuple[int, ...]:
        """Client ids that took part in round i (sorted)."""

    @abstractmethod
    def weights(self, i: int) -> Mapping[int, float]:
        """FedAvg weights w_i^j = |D_j| / sum of |D_k| over round i's participants."""

    @abstractmethod
    def update(self, i: int, client: int) -> Secret:
        """g_i^j, computed by client j on M_{i-1}."""

    @abstractmethod
    def norm(self, i: int, client: int) -> Secret:
        """||g_i^j||_2 as reported by the client."""

    @abstractmethod
    def delta(self, i: int, client: int) -> Secret:
        """delta_i^j, the client's tolerance threshold for round i."""

    @abstractmethod
    def append_round(self, record: RoundRecord) -> None:
        """Store round T+1 (its model is M_{T+1})."""

    def stored_update(self, i: int, client: int) -> tuple[str, int] | None:
        """Where g_i^j's share already lies on coordinate shards (issue 30): a reference the shard
        executor resolves at its workers, and the share's fractional bits; None (every history but a
        store on shards): read it with :meth:`update`."""
        return None

    # ---- conveniences built on the abstract accessors -------------------------------
    def clients(self) -> tuple[int, ...]:
        """Every client that took part in any round."""
        seen: set[int] = set()
        for i in range(1, self.num_rounds + 1):
            seen.update(self.participants(i))
        return tuple(sorted(seen))

    def model_delta(self, i: int) -> torch.Tensor:
        """M_i - M_{i-1} (public)."""
        return self.model(i) - self.model(i - 1)

    def weight(self, client: int) -> float | None:
        """``client``'s FedAvg weight in the first round it joined (its relative data size;
        None if it never took part). A weight, not a count: histories keep w_j = |D_j| / N."""
        for i in range(1, self.num_rounds + 1):
            w = self.weights(i)
            if client in w:
                return float(w[client])
        return None


def check_record(record: RoundRecord, dim: int | None) -> None:
    """Refuse a malformed round: participants sorted and unique, one entry per participant in
    every table, weights summing to 1, the model's size. A round without participants (an
    unlearning round) has empty tables and is accepted."""
    parts = tuple(record.participants)
    if tuple(sorted(set(parts))) != parts:
        raise ValueError("participants must be sorted and unique")
    for name, table in (("weights", record.weights), ("updates", record.updates),
                        ("norms", record.norms), ("deltas", record.deltas)):
        if set(table) != set(parts):
            raise ValueError(f"{name} must have exactly one entry per participant")
    total = sum(float(record.weights[j]) for j in parts)
    if parts and abs(total - 1.0) > 1e-6:
        raise ValueError(f"FedAvg weights must sum to 1, got {total}")
    if dim is not None and record.model.numel() != dim:
        raise ValueError(f"model has {record.model.numel()} entries, expected {dim}")


class CorrectionClients(Protocol):
    """The remaining clients as Stage II reaches them.

    ``exact_updates`` asks each client in ``client_ids`` for its exact update on the
    public ``model`` (batch order of historical round ``round_index``) and returns them:
    plain tensors in the lab, this party's CrypTen shares on a server.

    The answer may leave clients out: a client that did not answer in time, or whose answer
    failed the servers' checks, is *absent* from that correction step (``replay.py``: a flagged
    client keeps its estimate; in a warm-up step it is left out of the round as a client that
    did not take part, the others' weights renormalised; its buffer is unchanged). Both servers
    must leave out the same clients (they agree on them before returning).
    """

    def exact_updates(self, round_index: int, model: torch.Tensor,
                      client_ids: list[int]) -> dict[int, Secret]: ...


def remaining_clients(history: History, targets: Iterable[int]) -> list[int]:
    """The clients that stay after unlearning ``targets`` (all of them must have taken part)."""
    t = set(targets)
    unknown = t - set(history.clients())
    if unknown:
        raise ValueError(f"targets {sorted(unknown)} never took part in FL")
    rest = [j for j in history.clients() if j not in t]
    if not rest:
        raise ValueError("no client would remain after unlearning")
    return rest


def present_clients(history: History, i: int, clients: Iterable[int]) -> list[int]:
    """present_i = ``clients`` that took part in round i, in the order of ``clients`` (public)."""
    taken = set(history.participants(i))
    return [j for j in clients if j in taken]


def candidate_rounds(history: History, clients: Iterable[int]) -> list[int]:
    """C: the rounds 1..T in which at least one of ``clients`` took part (public).

    Stage II and FedRecover replay only rounds of C (for ``clients`` = the remaining clients):
    an unlearning round or a round of targets only has nothing to replay.
    """
    wanted = set(clients)
    return [i for i in range(1, history.num_rounds + 1) if wanted.intersection(history.participants(i))]


def rounds_of(history: History, client: int) -> list[int]:
    """The rounds ``client`` took part in (public)."""
    return [i for i in range(1, history.num_rounds + 1) if client in history.participants(i)]


class HistoryView(History):
    """A read-only history that reads everything from ``base`` (subclasses change what they must)."""

    def __init__(self, base: History) -> None:
        self._base = base

    @property
    def num_rounds(self) -> int:
        return self._base.num_rounds

    @property
    def server_lr(self) -> float:
        return self._base.server_lr

    def model(self, i: int) -> torch.Tensor:
        return self._base.model(i)

    def participants(self, i: int) -> tuple[int, ...]:
        return self._base.participants(i)

    def weights(self, i: int) -> Mapping[int, float]:
        return self._base.weights(i)

    def update(self, i: int, client: int) -> Secret:
        return self._base.update(i, client)

    def norm(self, i: int, client: int) -> Secret:
        return self._base.norm(i, client)

    def delta(self, i: int, client: int) -> Secret:
        return self._base.delta(i, client)

    def stored_update(self, i: int, client: int) -> tuple[str, int] | None:
        return self._base.stored_update(i, client)

    def append_round(self, record: RoundRecord) -> None:
        raise TypeError(f"this history view ({type(self).__name__}) is read-only; append to the underlying history")


class _WithoutClients(HistoryView):
    """Read-only view of ``base`` with ``hidden`` clients erased (see :func:`without_clients`)."""

    def __init__(self, base: History, hidden: Iterable[int]) -> None:
        super().__init__(base)
        self._hidden = frozenset(int(j) for j in hidden)

    def participants(self, i: int) -> tuple[int, ...]:
        return tuple(j for j in self._base.participants(i) if j not in self._hidden)

    def weights(self, i: int) -> Mapping[int, float]:
        return {j: w for j, w in self._base.weights(i).items() if j not in self._hidden}

    def _visible(self, client: int) -> None:
        if client in self._hidden:
            raise KeyError(f"client {client} was erased from this history")

    def update(self, i: int, client: int) -> Secret:
        self._visible(client)
        return self._base.update(i, client)

    def norm(self, i: int, client: int) -> Secret:
        self._visible(client)
        return self._base.norm(i, client)

    def delta(self, i: int, client: int) -> Secret:
        self._visible(client)
        return self._base.delta(i, client)

    def stored_update(self, i: int, client: int) -> tuple[str, int] | None:
        self._visible(client)
        return self._base.stored_update(i, client)


def without_clients(history: History, clients: Iterable[int]) -> History:
    """``history`` as a store that erased ``clients`` would hold it (a read-only view).

    The erased clients are gone from ``participants`` and ``weights`` of every round; the other
    participants' weights are left as stored (not renormalised: Stage II renormalises over the
    clients it replays anyway); reading an erased client's update, norm or threshold raises
    KeyError. Models are unchanged. For the plaintext twin of a server whose store erased
    ``clients`` after an earlier unlearning.
    """
    return _WithoutClients(history, clients)


class _Prefix(_WithoutClients):
    """Read-only view of the first ``rounds`` rounds of ``base`` (see :func:`history_prefix`)."""

    def __init__(self, base: History, rounds: int) -> None:
        super().__init__(base, ())
        if not 0 <= rounds <= base.num_rounds:
            raise ValueError(f"a prefix of {rounds} rounds of a history of {base.num_rounds}")
        self._rounds = rounds

    @property
    def num_rounds(self) -> int:
        return self._rounds

    def model(self, i: int) -> torch.Tensor:
        if not 0 <= i <= self._rounds:
            raise IndexError(f"model {i} not in 0..{self._rounds}")
        return self._base.model(i)

    def participants(self, i: int) -> tuple[int, ...]:
        if not 1 <= i <= self._rounds:
            raise IndexError(f"round {i} not in 1..{self._rounds}")
        return self._base.participants(i)


def history_prefix(history: History, rounds: int) -> History:
    """Rounds 1..``rounds`` of ``history`` (read-only): what a job pinned to them reads, for the
    plaintext twin of a job that ran before later rounds were recorded."""
    return _Prefix(history, rounds)
