"""A LightningModule's hooks at their federated moments, for one client's local training.

``on_train_epoch_start`` when the client starts its round, ``on_train_batch_start`` / ``on_before_backward`` around
each ``training_step``, ``on_after_backward`` and ``on_before_optimizer_step`` just before each optimizer step (after
fedlight's clip when ``loop.max_grad_norm`` is set), ``on_train_batch_end`` after it and ``on_train_epoch_end``
after the client's last step. ``self.optimizers()`` is the client's optimizer (its ``step`` does what the rule's
step does: clip, step, count); ``self.manual_backward`` is the precision-aware backward; ``training_step``
returning ``None`` skips the step (no optimizer step), as in Lightning.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from fedlight.core import params as P
from fedlight.core.params import in_stacked
from fedlight.tasks.lightning.compat import note, overrides
from fedlight.tasks.lightning.groups import optimizers_of
from fedlight.tasks.lightning.logs import capture_logs


def call_hook(module: Any, name: str, *args: Any, sink: dict | None = None) -> Any:
    """``module.<name>(*args)`` with its ``self.log`` calls added to ``sink`` (``{name: Logged}``; an epoch hook
    logs on_epoch by default, a step hook on_step, as in Lightning)."""
    with capture_logs(module, step="epoch" not in name) as logs:
        out = getattr(module, name)(*args)
    if sink is not None:
        sink.update(logs)
    return out


class ClientOptimizer:
    """One of ``self.optimizers()`` during a client's round: a client optimizer whose ``step`` clips its own
    parameters' gradients (when ``loop.max_grad_norm`` is a number), steps under the precision plugin and counts the
    lr (the first optimizer's), as the rule's own step. Gradients persist until the module zeroes them."""

    def __init__(self, ctx: Any, optimizer: torch.optim.Optimizer, first: bool = True) -> None:
        self._ctx, self._optimizer, self._first = ctx, optimizer, first

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Any = None) -> None:
        ctx, opt = self._ctx, self._optimizer
        if closure is not None:
            closure()
        if self._first:
            ctx.lr_sum += opt.param_groups[0]["lr"]
        with torch.no_grad():
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            P.joint_clip_(grads, ctx.max_grad_norm)
        if ctx.fabric is None or ctx._plain:
            opt.step()
        else:
            ctx.fabric.strategy.optimizer_step(opt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class NoStep:
    """``self.optimizers()`` outside a client's round (the probe, an evaluation by ``training_step``): the
    module's optimizer's groups, stepping nothing."""

    def __init__(self, optimizer: Any = None) -> None:
        self.param_groups = [dict(g) for g in optimizer.param_groups] if optimizer is not None else [{}]

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


@contextmanager
def frozen(module: Any, optimizers: list):
    """Within the block, ``self.optimizers()`` steps nothing and ``self.manual_backward`` does nothing."""
    saved = {k: module.__dict__.get(k) for k in ("optimizers", "manual_backward")}
    views = [NoStep(o) for o in optimizers] or [NoStep()]
    module.__dict__["optimizers"] = lambda use_pl_optimizer=True: views[0] if len(views) == 1 else views
    module.__dict__["manual_backward"] = lambda loss, *args, **kwargs: None
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                module.__dict__.pop(k, None)
            else:
                module.__dict__[k] = v


def set_lrs(optimizer: Any, lrs: tuple[float, ...]) -> None:
    """Each param group's lr (the module's schedule at this step)."""
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


class ClientHooks:
    """Installs the per-client pieces on the module and calls its training hooks (see the module docstring)."""

    def __init__(self, task: Any, module: Any, ctx: Any) -> None:
        self.task, self.module, self.ctx = task, module, ctx
        self.logs: dict[str, tuple[Any, Any]] = {}
        self.skip, self.batch, self.outputs = False, None, None
        self.stacked = in_stacked() or type(ctx).__name__ == "StackedContext"
        self.optimizers = optimizers_of(ctx.optimizer)  # the client's torch optimizers (one, or a Joint's parts)
        opts = [ClientOptimizer(ctx, o, i == 0) for i, o in enumerate(self.optimizers)]
        module.__dict__["optimizers"] = lambda use_pl_optimizer=True: opts[0] if len(opts) == 1 else opts
        module.__dict__["lr_schedulers"] = lambda: _schedulers(task, ctx)
        module.__dict__["manual_backward"] = self.manual_backward
        module.__dict__.update({k: SchedulerView(v, ctx) for k, v in task.hidden.items()})
        self.steps_itself = overrides(module, "optimizer_step") and not task.manual
        if not self.stacked:
            for opt in self.optimizers:
                self._wrap_step(opt)
            call_hook(module, "on_train_epoch_start", sink=self.logs)

    @contextmanager
    def trainer_optimizers(self):
        """Within the block (a ``training_step``), ``self.trainer.optimizers`` are the client's optimizers, over the
        parameters that train (a runner's copy of the module has its own), as ``toggle_optimizer`` needs."""
        trainer = self.task.trainer
        saved, trainer.optimizers = trainer.optimizers, self.optimizers
        try:
            yield
        finally:
            trainer.optimizers = saved

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        ctx = self.ctx
        if ctx.fabric is None or ctx._plain:
            loss.backward(*args, **kwargs)
        else:
            ctx.fabric.backward(loss, *args, **kwargs)
            for opt in self.optimizers:
                ctx.fabric.strategy.precision.unscale_gradients(opt)

    def before_step(self, batch: Any, k: int) -> bool:
        """Before ``training_step`` of local step ``k`` (once per step, even when a rule evaluates it twice); True
        once ``on_train_batch_start`` has returned -1: Lightning then skips the rest of the epoch, so the client's
        remaining steps take no optimizer step and call no batch hook."""
        scratch = self.ctx.scratch
        if self.stacked or scratch.get("lightning_batch") == k or scratch.get("lightning_cut"):
            return bool(scratch.get("lightning_cut"))
        scratch["lightning_batch"] = k
        self.skip, self.batch, self.outputs = False, batch, None
        if call_hook(self.module, "on_train_batch_start", batch, k, sink=self.logs) == -1:
            scratch["lightning_cut"] = True
        return bool(scratch.get("lightning_cut"))

    def before_backward(self, loss: Tensor) -> None:
        """``on_before_zero_grad`` (automatic optimisation: fedlight zeroes the gradients then) and
        ``on_before_backward``, as Lightning's closure calls them after ``training_step``."""
        if not self.stacked:
            if not self.task.manual:
                call_hook(self.module, "on_before_zero_grad", self.optimizers[0], sink=self.logs)
            call_hook(self.module, "on_before_backward", loss, sink=self.logs)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        step = optimizer.step

        def hooked(*args: Any, **kwargs: Any) -> Any:
            scratch = self.ctx.scratch
            out, k = None, self.ctx.step_index if scratch.get("lightning_cut") else scratch.get("lightning_batch", 0)
            if not self.skip:  # training_step returned None: no optimizer step, as in Lightning
                call_hook(self.module, "on_after_backward", sink=self.logs)
                if self.steps_itself:  # the module's optimizer_step, with the closure, as Lightning calls it
                    view = StepView(optimizer, lambda: self._step(optimizer, step, *args, **kwargs))
                    call_hook(self.module, "optimizer_step", self.task.trainer.current_epoch, k, view,
                              lambda: self.outputs, sink=self.logs)
                    out = view.out
                else:
                    out = self._step(optimizer, step, *args, **kwargs)
            if not self.task.manual:
                if not self.ctx.scratch.get("lightning_cut"):
                    call_hook(self.module, "on_train_batch_end", self.outputs, self.batch, k, sink=self.logs)
                if k == self.ctx.num_steps - 1:
                    self.end()
            return out

        optimizer.step = hooked

    def _step(self, optimizer: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        call_hook(self.module, "on_before_optimizer_step", optimizer, sink=self.logs)
        return step(*args, **kwargs)

    def end(self) -> None:
        """After the client's last step: ``on_train_epoch_end`` (once)."""
        if self.stacked or self.ctx.scratch.get("lightning_ended"):
            return
        self.ctx.scratch["lightning_ended"] = True
        self.task.trainer.global_step = self.ctx.round * self.ctx.num_steps + self.ctx.num_steps
        call_hook(self.module, "on_train_epoch_end", sink=self.logs)
        schedule = self.task.schedule
        if self.task.manual and schedule:
            said = schedule.unfollowed_calls(self.ctx.scratch.get("lightning_scheduler_calls", {}), self.ctx.round,
                                             self.ctx.num_steps)
            if said:
                note(self.ctx.fabric, said)
        self.task._train_logs(self.logs, self.ctx.scratch["lightning_logs"], self.ctx, final=True)
        self.logs.clear()


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


def _schedulers(task: Any, ctx: Any) -> Any:
    views = [SchedulerView(c.scheduler, ctx) for c in (task.trainer.lr_scheduler_configs if task.trainer else [])]
    return None if not views else views[0] if len(views) == 1 else views
