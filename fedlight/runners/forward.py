"""The stacked loss: ``vmap`` of ``functional_call`` over the clients' stacked parameters, optionally compiled
(:class:`StackedForward`), and the rule's context that carries it (:class:`StackedContext`).

What the per-client call sees is one client's parameters and buffers bound to the one model (:class:`_Bound`);
forward pre-hooks installed only for the call (:func:`input_hooks`) adjust what particular layers receive (float32
BatchNorm inputs under eager mixed precision; contiguous BatchNorm inputs on the channels-last route), and
convolutions may convolve otherwise for the call (:func:`conv_forwards`: ``loop.matmul_convs``,
:mod:`fedlight.runners.matmul_conv`; the channels-last route's operator).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn.utils.stateless import _reparametrize_module

from fedlight.core.params import Params
from fedlight.core.rules import LocalContext
from fedlight.runners import matmul_conv
from fedlight.runners.base import compile_kwargs


class _Bound:
    """Calls ``model`` with one client's parameters and buffers (inside vmap: one slice of the stack)."""

    def __init__(self, model: nn.Module, params: Params, buffers: Params) -> None:
        self.model, self.params, self.buffers = model, params, buffers
        self._fedlight_module = model  # what a task reads to reach the module behind the binding

    def __call__(self, *args, **kwargs):
        return functional_call(self.model, (self.params, self.buffers), args, kwargs)

    def __getattr__(self, name: str):
        """Any other method of the model (a LightningModule's ``training_step``) runs with this client's tensors."""
        attr = getattr(self.model, name)
        if not callable(attr):
            return attr

        def bound(*args, **kwargs):
            with _reparametrize_module(self.model, {**self.params, **self.buffers}):
                return attr(*args, **kwargs)

        return bound


class StackedForward:
    """Per-client losses ``[C]`` of stacked parameters: ``vmap`` of ``functional_call``, optionally compiled.

    Under mixed precision inputs stay float32 (autocast casts weights and inputs itself: under vmap it does not
    cast a batched float32 weight to meet an input already in bf16). Eager BatchNorm under vmap + autocast
    fails on CUDA ("Expected running_mean to have type BFloat16"): vmap's batching rule calls the kernel without
    the float32 affine weight, which is what licenses a bf16 input next to float32 statistics. Eager stacked
    runs therefore feed BatchNorm float32 inputs (a forward pre-hook, only inside this call); compiled runs need
    no hook, inductor decomposes the normalisation.
    """

    def __init__(self, model: nn.Module, fabric: Any, compile: bool | str = False) -> None:
        self.model = model
        self.precision = None if fabric is None else fabric.strategy.precision
        self.mixed = isinstance(self.precision, MixedPrecision)
        self.compiled, self.compile = bool(compile), compile
        self.norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.matmul_convs = matmul_conv.selected(model)  # loop.matmul_convs
        self._matmul = {id(m): matmul_conv.conv_as_matmul(m) for m in self.matmul_convs}  # made once, not per step
        fn = self._losses
        if compile:
            fn = torch.compile(fn, dynamic=False, **compile_kwargs(compile))
        self.fn = fn

    @classmethod
    def shared(cls, model: nn.Module, fabric: Any, compile: bool | str = False) -> StackedForward:
        """One instance per (model, precision, compile, ``loop.matmul_convs`` selection), so loops over the same
        model reuse compiled code."""
        precision = None if fabric is None else fabric.strategy.precision
        key = (cls.__name__, type(precision).__name__, str(getattr(precision, "precision", "")), compile,
               tuple(map(id, matmul_conv.selected(model))))
        per_model = model.__dict__.setdefault("_fedlight_stacked_forwards", {})  # dies with the model
        if key not in per_model:
            per_model[key] = cls(model, fabric, compile)
        return per_model[key]

    def _losses(self, params: Params, buffers: Params, batch: Any, objective: Callable) -> Tensor:
        model, precision = self.model, self.precision

        def one(p: Params, b: Params, batch_c: Any) -> Tensor:
            with precision.forward_context() if precision is not None else nullcontext():
                return objective(_Bound(model, p, b), batch_c)

        return vmap(one, randomness="different")(params, buffers, batch)

    def __call__(self, params: Params, buffers: Params, batch: Any, objective: Callable) -> Tensor:
        if self.precision is not None and not self.mixed:
            batch = self.precision.convert_input(batch)  # e.g. float64 for 64-true
        with input_hooks(self.norms, _float32) if self.mixed and not self.compiled else nullcontext(), \
                conv_forwards(self.matmul_convs, lambda m: self._matmul[id(m)]):
            return self.fn(params, buffers, batch, objective)


@contextmanager
def conv_forwards(modules: list[nn.Module], make: Callable[[nn.Module], Callable]):
    """Within the block, each of ``modules`` (``nn.Conv2d``) convolves through ``make(module)``, a function of
    ``(x, weight, bias)`` as ``Conv2d._conv_forward`` is."""
    for m in modules:
        m._conv_forward = make(m)
    try:
        yield
    finally:
        for m in modules:
            del m._conv_forward


def _float32(x: Tensor) -> Tensor:
    return x.float()


@contextmanager
def input_hooks(modules: list[nn.Module], fn: Callable[[Tensor], Tensor]):
    """Within the block, ``modules`` receive ``fn`` of their first input."""
    def hook(_m, args):
        return (fn(args[0]), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(eq=False)
class StackedContext(LocalContext):
    """A :class:`~fedlight.core.rules.LocalContext` whose tensors carry a leading client dimension."""

    buffers: Params = field(default_factory=dict)
    """Stacked floating-point buffers (BatchNorm running statistics), one slice per client."""
    forward: StackedForward | None = None
    """Computes the per-client losses (set by :class:`StackedRunner`)."""

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """Per-client losses, shape ``[C]``."""
        forward = self.forward if self.forward is not None else StackedForward.shared(model, self.fabric)
        return forward(self.params, self.buffers, batch, self.objective)
