"""Convolutions of two sharings as one matrix product on the im2col layout, exact in the ring.

Why: the two-party engine multiplies two sharings only as ``mul`` or ``matmul``. A convolution
is a matrix product once the input is laid out as columns (im2col: one row per output position,
one column per kernel tap); the layout only moves and pads elements, so each party applies it to
its own share and the result is still a share of the laid-out input. One engine ``matmul`` of the
columns with the flattened kernel then gives shares of the convolution, exactly mod 2**64.
The transposed convolutions are convolutions too (input dilated by the stride, padded, kernel
flipped and transposed), again a local re-layout; conv1d is conv2d with height 1.

``torch.nn.functional.unfold`` has no int64 kernel on the CPU, so the layout is built from
``Tensor.unfold`` views (any dtype). The arguments follow torch's signatures (CrypTen passes the
user's positional and keyword arguments on to torch): stride, padding (ints, pairs, "valid",
"same"), dilation, groups; conv_transpose also output_padding. A bias is refused: CrypTen adds
biases itself, after the product.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["OPS", "ring_conv"]

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

OPS = ("conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d")


# torch's argument order (its functions are builtins without an inspectable signature)
def _conv_args(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    pass


def _conv_transpose_args(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    pass


_SIGNATURES = {name: inspect.signature(_conv_transpose_args if "transpose" in name else _conv_args)
               for name in OPS}


def _pair(v, spatial: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        vals = tuple(int(t) for t in v)
        return vals if len(vals) == spatial else vals * spatial
    return (int(v),) * spatial


def _arguments(op: str, args: tuple, kwargs: dict) -> dict:
    bound = _SIGNATURES[op].bind(None, None, *args, **kwargs)
    bound.apply_defaults()
    params = dict(bound.arguments)
    if params.pop("bias", None) is not None:
        raise ValueError(f"{op} of two sharings takes no bias (CrypTen adds it after the product)")
    params.pop("input", None)
    params.pop("weight", None)
    return params


def _conv2d_cols(x: torch.Tensor, w: torch.Tensor, matmul: Matmul, stride, padding, dilation,
                 groups: int) -> torch.Tensor:
    """conv2d(x, w) with explicit per-side padding ((top, bottom), (left, right)), no bias."""
    n, c, _, _ = x.shape
    out_ch, cg, kh, kw = w.shape
    if c != cg * groups or out_ch % groups:
        raise ValueError(f"conv2d: {c} input channels, kernel {tuple(w.shape)}, groups {groups}")
    (pt, pb), (pl, pr) = padding
    # negative padding (from a transposed convolution's padding) crops
    x = x[:, :, max(0, -pt): x.shape[2] - max(0, -pb), max(0, -pl): x.shape[3] - max(0, -pr)]
    x = F.pad(x, (max(0, pl), max(0, pr), max(0, pt), max(0, pb)))
    sh, sw = stride
    dh, dw = dilation
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if x.shape[2] < span_h or x.shape[3] < span_w:
        raise ValueError("conv2d: the kernel is larger than the padded input")
    # (n, c, oh, ow, span_h, span_w) views, then every dilation-th tap
    cols = x.unfold(2, span_h, sh).unfold(3, span_w, sw)[..., ::dh, ::dw]
    oh, ow = cols.shape[2], cols.shape[3]
    og = out_ch // groups
    # per group: (n oh ow, cg kh kw) @ (cg kh kw, og)
    cols = cols.reshape(n, groups, cg, oh, ow, kh, kw).permute(1, 0, 3, 4, 2, 5, 6)
    cols = cols.reshape(groups, n * oh * ow, cg * kh * kw)
    kernel = w.reshape(groups, og, cg * kh * kw).transpose(1, 2)
    if groups == 1:
        prod = matmul(cols[0].contiguous(), kernel[0].contiguous()).unsqueeze(0)
    else:
        prod = matmul(cols.contiguous(), kernel.contiguous())
    # (groups, n oh ow, og) -> (n, groups og, oh, ow)
    return prod.reshape(groups, n, oh, ow, og).permute(1, 0, 4, 2, 3).reshape(n, out_ch, oh, ow)


def _same_padding(k: int, d: int) -> tuple[int, int]:
    total = d * (k - 1)
    return total // 2, total - total // 2


def _conv2d(x, w, matmul, stride, padding, dilation, groups):
    kh, kw = w.shape[2], w.shape[3]
    if isinstance(padding, str):
        if padding == "valid":
            pads = ((0, 0), (0, 0))
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError("padding='same' needs stride 1 (as in torch)")
            pads = (_same_padding(kh, dilation[0]), _same_padding(kw, dilation[1]))
        else:
            raise ValueError(f"unknown padding {padding!r}")
    else:
        ph, pw = padding
        pads = ((ph, ph), (pw, pw))
    return _conv2d_cols(x, w, matmul, stride, pads, dilation, groups)


def _conv_transpose2d(x, w, matmul, stride, padding, output_padding, groups, dilation):
    """conv_transpose2d as conv2d: zeros between input elements (stride), padding
    d (k - 1) - p before and that plus output_padding after, the kernel flipped with its in and
    out channels swapped per group."""
    n, c, h, wd = x.shape
    cin, og, kh, kw = w.shape
    if cin != c or c % groups:
        raise ValueError(f"conv_transpose2d: {c} input channels, kernel {tuple(w.shape)}, groups {groups}")
    sh, sw = stride
    spread = x.new_zeros((n, c, (h - 1) * sh + 1, (wd - 1) * sw + 1))
    spread[:, :, ::sh, ::sw] = x
    cg = c // groups
    flipped = w.flip(2, 3).reshape(groups, cg, og, kh, kw).transpose(1, 2).reshape(groups * og, cg, kh, kw)
    pads = tuple((dd * (k - 1) - p, dd * (k - 1) - p + op)
                 for k, dd, p, op in zip((kh, kw), dilation, padding, output_padding))
    return _conv2d_cols(spread, flipped, matmul, (1, 1), pads, dilation, groups)


def ring_conv(op: str, x: torch.Tensor, w: torch.Tensor, matmul: Matmul, *args, **kwargs) -> torch.Tensor:
    """``op`` (one of ``OPS``) of int64 ``x`` and ``w`` with torch's arguments, where the one
    product is ``matmul(a, b)`` (2-d, or 3-d batched over groups). With ``torch.matmul`` on
    plain ring values this equals torch's own integer convolution; with the engine's product on
    shares it gives shares of it."""
    if op not in OPS:
        raise ValueError(f"not a convolution: {op!r}")
    p = _arguments(op, args, kwargs)
    if op.endswith("1d"):   # height 1
        x, w = x.unsqueeze(2), w.unsqueeze(2)
        p = {k: (v if isinstance(v, str) or k == "groups" else (1 if k in ("stride", "dilation") else 0,
                                                               _pair(v, 1)[0]))
             for k, v in p.items()}
    p = {k: (v if isinstance(v, str) or k == "groups" else _pair(v, 2)) for k, v in p.items()}
    groups = int(p["groups"])
    if op.startswith("conv_transpose"):
        out = _conv_transpose2d(x, w, matmul, p["stride"], p["padding"], p["output_padding"], groups,
                                p["dilation"])
    else:
        out = _conv2d(x, w, matmul, p["stride"], p["padding"], p["dilation"], groups)
    return out.squeeze(2) if op.endswith("1d") else out
