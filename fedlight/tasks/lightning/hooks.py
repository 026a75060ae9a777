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

from fedlight.core.params import in_stacked
from fedlight.tasks.lightning.compat import note, overrides
from fedlight.tasks.lightning.groups import optimizers_of
from fedlight.tasks.lightning.logs import capture_logs
from fedlight.tasks.lightning.stepping import (
    ClientOptimizer,
    NoStep,
    SchedulerView,
    StepView,
    frozen_out,
    needs_closure,
    rerun_closure,
    schedulers,
)


def call_hook(module: Any, name: str, *args: Any, sink: dict | None = None) -> Any:
    """``module.<name>(*args)`` with its ``self.log`` calls added to ``sink`` (``{name: Logged}``; an epoch hook
    logs on_epoch by default, a step hook on_step, as in Lightning)."""
    with capture_logs(module, step="epoch" not in name) as logs:
        out = getattr(module, name)(*args)
    if sink is not None:
        sink.update(logs)
    return out


@contextmanager
def frozen(module: Any, optimizers: list):
    """Within the block, ``self.optimizers()`` steps nothing; ``self.manual_backward`` and ``self.clip_gradients``
    do nothing (no gradient is taken)."""
    saved = {k: module.__dict__.get(k) for k in ("optimizers", "manual_backward", "clip_gradients")}
    views = [NoStep(o) for o in optimizers] or [NoStep()]
    module.__dict__["optimizers"] = lambda use_pl_optimizer=True: views[0] if len(views) == 1 else views
    module.__dict__["manual_backward"] = module.__dict__["clip_gradients"] = lambda *args, **kwargs: None
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
        self.skip, self.batch, self.outputs, self.model = False, None, None, None
        self.stacked = in_stacked() or type(ctx).__name__ == "StackedContext"
        self.optimizers = optimizers_of(ctx.optimizer)  # the client's torch optimizers (one, or a Joint's parts)
        opts = [ClientOptimizer(self, o, i == 0) for i, o in enumerate(self.optimizers)]
        module.__dict__["optimizers"] = lambda use_pl_optimizer=True: opts[0] if len(opts) == 1 else opts
        module.__dict__["lr_schedulers"] = lambda: schedulers(task, ctx)
        module.__dict__["manual_backward"] = self.manual_backward
        module.__dict__.update({k: SchedulerView(v, ctx) for k, v in task.hidden.items()})
        self.steps_itself = overrides(module, "optimizer_step") and not task.manual
        self.clips_itself = overrides(module, "configure_gradient_clipping") and not task.manual
        self.base = task.step_offset(ctx.round, ctx.num_steps)  # global_step when the client's round begins
        ctx.scratch.setdefault("lightning_steps", 0)
        if not self.stacked:
            for opt in self.optimizers:
                self._wrap_step(opt)
            task.trainer.global_step = self.base
            call_hook(module, "on_train_epoch_start", sink=self.logs)

    def call(self, name: str, *args: Any) -> Any:
        return call_hook(self.module, name, *args, sink=self.logs)

    @property
    def global_step(self) -> int:
        """Lightning's count of optimizer steps for this client (``trainer.global_step``)."""
        return self.base + self.ctx.scratch["lightning_steps"]

    def counted(self) -> None:
        """One optimizer step taken (Lightning counts it once the step is done)."""
        self.ctx.scratch["lightning_steps"] += 1
        self.task.trainer.global_step = self.global_step

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
        """Lightning's ``manual_backward``: ``on_before_backward``, the precision-aware backward,
        ``on_after_backward``."""
        ctx = self.ctx
        self.call("on_before_backward", loss)
        if ctx.fabric is None or ctx._plain:
            loss.backward(*args, **kwargs)
        else:
            ctx.fabric.backward(loss, *args, **kwargs)
            for opt in self.optimizers:
                ctx.fabric.strategy.precision.unscale_gradients(opt)
        self.call("on_after_backward")

    def before_step(self, batch: Any, k: int) -> bool:
        """Before ``training_step`` of local step ``k`` (once per step, even when a rule evaluates it twice); True
        once ``on_train_batch_start`` has returned -1: Lightning then skips the rest of the epoch, so the client's
        remaining steps take no optimizer step and call no batch hook."""
        scratch = self.ctx.scratch
        if not self.stacked:
            self.task.trainer.global_step = self.global_step
        if self.stacked or scratch.get("lightning_batch") == k or scratch.get("lightning_cut"):
            return bool(scratch.get("lightning_cut"))
        scratch["lightning_batch"] = k
        self.skip, self.batch, self.outputs = False, batch, None
        if self.call("on_train_batch_start", batch, k) == -1:
            scratch["lightning_cut"] = True
        return bool(scratch.get("lightning_cut"))

    def before_backward(self, loss: Tensor) -> None:
        """``on_before_zero_grad`` and ``on_before_backward``, as Lightning's closure calls them after
        ``training_step`` (automatic optimisation; under manual optimisation ``manual_backward`` calls them)."""
        if not self.stacked and not self.task.manual:
            self.call("on_before_zero_grad", self.optimizers[0])
            self.call("on_before_backward", loss)

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        step, closing = optimizer.step, needs_closure(optimizer)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if self.task.manual:  # self.optimizers()'s step called the hooks (stepping.ClientOptimizer)
                return step(*args, **kwargs)
            scratch = self.ctx.scratch
            out, k = None, self.ctx.step_index if scratch.get("lightning_cut") else scratch.get("lightning_batch", 0)
            if closing and not args and "closure" not in kwargs:  # LBFGS: Lightning's closure, re-run on the batch
                kwargs["closure"] = rerun_closure(self, optimizer, (self.outputs or {}).get("loss"))
            if not self.skip:  # training_step returned None: no optimizer step, as in Lightning
                self.call("on_after_backward")
                if self.steps_itself:  # the module's optimizer_step, with the closure, as Lightning calls it
                    view = StepView(optimizer, lambda: self._step(optimizer, step, *args, **kwargs))
                    self.call("optimizer_step", self.task.trainer.current_epoch, k, view, lambda: self.outputs)
                    out = view.out
                else:
                    out = self._step(optimizer, step, *args, **kwargs)
            if not scratch.get("lightning_cut"):
                self.counted()
                self.call("on_train_batch_end", self.outputs, self.batch, k)
            if k == self.ctx.num_steps - 1:
                self.end()
            return out

        optimizer.step = hooked

    def _step(self, optimizer: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        frozen_out(optimizer)
        self.call("on_before_optimizer_step", optimizer)
        if self.clips_itself:  # Lightning's Trainer calls it after on_before_optimizer_step, with its clip settings
            trainer = self.task.trainer
            self.call("configure_gradient_clipping", optimizer, trainer.gradient_clip_val,
                      trainer.gradient_clip_algorithm)
        return step(*args, **kwargs)

    def batch_end(self, k: int) -> None:
        """Under manual optimisation: ``on_train_batch_end`` after each ``training_step``, as Lightning calls it."""
        if not self.stacked and not self.ctx.scratch.get("lightning_cut"):
            self.call("on_train_batch_end", self.outputs, self.batch, k)

    def end(self) -> None:
        """After the client's last step: ``on_train_epoch_end`` (once)."""
        if self.stacked or self.ctx.scratch.get("lightning_ended"):
            return
        self.ctx.scratch["lightning_ended"] = True
        self.task.learned_steps(self.ctx.num_steps, self.ctx.scratch["lightning_steps"])
        self.task.trainer.global_step = self.global_step
        self.call("on_train_epoch_end")
        schedule = self.task.schedule
        if self.task.manual and schedule:
            said = schedule.unfollowed_calls(self.ctx.scratch.get("lightning_scheduler_calls", {}), self.ctx.round,
                                             self.ctx.num_steps)
            if said:
                note(self.ctx.fabric, said)
        self.task._train_logs(self.logs, self.ctx.scratch["lightning_logs"], self.ctx, final=True)
        self.logs.clear()


def batch_output(out: Any, loss: Any, manual: bool) -> dict:
    """What Lightning passes ``on_train_batch_end`` for what ``training_step`` returned: automatic optimisation
    ``{"loss": <detached loss>, **<the dict's other keys>}`` (``{}`` when it returned None); manual optimisation the
    dict (its ``"loss"`` detached), ``{"loss": <the tensor, detached>}``, or ``{}``."""
    if manual:
        extra = dict(out) if isinstance(out, dict) else {"loss": out} if isinstance(out, Tensor) else {}
        if isinstance(extra.get("loss"), Tensor):
            extra["loss"] = extra["loss"].detach()
        return extra
    if loss is None:
        return {}
    extra = {k: v for k, v in out.items() if k != "loss"} if isinstance(out, dict) else {}
    return {"loss": loss.detach().clone(), **extra}
