"""Channels-last end to end in the stacked runner (``loop.channels_last: true`` with the stacked runner).

Under ``vmap`` a convolution of C clients' weights becomes one grouped convolution over ``[B, C·ch, H, W]``, and
vmap's batching rule builds that input with a copy into the default (NCHW) layout, whatever the layout of the
clients' activations: cuDNN's grouped kernels then transpose NCHW → NHWC and back (15 % of the kernel time of an
H100 round, ``results/performance.md`` §6.2). Here the batching rule of every (zero-padded) ``nn.Conv2d`` is
replaced by one that keeps the stacked activations ``[C, B, ch, H, W]`` stored as ``[B, H, W, C, ch]``: that is
exactly the channels-last layout of the grouped input ``[B, C·ch, H, W]``, so the grouped convolution reads it as a
view, runs on channels-last weights, and its channels-last output *is* the next layer's stacked activations (a
view again). Element-wise layers keep the layout; one copy remains wherever a layer's own batching rule makes one.

The math is the grouped convolution vmap would run (same groups, same weights): equal to the sequential runner
up to the summation order of the convolution algorithm (``tests/loop/test_runner_routes.py``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.runners.base import TrainSetup
from fedlight.runners.stacked import StackedForward, StackedRunner


class _StackedConv2d(torch.autograd.Function):
    """``F.conv2d`` whose batching rule keeps the client dimension inside channels-last storage."""

    @staticmethod
    def forward(x, w, b, stride, padding, dilation, groups):
        return F.conv2d(x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
        ctx.has_bias = b is not None
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, gy):  # an unbatched call (outside vmap): the plain convolution's gradients
        x, w = ctx.saved_tensors
        gx, gw, gb = torch.ops.aten.convolution_backward(
            gy, x, w, [w.shape[0]] if ctx.has_bias else None, list(ctx.stride), list(ctx.padding),
            list(ctx.dilation), False, [0, 0], ctx.groups, [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                            ctx.has_bias and ctx.needs_input_grad[2]])
        return gx, gw, gb, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, w, b, stride, padding, dilation, groups):
        C = info.batch_size
        x, w = _lead(x, in_dims[0], C), _lead(w, in_dims[1], C)
        b = None if b is None else _lead(b, in_dims[2], C).reshape(-1)
        _, B, ch, H, W = x.shape
        xg = x.permute(1, 3, 4, 0, 2).reshape(B, H, W, C * ch).permute(0, 3, 1, 2)  # a view when laid out as ours
        wg = w.reshape(C * w.shape[1], *w.shape[2:]).contiguous(memory_format=torch.channels_last)
        y = F.conv2d(xg, wg, b, stride, padding, dilation, groups * C)
        out, Ho, Wo = w.shape[1], y.shape[-2], y.shape[-1]
        y = y.permute(0, 2, 3, 1).reshape(B, Ho, Wo, C, out).permute(3, 0, 4, 1, 2)  # [C, B, out, Ho, Wo]: a view
        return y, 0


def _lead(t: Tensor, dim: int | None, C: int) -> Tensor:
    """``t`` with its client dimension first (expanded when it has none: a frozen weight shared by the clients)."""
    return t.expand(C, *t.shape) if dim is None else t.movedim(dim, 0)


def _swappable(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str)


@contextmanager
def channels_last_convs(modules: list[nn.Conv2d]):
    """Within the block, ``modules`` convolve through :class:`_StackedConv2d`."""
    def conv(m):
        return lambda x, w, b: _StackedConv2d.apply(x, w, b, m.stride, m.padding, m.dilation, m.groups)

    for m in modules:
        m._conv_forward = conv(m)
    try:
        yield
    finally:
        for m in modules:
            del m._conv_forward


class ChannelsLastForward(StackedForward):
    """The stacked loss with every zero-padded ``Conv2d`` convolving channels-last (see the module docstring)."""

    def __init__(self, model: nn.Module, fabric, compile: bool | str = False) -> None:
        super().__init__(model, fabric, compile)
        self.convs = [m for m in model.modules() if _swappable(m)]

    def __call__(self, params, buffers, batch, objective) -> Tensor:
        with channels_last_convs(self.convs):
            return super().__call__(params, buffers, batch, objective)


class ChannelsLastStackedRunner(StackedRunner):
    """:class:`~fedlight.runners.stacked.StackedRunner` with :class:`ChannelsLastForward`."""

    def __init__(self, setup: TrainSetup, chunk: int | str | None = None, compile: bool | str = False) -> None:
        super().__init__(setup, chunk, compile)
        self.forward = ChannelsLastForward.shared(setup.model, setup.fabric, compile)

    @property
    def description(self) -> str:
        return super().description.replace("stacked,", "stacked, channels-last,", 1)
