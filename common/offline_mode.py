"""Where a 2PC session's correlated randomness comes from (docs/design.md 4.3): one value from the
deployment config (``[deployment] offline``) through ``run_parties`` and ``open_party`` to the
session (``Party.offline``).

``dealer``: a third, non-colluding process hands out the material; ``two-party``: no third party,
the servers make it between themselves. A deployment that names no mode is two-party
(``DEFAULT_OFFLINE``, issue 26): the paper's trust model, two non-colluding servers and nobody
else; the dealer is an option for those who accept a third party for speed. The enum's members are strings ("dealer" == OfflineMode.DEALER),
so configs, command lines and ``run_parties(offline="two-party")`` keep spelling them as text;
:meth:`OfflineMode.of` is the one place a spelling is checked.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["OfflineMode", "DEFAULT_OFFLINE", "OFFLINE_CHOICES"]


class OfflineMode(StrEnum):
    DEALER = "dealer"
    TWO_PARTY = "two-party"

    @classmethod
    def of(cls, value: str) -> OfflineMode:
        """The mode a user wrote; anything else is a ValueError naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"offline must be one of {', '.join(m.value for m in cls)}, "
                             f"got {value!r}") from None


#: what a deployment config without ``[deployment] offline``, ``starfish init-deployment`` and
#: ``starfish demo`` use
DEFAULT_OFFLINE = OfflineMode.TWO_PARTY

#: the spellings a command line accepts, in the enum's order
OFFLINE_CHOICES = tuple(m.value for m in OfflineMode)
