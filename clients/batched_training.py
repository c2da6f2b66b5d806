"""Many clients' local training as one batched program (``torch.func.vmap``).

Why: an FL round trains every client from the same global model on its own data; one client
after another leaves a GPU mostly idle (small batches, one kernel launch after another) and, on
a few CPU cores, pays the per-step overhead of a small model K times. Stacking the K clients'
parameters along a new leading dimension and running one step of all of them as one program
(``torch.func.functional_call`` for the model, ``grad`` for its gradient, ``vmap`` over clients)
does the same arithmetic in K times fewer, K times larger operations.

Same math as the one-client loop (``clients.training.local_update``), client by client:

* each client walks its own :func:`clients.training.batch_schedule` (seed (seed, client, round),
  its own batch size and epochs), so its sequence of mini-batches is the sequential one;
* batches are padded to the largest batch of the step with weight 0, and the data loss is the
  weighted mean ``sum(w * ce) / sum(w)``, i.e. the plain mean over the real samples (the padded
  ones contribute nothing to the value or the gradient);
* the L2 term ``0.5 * l2 * ||params||^2`` (``clients.models.regularizer``) and the step
  ``p <- p - lr_j * grad`` use each client's own parameters and learning rate;
* ragged step counts (clients with more data or more epochs take more steps): clients are
  ordered by step count, longest first, so the clients still training are always a prefix of
  the stack; when some finish, their parameters are set aside and the stack is cut to the
  prefix (a view, no copy), so finished clients cost nothing;
* the upload is built by the client's own code: ``LocalClient.finish`` (the backdoor's boost
  is its ``postprocess``), then each attack wrapper's ``forge`` and ``upload``
  (``clients.attacks.AttackedClient``), exactly what their ``train`` would have done.

Only float rounding differs (summation order inside batched kernels), which
``tests/clients/test_batched_training.py`` bounds against the sequential loop.

What is not batched (the sequential loop runs instead, chosen automatically): models with
buffers (batch normalisation's running statistics are state that ``vmap`` would have to thread
through every step) or with dropout (its random masks would differ from the sequential run),
participants that are not a ``LocalClient`` (possibly under attack wrappers) with the stock
``train``, and a group of one client (nothing to batch).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from .attacks import AttackedClient
from .training import (ClientUpdate, LocalClient, batch_schedule, resolve_device, round_seed,
                       steps_for)

__all__ = ["ClientTrainer", "batchable", "train_clients", "MODES", "ProgressFn"]

#: ``auto``: batch what can be batched; ``batched`` insists (tests, benchmarks: an unbatchable
#: group is an error); ``sequential``: the one-client loop for everyone.
MODES = ("auto", "batched", "sequential")

#: ``progress(done, total, info)``: local steps done / to do over the clients of the call,
#: ``info`` says how many clients have finished (the bars of ``bench.progress`` show it).
ProgressFn = Callable[[int, int, str], None]

_UNBATCHABLE = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd,  # noqa: SLF001
                nn.GroupNorm, nn.LocalResponseNorm)


class _UnfoldConv2d(nn.Module):
    """A ``Conv2d`` computed as a matmul over unfolded patches, with the same parameters.

    Why: under ``vmap`` a convolution with per-client weights becomes one grouped convolution
    (K groups), and on the CPU the backward of a grouped convolution with few input channels is
    slow: for the paper CNN's first layer (1 channel, 5x5) one batched step of 8 clients took
    3.9 s with it and 2.1 s with this form (2 shared cores; 6.9 s one client after another).
    As ``weight @ unfold(x)``, ``vmap`` turns it into one batched matmul. Only the template used
    by the batched trainer on the CPU is changed, never a client's model.
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.kernel_size, self.stride = conv.kernel_size, conv.stride
        self.padding, self.dilation = conv.padding, conv.dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _c, h, w = x.shape
        cols = F.unfold(x, self.kernel_size, dilation=self.dilation, padding=self.padding,
                        stride=self.stride)                          # (n, c*kh*kw, L)
        out = self.weight.reshape(self.weight.shape[0], -1) @ cols    # (n, out, L)
        if self.bias is not None:
            out = out + self.bias.reshape(1, -1, 1)
        side = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                zip((h, w), self.padding, self.dilation, self.kernel_size, self.stride)]
        return out.reshape(n, -1, *side)


