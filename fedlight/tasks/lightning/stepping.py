"""The optimizers a LightningModule steps during a client's round, as Lightning's wrap them.

``self.optimizers()`` (:class:`ClientOptimizer`) steps as ``LightningOptimizer.step(closure)``: the optimizer is
given a closure (the module's, else one doing nothing) that runs it, then ``on_before_optimizer_step``, then
fedlight's clip (``loop.max_grad_norm``), so closure optimizers (``torch.optim.LBFGS``) re-evaluate as under the
Trainer; each step counts one ``global_step``. Under automatic optimisation an optimizer that needs a closure gets
one re-running the client's ``training_step`` on the batch (:func:`rerun_closure`), as Lightning's closure does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from fedlight.core import params as P


def frozen_out(optimizer: Any) -> None:
    """A parameter the module froze (``requires_grad_(False)``, ``freeze()``) has no gradient under Lightning, so its
    optimizer skips it (no weight decay, no momentum); fedlight's rules filled a zero one: removed."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                p.grad = None


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` requires a closure (``torch.optim.LBFGS``)."""
    try:
        param = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def plain_step(ctx: Any, optimizer: Any, **kwargs: Any) -> Any:
    """``optimizer.step(**kwargs)`` under the run's precision plugin."""
    if ctx.fabric is None or ctx._plain:
        return optimizer.step(**kwargs)
    return ctx.fabric.strategy.optimizer_step(optimizer, **kwargs)


class ClientOptimizer:
    """One of ``self.optimizers()`` during a client's round (see the module docstring). Gradients persist until the
    module zeroes them."""

    def __init__(self, hooks: Any, optimizer: torch.optim.Optimizer, first: bool = True) -> None:
        self._hooks, self._optimizer, self._first = hooks, optimizer, first

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        hooks, opt = self._hooks, self._optimizer
        ctx = hooks.ctx
        if self._first:
            ctx.lr_sum += opt.param_groups[0]["lr"]

        def wrapped():
            out = closure() if closure is not None else None
            frozen_out(opt)
            hooks.call("on_before_optimizer_step", opt)
            with torch.no_grad():
                P.joint_clip_([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None],
                              ctx.max_grad_norm)
            return out

        if needs_closure(opt):  # LBFGS calls it as often as it needs
            out = plain_step(ctx, opt, closure=wrapped, **kwargs)
        else:  # once, then the step (as Lightning's precision plugins do; a GradScaler takes no closure)
            out = wrapped()
            plain_step(ctx, opt, **kwargs)
        hooks.counted()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def rerun_closure(hooks: Any, optimizer: Any, loss: Any) -> Any:
    """The closure a closure optimizer gets under automatic optimisation: its first call returns the loss the rule's
    step computed (the gradients are in place, clipped); each further call runs Lightning's closure again on the
    batch: ``training_step``, ``on_before_zero_grad``, zero grad, ``on_before_backward``, backward,
    ``on_after_backward``, then ``on_before_optimizer_step`` and fedlight's clip."""
    ctx, calls = hooks.ctx, [0]

    def closure():
        calls[0] += 1
        if calls[0] == 1:
            return loss
        ctx.zero_grad()
        ctx.scratch["lightning_closure"] = True  # its logs and outputs are kept, as each call of Lightning's closure
        try:
            out = ctx.forward_backward(hooks.model, hooks.batch)
        finally:
            ctx.scratch["lightning_closure"] = False
        hooks.call("on_after_backward")
        hooks.call("on_before_optimizer_step", optimizer)
        with torch.no_grad():
            P.joint_clip_([p.grad for p in ctx.params.values() if p.grad is not None], ctx.max_grad_norm)
        return out

    return closure


class NoStep:
    """``self.optimizers()`` outside a client's round (the probe, an evaluation by ``training_step``): the
    module's optimizer's groups, stepping nothing."""

    def __init__(self, optimizer: Any = None) -> None:
        self.param_groups = [dict(g) for g in optimizer.param_groups] if optimizer is not None else [{}]

    def step(self, closure: Any = None, **kwargs: Any) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class StepView:
    """The optimizer an overridden ``optimizer_step`` gets: ``step(closure)`` calls the closure (it returns the loss
    already computed) and takes the rule's step; anything else is the client's optimizer's."""

    def __init__(self, optimizer: Any, step: Any) -> None:
        self._optimizer, self._step, self.out = optimizer, step, None

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        if closure is not None:
            closure()
        self.out = self._step()
        return self.out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class SchedulerView:
    """``self.lr_schedulers()``: the module's scheduler as seen by a client; fedlight sets the lr by its interval
    (``step()`` does not step it, so a manual loop calling it keeps the same schedule; under manual optimisation a
    round whose calls differ from the interval gets one note naming the interval that matches)."""

    def __init__(self, scheduler: Any, ctx: Any) -> None:
        self._scheduler, self._ctx = scheduler, ctx

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Counted only (:meth:`~fedlight.tasks.lightning.schedule.Schedule.unfollowed_calls`)."""
        calls = self._ctx.scratch.setdefault("lightning_scheduler_calls", {})
        calls[id(self._scheduler)] = calls.get(id(self._scheduler), 0) + 1

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self._ctx.optimizer.param_groups]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def schedulers(task: Any, ctx: Any) -> Any:
    views = [SchedulerView(c.scheduler, ctx) for c in (task.trainer.lr_scheduler_configs if task.trainer else [])]
    return None if not views else views[0] if len(views) == 1 else views
