"""Candidates for the rest of the stacked round's distance to its bound (issue 42), prepared on a CPU for one GPU
call: options of the routes bench (:data:`fedlight.lab.benchmarks.routes.ROUTES`), not routes of ``fedlight fit`` until
a GPU measures them. Each equals the sequential runner on a CPU (``tests/loop/test_route_candidates.py``).

* ``bmm``: the per-layer kernel choice. The turn-2 profile had a batched matmul beating cuDNN's grouped convolution
  on the 256-channel layers (``tools/gpu_profile.py --sections conv``): here every stacked ``Conv2d`` with at least
  :attr:`BmmForward.FROM` input channels convolves as one ``bmm`` over unfolded patches (:func:`stacked_conv2d_bmm`,
  an operator whose batching rule is that matmul, so ``torch.compile`` traces it), the others as vmap's grouped
  convolution.
* ``halves``: the chunk cut in two halves, each a stacked chunk of its own on its own CUDA stream, their steps
  interleaved (:class:`HalvesRunner`), so one half's small kernels fill the gaps of the other's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlight.runners.forward import StackedForward
from fedlight.runners.interleave import Streams, interleave, values
from fedlight.runners.nhwc import _backward, _lead, _save, _swappable, channels_last_convs
from fedlight.runners.stacked import StackedRunner


@torch.library.custom_op("fedlight::stacked_conv2d_bmm", mutates_args=())
def stacked_conv2d_bmm(x: Tensor, w: Tensor, b: Tensor | None, stride: list[int], padding: list[int],
                       dilation: list[int], groups: int) -> Tensor:
    """``F.conv2d``; under vmap (:func:`_bmm_rule`) one batched matmul over the clients' unfolded patches."""
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


@stacked_conv2d_bmm.register_fake
def _(x, w, b, stride, padding, dilation, groups):
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


def _bmm_rule(info, in_dims, x, w, b, stride, padding, dilation, groups):
    C = info.batch_size
    x, w = _lead(x, in_dims[0], C), _lead(w, in_dims[1], C)
    _, B, ch, H, W = x.shape
    out, k = w.shape[1], w.shape[-2:]
    if torch.is_autocast_enabled(x.device.type):  # as autocast casts one client's conv2d
        dt = torch.get_autocast_dtype(x.device.type)
        x, w, b = x.to(dt), w.to(dt), None if b is None else b.to(dt)
    Ho = (H + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    cols = F.unfold(x.reshape(C * B, ch, H, W), k, dilation, padding, stride)  # [C·B, ch·k·k, Ho·Wo]
    cols = cols.reshape(C, B, ch * k[0] * k[1], Ho * Wo).transpose(1, 2).reshape(C, ch * k[0] * k[1], B * Ho * Wo)
    y = torch.bmm(w.reshape(C, out, -1), cols).reshape(C, out, B, Ho, Wo)
    y = y.transpose(1, 2).contiguous()  # [C, B, out, Ho, Wo]; a copy, or AOTAutograd's backward fails on a view
    if b is not None:
        y = y + _lead(b, in_dims[2], C).reshape(C, 1, out, 1, 1)
    return y, 0


torch.library.register_vmap("fedlight::stacked_conv2d_bmm", _bmm_rule)
stacked_conv2d_bmm.register_autograd(_backward, setup_context=_save)


class BmmForward(StackedForward):
    """The stacked loss with the convolutions of at least :attr:`FROM` input channels as batched matmuls."""

    FROM = 256

    def __init__(self, model, fabric, compile: bool | str = False) -> None:
        super().__init__(model, fabric, compile)
        self.convs = [m for m in model.modules() if _swappable(m) and m.groups == 1 and m.in_channels >= self.FROM
                      and m not in self.matmul_convs]

    def __call__(self, params, buffers, batch, objective) -> Tensor:
        with channels_last_convs(self.convs, stacked_conv2d_bmm):
            return super().__call__(params, buffers, batch, objective)


class BmmRunner(StackedRunner):
    """:class:`~fedlight.runners.stacked.StackedRunner` with a :class:`BmmForward`."""

    @property
    def description(self) -> str:
        return super().description + f", bmm from {type(self.forward).FROM} channels"


class HalvesRunner(StackedRunner):
    """Each chunk as two stacked halves on two CUDA streams, their steps interleaved (on a CPU: no streams)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.streams = Streams(self.setup.device)

    @property
    def description(self) -> str:
        return super().description + ", two halves on two streams"

    def chunk_steps(self, jobs, info, buffers):
        if len(jobs) < 2:
            return (yield from super().chunk_steps(jobs, info, buffers))
        return self._halves(jobs, info, buffers)  # not paused: the halves are interleaved with each other

    def _halves(self, jobs, info, buffers):
        dev = self.setup.device
        half = -(-len(jobs) // 2)
        parts = [jobs[:half], jobs[half:]]
        first, second = values(interleave([self.stepwise(p, info, buffers) for p in parts], self.streams.take(2),
                                          dev))
        return first + second


def swap(loop, candidate: str, bmm_from: int | None = None):
    """``loop``'s stacked runner replaced by ``candidate`` (``bmm`` or ``halves``), same chunk and compilation."""
    old = loop.runner
    if not isinstance(old, StackedRunner):
        raise ValueError(f"{candidate}: needs the stacked runner, not {type(old).__name__}")
    compile = old.forward.compile
    if candidate == "halves":
        new = HalvesRunner(old.setup, old.chunk, compile)
        new.forward = old.forward
    elif candidate == "bmm":
        new = BmmRunner(old.setup, old.chunk, compile)
        cls = BmmForward if bmm_from is None else type(f"BmmForward{bmm_from}", (BmmForward,), {"FROM": bmm_from})
        new.forward = cls.shared(old.setup.model, old.setup.fabric, compile)
    else:
        raise ValueError(f"unknown candidate {candidate!r} (bmm, halves)")
    loop.runner = new
    return new