#: Convolutions whose patches have at most this many values are unfolded on the CPU (the paper
#: CNN's first layer has 25; its second, 800, is faster as a grouped convolution).
_UNFOLD_MAX_PATCH = 64


def _unfold_small_convs(model: nn.Module) -> nn.Module:
    for name, child in list(model.named_children()):
        if (type(child) is nn.Conv2d and child.groups == 1 and child.padding_mode == "zeros"
                and not isinstance(child.padding, str)
                and child.in_channels * child.kernel_size[0] * child.kernel_size[1] <= _UNFOLD_MAX_PATCH):
            setattr(model, name, _UnfoldConv2d(child))
        else:
            _unfold_small_convs(child)
    return model


def batchable(model: nn.Module) -> bool:
    """Whether the batched step computes what the sequential loop does for ``model``."""
    if any(True for _ in model.buffers()):
        return False
    return not any(isinstance(m, _UNBATCHABLE) for m in model.modules())


@dataclass
class _Job:
    """One participant of a call: its trainable core, the wrappers around it, its start."""

    participant: Any
    core: LocalClient | None          # None: not batchable, trained by its own ``train``
    wrappers: list[AttackedClient]    # outermost first
    start: torch.Tensor
    epochs: float                     # what the client will run
    asked: float | None               # what the caller asked for (None: the client's own)


def _unwrap(p: Any) -> tuple[LocalClient | None, list[AttackedClient]]:
    """The LocalClient under ``p``'s attack wrappers, if each layer trains the stock way."""
    wrappers: list[AttackedClient] = []
    inner = p
    while isinstance(inner, AttackedClient):
        if type(inner).train is not AttackedClient.train:
            return None, []
        wrappers.append(inner)
        inner = inner.inner
    if isinstance(inner, LocalClient) and type(inner).train is LocalClient.train:
        return inner, wrappers
    return None, []


def _wrap_up(job: _Job, honest: ClientUpdate, round_idx: int) -> ClientUpdate:
    """Apply the attack wrappers from the innermost out, as their nested ``train`` calls would."""
    up = honest
    for w in reversed(job.wrappers):
        up = w.upload(w.forge(up.update, round_idx))
    return up


