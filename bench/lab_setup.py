"""What a lab run is built from: data, clients (targets backdoored), model and evaluator.

Why a module of its own: the plaintext lab (``bench.lab``) and the secure lab's server
processes (``bench.secure_lab``, which rebuild the same clients from the same arguments
because model factories do not pickle) both need it, and neither should import the other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from clients.backdoor import BackdoorClient, default_trigger
from clients.datasets import load_dataset
from clients.metrics import Evaluator
from clients.models import build_model, flatten_params, num_params
from clients.partition import partition
from clients.training import LocalClient
from protocols.starfish.params import StarfishParams
from servers.lab.recovery import METHODS

__all__ = ["CNN_SIDE", "DATASET_DEFAULTS", "LabConfig", "LabSetup", "build_setup", "image_side", "starfish_params"]

#: Per-dataset defaults. MNIST/F-MNIST/CIFAR-10 follow the paper (SGD lr 0.005, batch 64,
#: 5 local epochs). For the 1797-image digits (about 67 training images per client) the
#: paper's lr would leave the model untrained after 40 rounds, so: L2-regularised logistic
#: regression (l2 = 1e-3; strongly convex, the setting of the paper's Theorem 1), lr 0.3,
#: batch 16, 5 local epochs, which converges within about 20 rounds, so a method that
#: replays only ceil(0.6 T) = 24 rounds can reach the retrained accuracy. The target
#: poisons 50% of its samples with the left-edge trigger and boosts its update 5x: one
#: client of twenty with FedAvg weight 1/20 otherwise reaches only ~25-50% BA-ASR in 40
#: rounds, too weak a fingerprint to show that unlearning removed it.
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"model": "logreg", "lr": 0.3, "epochs": 5.0, "batch_size": 16, "l2": 1e-3,
               "poison_fraction": 0.5, "boost": 5.0},
    "mnist": {"model": "cnn", "lr": 0.005, "epochs": 5.0, "batch_size": 64, "l2": 0.0,
              "poison_fraction": 0.5, "boost": 1.0},
    "fmnist": {"model": "cnn-extra-fc", "lr": 0.005, "epochs": 5.0, "batch_size": 64,
               "l2": 0.0, "poison_fraction": 0.5, "boost": 1.0},
    "cifar10": {"model": "cnn", "lr": 0.005, "epochs": 5.0, "batch_size": 64, "l2": 0.0,
                "poison_fraction": 0.5},
}


@dataclass
class LabConfig:
    args: argparse.Namespace

    def get(self, name: str) -> Any:
        value = getattr(self.args, name)
        if value is None:
            return DATASET_DEFAULTS[self.args.dataset].get(name)
        return value


@dataclass
class LabSetup:
    """Everything a lab run is built from; deterministic in ``args`` (seeded)."""

    targets: list[int]
    methods: list[str]
    cfg: "LabConfig"
    factory: Any
    m0: torch.Tensor
    participants: list
    evaluate: Any
    trigger: Any


def build_setup(args: argparse.Namespace, say=lambda _msg: None) -> LabSetup:
    """Data, clients (targets backdoored), model and evaluator, as ``run_lab`` uses them.

    The secure lab rebuilds the same clients inside each server process from ``args``
    (model factories are closures and do not pickle), so this must stay deterministic.
    """
    torch.manual_seed(args.seed)
    cfg = LabConfig(args)
    targets = sorted({int(t) for t in str(args.targets).split(",") if t.strip() != ""})
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not targets or min(targets) < 0 or max(targets) >= args.clients:
        raise ValueError(f"targets must be client ids in 0..{args.clients - 1}")

    data = load_dataset(args.dataset, args.data_dir)
    data = data.subset_train(args.train_limit, args.seed).subset_test(args.test_limit, args.seed)
    data = data.resized(image_side(getattr(args, "image_size", None), cfg.get("model"), data.input_shape))
    parts = partition(args.partition, data.y_train, args.clients, args.seed, q=args.q,
                      concentration=args.concentration, num_classes=data.num_classes)
    factory = build_model(cfg.get("model"), data.input_shape, data.num_classes,
                          l2=cfg.get("l2") or 0.0)
    torch.manual_seed(args.seed)
    m0 = flatten_params(factory())
    say(f"lab: {args.dataset} ({len(data.y_train)} train / {len(data.y_test)} test), "
        f"{cfg.get('model')} with {num_params(factory())} parameters, {args.clients} clients, "
        f"{args.rounds} rounds, targets {targets}")

    trigger = default_trigger(data.input_shape)
    participants: list[LocalClient] = []
    for j, idx in enumerate(parts):
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        client = LocalClient(j, data.x_train[idx_t], data.y_train[idx_t], factory,
                             epochs=cfg.get("epochs"), lr=cfg.get("lr"),
                             batch_size=cfg.get("batch_size"), alpha=args.alpha, seed=args.seed)
        if j in targets and not args.no_backdoor:
            client = BackdoorClient.from_clean(client, trigger, args.target_label,
                                               cfg.get("poison_fraction"), boost=cfg.get("boost"),
                                               seed=args.seed + j)
        participants.append(client)

    tx = torch.cat([participants[t].x if args.no_backdoor else participants[t].clean_x
                    for t in targets])
    ty = torch.cat([participants[t].y if args.no_backdoor else participants[t].clean_y
                    for t in targets])
    evaluate = Evaluator(factory, data.x_test, data.y_test, tx, ty,
                         None if args.no_backdoor else trigger, args.target_label)
    return LabSetup(targets, methods, cfg, factory, m0, participants, evaluate, trigger)


#: The paper CNN's input side (MNIST); smaller images (the 8x8 digits) are enlarged to it.
CNN_SIDE = 28


def image_side(requested: int | None, model: str, input_shape: tuple[int, int, int]) -> int | None:
    """The side the lab's images are resized to, or None to keep them as they are."""
    if requested is not None:
        return requested
    _c, h, _w = input_shape
    if model.startswith("cnn") and h < CNN_SIDE:
        return CNN_SIDE
    return None


def starfish_params(args: argparse.Namespace) -> StarfishParams:
    """The lab's Starfish parameters from its command line (one place for plaintext and 2PC)."""
    return StarfishParams(sigma=args.sigma, alpha=args.alpha, beta=args.beta, buffer=args.buffer,
                          method=args.rs_method)
