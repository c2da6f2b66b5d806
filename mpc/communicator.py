"""CrypTen's communicator interface for exactly two parties over one ``Channel``.

CrypTen calls these collectives; with two parties each reduces to "send my tensor,
receive yours" (one frame each way, one round) or to a one-way transfer. Tensors cross
the wire as their raw little-endian bytes; the receiver knows the shape from the call,
so a frame of the wrong size is a ``ProtocolError``, never a silent reshape.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from net.channel import KIND_OBJECT, KIND_TENSOR, Channel
from .crypten_compat import CommunicatorBase, restricted_loads


class _Done:
    """Stands in for torch.distributed's request objects: our sends complete at once."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).cpu().numpy()).cast("B")  # flat: empty 2-D views cannot be cast


class TwoPartyCommunicator(CommunicatorBase):
    BYTES_PER_ELEMENT = 8
    instance: "TwoPartyCommunicator | None" = None

    def __init__(self, rank: int, channel: Channel):
        if rank not in (0, 1):
            raise ValueError("two-party communicator: rank must be 0 or 1")
        self.rank = rank
        self.world_size = 2
        self.channel = channel
        self._name = f"server{rank}"
        self.reset_communication_stats()

    # ------------------------------------------------------------ class-level hooks
    @classmethod
    def is_initialized(cls) -> bool:
        return cls.instance is not None

    @classmethod
    def get(cls) -> "TwoPartyCommunicator":
        return cls.instance

    @classmethod
    def initialize(cls, rank, world_size, init_ttp=False):  # noqa: ARG003
        raise RuntimeError("use mpc.session to start a two-party session, not crypten.init()")

    @classmethod
    def shutdown(cls) -> None:
        cls.instance = None

    # ------------------------------------------------------------------- primitives
    def _send(self, t: torch.Tensor) -> None:
        self.channel.send_frame(KIND_TENSOR, _bytes_of(t))

    def _recv_like(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        payload = self.channel.recv_frame(KIND_TENSOR, nbytes)
        arr = np.frombuffer(payload, dtype=_numpy_dtype(t.dtype))
        return torch.from_numpy(arr).reshape(t.shape)

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        self._send(t)
        return self._recv_like(t)

    def _exchange_list(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = [x.detach().contiguous().reshape(-1) for x in tensors]
        dtypes = {x.dtype for x in flat}
        if len(dtypes) != 1:
            return [self._exchange(x) for x in tensors]
        joined = torch.cat(flat) if flat else torch.empty(0, dtype=torch.long)
        other = self._exchange(joined)
        out, off = [], 0
        for x in tensors:
            n = x.numel()
            out.append(other[off : off + n].reshape(x.shape))
            off += n
        return out

    @staticmethod
    def _combine(a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
        if op == ReduceOp.SUM:
            return a + b
        if op == ReduceOp.BXOR:
            return a ^ b
        raise NotImplementedError(f"reduce op {op} is not used by CrypTen two-party protocols")

    # -------------------------------------------------------- CrypTen collectives
    def send(self, tensor, dst):
        self._send(tensor)

    def recv(self, tensor, src=None):
        return self._recv_like(tensor)

    def isend(self, tensor, dst):
        self._send(tensor)
        return _Done()

    def irecv(self, tensor, src=None):
        tensor.copy_(self._recv_like(tensor))
        return _Done()

    def all_reduce(self, input, op=ReduceOp.SUM, batched=False):
        if batched:
            others = self._exchange_list(list(input))
            return [self._combine(x, o, op) for x, o in zip(input, others)]
        return self._combine(input, self._exchange(input), op)

    def reduce(self, input, dst, op=ReduceOp.SUM, batched=False):
        tensors = list(input) if batched else [input]
        if self.rank == dst:
            others = [self._recv_like(x) for x in tensors] if not batched else self._recv_list(tensors)
            result = [self._combine(x, o, op) for x, o in zip(tensors, others)]
            return result if batched else result[0]
        if batched:
            self._send(torch.cat([x.detach().contiguous().reshape(-1) for x in tensors]))
        else:
            self._send(input)
        return None

    def _recv_list(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        template = torch.empty(sum(x.numel() for x in like), dtype=like[0].dtype)
        flat = self._recv_like(template)
        out, off = [], 0
        for x in like:
            out.append(flat[off : off + x.numel()].reshape(x.shape))
            off += x.numel()
        return out

    def broadcast(self, input, src, group=None, batched=False):
        tensors = list(input) if batched else [input]
        if self.rank == src:
            for x in tensors:
                self._send(x)
        else:
            for x in tensors:
                x.data.copy_(self._recv_like(x))
        return input

    def gather(self, tensor, dst):
        if self.rank == dst:
            other = self._recv_like(tensor)
            pair = [tensor, other] if self.rank == 0 else [other, tensor]
            return pair
        self._send(tensor)
        return [None]

    def all_gather(self, tensor):
        other = self._exchange(tensor)
        return [tensor, other] if self.rank == 0 else [other, tensor]

    def scatter(self, scatter_list, src, size=None, device=None):
        if self.rank == src:
            self._send(scatter_list[1 - self.rank])
            return scatter_list[self.rank]
        if size is None:
            size = scatter_list[self.rank].size()
        return self._recv_like(torch.empty(size, dtype=torch.long))

    def barrier(self):
        self._exchange(torch.zeros(1, dtype=torch.long))

    # --------------------------------------------------------------------- objects
    def send_obj(self, obj: Any, dst, group=None):
        self.channel.send_frame(KIND_OBJECT, pickle.dumps(obj))

    def recv_obj(self, src, group=None):
        return restricted_loads(bytes(self.channel.recv_frame(KIND_OBJECT)))

    def broadcast_obj(self, obj, src, group=None):
        if self.rank == src:
            self.send_obj(obj, 1 - src)
            return obj
        return self.recv_obj(src)

    # ----------------------------------------------------------------- bookkeeping
    def get_world_size(self) -> int:
        return 2

    def get_rank(self) -> int:
        return self.rank

    def set_name(self, name: str) -> None:
        self._name = name

    def get_name(self) -> str:
        return self._name

    def get_communication_stats(self) -> dict:
        return self.channel.meter.as_dict() if self.channel.meter else {}


_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def _numpy_dtype(dt: torch.dtype):
    try:
        return _NUMPY[dt]
    except KeyError:
        raise TypeError(f"cannot transfer tensors of dtype {dt}") from None
