"""A client's sample count |D_j|, defined once: the bound, its check and its type.

Why a module: |D_j| travels from the client (the ``upload`` field ``num_samples``) through each
server's bookkeeping (``servers.daemon.service_state``), the servers' link (the ``sizes`` of
``LastRound``, ``CloseRound``, ``CloseRobustRound`` and ``PeerState.staged``) and the store's
round metadata (``{"num_samples": {"<client>": n}}``) into FedAvg's weights
(``common.fedavg``), which the daemon commits and the lab's histories carry to Stage II. Each of
those places used to restate the range (or none); here it is stated once, and every place a
count enters checks it with :func:`check_sample_count`.

A count stays a plain ``int`` on the wire, in SQLite and in the store's JSON: ``SampleCount``
is a ``NewType`` (no runtime wrapper), so formats and comparisons are unchanged. Imports
nothing beyond the standard library.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, NewType

__all__ = ["SampleCount", "MIN_SAMPLE_COUNT", "MAX_SAMPLE_COUNT", "METADATA_KEY", "SampleCountError",
           "check_sample_count", "sample_counts", "counts_from_metadata", "counts_to_metadata"]

#: A client with no data has nothing to upload; FedAvg's weight |D_j| / N needs N > 0.
MIN_SAMPLE_COUNT = 1
#: The upload's bound since the first wire version (a signed 32-bit count); the deployment's
#: ``limits.max_num_samples`` and the exact ring's bound may cap it lower (``client_api``).
MAX_SAMPLE_COUNT = 2**31 - 1
#: The key of a committed round's metadata holding ``{str(client): count}``.
METADATA_KEY = "num_samples"

SampleCount = NewType("SampleCount", int)


class SampleCountError(ValueError):
    """A value that is not a sample count; the message names where it came from."""


def check_sample_count(value: Any, where: str) -> SampleCount:
    """``value`` as a :data:`SampleCount`, or :class:`SampleCountError` naming ``where``.

    Any integral value but a boolean is taken (numpy integers from the lab's clients included;
    msgpack and SQLite only ever give ``int``); floats are refused, never truncated.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SampleCountError(f"{where} must be an integer, got {type(value).__name__}")
    n = int(value)
    if not MIN_SAMPLE_COUNT <= n <= MAX_SAMPLE_COUNT:
        raise SampleCountError(f"{where} must be in {MIN_SAMPLE_COUNT}..{MAX_SAMPLE_COUNT}, got {n}")
    return SampleCount(n)


def sample_counts(values: Iterable[Any], where: str) -> tuple[SampleCount, ...]:
    """Each of ``values`` checked, in order (``where[i]`` names a bad one)."""
    return tuple(check_sample_count(v, f"{where}[{i}]") for i, v in enumerate(values))


def counts_from_metadata(meta: Mapping[str, Any], where: str) -> dict[int, SampleCount]:
    """client -> count of a round's metadata (``{}`` where it records none, e.g. an
    unlearning round); a malformed entry is a :class:`SampleCountError` naming ``where``."""
    raw = meta.get(METADATA_KEY, {})
    if not isinstance(raw, Mapping):
        raise SampleCountError(f"{where}: {METADATA_KEY} must be a map of client to count")
    out = {}
    for k, v in raw.items():
        try:
            j = int(k)
        except (TypeError, ValueError):
            raise SampleCountError(f"{where}: {METADATA_KEY} has a client id {k!r}") from None
        out[j] = check_sample_count(v, f"{where}: {METADATA_KEY} of client {j}")
    return out


def counts_to_metadata(counts: Mapping[int, SampleCount], clients: Iterable[int]) -> dict[str, int]:
    """The metadata form of ``clients``' counts: JSON keys are strings, values plain ints."""
    return {str(j): int(counts[j]) for j in clients}
