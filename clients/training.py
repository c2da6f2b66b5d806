"""Local training of one FL client and its assistive information.

Update convention (docs/design.md 3): the server forms M_i = M_{i-1} - eta * sum_j w_j g_i^j with
FedAvg weights w_j = |D_j| / |D|. A client trains E epochs of plain SGD (no momentum) with
learning rate ``lr`` starting from M_{i-1} and reports

    g = (M_{i-1} - M_local) / lr,

i.e. the sum of the mini-batch gradients along its local trajectory. With the server step
eta equal to ``lr`` this makes M_i exactly the FedAvg average of the local models, and g
has gradient units, which is what FedRecover's L-BFGS pairs (y = g_bar - g) assume.

Assistive information (computed in the clear by the client, Starfish Alg. 4 line 5):
``norm`` = ||g||_2 and ``delta``, the tolerance threshold of :func:`tolerance_threshold`.

Randomness: the mini-batch order of client j in round i comes from a generator seeded by
(seed, j, i) only. Removing a client therefore never changes another client's batches,
which is what makes "retrain from scratch" reproduce "FL without the target" bit for bit,
and a client asked to recompute its round-i update on another model uses the same batches.
:func:`batch_schedule` is that order, written once: the one-client loop here and the batched
training of many clients (``clients.batched_training``) both walk it.

Device: a client trains on ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``: CUDA when present;
:func:`resolve_device`). Only the local SGD runs there: the model vector it starts from and the
update it returns stay where the caller keeps them (the CPU), so whatever consumes the upload
(sharing for 2PC, the lab's aggregation) never sees a device tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from common.starfish_params import PAPER

from .models import flatten_params, load_params, regularizer

__all__ = ["ClientUpdate", "LocalClient", "tolerance_threshold", "local_update", "round_seed",
           "batch_schedule", "steps_for", "resolve_device", "DEVICES"]

#: What ``--device`` accepts.
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ClientUpdate:
    """What a client uploads for one round (shared in the 2PC system, plain here)."""

    update: torch.Tensor
    norm: float
    delta: float
    num_samples: int


def tolerance_threshold(g: torch.Tensor, alpha: float) -> float:
    """delta such that a fraction ``alpha`` of the coordinates of |g| exceed it.

    Quantile convention: with m coordinates and k = floor(alpha * m), delta is the
    (k+1)-th largest |g_i| (1-based), so exactly k coordinates are strictly larger when
    the values are distinct (ties can only make that count smaller). alpha = 0 gives
    delta = max |g|; k >= m (alpha = 1) gives delta = 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError("alpha must be in [0, 1]")
    a = g.detach().reshape(-1).abs()
    m = a.numel()
    k = math.floor(alpha * m)
    if m == 0 or k >= m:
        return 0.0
    # (k+1)-th largest == (m-k)-th smallest
    return float(torch.kthvalue(a, m - k).values)


def round_seed(seed: int, client_id: int, round_idx: int) -> int:
    """Deterministic per-(client, round) seed; independent of who else participates."""
    return (seed * 1_000_003 + client_id * 10_007 + round_idx * 101 + 17) % (2**63 - 1)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (or None): CUDA when torch sees a GPU, else the CPU; ``cuda`` without one is an
    error rather than a silent fall-back, so a requested GPU run never quietly runs on the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    return dev


def steps_for(n: int, batch_size: int, epochs: float) -> int:
    """Mini-batch steps of ``epochs`` local epochs over ``n`` samples (fractional epochs stop
    after that fraction of the last epoch's batches; at least one step when epochs > 0)."""
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    return max(1, round(epochs * steps_per_epoch)) if epochs > 0 else 0


def batch_schedule(n: int, batch_size: int, epochs: float, seed: int) -> list[torch.Tensor]:
    """The sample indices of every local step, in order: one seeded permutation per epoch,
    cut into batches of ``batch_size`` (the last batch of an epoch may be smaller)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    total = steps_for(n, batch_size, epochs)
    out: list[torch.Tensor] = []
    while len(out) < total:
        perm = torch.randperm(n, generator=gen)
        for b in range(min(steps_per_epoch, total - len(out))):
            out.append(perm[b * batch_size:(b + 1) * batch_size])
    return out


def local_update(model: nn.Module, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 epochs: float, lr: float, batch_size: int, seed: int) -> torch.Tensor:
    """Run local SGD from ``start`` and return g = (start - end) / lr.

    ``epochs`` may be fractional (FedEraser's calibration uses half the epochs): the last
    epoch then stops after that fraction of its batches. The SGD runs on the model's device
    (``x``, ``y`` are moved there if needed); g comes back on ``start``'s device and dtype.
    """
    if lr <= 0:
        raise ValueError("lr must be positive")
    load_params(model, start)
    model.train()
    params = list(model.parameters())
    dev = params[0].device if params else torch.device("cpu")
    x, y = x.to(dev), y.to(dev)
    for idx in batch_schedule(len(y), batch_size, epochs, seed):
        idx = idx.to(dev)
        loss = F.cross_entropy(model(x[idx]), y[idx]) + regularizer(model)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, gp in zip(params, grads):
                p.sub_(lr * gp)
    return (start - flatten_params(model).to(start.device, start.dtype)) / lr


@dataclass
class LocalClient:
    """A simulated FL client holding its data; satisfies ``lab.fl.Participant``.

    ``train`` is called by the FL coordinator in Stage I and again by unlearning methods
    that ask remaining clients for exact updates (warm-up, correction, calibration).
    """

    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    model_factory: Callable[[], nn.Module]
    epochs: float = 5
    lr: float = 0.005
    batch_size: int = 64
    alpha: float = PAPER.alpha       # Stage I's tolerance rate (the paper's)
    seed: int = 0
    device: str = "cpu"
    _model: nn.Module | None = field(default=None, repr=False)
    _on_device: tuple[torch.device, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_samples(self) -> int:
        return int(len(self.y))

    def data_on(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``y`` on ``dev``, copied there once (a GPU run would otherwise move the
        client's whole data set every round)."""
        if dev.type == "cpu":
            return self.x, self.y
        cached = self._on_device
        if cached is None or cached[0] != dev:
            cached = self._on_device = (dev, self.x.to(dev), self.y.to(dev))
        return cached[1], cached[2]

    def train(self, model_vec: torch.Tensor, round_idx: int,
              epochs: float | None = None) -> ClientUpdate:
        """Exact local update on ``model_vec`` with this round's batch order."""
        dev = resolve_device(self.device)
        if self._model is None or next(self._model.parameters()).device != dev:
            self._model = self.model_factory().to(dev)
        x, y = self.data_on(dev)
        g = local_update(self._model, model_vec, x, y,
                         self.epochs if epochs is None else epochs, self.lr,
                         self.batch_size, round_seed(self.seed, self.client_id, round_idx))
        return self.finish(g)

    def finish(self, g: torch.Tensor) -> ClientUpdate:
        """The upload for raw local update ``g`` (after :meth:`postprocess`); shared by
        :meth:`train` and the batched trainer so both upload the same thing."""
        g = self.postprocess(g)
        return ClientUpdate(g, float(g.norm()), tolerance_threshold(g, self.alpha),
                            self.num_samples)

    def postprocess(self, g: torch.Tensor) -> torch.Tensor:
        """Hook for attack clients (e.g. update boosting); honest clients return g."""
        return g
