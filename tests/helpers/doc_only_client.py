"""A Starfish client written from docs/protocol.md alone.

Why it exists: it proves the document is enough to build a client. It imports nothing of this
project, only the standard library (``ssl``, ``socket``, ``struct``, ``hashlib``), ``msgpack``
and ``numpy``; AES-128 (for seed shares) is implemented below in pure Python, since the
standard library has none. Section numbers refer to docs/protocol.md.

Training is a stand-in for a real client's: multinomial logistic regression (the ``logreg``
layout of ``state.model``) on a small synthetic data set of its own, full of deterministic
choices so that a correction task (section 5) reproduces a round's update exactly.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# ------------------------------------------------------------------ section 1: frames, hello
HEADER = struct.Struct("<BQ")
KIND_OBJECT = 2
KIND_HELLO = 3
HELLO = b"starfish/1"


class Refused(Exception):
    """An ``ok: false`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Connection:
    """One TLS 1.3 connection to one server's client API."""

    def __init__(self, address: tuple[str, int], server_name: str, cert: Path, key: Path, ca: Path,
                 timeout: float = 60.0) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        raw = socket.create_connection(address, timeout=timeout)
        self.sock = ctx.wrap_socket(raw, server_hostname=server_name)
        self._send(KIND_HELLO, HELLO)
        kind, payload = self._recv()
        if kind != KIND_HELLO or payload != HELLO:
            raise ConnectionError(f"{server_name} sent no hello")

    def _send(self, kind: int, payload: bytes) -> None:
        self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return bytes(buf)

    def _recv(self) -> tuple[int, bytes]:
        kind, length = HEADER.unpack(self._exact(HEADER.size))
        return kind, self._exact(length)

    # -------------------------------------------------------------- section 2: messages
    def request(self, op: str, **fields: Any) -> dict:
        msg_id = os.urandom(16)
        self._send(KIND_OBJECT, msgpack.packb({"v": 1, "op": op, "id": msg_id, **fields}, use_bin_type=True))
        kind, payload = self._recv()
        reply = msgpack.unpackb(payload, raw=False)
        if kind != KIND_OBJECT or reply.get("id") not in (msg_id, None):
            raise ConnectionError("reply does not answer the request")
        if reply.get("ok") is not True:
            raise Refused(reply["error"]["code"], reply["error"]["message"])
        return reply

    def close(self) -> None:
        self.sock.close()


def tensor(arr: np.ndarray) -> dict:
    # np.asarray, not np.ascontiguousarray: the latter turns a scalar (shape []) into shape [1];
    # tobytes() writes C order either way
    a = np.asarray(arr)
    return {"dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape),
            "data": a.astype(a.dtype.newbyteorder("<")).tobytes()}


def from_tensor(t: dict) -> np.ndarray:
    return np.frombuffer(t["data"], dtype=t["dtype"]).reshape(t["shape"]).astype(np.float64)


# ------------------------------------------------------------------ section 4: AES-128, the PRG
def _xtime(a: int) -> int:
    a <<= 1
    return (a ^ 0x11B) if a & 0x100 else a


def _sbox() -> list[int]:
    # the inverse in GF(2^8) (by exponentiation: a^254), then the affine map
    def mul(a: int, b: int) -> int:
        r = 0
        while b:
            if b & 1:
                r ^= a
            a, b = _xtime(a), b >> 1
        return r

    box = []
    for x in range(256):
        inv, p, e = 1, x, 254
        while e:
            if e & 1:
                inv = mul(inv, p)
            p, e = mul(p, p), e >> 1
        inv = inv if x else 0
        y = inv
        for s in (1, 2, 3, 4):
            y ^= ((inv << s) | (inv >> (8 - s))) & 0xFF
        box.append(y ^ 0x63)
    return box


SBOX = _sbox()


def _expand_key(key: bytes) -> list[list[int]]:
    words = [list(key[i:i + 4]) for i in range(0, 16, 4)]
    rcon = 1
    for i in range(4, 44):
        w = list(words[i - 1])
        if i % 4 == 0:
            w = [SBOX[b] for b in w[1:] + w[:1]]
            w[0] ^= rcon
            rcon = _xtime(rcon) & 0xFF
        words.append([a ^ b for a, b in zip(words[i - 4], w)])
    return [sum(words[4 * r:4 * r + 4], []) for r in range(11)]


def aes128_encrypt(round_keys: list[list[int]], block: bytes) -> bytes:
    s = [b ^ k for b, k in zip(block, round_keys[0])]          # column-major state, as FIPS-197
    for rnd in range(1, 11):
        s = [SBOX[b] for b in s]
        s = [s[(i + 4 * (i % 4)) % 16] for i in range(16)]      # ShiftRows
        if rnd != 10:
            out = []
            for c in range(4):                                    # MixColumns
                a = s[4 * c:4 * c + 4]
                t = a[0] ^ a[1] ^ a[2] ^ a[3]
                out += [a[i] ^ t ^ (_xtime(a[i] ^ a[(i + 1) % 4]) & 0xFF) for i in range(4)]
            s = out
        s = [b ^ k for b, k in zip(s, round_keys[rnd])]
    return bytes(s)


def prg(seed: bytes, n: int) -> np.ndarray:
    """PRG(s, n): AES-128-CTR, blocks 8 zero bytes || i big-endian, elements little-endian int64."""
    keys = _expand_key(seed)
    stream = b"".join(aes128_encrypt(keys, bytes(8) + i.to_bytes(8, "big")) for i in range((8 * n + 15) // 16))
    return np.frombuffer(stream[:8 * n], dtype="<i8").astype(np.int64)


# ------------------------------------------------------------------ section 4: encoding, shares
def encode(x: np.ndarray, f: int) -> np.ndarray:
    return (np.asarray(x, dtype=np.float64) * float(1 << f)).astype(np.int64)   # toward zero


def split(x: np.ndarray, f: int, seed_form: bool) -> tuple[dict, dict]:
    """(the field for server 0, the field for server 1) of one value."""
    v = encode(x, f)
    n = v.size
    if seed_form:
        s = os.urandom(16)
        r = prg(s, n).reshape(v.shape)
        first: dict = {"seed": s}
    else:
        r = np.frombuffer(os.urandom(8 * n), dtype="<i8").reshape(v.shape).astype(np.int64)
        first = tensor(r)
    with np.errstate(over="ignore"):
        second = v - r                                           # wraps modulo 2^64
    return first, tensor(second)


# ------------------------------------------------------------------ section 3: a client
class DocOnlyClient:
    """Client ``client_id`` of a deployment whose key directory and addresses it is given."""

    def __init__(self, client_id: int, keys_dir: Path, addresses: list[tuple[str, int]],
                 samples: int = 40) -> None:
        self.id = client_id
        name = f"client-{client_id}"
        self.conns = [Connection(addresses[p], f"server{p}", keys_dir / f"{name}.pem",
                                 keys_dir / f"{name}.key", keys_dir / "ca.pem") for p in (0, 1)]
        self._nonce = 0
        self.samples = samples
        self.state = self.conns[0].request("state")
        self.answered: set[str] = set()
        model = self.state["model"]
        layout = {p["name"]: p["shape"] for p in model["layout"]}
        assert list(layout) == ["linear.weight", "linear.bias"], layout
        self.classes, self.features = layout["linear.weight"]
        rng = np.random.default_rng(1000 + client_id)
        teacher = np.random.default_rng(7).normal(size=(self.classes, self.features))
        self.x = rng.normal(size=(samples, self.features))
        self.y = np.argmax(self.x @ teacher.T, axis=1)

    def nonce(self) -> int:
        self._nonce = max(self._nonce + 1, time.time_ns())
        return self._nonce

    def both(self, op: str, **fields: Any) -> list[dict]:
        return [c.request(op, **fields) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.close()

    # -------------------------------------------------------------- training
    def train(self, model: np.ndarray, round_no: int) -> np.ndarray:
        """g = (M - M_local) / lr after one epoch of SGD, batch order from the round number."""
        lr, l2 = self.state["server_lr"], self.state["model"]["l2"]
        k, d = self.classes, self.features
        w = model.copy()
        order = np.random.default_rng([self.id, round_no]).permutation(self.samples)
        for start in range(0, self.samples, 8):
            idx = order[start:start + 8]
            W, b = w[:k * d].reshape(k, d), w[k * d:]
            logits = self.x[idx] @ W.T + b
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(idx)), self.y[idx]] -= 1.0
            p /= len(idx)
            grad = np.concatenate([(p.T @ self.x[idx]).ravel(), p.sum(axis=0)]) + l2 * w
            w = w - lr * grad
        return (model - w) / lr

    @staticmethod
    def delta(g: np.ndarray, alpha: float) -> float:
        m = g.size
        k = int(np.floor(alpha * m))
        if k >= m:
            return 0.0
        return float(np.sort(np.abs(g))[::-1][k])               # the (k+1)-th largest

    def models(self, round_no: int | None = None) -> np.ndarray | None:
        """M_round from both servers, or None while they differ (one is committing)."""
        fields = {} if round_no is None else {"round": round_no}
        a, b = self.both("get_model", **fields)
        if a["round"] != b["round"] or a["model"]["data"] != b["model"]["data"]:
            return None
        self.model_round = a["round"]
        return from_tensor(a["model"])

    # -------------------------------------------------------------- an FL round
    def upload_round(self, seed_form: bool) -> int:
        """Train on M_T and upload to both servers; returns the round uploaded for."""
        model = None
        while model is None:
            model = self.models()
        r = self.model_round + 1
        g = self.train(model, r)
        f = self.state["precision"]
        fields0: dict = {}
        fields1: dict = {}
        for name, value in (("update", g), ("norm", np.array(np.linalg.norm(g))),
                            ("delta", np.array(self.delta(g, self.state["alpha"])))):
            fields0[name], fields1[name] = split(value, f, seed_form)
        for conn, fields in zip(self.conns, (fields0, fields1)):
            rep = conn.request("upload", round=r, num_samples=self.samples, nonce=self.nonce(), **fields)
            assert rep["stored"] is True, rep
        return r

    # -------------------------------------------------------------- section 5: correction tasks
    def answer_tasks(self, seed_form: bool = False) -> int:
        done = 0
        lists = [{t["task"]: t for t in rep["tasks"]} for rep in self.both("poll_tasks")]
        for tid in sorted(set(lists[0]) & set(lists[1]) - self.answered):
            try:
                a, b = self.both("get_task", task=tid)
            except Refused as exc:
                if exc.code in ("closed", "not_found"):
                    continue
                raise
            if a["round"] != b["round"] or a["model"]["data"] != b["model"]["data"] \
                    or hashlib.sha256(a["model"]["data"]).hexdigest() != a["model_sha256"]:
                self.answered.add(tid)
                continue
            g = self.train(from_tensor(a["model"]), a["round"])
            s0, s1 = split(g, self.state["precision"], seed_form)
            for conn, share in zip(self.conns, (s0, s1)):
                try:
                    conn.request("task_result", task=tid, update=share, nonce=self.nonce())
                except Refused as exc:
                    if exc.code not in ("closed", "not_found"):
                        raise
            self.answered.add(tid)
            done += 1
        return done

    # -------------------------------------------------------------- section 6: forgetting
    def request_unlearning(self, job: str) -> None:
        for rep in self.both("unlearn", job=job, nonce=self.nonce()):
            assert rep["job"] == job, rep

    def receipt_checks(self, job: str) -> dict:
        """The receipt once both servers are done; raises if the model does not match it."""
        recs = self.both("job_status", job=job)
        assert all(r["state"] == "done" for r in recs), [r["state"] for r in recs]
        receipt = recs[0]["receipt"]
        for rep in self.both("get_model", round=receipt["adopted_round"]):
            assert hashlib.sha256(rep["model"]["data"]).hexdigest() == receipt["model_sha256"]
        return receipt
