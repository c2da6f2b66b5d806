"""M_0: the initial global model both servers publish, drawn from the config's seed.

Why from a seed: the two servers must start from the same M_0 without exchanging it, and
a restarted server must find the M_0 its history store was created with (the store
refuses to open with a different one). The architecture comes from the model zoo
(``clients.models``); the dataset only fixes the input shape, so no data is loaded. It lives
with the clients because the model zoo does: ``starfish server`` draws M_0 here and hands it
to the daemon, so server code never imports client code.
"""

from __future__ import annotations

import numpy as np
import torch

from common.service_config import ConfigError, ModelSection

from .models import build_model, default_model_name, flatten_params

__all__ = ["INPUT_SHAPES", "initial_model", "architecture_of", "model_layout"]

INPUT_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "fmnist": (1, 28, 28),
                "cifar10": (3, 32, 32)}


def architecture_of(section: ModelSection) -> str:
    return section.architecture or default_model_name(section.dataset)


def initial_model(section: ModelSection) -> np.ndarray:
    """Flattened parameters of a fresh model (torch seeded with ``section.seed``), float64."""
    if section.dataset not in INPUT_SHAPES:
        raise ConfigError(f"[model] dataset must be one of {sorted(INPUT_SHAPES)}")
    factory = build_model(architecture_of(section), INPUT_SHAPES[section.dataset], 10,
                          l2=section.l2)
    torch.manual_seed(section.seed)
    return flatten_params(factory()).to(torch.float64).numpy().copy()


def model_layout(section: ModelSection) -> dict:
    """The model as a client must know it to train: architecture, input shape, classes and
    the parameter layout of the flat vector (name and shape of each tensor, in order; each
    flattened in C order). The servers publish it in ``state`` (docs/protocol.md)."""
    arch = architecture_of(section)
    model = build_model(arch, INPUT_SHAPES[section.dataset], 10, l2=section.l2)()
    return {"dataset": section.dataset, "architecture": arch,
            "input_shape": list(INPUT_SHAPES[section.dataset]), "classes": 10, "l2": section.l2,
            "layout": [{"name": n, "shape": list(p.shape)} for n, p in model.named_parameters()]}
