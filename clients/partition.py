"""Splitting a training set among FL clients: IID, Dirichlet non-IID, label-bias.

Why three: unlearning quality depends on how different the target is from the remaining
clients. IID is the easy case; Dirichlet(concentration) is the common non-IID benchmark;
the label-bias split of FLTrust (Cao et al., NDSS 2021) and Fang et al. (USENIX Sec 2020)
is what FedRecover and Starfish evaluate with.

All functions take labels and a seed and return one sorted int64 index array per client.
"""

from __future__ import annotations

import numpy as np

__all__ = ["iid_split", "dirichlet_split", "label_bias_split", "partition"]


def _as_labels(labels) -> np.ndarray:
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def iid_split(labels, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle and deal out the samples in near-equal shares."""
    y = _as_labels(labels)
    if num_clients < 1 or num_clients > len(y):
        raise ValueError(f"need 1 <= num_clients <= {len(y)}, got {num_clients}")
    perm = np.random.default_rng(seed).permutation(len(y))
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def dirichlet_split(labels, num_clients: int, concentration: float = 0.5, seed: int = 0,
                    min_size: int = 1) -> list[np.ndarray]:
    """Per class, draw client proportions from Dirichlet(concentration) and split.

    Small ``concentration`` gives very skewed clients. Draws are repeated (same seed
    stream) until every client has at least ``min_size`` samples, so no client is empty.
    """
    y = _as_labels(labels)
    if concentration <= 0:
        raise ValueError("concentration must be positive")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    for _attempt in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(y == c))
            props = rng.dirichlet(np.full(num_clients, concentration))
            cuts = (np.cumsum(props)[:-1] * len(members)).astype(int)
            for j, chunk in enumerate(np.split(members, cuts)):
                parts[j].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError("could not give every client min_size samples; raise concentration")


def label_bias_split(labels, num_clients: int, q: float = 0.5, num_classes: int | None = None,
                     seed: int = 0) -> list[np.ndarray]:
    """The FLTrust/Fang et al. label-bias split with bias probability ``q``.

    Clients are divided evenly into G = min(num_classes, num_clients) groups. A sample with
    label l goes to group (l mod G) with probability q and to each other group with
    probability (1 - q)/(G - 1); inside the chosen group the client is uniform. q = 1/G is
    IID; larger q is more non-IID.
    """
    y = _as_labels(labels)
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    n_cls = int(num_classes if num_classes is not None else y.max() + 1)
    groups_n = min(n_cls, num_clients)
    if groups_n < 2:
        return iid_split(y, num_clients, seed)
    rng = np.random.default_rng(seed)
    groups = np.array_split(np.arange(num_clients), groups_n)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for idx, label in enumerate(y):
        home = int(label) % groups_n
        if rng.random() < q:
            g = home
        else:
            g = int(rng.integers(groups_n - 1))
            g = g + 1 if g >= home else g
        members = groups[g]
        parts[int(members[rng.integers(len(members))])].append(idx)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def partition(kind: str, labels, num_clients: int, seed: int = 0, *,
              q: float = 0.5, concentration: float = 0.5,
              num_classes: int | None = None) -> list[np.ndarray]:
    """Dispatch by name: ``iid``, ``dirichlet`` or ``label-bias``."""
    if kind == "iid":
        return iid_split(labels, num_clients, seed)
    if kind == "dirichlet":
        return dirichlet_split(labels, num_clients, concentration, seed)
    if kind in ("label-bias", "label_bias"):
        return label_bias_split(labels, num_clients, q, num_classes, seed)
    raise ValueError(f"unknown partition {kind!r}; choose iid, dirichlet or label-bias")
