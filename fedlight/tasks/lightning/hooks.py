"""A LightningModule's hooks at their federated moments, for one client's local training.

``on_train_epoch_start`` when the client starts its round, ``on_train_batch_start`` / ``on_before_backward`` around
each ``training_step``, ``on_after_backward`` and ``on_before_optimizer_step`` just before each optimizer step (after
fedlight's clip when ``loop.max_grad_norm`` is set), ``on_train_batch_end`` after it and ``on_train_epoch_end``
after the client's last step. ``self.optimizers()`` is the client's optimizer (its ``step`` does what the rule's
step does: clip, step, count); ``self.manual_backward`` is the precision-aware backward; ``training_step``
returning ``None`` skips the step (no optimizer step), as in Lightning.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedlight.core import params as P
from fedlight.core.params import in_stacked
from fedlight.tasks.lightning.logs import capture_logs


def call_hook(module: Any, name: str, *args: Any, sink: dict | None = None) -> Any:
    """``module.<name>(*args)`` with its ``self.log`` values added to ``sink`` (``{name: (value, batch_size)}``)."""
    with capture_logs(module) as logs:
        out = getattr(module, name)(*args)
    if sink is not None:
        sink.update(logs)
    return out


class ClientOptimizer:
    """``self.optimizers()`` during a client's round: the client's optimizer, whose ``step`` clips (when
    ``loop.max_grad_norm`` is set), steps under the precision plugin and counts the lr, as the rule's own step."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._ctx.optimizer

    def step(self, closure: Any = None) -> None:
        ctx = self._ctx
        if closure is not None:
            closure()
        ctx.lr_sum += ctx.optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            P.joint_clip_([p.grad for p in ctx.params.values() if p.grad is not None], ctx.max_grad_norm)
        if ctx.fabric is None or ctx._plain:
            ctx.optimizer.step()
        else:
            ctx.fabric.strategy.optimizer_step(ctx.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._ctx.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx.optimizer, name)


class ClientHooks:
    """Installs the per-client pieces on the module and calls its training hooks (see the module docstring)."""

    def __init__(self, task: Any, module: Any, ctx: Any) -> None:
        self.task, self.module, self.ctx = task, module, ctx
        self.logs: dict[str, tuple[Any, Any]] = {}
        self.skip, self.batch, self.outputs = False, None, None
        self.stacked = in_stacked() or type(ctx).__name__ == "StackedContext"
        module.__dict__["optimizers"] = lambda use_pl_optimizer=True: ClientOptimizer(ctx)
        module.__dict__["lr_schedulers"] = lambda: _schedulers(task, ctx)
        module.__dict__["manual_backward"] = self.manual_backward
        if not self.stacked:
            self._wrap_step(ctx.optimizer)
            call_hook(module, "on_train_epoch_start", sink=self.logs)

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        ctx = self.ctx
        if ctx.fabric is None or ctx._plain:
            loss.backward(*args, **kwargs)
        else:
            ctx.fabric.backward(loss, *args, **kwargs)
            ctx.fabric.strategy.precision.unscale_gradients(ctx.optimizer)

    def before_step(self, batch: Any, k: int) -> None:
        """Before ``training_step`` of local step ``k`` (once per step, even when a rule evaluates it twice)."""
        if self.stacked or self.ctx.scratch.get("lightning_batch") == k:
            return
        self.ctx.scratch["lightning_batch"] = k
        self.skip, self.batch, self.outputs = False, batch, None
        call_hook(self.module, "on_train_batch_start", batch, k, sink=self.logs)

    def before_backward(self, loss: Tensor) -> None:
        if not self.stacked:
            call_hook(self.module, "on_before_backward", loss, sink=self.logs)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        step = optimizer.step

        def hooked(*args: Any, **kwargs: Any) -> Any:
            out, k = None, self.ctx.scratch.get("lightning_batch", 0)
            if not self.skip:  # training_step returned None: no optimizer step, as in Lightning
                call_hook(self.module, "on_after_backward", sink=self.logs)
                call_hook(self.module, "on_before_optimizer_step", optimizer, sink=self.logs)
                out = step(*args, **kwargs)
            if not self.task.manual:
                call_hook(self.module, "on_train_batch_end", self.outputs, self.batch, k, sink=self.logs)
                if k == self.ctx.num_steps - 1:
                    self.end()
            return out

        optimizer.step = hooked

    def end(self) -> None:
        """After the client's last step: ``on_train_epoch_end`` (once)."""
        if self.stacked or self.ctx.scratch.get("lightning_ended"):
            return
        self.ctx.scratch["lightning_ended"] = True
        self.task.trainer.global_step = self.ctx.round * self.ctx.num_steps + self.ctx.num_steps
        call_hook(self.module, "on_train_epoch_end", sink=self.logs)
        self.task._train_logs(self.logs, self.ctx.scratch.setdefault("lightning_logs", {}), self.ctx)
        self.logs.clear()


class SchedulerView:
    """``self.lr_schedulers()``: the module's scheduler as seen by a client; fedlight sets the lr by its interval
    (``step()`` does nothing, so a manual loop calling it keeps the same schedule)."""

    def __init__(self, scheduler: Any, ctx: Any) -> None:
        self._scheduler, self._ctx = scheduler, ctx

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self._ctx.optimizer.param_groups]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _schedulers(task: Any, ctx: Any) -> Any:
    views = [SchedulerView(c.scheduler, ctx) for c in (task.trainer.lr_scheduler_configs if task.trainer else [])]
    return None if not views else views[0] if len(views) == 1 else views
