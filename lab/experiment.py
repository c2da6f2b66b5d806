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

from clients.attacks import ALIE_JITTER, ALIE_Z, ATTACKS, SCALE, AlieClient, ScalingClient, SignFlipClient
from clients.backdoor import BackdoorClient, default_trigger
from clients.batched_training import MODES as CLIENT_TRAINING_MODES
from clients.batched_training import ClientTrainer
from clients.datasets import load_dataset
from clients.metrics import Evaluator
from clients.models import build_model, flatten_params, num_params
from clients.partition import partition
from clients.training import LocalClient, resolve_device
from protocols.starfish.params import PAPER, StarfishParams
from lab.recovery import METHODS

__all__ = ["ATTACK_NAMES", "CLIENT_TRAINING_MODES", "CNN_SIDE", "DATASET_DEFAULTS", "LabConfig", "MODEL_DEFAULTS", "LabSetup", "attackers_of",
           "build_setup", "image_side", "starfish_params"]

#: ``--attack``: nobody, the targets' backdoor (data poisoning, the lab's default), or an upload
#: attack of ``clients.attacks``.
ATTACK_NAMES = ("none", "backdoor", *ATTACKS)

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


#: Defaults of one model on one dataset, over the dataset's. The paper CNN on the digits
#: (enlarged to 28x28): lr 0.3 makes its first rounds diverge and the paper's 0.005 leaves it
#: untrained after 40 rounds; lr 0.1 reaches 3.6% test error when retrained without the target
#: (measured, docs/lab.md "Deep models").
#: Starfish's selection rate on the MLP: replaying ceil(0.6 T) = 24 rounds leaves it as trained
#: as 24 rounds of retraining (5.3% test error against 4.7% after 40, seed 0); 0.8 closes the gap
#: (the paper's Theorem 1: the bound shrinks as sigma grows). The CNN keeps the paper's 0.6:
#: it is trained by round 24 and more estimated rounds cost it accuracy (4.2% at 0.6, 4.7% at
#: 0.8, retraining 3.6%; docs/lab.md "Deep models"). The MLP on all of Fashion-MNIST the same
#: way: 19.9% test error at 0.6, 18.5% at 0.8, 18.0% at 1.0 and retraining 18.0% (docs/lab.md,
#: "Measured on real data").
MODEL_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("digits", "mlp"): {"sigma": 0.8},
    ("fmnist", "mlp"): {"sigma": 0.8},
    ("digits", "cnn"): {"lr": 0.1, "l2": 0.0},
    ("digits", "cnn-extra-fc"): {"lr": 0.1, "l2": 0.0},
}


#: What no dataset or model changes: the paper's values.
LAB_DEFAULTS: dict[str, Any] = {"sigma": PAPER.sigma}


@dataclass
class LabConfig:
    args: argparse.Namespace

    def get(self, name: str) -> Any:
        """The command line's value, else the (dataset, model) default, else the dataset's."""
        value = getattr(self.args, name)
        if value is not None:
            return value
        dataset = DATASET_DEFAULTS[self.args.dataset]
        if name != "model":
            model = self.args.model or dataset.get("model")
            specific = MODEL_DEFAULTS.get((self.args.dataset, model), {})
            if name in specific:
                return specific[name]
        return dataset.get(name, LAB_DEFAULTS.get(name))


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
    attack: str = "backdoor"
    attackers: tuple[int, ...] = ()
    #: trains a round's clients (batched where the model allows; ``--client-training``)
    trainer: Any = None


def attackers_of(args: argparse.Namespace, targets: list[int]) -> tuple[str, tuple[int, ...]]:
    """(attack, attacking client ids) of a lab run.

    Default (no ``--attackers``): the targets attack, as the lab always did with its backdoor.
    ``--attackers N``: clients 0..N-1 attack whether or not they are targets (the default
    target 0 is then one of them when N >= 1). ``--no-backdoor`` turns the backdoor off.
    """
    attack = getattr(args, "attack", "backdoor") or "backdoor"
    if attack not in ATTACK_NAMES:
        raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACK_NAMES)}")
    if attack == "none" or (attack == "backdoor" and args.no_backdoor):
        return "none", ()
    n = getattr(args, "attackers", None)
    if n is None:
        return attack, tuple(targets)
    if not 0 <= n <= args.clients:
        raise ValueError(f"--attackers must be in 0..{args.clients}, got {n}")
    return (attack, tuple(range(n))) if n > 0 else ("none", ())


def _attacking(client: LocalClient, attack: str, args: argparse.Namespace, cfg: LabConfig,
               trigger: Any):
    """``client`` turned into an attacker of kind ``attack`` (parameters from ``args``)."""
    if attack == "backdoor":
        return BackdoorClient.from_clean(client, trigger, args.target_label,
                                         cfg.get("poison_fraction"), boost=cfg.get("boost"),
                                         seed=args.seed + client.client_id)
    if attack == "sign-flip":
        return SignFlipClient(client)
    if attack == "scaling":
        return ScalingClient(client, scale=getattr(args, "scale", SCALE))
    if attack == "alie":
        return AlieClient(client, z_max=getattr(args, "alie_z", ALIE_Z),
                          jitter=getattr(args, "alie_jitter", ALIE_JITTER), seed=args.seed)
    raise ValueError(f"unknown attack {attack!r}")


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
    attack, attackers = attackers_of(args, targets)
    # --device: where the clients' local SGD runs (auto: CUDA when present); every model vector
    # the lab keeps stays on the CPU. Namespaces built by tests and the secure lab's servers
    # have no --device: the CPU.
    device = str(resolve_device(getattr(args, "device", None) or "cpu"))
    participants: list[LocalClient] = []
    for j, idx in enumerate(parts):
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        client = LocalClient(j, data.x_train[idx_t], data.y_train[idx_t], factory,
                             epochs=cfg.get("epochs"), lr=cfg.get("lr"),
                             batch_size=cfg.get("batch_size"), alpha=args.alpha, seed=args.seed,
                             device=device)
        if j in attackers:
            client = _attacking(client, attack, args, cfg, trigger)
        participants.append(client)

    # BA-ASR and MIA are measured on the targets' own clean samples
    def clean(p: Any, what: str) -> torch.Tensor:
        kept = getattr(p, f"clean_{what}", None)
        return getattr(p, what) if kept is None else kept

    tx = torch.cat([clean(participants[t], "x") for t in targets])
    ty = torch.cat([clean(participants[t], "y") for t in targets])
    evaluate = Evaluator(factory, data.x_test, data.y_test, tx, ty,
                         None if args.no_backdoor else trigger, args.target_label)
    trainer = ClientTrainer(getattr(args, "client_training", None) or "auto")
    return LabSetup(targets, methods, cfg, factory, m0, participants, evaluate, trigger,
                    attack, attackers, trainer)


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
    return StarfishParams(sigma=LabConfig(args).get("sigma"), alpha=args.alpha, beta=args.beta,
                          buffer=args.buffer,
                          method=args.rs_method, guard=getattr(args, "guard", PAPER.guard))
