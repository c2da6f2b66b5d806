"""Starfish's parameters as the scheme reads them: defined once in ``common.starfish_params``
(the deployment config and the clients read the same defaults, and may not import
``protocols``), re-exported here beside the steps that use them."""

from common.starfish_params import PAPER, Method, StarfishParams, ceil_rate

__all__ = ["StarfishParams", "PAPER", "Method", "ceil_rate"]
