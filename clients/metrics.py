"""Model-quality metrics of the lab: TER, BA-ASR, MIA-ASR (Starfish Sec. VI-A).

Why in ``clients``: they need a model architecture and data, nothing from the servers.
Cost metrics (ARP, L2 distance, wall time) live in ``lab.metrics``.

* TER - test error rate: fraction of test inputs misclassified.
* BA-ASR - backdoor attack success rate: of the target client's own samples whose true
  label is not the backdoor's target label, the fraction classified as the target label
  once the trigger is stamped on. (Samples already of the target label are left out:
  they would count as "successes" without any backdoor.)
* MIA-ASR - membership inference on the target client's clean samples with a
  loss-threshold attack (Yeom et al., CSF 2018): a sample is called a member when the
  model's cross-entropy loss on it is below tau, where tau is the median loss of the same
  model on the held-out test set. A model that never saw the target therefore scores
  about 50%; a model that memorised the target's data scores higher. Calibrating tau on
  each evaluated model keeps the attack from confusing "more accurate" with "member".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .backdoor import Trigger
from .models import load_params

__all__ = ["predict_logits", "test_error_rate", "backdoor_asr", "mia_asr", "Evaluator"]


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def test_error_rate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((predict_logits(model, x).argmax(1) != y).float().mean())


def backdoor_asr(model: nn.Module, x: torch.Tensor, y: torch.Tensor, trigger: Trigger,
                 target_label: int) -> float:
    keep = y != target_label
    if not bool(keep.any()):
        return float("nan")
    pred = predict_logits(model, trigger.apply(x[keep])).argmax(1)
    return float((pred == target_label).float().mean())


@torch.no_grad()
def mia_asr(model: nn.Module, member_x: torch.Tensor, member_y: torch.Tensor,
            ref_x: torch.Tensor, ref_y: torch.Tensor) -> float:
    ref_loss = F.cross_entropy(predict_logits(model, ref_x), ref_y, reduction="none")
    tau = float(ref_loss.median())
    loss = F.cross_entropy(predict_logits(model, member_x), member_y, reduction="none")
    return float((loss < tau).float().mean())


class Evaluator:
    """Evaluates model vectors on fixed data: the test set and the target's samples."""

    def __init__(self, model_factory: Callable[[], nn.Module], x_test: torch.Tensor,
                 y_test: torch.Tensor, target_x: torch.Tensor | None = None,
                 target_y: torch.Tensor | None = None, trigger: Trigger | None = None,
                 target_label: int = 0) -> None:
        self.model = model_factory()
        self.x_test, self.y_test = x_test, y_test
        self.target_x, self.target_y = target_x, target_y
        self.trigger = trigger
        self.target_label = target_label

    def __call__(self, vector: torch.Tensor) -> dict[str, float]:
        load_params(self.model, vector)
        out = {"ter": test_error_rate(self.model, self.x_test, self.y_test)}
        if self.target_x is not None and self.target_y is not None:
            if self.trigger is not None:
                out["ba_asr"] = backdoor_asr(self.model, self.target_x, self.target_y,
                                             self.trigger, self.target_label)
            out["mia_asr"] = mia_asr(self.model, self.target_x, self.target_y,
                                     self.x_test, self.y_test)
        return out