class ClientTrainer:
    """Trains a round's clients, batched where possible; keeps their data on the device.

    One trainer serves a whole run (FL, then every unlearning method): it caches, per device
    and set of clients, their data concatenated into one tensor (a batch of all clients is then
    one gather), and one model template per architecture.
    """

    def __init__(self, mode: str = "auto", cache_entries: int = 4,
                 progress: ProgressFn | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        #: progress of every call that names none (the lab points it at its in-round bar)
        self.progress = progress
        self._data: OrderedDict[tuple, tuple[Any, torch.Tensor, torch.Tensor, dict[int, int]]] = OrderedDict()
        self._templates: dict[tuple, nn.Module] = {}
        self._cache_entries = cache_entries

    # ------------------------------------------------------------------ public
    def train(self, participants: Sequence[Any], model_vec: torch.Tensor | Mapping[int, torch.Tensor],
              round_idx: int, epochs: float | Mapping[int, float] | None = None, *,
              progress: ProgressFn | None = None) -> dict[int, ClientUpdate]:
        """``{p.client_id: p.train(start, round_idx, epochs)}``, batched where the math allows.

        ``model_vec``: the model every participant starts from, or one per client id;
        ``epochs``: None (each client's own), one value, or one per client id.
        """
        progress = progress if progress is not None else self.progress
        jobs = []
        for p in participants:
            core, wrappers = _unwrap(p) if self.mode != "sequential" else (None, [])
            start = model_vec[p.client_id] if isinstance(model_vec, Mapping) else model_vec
            asked = epochs.get(p.client_id) if isinstance(epochs, Mapping) else epochs
            e = asked if asked is not None else (core.epochs if core is not None
                                                 else getattr(p, "epochs", 1.0))
            jobs.append(_Job(p, core, wrappers, start, float(e), asked))
        groups: dict[tuple, list[_Job]] = {}
        alone: list[_Job] = []
        for job in jobs:
            if job.core is None:
                if self.mode == "batched":
                    raise ValueError(f"client {job.participant.client_id} cannot be batched "
                                     f"({type(job.participant).__name__})")
                alone.append(job)
            else:
                key = (job.core.model_factory, resolve_device(job.core.device))
                groups.setdefault(key, []).append(job)
        for key, members in list(groups.items()):
            ok = batchable(self._template(key))
            if self.mode == "batched" and not ok:
                raise ValueError("this model cannot be batched (buffers, dropout or "
                                 "normalisation layers); use the sequential loop")
            if not ok or (self.mode == "auto" and len(members) < 2):
                alone.extend(groups.pop(key))

        total = sum(self._steps(j) for j in jobs)
        tracker = _Progress(progress, total, len(jobs))
        out: dict[int, ClientUpdate] = {}
        for key, members in groups.items():
            raw = self._train_group(key, members, round_idx, tracker)
            for job in members:
                out[job.participant.client_id] = _wrap_up(job, job.core.finish(raw[id(job)]), round_idx)
        for job in alone:
            out[job.participant.client_id] = job.participant.train(job.start, round_idx, job.asked)
            tracker.advance(self._steps(job), clients=1)
        return {p.client_id: out[p.client_id] for p in participants}

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _steps(job: _Job) -> int:
        c = job.core if job.core is not None else job.participant
        n = getattr(c, "num_samples", 0)
        bs = getattr(c, "batch_size", None)
        return steps_for(int(n), int(bs), job.epochs) if bs else 1

    def _template(self, key: tuple) -> nn.Module:
        """The architecture whose parameters the batched step swaps in (its own values unused)."""
        if key not in self._templates:
            model = key[0]().to(key[1])
            if key[1].type == "cpu" and batchable(model):
                model = _unfold_small_convs(model)
            self._templates[key] = model
        return self._templates[key]

    def _group_data(self, key: tuple, cores: list[LocalClient]) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
        """All cores' samples in one tensor on the device and each client's row offset."""
        ident = (key[1], tuple(sorted((c.client_id, id(c.x), id(c.y)) for c in cores)))
        hit = self._data.get(ident)
        if hit is None:
            ordered = sorted(cores, key=lambda c: c.client_id)
            offsets, row = {}, 0
            for c in ordered:
                offsets[c.client_id] = row
                row += len(c.y)
            x = torch.cat([c.x for c in ordered]).to(key[1])
            y = torch.cat([c.y for c in ordered]).to(key[1])
            # the cached entry keeps the clients' tensors alive, so their ids stay theirs
            hit = ([(c.x, c.y) for c in ordered], x, y, offsets)
            self._data[ident] = hit
            while len(self._data) > self._cache_entries:
                self._data.popitem(last=False)
        self._data.move_to_end(ident)
        return hit[1], hit[2], hit[3]

    def _train_group(self, key: tuple, jobs: list[_Job], round_idx: int,
                     tracker: _Progress) -> dict[int, torch.Tensor]:
        """Raw updates g = (start - end) / lr of one architecture's clients, keyed by id(job)."""
        dev = key[1]
        model = self._template(key)
        names = [n for n, _ in model.named_parameters()]
        shapes = [p.shape for _, p in model.named_parameters()]
        dtype = next(model.parameters()).dtype
        l2 = float(getattr(model, "l2", 0.0) or 0.0)
        x_all, y_all, offsets = self._group_data(key, [j.core for j in jobs])

        schedules = [batch_schedule(j.core.num_samples, j.core.batch_size, j.epochs,
                                    round_seed(j.core.seed, j.core.client_id, round_idx)) for j in jobs]
        # longest first, so the clients still training are a prefix of the stack
        order = sorted(range(len(jobs)), key=lambda i: (-len(schedules[i]), jobs[i].core.client_id))
        jobs = [jobs[i] for i in order]
        schedules = [schedules[i] for i in order]
        k_all, steps = len(jobs), len(schedules[0])
        width = max((len(idx) for s in schedules for idx in s), default=1)

        # every step's global sample rows and weights, built once on the CPU and moved once
        rows = torch.zeros((steps, k_all, width), dtype=torch.long)
        weight = torch.zeros((steps, k_all, width), dtype=dtype)
        for c, (job, sched) in enumerate(zip(jobs, schedules)):
            off = offsets[job.core.client_id]
            for s, idx in enumerate(sched):
                rows[s, c, :len(idx)] = idx + off
                rows[s, c, len(idx):] = off      # padding: any own sample, weight 0
                weight[s, c, :len(idx)] = 1.0
        rows, weight = rows.to(dev), weight.to(dev)
        lr = torch.tensor([j.core.lr for j in jobs], dtype=dtype, device=dev)
        if bool((lr <= 0).any()):
            raise ValueError("lr must be positive")

        starts = torch.stack([j.start.reshape(-1).to(dev, dtype) for j in jobs])
        params: dict[str, torch.Tensor] = {}
        col = 0
        for n, shape in zip(names, shapes):
            size = shape.numel()
            params[n] = starts[:, col:col + size].reshape(k_all, *shape)
            col += size

        def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor,
                 wb: torch.Tensor) -> torch.Tensor:
            ce = F.cross_entropy(functional_call(model, p, (xb,)), yb, reduction="none")
            value = (ce * wb).sum() / wb.sum()
            if l2 != 0.0:
                value = value + 0.5 * l2 * sum((t * t).sum() for t in p.values())
            return value

        step_all = vmap(grad(loss))
        finals: dict[int, torch.Tensor] = {}
        active = k_all

        def set_aside(lo: int, hi: int) -> None:
            for c in range(lo, hi):
                finals[c] = torch.cat([params[n][c].reshape(-1) for n in names])

        model.train()
        for s in range(steps):
            still = active
            while still > 0 and len(schedules[still - 1]) <= s:
                still -= 1
            if still < active:
                set_aside(still, active)
                tracker.advance(0, clients=active - still)
                params = {n: t[:still] for n, t in params.items()}
                active = still
            r = rows[s, :active]
            grads = step_all(params, x_all[r], y_all[r], weight[s, :active])
            scale = lr[:active]
            params = {n: t - scale.view(-1, *([1] * (t.dim() - 1))) * grads[n]
                      for n, t in params.items()}
            tracker.advance(active, clients=0)
        set_aside(0, active)
        tracker.advance(0, clients=active)

        out = {}
        for c, job in enumerate(jobs):
            end = finals[c].to(job.start.device, job.start.dtype)
            out[id(job)] = (job.start.reshape(-1) - end).reshape(job.start.shape) / job.core.lr
        return out


class _Progress:
    """Feeds ``progress(done, total, info)`` at most every 0.2 s (a batched step can take
    milliseconds; redrawing a bar that often would cost more than the step)."""

    def __init__(self, fn: ProgressFn | None, total: int, clients: int) -> None:
        self.fn, self.total, self.clients = fn, total, clients
        self.done = 0
        self.finished = 0
        self._last = 0.0

    def advance(self, steps: int, clients: int) -> None:
        self.done += steps
        self.finished += clients
        if self.fn is None:
            return
        now = time.monotonic()
        if now - self._last >= 0.2 or self.finished == self.clients:
            self._last = now
            self.fn(min(self.done, self.total), self.total,
                    f"{self.finished}/{self.clients} clients done")


def train_clients(participants: Sequence[Any], model_vec: torch.Tensor | Mapping[int, torch.Tensor],
                  round_idx: int, epochs: float | Mapping[int, float] | None = None, *,
                  mode: str = "auto",
                  progress: ProgressFn | None = None) -> dict[int, ClientUpdate]:
    """One-off :meth:`ClientTrainer.train` (no data cache kept between calls)."""
    return ClientTrainer(mode).train(participants, model_vec, round_idx, epochs, progress=progress)
