"""Stacked convolutions of few input channels as one matrix product (``loop.matmul_convs: N``).

Under ``vmap`` a convolution with per-client weights becomes one grouped convolution, C groups of ``ch`` input
channels. With few input channels (a network's first layer: 3 for RGB) cuDNN's grouped kernels are slow: LeNet-5's
conv1 (3→64, 5×5) stacked over 330 clients ran at 10–16 TFLOP/s on an H200, a third of an eager 330-client step of
the CIFAR column, while its conv2 (64 channels) ran at 180–290 (``results/gpu_window_2026-11-28_lockstep.md``).

Here each selected ``nn.Conv2d`` convolves as what the convolution is: the image's patches (``unfold``, ``[ch·k·k,
B·Ho·Wo]`` per client) times the weight matrix ``[out, ch·k·k]``, one matrix product per client, which ``vmap``
turns into one batched matmul for the chunk (forward ``[C, out, ch·k·k] × [C, ch·k·k, B·Ho·Wo]``; the weight gradient
another batched matmul whose inner dimension is ``B·Ho·Wo``, tensor-core friendly). The input of a first layer needs
no gradient, so nothing is spent on the patches' backward. Under autocast the patches and the weight are cast to the
autocast dtype first, as ``conv2d`` casts its operands, and the output leaves in the dtype vmap's batched ``conv2d``
gives there (on a CPU that one is not autocast and stays float32; the next layer must get what it gets without this
setting).

The same convolution, summed in another order: equal to the grouped convolution to rounding (``64-true``: 1e-12,
``tests/loop/test_matmul_convs.py``), so an execution-only setting like ``loop.compile``. Off by default: whether it
is faster is a device measurement (``tools/gpu_lockstep_bench.py`` times the column's step with and without it); the
sequential runner is not affected (one client's convolution is cuDNN's ungrouped kernel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

MARK = "_fedlight_matmul_conv"
"""The attribute that selects a module (set by :func:`select`, read by the stacked forward)."""


def eligible(m: nn.Module, max_channels: int) -> bool:
    """An ungrouped, zero-padded ``Conv2d`` with numeric padding and at most ``max_channels`` input channels."""
    return (isinstance(m, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros"
            and not isinstance(m.padding, str) and m.in_channels <= max_channels)


def select(model: nn.Module, max_channels: int) -> list[str]:
    """Mark the convolutions of ``model`` with at most ``max_channels`` input channels, and only those (a model
    reused by a later run keeps no mark of an earlier one's setting); their names."""
    names = []
    for name, m in model.named_modules():
        if eligible(m, max_channels):
            setattr(m, MARK, True)
            names.append(name)
        elif getattr(m, MARK, False):
            delattr(m, MARK)
    return names


def selected(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if getattr(m, MARK, False)]


def conv_as_matmul(m: nn.Conv2d):
    """``m``'s ``_conv_forward(x, w, b)`` for one client's ``x [B, ch, H, W]`` (called under ``vmap``): unfold, one
    matrix product. Under autocast it computes in the autocast dtype and returns what vmap's batched ``conv2d``
    would return there (:func:`batched_conv_autocasts`), so the next layers see the dtype they see without it."""
    k, stride, padding, dilation = m.kernel_size, m.stride, m.padding, m.dilation
    kind = m.weight.device.type
    casts = {dt: batched_conv_autocasts(kind, dt) for dt in (torch.bfloat16, torch.float16)}

    def conv(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out_dt = x.dtype
        if torch.is_autocast_enabled(kind):  # the operands conv2d would see under autocast
            dt = torch.get_autocast_dtype(kind)
            out_dt = dt if casts.get(dt, True) else x.dtype
            x, w, b = x.to(dt), w.to(dt), None if b is None else b.to(dt)
        B, _, H, W = x.shape
        Ho = (H + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
        Wo = (W + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
        cols = F.unfold(x, k, dilation, padding, stride)  # [B, ch·k·k, Ho·Wo]
        cols = cols.transpose(0, 1).reshape(cols.shape[1], B * Ho * Wo)  # [ch·k·k, B·Ho·Wo]
        y = (w.reshape(w.shape[0], -1) @ cols).view(w.shape[0], B, Ho, Wo).transpose(0, 1).contiguous()
        return (y if b is None else y + b.view(1, -1, 1, 1)).to(out_dt)

    return conv


@functools.cache
def batched_conv_autocasts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether vmap's batched ``conv2d`` computes in ``dtype`` under autocast on this kind of device (on a CPU,
    torch 2.x, it does not: it stays float32, results/performance.md §6). Probed once, outside any vmap or trace."""
    x = torch.zeros(2, 1, 1, 3, 3, device=device_type)
    w = torch.zeros(2, 1, 1, 1, 1, device=device_type)
    try:
        with torch.autocast(device_type, dtype=dtype):
            return vmap(F.conv2d)(x, w).dtype == dtype
    except RuntimeError:  # autocast does not support this dtype here
        return False
