"""Convolutions as one matrix product on the im2col layout (``mpc.ring_conv``), against torch.

The two-party mode computes a convolution of two sharings as ``ring_conv(op, x, w, matmul)``
with the engine's product as ``matmul``; each party lays out its own share. Because the layout
is linear, it is enough that, with ``torch.matmul`` on plain ring values, the result equals
torch's own int64 convolution exactly, wraparound included (uniform int64 inputs overflow on
almost every product). Checked for every argument CrypTen passes on: stride, padding (ints,
pairs, "valid", "same"), dilation, groups, output_padding, positional or keyword.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from mpc.ring_conv import ring_conv

LO, HI = -(2**63), 2**63 - 1


def ring(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(LO, HI, shape, generator=g, dtype=torch.int64)


@st.composite
def conv2d_case(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = draw(st.sampled_from(["ints", "valid", "same"]))
    if padding == "ints":
        padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    elif padding == "same":
        stride = (1, 1)
    h = draw(st.integers(dilation[0] * (kh - 1) + 1, 8))
    w = draw(st.integers(dilation[1] * (kw - 1) + 1, 8))
    return dict(n=draw(st.integers(1, 2)), cin=cin, cout=cout, kh=kh, kw=kw, h=h, w=w, groups=groups,
                stride=stride, padding=padding, dilation=dilation, seed=draw(st.integers(0, 2**31)))


@given(conv2d_case())
def test_conv2d_equals_torch_in_the_ring(c):
    x = ring((c["n"], c["cin"], c["h"], c["w"]), c["seed"])
    w = ring((c["cout"], c["cin"] // c["groups"], c["kh"], c["kw"]), c["seed"] + 1)
    kwargs = dict(stride=c["stride"], padding=c["padding"], dilation=c["dilation"], groups=c["groups"])
    assert torch.equal(ring_conv("conv2d", x, w, torch.matmul, **kwargs), F.conv2d(x, w, **kwargs))


@given(conv2d_case(), st.data())
def test_conv_transpose2d_equals_torch_in_the_ring(c, data):
    stride = c["stride"]
    padding = c["padding"] if isinstance(c["padding"], tuple) else (0, 0)
    # torch requires output_padding < stride or < dilation
    output_padding = tuple(data.draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, c["dilation"]))
    x = ring((c["n"], c["cin"], c["h"], c["w"]), c["seed"])
    w = ring((c["cin"], c["cout"] // c["groups"], c["kh"], c["kw"]), c["seed"] + 1)
    args = (None, stride, padding, output_padding, c["groups"], c["dilation"])   # torch's positional order
    try:
        ref = F.conv_transpose2d(x, w, *args)
    except RuntimeError:   # torch refuses this combination (e.g. an empty output): so do we
        with pytest.raises((ValueError, RuntimeError)):
            ring_conv("conv_transpose2d", x, w, torch.matmul, *args)
        return
    assert torch.equal(ring_conv("conv_transpose2d", x, w, torch.matmul, *args), ref)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2), st.integers(1, 2),
       st.integers(0, 2**31))
def test_conv1d_and_conv_transpose1d_equal_torch_in_the_ring(groups, k, stride, padding, dilation, seed):
    x = ring((2, groups * 2, 11), seed)
    w = ring((groups * 3, 2, k), seed + 1)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert torch.equal(ring_conv("conv1d", x, w, torch.matmul, **kw), F.conv1d(x, w, **kw))
    wt = ring((groups * 2, 3, k), seed + 2)
    assert torch.equal(ring_conv("conv_transpose1d", x, wt, torch.matmul, **kw), F.conv_transpose1d(x, wt, **kw))


def test_matmul_is_called_once_per_convolution_with_2d_or_group_batched_operands():
    calls = []

    def counting(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return torch.matmul(a, b)

    x, w = ring((2, 3, 6, 6), 1), ring((4, 3, 3, 3), 2)
    ring_conv("conv2d", x, w, counting, padding=1)
    ring_conv("conv2d", ring((2, 6, 6, 6), 3), ring((6, 2, 3, 3), 4), counting, groups=3)
    assert calls == [((2 * 36, 27), (27, 4)), ((3, 2 * 16, 18), (3, 18, 2))]


def test_a_bias_and_unknown_ops_are_refused():
    x, w = ring((1, 1, 4, 4), 1), ring((1, 1, 2, 2), 2)
    with pytest.raises(ValueError, match="bias"):
        ring_conv("conv2d", x, w, torch.matmul, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError):
        ring_conv("conv3d", x, w, torch.matmul)
