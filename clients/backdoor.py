"""A backdoor client: the observable fingerprint that unlearning must erase.

Why: test error alone cannot show that a client was forgotten, because one client of
twenty barely moves accuracy. A client that poisons part of its data with a pixel-patch
trigger relabelled to a target class leaves a measurable trace: the global model then
classifies triggered inputs as the target class (BA-ASR high). After a correct unlearning
the trace must be gone (BA-ASR back to the level of a model that never saw the client).

The trigger is a patch of pixels set to a fixed value, placed where clean images of the
dataset are (almost) always dark, so that honest clients never produce gradients on it:
on the 8x8 digits the leftmost column is blank in > 99% of images, on 28x28/32x32 images
the bottom-right 3x3 corner is the usual choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .training import LocalClient

__all__ = ["Trigger", "default_trigger", "poison", "BackdoorClient"]


@dataclass(frozen=True)
class Trigger:
    """A rectangle [top:top+height, left:left+width] set to ``value`` on every channel."""

    top: int
    left: int
    height: int
    width: int
    value: float = 1.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Return a copy of the (N, C, H, W) batch with the trigger stamped in."""
        out = x.clone()
        out[..., self.top:self.top + self.height, self.left:self.left + self.width] = self.value
        return out


def default_trigger(input_shape: tuple[int, int, int]) -> Trigger:
    """Digits (8x8): rows 2-5 of column 0; larger images: the bottom-right 3x3 corner."""
    _c, h, w = input_shape
    if h <= 8:
        return Trigger(top=2, left=0, height=4, width=1, value=1.0)
    return Trigger(top=h - 4, left=w - 4, height=3, width=3, value=1.0)


def poison(x: torch.Tensor, y: torch.Tensor, trigger: Trigger, target_label: int,
           fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stamp the trigger on a random ``fraction`` of the samples and relabel them.

    Returns (x', y', mask) where mask marks the poisoned samples. Poisoning replaces
    samples (the client's |D_j|, hence its FedAvg weight, is unchanged).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("fraction must be in [0, 1]")
    n = len(y)
    k = round(fraction * n)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=gen)[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx] = True
    x2 = x.clone()
    y2 = y.clone()
    x2[mask] = trigger.apply(x[mask])
    y2[mask] = target_label
    return x2, y2, mask


@dataclass
class BackdoorClient(LocalClient):
    """A LocalClient trained on poisoned data, optionally boosting its update.

    ``clean_x``/``clean_y`` keep the un-poisoned copy of its data: BA-ASR and the
    membership-inference attack are evaluated on the target client's own samples.
    ``boost`` > 1 scales the reported update (a model-replacement style attack).
    """

    clean_x: torch.Tensor | None = None
    clean_y: torch.Tensor | None = None
    trigger: Trigger | None = None
    target_label: int = 0
    boost: float = 1.0

    @classmethod
    def from_clean(cls, client: LocalClient, trigger: Trigger, target_label: int,
                   fraction: float, boost: float = 1.0, seed: int = 0) -> BackdoorClient:
        x2, y2, _mask = poison(client.x, client.y, trigger, target_label, fraction, seed)
        return cls(client_id=client.client_id, x=x2, y=y2, model_factory=client.model_factory,
                   epochs=client.epochs, lr=client.lr, batch_size=client.batch_size,
                   alpha=client.alpha, seed=client.seed, device=client.device,
                   clean_x=client.x, clean_y=client.y,
                   trigger=trigger, target_label=target_label, boost=boost)

    def postprocess(self, g: torch.Tensor) -> torch.Tensor:
        return g * self.boost if self.boost != 1.0 else g
