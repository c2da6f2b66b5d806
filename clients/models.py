"""Models of the paper's experiments plus small models for the 8x8 digits, and flattening.

Why flattening lives here: the servers only ever see a model as one vector (the global
model M_i, the updates g_i^j, the differences M_hat - M used by L-BFGS). Clients convert
between that vector and a torch module with :func:`flatten_params` / :func:`load_params`,
which fix one parameter order (``module.parameters()`` order) for both directions.

Architectures (Starfish Sec. VI-A, following FedRecover):

* 28x28x1 (MNIST): Conv(1->32,5)-ReLU-MaxPool2-Conv(32->64,5)-ReLU-MaxPool2-FC(1024->512)-
  ReLU-FC(512->10): 582,026 parameters.
* 32x32x3 (CIFAR-10): the same with FC(1600->512): 878,538 parameters.
* Fashion-MNIST: "an extra fully connected layer". The paper does not give its width; we
  use FC(1024->512)-FC(512->128)-FC(128->10) (643,850 parameters).
* digits (8x8): an L2-regularised multinomial logistic regression (strongly convex, the
  setting of the paper's Theorem 1) and a one-hidden-layer MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "PaperCNN",
    "LogisticRegression",
    "SmallMLP",
    "MODEL_NAMES",
    "build_model",
    "default_model_name",
    "flatten_params",
    "load_params",
    "num_params",
    "regularizer",
]

MODEL_NAMES = ("cnn", "cnn-extra-fc", "logreg", "mlp")


class PaperCNN(nn.Module):
    """Two 5x5 conv layers with 2x2 max-pooling, then fully connected layers."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10,
                 extra_fc: int | None = None) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        flat = 64 * side * side
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(flat, 512), nn.ReLU()]
        if extra_fc:
            layers += [nn.Linear(512, extra_fc), nn.ReLU(), nn.Linear(extra_fc, num_classes)]
        else:
            layers += [nn.Linear(512, num_classes)]
        self.classifier = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression; ``l2`` makes the training loss strongly convex.

    The L2 term is not part of ``forward``: training adds :func:`regularizer` to the data
    loss, so evaluation losses (membership inference) are the plain cross-entropy.
    """

    def __init__(self, in_features: int = 64, num_classes: int = 10, l2: float = 1e-3) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.l2 = l2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class SmallMLP(nn.Module):
    """64 -> hidden -> classes with ReLU; a small non-convex model for the digits."""

    def __init__(self, in_features: int = 64, hidden: int = 32, num_classes: int = 10,
                 l2: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))
        self.l2 = l2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def regularizer(model: nn.Module) -> torch.Tensor:
    """0.5 * l2 * ||params||^2 for models that declare ``l2`` (else 0)."""
    l2 = float(getattr(model, "l2", 0.0) or 0.0)
    if l2 == 0.0:
        return torch.zeros(())
    return 0.5 * l2 * sum((p * p).sum() for p in model.parameters())


def default_model_name(dataset: str) -> str:
    return {"digits": "logreg", "mnist": "cnn", "fmnist": "cnn-extra-fc",
            "cifar10": "cnn"}.get(dataset, "cnn")


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int = 10,
                l2: float = 1e-3, hidden: int = 32) -> Callable[[], nn.Module]:
    """A factory of fresh models; the factory is what clients and metrics share."""
    c, h, w = input_shape
    if name == "cnn":
        if h != w:
            raise ValueError("the paper CNN expects square images")
        return lambda: PaperCNN(c, h, num_classes)
    if name == "cnn-extra-fc":
        return lambda: PaperCNN(c, h, num_classes, extra_fc=128)
    if name == "logreg":
        return lambda: LogisticRegression(c * h * w, num_classes, l2=l2)
    if name == "mlp":
        return lambda: SmallMLP(c * h * w, hidden, num_classes, l2=l2)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flatten_params(model: nn.Module) -> torch.Tensor:
    """All parameters concatenated in ``parameters()`` order, as a detached 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_params(model: nn.Module, vector: torch.Tensor) -> nn.Module:
    """Copy ``vector`` into the model's parameters (inverse of :func:`flatten_params`)."""
    vector = vector.reshape(-1)
    expected = num_params(model)
    if vector.numel() != expected:
        raise ValueError(f"vector has {vector.numel()} entries, model has {expected} parameters")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(vector[offset:offset + n].view_as(p).to(p.dtype))
            offset += n
    return model
