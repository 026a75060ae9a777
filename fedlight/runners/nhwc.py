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
up to the summation order of the convolution algorithm (``tests/loop/test_runner_routes.py``). Under autocast it
convolves in the autocast dtype, as each client's own ``conv2d`` does in the sequential runner, eager or compiled
(vmap's own batched convolution is not autocast on CPU, torch 2.x; ``tools/gpu_paths.py --steps dtypes`` shows
what a GPU does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.runners.base import TrainSetup
from fedlight.runners.forward import StackedForward, conv_forwards, input_hooks
from fedlight.runners.stacked import StackedRunner


@torch.library.custom_op("fedlight::stacked_conv2d", mutates_args=())
def stacked_conv2d(x: Tensor, w: Tensor, b: Tensor | None, stride: list[int], padding: list[int],
                   dilation: list[int], groups: int) -> Tensor:
    """``F.conv2d``, whose batching rule (:func:`_stacked_rule`) keeps the client dimension inside channels-last
    storage. An operator of its own, so that ``torch.compile`` traces that rule as eager vmap runs it (an
    ``autograd.Function``'s vmap rule is bypassed by dynamo, which inlines its forward)."""
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


@stacked_conv2d.register_fake
def _(x, w, b, stride, padding, dilation, groups):
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


def _stacked_rule(info, in_dims, x, w, b, stride, padding, dilation, groups):
    C = info.batch_size
    x, w = _lead(x, in_dims[0], C), _lead(w, in_dims[1], C)
    b = None if b is None else _lead(b, in_dims[2], C).reshape(-1)
    _, B, ch, H, W = x.shape
    xg = x.permute(1, 3, 4, 0, 2).reshape(B, H, W, C * ch).permute(0, 3, 1, 2)  # a view when laid out as ours
    wg = w.reshape(C * w.shape[1], *w.shape[2:]).contiguous(memory_format=torch.channels_last)
    if torch.is_autocast_enabled(xg.device.type):  # cast as autocast casts one client's conv2d, traced or not
        dt = torch.get_autocast_dtype(xg.device.type)
        xg, wg, b = xg.to(dt), wg.to(dt), None if b is None else b.to(dt)
    y = F.conv2d(xg, wg, b, stride, padding, dilation, groups * C)
    out, Ho, Wo = w.shape[1], y.shape[-2], y.shape[-1]
    return y.permute(0, 2, 3, 1).reshape(B, Ho, Wo, C, out).permute(3, 0, 4, 1, 2), 0  # [C, B, out, Ho, Wo]: a view


torch.library.register_vmap("fedlight::stacked_conv2d", _stacked_rule)


def _save(ctx, inputs, output):
    x, w, b, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
    ctx.has_bias = b is not None
    ctx.save_for_backward(x, w)


def _backward(ctx, gy):  # an unbatched call (outside vmap): the plain convolution's gradients
    x, w = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx, gw, gb = torch.ops.aten.convolution_backward(
        gy, x, w, [w.shape[0]] if ctx.has_bias else None, ctx.stride, ctx.padding, ctx.dilation, False, [0, 0],
        ctx.groups, [need[0], need[1], ctx.has_bias and need[2]])
    return gx, gw, gb, None, None, None, None


stacked_conv2d.register_autograd(_backward, setup_context=_save)


def _lead(t: Tensor, dim: int | None, C: int) -> Tensor:
    """``t`` with its client dimension first (expanded when it has none: a frozen weight shared by the clients)."""
    return t.expand(C, *t.shape) if dim is None else t.movedim(dim, 0)


def _swappable(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def channels_last_convs(modules: list[nn.Conv2d], op=None):
    """Within the block, ``modules`` convolve through ``op`` (default :func:`stacked_conv2d`; an operator with its
    signature and a batching rule of its own)."""
    op = op or stacked_conv2d

    def conv(m):
        stride, padding, dilation = list(m.stride), list(m.padding), list(m.dilation)
        return lambda x, w, b: op(x, w, b, stride, padding, dilation, m.groups)

    return conv_forwards(modules, conv)


def _contiguous(x: Tensor) -> Tensor:
    return x.contiguous()


class ChannelsLastForward(StackedForward):
    """The stacked loss with every zero-padded ``Conv2d`` convolving channels-last (see the module docstring).

    BatchNorm gets its input copied to the default layout: CUDA's batch norm asks an input whose strides look
    channels-last whether it is channels-last contiguous, and under vmap that question is not implemented ("NYI:
    querying is_contiguous inside of vmap for memory_format other than torch.contiguous_format", issue 42). The
    copy costs one pass over the activations per BatchNorm layer (the GroupNorm models the route is for pay none).
    """

    def __init__(self, model: nn.Module, fabric, compile: bool | str = False) -> None:
        super().__init__(model, fabric, compile)
        self.convs = [m for m in model.modules() if _swappable(m) and m not in self.matmul_convs]

    def __call__(self, params, buffers, batch, objective) -> Tensor:
        with channels_last_convs(self.convs), input_hooks(self.norms, _contiguous):
            return super().__call__(params, buffers, batch, objective)


class ChannelsLastStackedRunner(StackedRunner):
    """:class:`~fedlight.runners.stacked.StackedRunner` with :class:`ChannelsLastForward`."""

    def __init__(self, setup: TrainSetup, chunk: int | str | None = None, compile: bool | str = False) -> None:
        super().__init__(setup, chunk, compile)
        self.forward = ChannelsLastForward.shared(setup.model, setup.fabric, compile)

    @property
    def description(self) -> str:
        return super().description.replace("stacked,", "stacked, channels-last,", 1)
