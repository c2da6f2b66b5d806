"""The history the erasure tests build (tests/servers/test_erasure.py), and its oracle.

Every share is recognisable on disk: an update is a 16-byte random marker tiled into the
int64 array (party 0 sometimes sends the client's 16-byte PRG seed instead, which the
catalog keeps as hex text); a norm or delta is an int64 whose decimal text is in the
catalog (or a seed); a client's |D_j| in the round metadata is a 13-digit number. Each
value's *trace* is the byte string a file holding it must contain. The spec is a pure
function of (seed, party), so a crash-test writer process and the checker agree on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from servers.store.erasure import renormalised
from servers.store.share_store import ClientShares, ShareStore
from tests.helpers.store_helpers import DIM

FORGOTTEN = (7, 8)
JOB = "job-1"
#: round -> participants. Round 3 loses every participant, round 4 none.
ROUNDS = {1: [1, 2, 7], 2: [1, 3, 8], 3: [7, 8], 4: [2, 3]}
T = len(ROUNDS)
#: uploads staged for round T+1 (the adoption supersedes all of them)
STAGED = [1, 7]


def _share(rng: np.random.Generator, party: int, shape: tuple[int, ...]) -> tuple[Any, bytes]:
    """A share and its trace: a seed (party 0, sometimes), a marker array or a scalar."""
    marker = rng.bytes(16)
    if party == 0 and rng.random() < 0.5:
        return marker, marker.hex().encode()
    if shape:
        raw = (marker * (DIM * 8 // 16 + 1))[: DIM * 8]
        return np.frombuffer(raw, dtype="<i8").astype(np.int64), marker
    value = np.int64(int.from_bytes(marker[:8], "little", signed=True))
    return value, str(int(value)).encode()


def spec(seed: int, party: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, party])
    models = np.random.default_rng([seed, 99])  # the public models: the same for both parties
    out: dict[str, Any] = {"m0": models.standard_normal(DIM).astype(np.float32), "rounds": {},
                           "traces": {"forgotten": [], "kept": [], "staged": []}}

    def upload(kind: str) -> ClientShares:
        vals = []
        for shape in ((DIM,), (), ()):
            value, trace = _share(rng, party, shape)
            vals.append(value)
            out["traces"][kind].append(trace)
        return ClientShares(*vals)

    for r, parts in ROUNDS.items():
        raw = np.arange(1, len(parts) + 1, dtype=np.float64)
        sizes = {c: int(10**12 + models.integers(10**11)) for c in parts}
        for c in parts:
            out["traces"]["forgotten" if c in FORGOTTEN else "kept"].append(str(sizes[c]).encode())
        out["rounds"][r] = {
            "parts": parts, "weights": {c: float(w) for c, w in zip(parts, raw / raw.sum())},
            "model": models.standard_normal(DIM).astype(np.float32),
            "meta": {"num_samples": {str(c): sizes[c] for c in parts}, "deadline": 100.0 + r},
            "shares": {c: upload("forgotten" if c in FORGOTTEN else "kept") for c in parts},
        }
    out["staged"] = {c: upload("staged") for c in STAGED}
    out["adopted"] = models.standard_normal(DIM).astype(np.float32)
    return out


def build(root: Path, sp: dict[str, Any], party: int, keep_open: bool = False) -> ShareStore | None:
    """Write the spec's rounds 1..T and staged uploads into a new store; close it, or
    return it open (then the catalog's WAL still holds the frames that wrote them)."""
    store = ShareStore(root, party=party, initial_model=sp["m0"], server_lr=0.25)
    with store if not keep_open else _Keep(store):
        for r, rd in sp["rounds"].items():
            if r % 2:  # odd rounds through staging, even ones appended
                for c in rd["parts"]:
                    store.stage_upload(r, c, *rd["shares"][c].__dict__.values())
                store.commit_round(r, rd["model"], rd["parts"], rd["weights"], rd["meta"])
            else:
                store.append_round(r, rd["model"], rd["parts"], rd["weights"], rd["shares"],
                                   rd["meta"])
        for c, up in sp["staged"].items():
            store.stage_upload(T + 1, c, *up.__dict__.values())
    return store if keep_open else None


class _Keep:
    """A context that leaves the store open (and closes it only if building failed)."""

    def __init__(self, store: ShareStore) -> None:
        self.store = store

    def __enter__(self) -> ShareStore:
        return self.store

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.store.close()


def expected_after(sp: dict[str, Any], r: int) -> tuple[list[int], dict[int, float], dict]:
    """Round r as the erasure must leave it: participants, weights (renormalised where a
    client was erased), metadata."""
    rd = sp["rounds"][r]
    parts = [c for c in rd["parts"] if c not in FORGOTTEN]
    erased = sorted(c for c in rd["parts"] if c in FORGOTTEN)
    meta = {k: v for k, v in rd["meta"].items()}
    if erased:
        meta["num_samples"] = {k: v for k, v in rd["meta"]["num_samples"].items()
                               if int(k) not in FORGOTTEN}
        meta["erased"] = erased
    weights = {c: rd["weights"][c] for c in parts}
    if erased:   # renormalised over the remaining clients (issue 25, 5): no trace of the erased |D_j|
        weights = renormalised(weights, meta["num_samples"])
    return parts, weights, meta


def blob_count_after(sp: dict[str, Any]) -> int:
    """Blob files a fully erased and swept store holds: M_0, M_1..M_T, the adopted model,
    the kept clients' update arrays (a seed has no file)."""
    kept = sum(isinstance(rd["shares"][c].update, np.ndarray)
               for rd in sp["rounds"].values() for c in rd["parts"] if c not in FORGOTTEN)
    return 1 + T + 1 + kept


def scan(root: Path, traces: list[bytes]) -> dict[bytes, list[str]]:
    """Every trace -> the files under ``root`` whose bytes contain it (all bytes read)."""
    found: dict[bytes, list[str]] = {t: [] for t in traces}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            for t in traces:
                if t in data:
                    found[t].append(p.name)
    return found
