"""Byzantine clients for the lab: wrappers that corrupt an honest participant's upload.

Why wrappers: an attacker is an ordinary client (same data, same batches, same FedAvg weight)
that lies about its update. Wrapping keeps everything else about the client (``x``, ``y``,
``model_factory``, ``epochs``, ... are read through to the wrapped client, which the recovery
methods use) and recomputes the upload's assistive fields the way an honest client does
(``clients.training``): ``norm = ||g||_2`` and ``delta = tolerance_threshold(g, alpha)`` with the
client's own ``alpha``, so the upload stays internally consistent and only g is a lie.

* :class:`SignFlipClient` uploads -g.
* :class:`ScalingClient` uploads s * g, s = 10 by default (FedSECA app. D.6 uses epsilon = 10;
  it scales the honest clients' mean, this client scales its own update: the attack needs no
  knowledge of the others).
* :class:`AlieClient` is FedSECA's "A Little Is Enough" (app. D.2, eq. 13):
  mu_H - z * sigma_H, with mu_H / sigma_H the coordinate-wise mean / population standard
  deviation of the honest updates of the same round and z = 1.0 + U(-0.05, 0.05) per
  attacker and round (the paper's z_max and jitter delta). It is an *omniscient* attacker:
  it needs the honest clients' current-round updates, which ``lab.fl.run_federated``
  hands to any participant with a ``train_omniscient`` method after the others have trained.
  That is the threat model of FedSECA and BRACE (the attacker sees every honest update of the
  round), not something a real server allows.

The backdoor client (``clients.backdoor.BackdoorClient``) is the lab's fourth attack; it
poisons data rather than uploads and needs no wrapper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .training import ClientUpdate, round_seed, tolerance_threshold

__all__ = ["Honest", "AttackedClient", "SignFlipClient", "ScalingClient", "AlieClient",
           "ATTACKS", "SCALE", "ALIE_Z", "ALIE_JITTER"]

#: FedSECA app. D.6: scaling factor epsilon = 10.
SCALE = 10.0
#: FedSECA app. D.2: z_max = 1.0 + delta, delta ~ Uniform(-0.05, 0.05).
ALIE_Z = 1.0
ALIE_JITTER = 0.05


class Honest(Protocol):
    """The participant shape a wrapper needs (``lab.fl.Participant``)."""

    client_id: int

    @property
    def num_samples(self) -> int: ...

    def train(self, model_vec: torch.Tensor, round_idx: int,
              epochs: float | None = None) -> Any: ...


class AttackedClient:
    """Base wrapper: forwards identity and data to ``inner``, rebuilds uploads from a forged g."""

    def __init__(self, inner: Honest, alpha: float | None = None) -> None:
        if alpha is None:
            alpha = getattr(inner, "alpha", None)
            if alpha is None:
                raise ValueError("the wrapped client has no alpha; pass alpha= to the attack")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError("alpha must be in [0, 1]")
        self.inner = inner
        self.alpha = float(alpha)

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes the wrapper lacks; guard 'inner' so copying/unpickling
        # (which probe attributes before __init__ ran) cannot recurse
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def client_id(self) -> int:
        return self.inner.client_id

    @property
    def num_samples(self) -> int:
        return self.inner.num_samples

    def upload(self, g: torch.Tensor) -> ClientUpdate:
        """The upload an honest client with update ``g`` would send."""
        return ClientUpdate(g, float(g.norm()), tolerance_threshold(g, self.alpha), self.num_samples)

    def forge(self, g: torch.Tensor, round_idx: int) -> torch.Tensor:
        raise NotImplementedError

    def train(self, model_vec: torch.Tensor, round_idx: int,
              epochs: float | None = None) -> ClientUpdate:
        honest = self.inner.train(model_vec, round_idx, epochs)
        return self.upload(self.forge(honest.update, round_idx))


class SignFlipClient(AttackedClient):
    """Uploads -g: the exact opposite of its honest update."""

    attack = "sign-flip"

    def forge(self, g: torch.Tensor, round_idx: int) -> torch.Tensor:
        return -g


class ScalingClient(AttackedClient):
    """Uploads ``scale`` * g (default :data:`SCALE`)."""

    attack = "scaling"

    def __init__(self, inner: Honest, scale: float = SCALE, alpha: float | None = None) -> None:
        super().__init__(inner, alpha)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        self.scale = float(scale)

    def forge(self, g: torch.Tensor, round_idx: int) -> torch.Tensor:
        return self.scale * g


class AlieClient(AttackedClient):
    """A Little Is Enough: mu_H - z sigma_H from the honest updates of the round (omniscient).

    ``z = z_max + u`` with u uniform in [-jitter, jitter), drawn from a generator seeded by
    (seed, client, round): a rerun (Retrain) forges the same z, two attackers forge different
    ones. Without a view of the others (a recovery method asking this client for one exact
    update outside an FL round) the attacker knows only its own honest update g: mu = g and
    sigma = 0, so it uploads g. Hence only Retrain, which re-runs FL, faces ALIE again.
    """

    attack = "alie"

    def __init__(self, inner: Honest, z_max: float = ALIE_Z, jitter: float = ALIE_JITTER,
                 seed: int = 0, alpha: float | None = None) -> None:
        super().__init__(inner, alpha)
        if not jitter >= 0.0:
            raise ValueError(f"ALIE jitter must be >= 0, got {jitter}")
        self.z_max = float(z_max)
        self.jitter = float(jitter)
        self.seed = int(seed)

    def z(self, round_idx: int) -> float:
        """The deviation factor this attacker uses in ``round_idx``."""
        if self.jitter == 0.0:
            return self.z_max
        gen = torch.Generator().manual_seed(round_seed(self.seed, self.client_id, round_idx))
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        return self.z_max + self.jitter * (2.0 * u - 1.0)

    def forge(self, g: torch.Tensor, round_idx: int) -> torch.Tensor:
        return g  # no view: mu = g, sigma = 0

    def train_omniscient(self, model_vec: torch.Tensor, round_idx: int,
                         others: Mapping[int, Any],
                         epochs: float | None = None) -> ClientUpdate:
        """Forge from the others' uploads of this round (no local training needed)."""
        if not others:
            return self.train(model_vec, round_idx, epochs)
        honest = torch.stack([others[j].update.reshape(-1) for j in sorted(others)])
        mu = honest.mean(dim=0)
        sigma = honest.std(dim=0, correction=0)  # population std, 1/H (FedSECA eq. 13)
        return self.upload((mu - self.z(round_idx) * sigma).reshape(others[min(others)].update.shape))


ATTACKS = {"sign-flip": SignFlipClient, "scaling": ScalingClient, "alie": AlieClient}
