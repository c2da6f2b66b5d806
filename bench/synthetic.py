"""A synthetic FL history of the paper's shapes, generated on demand, for the 2PC cost benchmarks.

Why synthetic: the 2PC cost of Stage II depends on shapes (model size m, clients n, rounds T,
sigma, beta, B), not on the values, and the MNIST files are not on this machine. Why on demand:
20 clients x 40 rounds x 582,026 float64 updates are 3.7 GB, too much to hold per server
process. So each update g_i^j is regenerated from a public seed whenever it is read, and only
the public global models (41 x 582,026 float32 = 93 MB) stay in memory.

Values (realistic scale, not real training):

* g_i^j = update_scale * (0.5 c_i + z_i^j), c_i and z_i^j standard normal vectors from a seeded
  generator keyed by (seed, round) and (seed, round, client): clients of one round share a
  common direction, so the cosines of round selection are not all zero;
* ||g_i^j|| and delta_i^j (the value a fraction alpha of |g_i^j| exceeds, the convention of
  ``clients.training.tolerance_threshold``) computed from it;
* M_0 = the paper CNN's initialisation (``clients.models``) for the MNIST configuration, else
  N(0, 0.05); M_i = M_{i-1} - server_lr * sum_j w_j g_i^j with FedAvg weights from synthetic
  dataset sizes, or, with ``aggregator`` "brace-sign" / "fedseca", M_i = M_{i-1} - server_lr *
  (the rule's step over round i's updates) (``rule_of``: the rule the replay is then told made
  each round), so that a robust replay meets a history its rule made;
* exact updates asked for by Stage II (warm-up and corrections) are synthetic too:
  gbar = g_t^j + curvature * (M_hat - M_{t-1}) + N(0, noise_scale^2), i.e. a quadratic loss,
  so the L-BFGS pairs are consistent and the 4 x 4 matrices W are well conditioned.

Shares. A server's history returns *its own share*, derived on the fly: party 0's share is
AES-CTR output (``common.prg``) keyed per (kind, round, client), party 1's is encode(value) minus
that. Both keys and the value generator are public here, so either process could rebuild the
other's share and the values: this is a cost benchmark, not a privacy setting (real servers
get shares from clients, ``servers/store/share_store.py``). Party 0 never computes a value at all.

The norms, thresholds and models of a configuration are computed once (one pass over all
n x T updates) and cached in an ``.npz`` file keyed by the configuration.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from clients.models import build_model, flatten_params
from common.encoding import encode
from common.prg import Prg
from common.robust_rules import brace_step_scale
from protocols.starfish.params import PAPER
from protocols.starfish.ports import History, Secret
from protocols.starfish.robust_replay import RoundRule, RuleCombine

__all__ = ["SyntheticConfig", "CONFIGS", "config", "prepare", "load_data", "SyntheticHistory",
           "SyntheticClients", "update_values"]

_KINDS = {"update": 1, "norm": 2, "delta": 3, "exact": 4}
#: bump when ``update_values`` changes: cached histories (models, norms, thresholds) were made
#: from the updates and must not be mixed with another generator's
GENERATOR_VERSION = 2


@dataclass(frozen=True)
class SyntheticConfig:
    name: str
    num_params: int
    clients: int = 20
    rounds: int = 40
    sigma: float = PAPER.sigma
    alpha: float = PAPER.alpha
    beta: float = PAPER.beta
    buffer: int = PAPER.buffer
    targets: tuple[int, ...] = (0,)
    update_scale: float = 1e-3
    server_lr: float = 1.0
    curvature: float = 1.0
    noise_scale: float = 1e-5
    seed: int = 0
    model: str | None = None          # "cnn": M_0 is the paper CNN's initialisation
    aggregator: str = "fedavg"        # the rule that made every round's model (``rule_of``)
    input_shape: tuple[int, int, int] = (1, 28, 28)
    classes: int = 10
    note: str = field(default="", compare=False)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SyntheticConfig":
        d = dict(d)
        d["targets"] = tuple(d.get("targets", (0,)))
        d["input_shape"] = tuple(d.get("input_shape", (1, 28, 28)))
        return cls(**d)

    def key(self) -> str:
        """Hash of everything that changes the generated values (the generator's version too)."""
        d = self.to_json()
        d.pop("note", None)
        if d["aggregator"] == "fedavg":      # FedAvg histories keep the keys they had before the field
            d.pop("aggregator")
        d["generator"] = GENERATOR_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def remaining(self) -> list[int]:
        return [j for j in range(self.clients) if j not in self.targets]

    def with_(self, **kw: Any) -> "SyntheticConfig":
        return replace(self, **kw)


CONFIGS: dict[str, SyntheticConfig] = {
    # The paper's MNIST setting (Sec. VI-A): 582,026-parameter CNN, 20 clients, 40 rounds.
    "mnist": SyntheticConfig("mnist", 582_026, model="cnn",
                             note="paper MNIST shapes: CNN 582,026 parameters, 20 clients, 40 rounds"),
    # Past one machine per server (issue 30): 8.6 times MNIST's coordinates; half its rounds, as
    # each round's working set, not their number, sets the peak memory; M_0 drawn (no model).
    "5m": SyntheticConfig("5m", 5_000_000, rounds=20,
                          note="5m: 5,000,000 parameters, 20 clients, 20 rounds (the scale-out run)"),
    # Minutes-scale smoke configuration with the same schedule logic.
    "small": SyntheticConfig("small", 10_000, clients=6, rounds=10,
                             note="small: 10,000 parameters, 6 clients, 10 rounds"),
    # Seconds-scale configuration for tests.
    "tiny": SyntheticConfig("tiny", 256, clients=3, rounds=10, update_scale=0.05,
                            note="tiny: 256 parameters, 3 clients, 10 rounds, updates N(0, 0.05^2)"),
}


def rule_of(aggregator: str) -> Callable[[int], RoundRule]:
    """Which rule made round t of a history made by ``aggregator`` in every round: BRACE's step
    of FL round t, FedSECA's momentum restarting at round 1."""
    if aggregator == "brace-sign":
        return lambda t: RoundRule("brace-sign", step=brace_step_scale(t))
    if aggregator == "fedseca":
        return lambda t: RoundRule("fedseca", restart=t == 1)
    raise ValueError(f"no rule for aggregator {aggregator!r}")


def config(name: str, **overrides: Any) -> SyntheticConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")
    return CONFIGS[name].with_(**overrides) if overrides else CONFIGS[name]


# ----------------------------------------------------------------------------- values
def update_values(cfg: SyntheticConfig, i: int, j: int, count: int | None = None) -> np.ndarray:
    """g_i^j (float64), or its first ``count`` coordinates (the same values: sequential draws)."""
    n = cfg.num_params if count is None else min(count, cfg.num_params)
    common = np.random.default_rng([cfg.seed, 2, i]).standard_normal(n)
    own = np.random.default_rng([cfg.seed, 1, i, j]).standard_normal(n)
    # how much client j follows the round's common direction varies by round (0.125 .. 0.875), so
    # the target's cosine with the aggregate differs from round to round by far more than the
    # fixed-point grid (with one weight for all, every round scored 0.485 +- 0.003: near-ties)
    weight = 0.125 + 0.75 * np.random.default_rng([cfg.seed, 4, i, j]).random()
    return cfg.update_scale * (weight * common + own)


def tolerance_delta(g: np.ndarray, alpha: float) -> float:
    """The (k+1)-th largest |g|, k = floor(alpha m): as clients.training.tolerance_threshold."""
    a = np.abs(g)
    m = a.size
    k = math.floor(alpha * m)
    if m == 0 or k >= m:
        return 0.0
    pos = m - k - 1                      # (m-k)-th smallest, 0-based
    return float(np.partition(a, pos)[pos])


def _initial_model(cfg: SyntheticConfig) -> np.ndarray:
    if cfg.model is not None:
        torch.manual_seed(cfg.seed)
        m0 = flatten_params(build_model(cfg.model, cfg.input_shape, cfg.classes)()).double().numpy()
        if m0.size != cfg.num_params:
            raise ValueError(f"model {cfg.model} has {m0.size} parameters, config says {cfg.num_params}")
        return m0
    return np.random.default_rng([cfg.seed, 5]).standard_normal(cfg.num_params) * 0.05


def weights(cfg: SyntheticConfig) -> np.ndarray:
    sizes = np.random.default_rng([cfg.seed, 6]).integers(2000, 4000, size=cfg.clients).astype(np.float64)
    return sizes / sizes.sum()


def prepare(cfg: SyntheticConfig, cache_dir: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """Models, norms and thresholds of ``cfg`` in ``cache_dir/synthetic-<key>.npz`` (made once)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"synthetic-{cfg.name}-{cfg.key()}.npz"
    if path.exists():
        return path
    w = weights(cfg)
    model = _initial_model(cfg)
    models = np.empty((cfg.rounds + 1, cfg.num_params), dtype=np.float32)
    models[0] = model
    norms = np.empty((cfg.rounds, cfg.clients))
    deltas = np.empty((cfg.rounds, cfg.clients))
    combine = None if cfg.aggregator == "fedavg" else RuleCombine(rule_of(cfg.aggregator))
    for i in range(1, cfg.rounds + 1):
        agg = np.zeros(cfg.num_params)
        rows = []
        for j in range(cfg.clients):
            g = update_values(cfg, i, j)
            norms[i - 1, j] = float(np.linalg.norm(g))
            deltas[i - 1, j] = tolerance_delta(g, cfg.alpha)
            if combine is None:
                agg += w[j] * g
            else:
                rows.append(torch.from_numpy(g))
        if combine is not None:   # the rule's step, as the replay's twin computes it
            agg = combine(rows, list(w), list(range(cfg.clients)), i).numpy()
        model = model - cfg.server_lr * agg
        models[i] = model
        if progress is not None:
            progress(f"synthetic history: round {i}/{cfg.rounds}")
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, models=models, norms=norms, deltas=deltas, weights=w,
             config=np.frombuffer(json.dumps(cfg.to_json()).encode(), dtype=np.uint8))
    tmp.replace(path)
    return path


def load_data(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in ("models", "norms", "deltas", "weights")}


# ----------------------------------------------------------------------------- shares
def _key(cfg: SyntheticConfig, kind: str) -> bytes:
    return hashlib.sha256(f"starfish-bench/{cfg.seed}/{kind}".encode()).digest()[:16]


def _stream(kind: str, i: int, j: int, extra: int = 0) -> int:
    return (_KINDS[kind] << 56) | (extra << 40) | (i << 20) | j


def _share_of(cfg: SyntheticConfig, rank: int, kind: str, i: int, j: int, shape: tuple,
              value: Callable[[], np.ndarray], extra: int = 0) -> np.ndarray:
    """This party's additive share of encode(value()): PRG for party 0, the difference for 1."""
    share0 = Prg(_key(cfg, kind), _stream(kind, i, j, extra)).ring(shape)
    if rank == 0:
        return share0
    ring = np.asarray(encode(np.asarray(value(), dtype=np.float64)), dtype=np.int64)
    return np.asarray(ring - share0, dtype=np.int64).reshape(shape)   # wraps mod 2^64


class SyntheticHistory(History):
    """The history as one server sees it (``rank`` 0/1: its shares, wrapped by ``wrap``),
    or in the clear (``rank=None``: float64 tensors, for plaintext checks)."""

    def __init__(self, cfg: SyntheticConfig, data: Mapping[str, np.ndarray], rank: int | None = None,
                 wrap: Callable[[np.ndarray], Any] | None = None) -> None:
        self.cfg = cfg
        self._models = data["models"]
        self._norms = data["norms"]
        self._deltas = data["deltas"]
        self._w = {j: float(x) for j, x in enumerate(data["weights"])}
        self.rank = rank
        self._wrap = wrap or (lambda s: s)
        self.reads = 0

    @property
    def num_rounds(self) -> int:
        return self.cfg.rounds

    @property
    def server_lr(self) -> float:
        return self.cfg.server_lr

    def model(self, i: int) -> torch.Tensor:
        if not 0 <= i <= self.cfg.rounds:
            raise IndexError(f"model {i} not in 0..{self.cfg.rounds}")
        return torch.from_numpy(self._models[i])

    def participants(self, i: int) -> tuple[int, ...]:
        return tuple(range(self.cfg.clients))

    def weights(self, i: int) -> Mapping[int, float]:
        return self._w

    def _secret(self, kind: str, i: int, j: int, shape: tuple, value: Callable[[], np.ndarray]) -> Secret:
        self.reads += 1
        if self.rank is None:
            return torch.as_tensor(np.asarray(value(), dtype=np.float64))
        return self._wrap(_share_of(self.cfg, self.rank, kind, i, j, shape, value))

    def update(self, i: int, client: int) -> Secret:
        return self._secret("update", i, client, (self.cfg.num_params,),
                            lambda: update_values(self.cfg, i, client))

    def update_prefix(self, i: int, client: int, count: int) -> Secret:
        """The first ``count`` coordinates of g_i^j (a sample for the FedRecover threshold)."""
        count = min(count, self.cfg.num_params)
        return self._secret("update", i, client, (count,), lambda: update_values(self.cfg, i, client, count))

    def norm(self, i: int, client: int) -> Secret:
        return self._secret("norm", i, client, (), lambda: self._norms[i - 1, client])

    def delta(self, i: int, client: int) -> Secret:
        return self._secret("delta", i, client, (), lambda: self._deltas[i - 1, client])

    def append_round(self, record) -> None:  # noqa: ANN001 - read-only history
        raise NotImplementedError("the synthetic history is generated, not appended to")


class SyntheticClients:
    """Stage II's remaining clients: synthetic exact updates, handed over as this party's share.

    gbar = g_t^j + curvature * (model - M_{t-1}) + noise; the k-th request for (t, j) gets its
    own PRG stream, identical in both server processes (they call in lockstep).
    """

    def __init__(self, history: SyntheticHistory) -> None:
        self.h = history
        self.cfg = history.cfg
        self._count: dict[tuple[int, int], int] = {}
        self.computations: dict[int, int] = {}

    def _value(self, t: int, j: int, model: torch.Tensor, k: int) -> np.ndarray:
        cfg = self.cfg
        s = model.double().numpy() - self.h._models[t - 1].astype(np.float64)
        noise = np.random.default_rng([cfg.seed, 3, t, j, k]).standard_normal(cfg.num_params)
        return update_values(cfg, t, j) + cfg.curvature * s + cfg.noise_scale * noise

    def exact_updates(self, round_index: int, model: torch.Tensor, client_ids: list[int]) -> dict[int, Secret]:
        out = {}
        for j in client_ids:
            k = self._count.get((round_index, j), 0)
            self._count[(round_index, j)] = k + 1
            self.computations[j] = self.computations.get(j, 0) + 1
            value = lambda t=round_index, j=j, k=k: self._value(t, j, model, k)  # noqa: E731
            if self.h.rank is None:
                out[j] = torch.as_tensor(value())
            else:
                out[j] = self.h._wrap(_share_of(self.cfg, self.h.rank, "exact", round_index, j,
                                                (self.cfg.num_params,), value, extra=k))
        return out
