"""Before round 1: one training and one test batch through a LightningModule, changing nothing."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedlight.errors import ConfigError
from fedlight.tasks.lightning.compat import is_lightning_module, module_name, note, overrides
from fedlight.tasks.lightning.errors import guard_user as guard
from fedlight.tasks.lightning.hooks import frozen
from fedlight.tasks.lightning.logs import capture_logs


def probe(task: Any, model, train_batch, test_batch, fabric=None) -> None:
    """Refuse, with the fix, a module without ``training_step``, a non-scalar loss or a module/data mismatch; learn
    what the evaluation logs (falling back to the training loss, with a note, when it logs nothing)."""

    name = module_name(model)
    if not overrides(model, "training_step"):
        raise ConfigError(f"{name} has no training_step: fedlight trains clients with it. Define "
                          "`training_step(self, batch, batch_idx)` returning the loss")
    copy = _copy(task, model)
    loss = _probe_loss(task, copy, train_batch, fabric)
    if not task.manual and (not isinstance(loss, Tensor) or loss.dim() != 0):
        raise ConfigError(f"{name}.training_step must return a scalar loss, got "
                          f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}")
    step = next((s for s in ("test_step", "validation_step") if overrides(model, s)), None)
    task.by_loss = step is None
    # the evaluation on the copy whose start hooks ran: state on_fit_start creates exists, as in fit-then-test
    logged = guard(f"{name}.{step or 'training_step on a test batch'}",
                   lambda: task.evaluate(copy, [test_batch], fabric), test_batch)
    if not logged and step is not None:
        task.by_loss = True
        logged = guard(f"{name}.training_step on a test batch", lambda: task.evaluate(copy, [test_batch], fabric),
                       test_batch)
    _own_metrics(task, copy, model)
    if task.by_loss:
        why = f"{name}.{step} logs nothing" if step else f"{name} defines neither test_step nor validation_step"
        by = ("training_step's loss on the test set (`test_loss`)" if "test_loss" in logged else
              f"what training_step logs on the test set ({', '.join(f'`{k}`' for k in logged)}; it returns no loss, "
              "and its optimizers step nothing there)")
        note(fabric, f"{why}: the global model is evaluated by {by}; log a metric with "
                     "`self.log(\"test_acc\", acc)` in a test_step to report your own")
    task.names = tuple(k[len("test_"):] for k in logged)
    if task.headline not in task.names:
        raise ConfigError(f"`task.headline` {task.headline!r} is not logged by {name}'s test_step (it logs "
                          f"{', '.join(task.names)})")
    _reset_metrics(model)  # on_fit_start / on_train_start: when the first round begins (LightningTask.begin_round)


def _probe_loss(task: Any, copy, batch, fabric) -> Any:
    """``training_step`` on one batch, after the start hooks in Lightning's order (``on_fit_start``,
    ``on_train_start``, ``on_train_epoch_start``, ``on_train_batch_start``), so state they create exists, then
    ``on_train_batch_end`` with what Lightning passes it: all on a copy of the module, so that the module that trains
    gets each hook once, at its moment (``begin_round``)."""
    from fedlight.tasks.lightning.hooks import batch_output

    was = copy.training
    copy.eval()
    optimizers = task.trainer.optimizers if task.trainer is not None else []
    try:
        with torch.no_grad(), capture_logs(copy), frozen(copy, optimizers):
            def step():
                if task.trainer is not None:
                    for hook, args in (("on_fit_start", ()), ("on_train_start", ()), ("on_train_epoch_start", ()),
                                       ("on_train_batch_start", (batch, 0))):
                        getattr(copy, hook)(*args)
                loss = task._probe_loss(copy, batch, fabric)
                if task.trainer is not None:
                    copy.on_train_batch_end(batch_output(task.output, loss, task.manual), batch, 0)
                return loss

            return guard(f"{module_name(copy)}.training_step", step, batch)
    finally:
        copy.train(was)


def _copy(task: Any, model) -> Any:
    """A deep copy of ``model`` sharing its stand-in trainer; the model itself, its start hooks then counted as
    called (``task.started``), when it cannot be copied."""
    import copy

    try:
        copied = copy.deepcopy(model, {id(task.trainer): task.trainer})
    except Exception:  # noqa: BLE001 - a module holding something that cannot be copied: its hooks run on itself
        task.started = True
        return model
    module = getattr(copied, "_fedlight_module", copied)
    if task.trainer is not None and is_lightning_module(module):  # Lightning does not copy its trainer
        module.trainer = task.trainer
    return copied


def _own_metrics(task: Any, copy, model) -> None:
    """The torchmetrics objects the evaluation learned on the copy, as the module's own (same place in it)."""
    if copy is model:
        return
    where = {id(m): n for n, m in copy.named_modules()}
    task._objects = {k: model.get_submodule(where[id(v)]) for k, v in task._objects.items() if id(v) in where}


def _reset_metrics(model) -> None:
    """The module's torchmetrics objects as before the probe (its batches are not training data)."""
    from torchmetrics import Metric

    for m in model.modules():
        if isinstance(m, Metric):
            m.reset()
