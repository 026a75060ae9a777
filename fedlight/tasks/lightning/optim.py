"""A LightningModule's own local optimization, used as it is written, and said in the run's first lines.

``configure_optimizers`` gives the local optimizer (class and hyperparameters of its first param group) and its lr
schedulers (replayed per step, :mod:`.lightning_schedule`), unless the rule prescribes its own optimizer. fedlight's
own defaults for its models do not apply to a LightningModule: ``loop.lr``, ``loop.weight_decay``,
``loop.momentum`` and ``loop.lr_schedule`` are not used when the module brings an optimizer, and
``loop.max_grad_norm`` clips only when set to another value than its default (10). One line states what is used.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import SimpleNamespace
from typing import Any

from fedlight.core.loop_config import LoopConfig, LRSchedule
from fedlight.errors import ConfigError
from fedlight.tasks.lightning.compat import module_name, note, overrides
from fedlight.tasks.lightning.hooks import call_hook
from fedlight.tasks.lightning.schedule import Schedule, read_configure_optimizers
from fedlight.tasks.lightning.trainer import FedTrainer, attach

DEFAULT_CLIP = LoopConfig.__dataclass_fields__["max_grad_norm"].default


def local_optimization(task: Any, fabric, model, algorithm, loop: LoopConfig, data=None):
    """Attach the stand-in trainer, call ``configure_model`` / ``setup("fit")``, and return ``(loop, optimizer
    factory or None, algorithm)`` for the module's own optimization (see the module docstring)."""
    from fedlight.tasks.lightning.manual import manual_algorithm

    name = module_name(model)
    _prepare(task, fabric, model, loop, data, name)
    task.manual = not model.automatic_optimization
    clip = loop.max_grad_norm if loop.max_grad_norm != DEFAULT_CLIP else None
    loop = dataclasses.replace(loop, max_grad_norm=clip)
    if task.manual:
        algorithm = manual_algorithm(algorithm, name)
    schedule = f"schedule `loop.lr_schedule` ({loop.lr_schedule.kind}), {_clip(clip)}"
    if not overrides(model, "configure_optimizers"):
        _say(fabric, task, f"local optimization: {name} has no configure_optimizers; `loop.optimizer` "
             f"{loop.optimizer.rsplit('.', 1)[-1]}(lr={loop.lr:g}, weight_decay={loop.weight_decay:g}), {schedule}")
        return loop, None, algorithm
    if _own_optimizer(algorithm):
        _say(fabric, task, f"{type(algorithm).__name__} prescribes its own local optimizer; "
             f"{name}.configure_optimizers() is not used (nor its lr schedulers); {schedule}")
        return loop, None, algorithm
    first, group = _module_optimizer(task, fabric, model, name)
    args = ", ".join(f"{k}={v}" for k, v in group.items()
                     if k in ("lr", "weight_decay") or (isinstance(v, (int, float, tuple)) and v and v is not True))
    in_round = "constant" if task.schedule else loop.local_lr_schedule  # the module's own schedule wins
    sched = (f"its lr schedule {task.schedule.describe()} (replayed per client step r·K+k; `loop.lr_schedule` and "
             "`loop.local_lr_schedule` do not apply)") if task.schedule else (
        "constant lr (no lr scheduler; `loop.lr_schedule` does not apply)" if in_round == "constant" else
        f"the module's lr under `loop.local_lr_schedule` {in_round} within each round (no lr scheduler)")
    _say(fabric, task, f"local optimizer from {name}.configure_optimizers(): {type(first).__name__}({args}); "
         f"{sched}; {_clip(clip)}; `loop.lr`, `loop.optimizer`, `loop.momentum` and `loop.weight_decay` are not used")
    _sgd_note(fabric, algorithm, first, group)
    loop = dataclasses.replace(loop, lr=float(group["lr"]), weight_decay=float(group.get("weight_decay", 0.0)),
                               momentum=0.0, lr_schedule=LRSchedule(), local_lr_schedule=in_round)
    hyper = {k: v for k, v in group.items() if k in _init_args(type(first)) and k != "lr"}
    task.hint = (f"the module's local optimizer {type(first).__name__} at lr {group['lr']:g} (from "
                 f"{name}.configure_optimizers()) may be too large for {type(algorithm).__name__}; lower it there")
    return loop, functools.partial(type(first), **hyper), algorithm


def _prepare(task: Any, fabric, model, loop: LoopConfig, data, name: str) -> None:
    """The stand-in trainer attached, ``configure_model`` and ``setup("fit")`` called, something to train."""
    steps = loop.local_steps or (loop.local_epochs or 1) * (
        max(data.steps_per_epoch(c) for c in range(data.num_clients)) if data is not None else 1)
    task.module = model
    task.trainer = FedTrainer(model, loop.rounds, steps, fabric, getattr(data, "datamodule", None))
    attach(model, task.trainer)
    call_hook(model, "configure_model")
    call_hook(model, "setup", "fit")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{name} has no trainable parameter (none with requires_grad=True, after configure_model): "
                          "there is nothing to train federatedly. Unfreeze at least one parameter")


def _module_optimizer(task: Any, fabric, model, name: str):
    """``configure_optimizers()`` read: its first optimizer and first param group's hyperparameters; the trainer's
    ``optimizers`` / ``lr_scheduler_configs`` and the task's schedule set; a note for each part not used."""

    optimizers, configs = read_configure_optimizers(model.configure_optimizers(), name)
    first = optimizers[0]
    for line in _notes(name, optimizers, configs, first):
        note(fabric, line)
    task.trainer.optimizers = optimizers
    task.trainer.lr_scheduler_configs = [SimpleNamespace(**c) for c in configs]
    task.schedule = Schedule(first, configs)
    return first, {k: v for k, v in first.param_groups[0].items() if k != "params"}


def _say(fabric, task: Any, line: str) -> None:
    (fabric.print if fabric is not None else print)(f"fedlight: {line}")
    task.effective = line


def _clip(clip: float | None) -> str:
    return (f"gradient clip {clip:g} (`loop.max_grad_norm`)" if clip is not None else
            f"no gradient clip (fedlight's default `loop.max_grad_norm` {DEFAULT_CLIP:g} is for its own models; set "
            "another value to clip)")


def _own_optimizer(algorithm) -> bool:
    from fedlight.core.rules import LocalUpdateRule

    return type(algorithm.local).make_optimizer is not LocalUpdateRule.make_optimizer


def _notes(name: str, optimizers: list, configs: list, first) -> list[str]:
    out = []
    if len(optimizers) > 1:
        out.append(f"{name}.configure_optimizers() returns {len(optimizers)} optimizers; only the first is used "
                   "(and only schedulers of the first)")
    if len(first.param_groups) > 1:
        out.append(f"{name}.configure_optimizers()'s optimizer has {len(first.param_groups)} param groups; the first "
                   "group's hyperparameters apply to every parameter")
    return out


def _sgd_note(fabric, algorithm, first, group) -> None:
    """A rule whose local algebra is written for SGD steps, run with another optimizer: say what that means."""
    import torch

    from fedlight.core.rules import LocalUpdateRule

    if type(algorithm.local) is LocalUpdateRule or isinstance(first, torch.optim.SGD):
        return

    note(fabric, f"{type(algorithm).__name__}'s local algebra is written for plain SGD steps; here its direction is "
                 f"stepped by {type(first).__name__} at lr {group['lr']:g} (the module's), and the lr in its algebra "
                 "is that lr. Return torch.optim.SGD from configure_optimizers to run the rule as published")


def _init_args(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
