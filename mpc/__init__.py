"""The two-party runtime: encoding and sharing (numpy only), and the CrypTen session.

Clients import ``mpc.encoding``/``mpc.sharing``/``mpc.prg`` only; those do not import
torch or CrypTen. ``run_parties``, ``open_party`` and ``meter`` load the 2PC engine on
first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_parties", "open_party", "meter", "LinkProfile", "PartyResults", "PartyError"]


def __getattr__(name: str) -> Any:
    if name in ("run_parties", "PartyResults", "PartyError"):
        from . import launcher

        return getattr(launcher, name)
    if name == "open_party":
        from .session import open_party

        return open_party
    if name == "meter":
        from .metering import meter

        return meter
    if name == "LinkProfile":
        from .channel import LinkProfile

        return LinkProfile
    raise AttributeError(name)
