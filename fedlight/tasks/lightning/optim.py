"""A LightningModule's own local optimization, used as it is written, and said in the run's first lines.

``configure_optimizers`` gives the local optimizers, rebuilt per client with every param group's own
hyperparameters (:mod:`.groups`), and their lr schedulers (replayed per step, :mod:`.schedule`), unless the rule
prescribes its own optimizer. Several optimizers need manual optimisation, as in Lightning; param groups whose lr or
weight decay differ are refused, naming the group, by a rule that cannot apply them (its own optimizer, or local
algebra that reads the one lr). fedlight's own defaults for its models do not apply to a LightningModule:
``loop.lr``, ``loop.weight_decay``, ``loop.momentum`` and ``loop.lr_schedule`` are not used when the module brings
an optimizer, and ``loop.max_grad_norm: auto`` does not clip it (a number does). One line states what is used.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from fedlight.core.loop_config import LoopConfig, LRSchedule
from fedlight.core.schedule import InRoundLR
from fedlight.errors import ConfigError
from fedlight.tasks.base import LocalOptimization
from fedlight.tasks.lightning import features
from fedlight.tasks.lightning.compat import module_name, note, overrides
from fedlight.tasks.lightning.groups import ModuleOptimizers, describe
from fedlight.tasks.lightning.hooks import call_hook
from fedlight.tasks.lightning.loggers import RunLoggers
from fedlight.tasks.lightning.module_data import own_data
from fedlight.tasks.lightning.schedule import Schedule, hidden_schedulers, read_configure_optimizers
from fedlight.tasks.lightning.trainer import FedTrainer, attach


def local_optimization(task: Any, fabric, model, algorithm, loop: LoopConfig, data=None) -> LocalOptimization:
    """Attach the stand-in trainer, call ``configure_model`` / ``setup("fit")``, and return the module's own
    optimization (see the module docstring)."""
    from fedlight.tasks.lightning.manual import manual_algorithm

    name = module_name(model)
    _prepare(task, fabric, model, loop, data, name)
    features.check(model, fabric, overrides(model, "test_step"), getattr(data, "datamodule", None))  # no silence
    task.manual = not model.automatic_optimization
    clip = None if loop.max_grad_norm == "auto" else loop.max_grad_norm
    loop = dataclasses.replace(loop, max_grad_norm=clip)
    if task.manual:
        algorithm = manual_algorithm(algorithm, name)
    schedule = f"schedule `loop.lr_schedule` ({loop.lr_schedule.kind}), {_clip(clip)}"
    if not overrides(model, "configure_optimizers"):
        return _said(fabric, loop, algorithm, None, f"local optimization: {name} has no configure_optimizers; "
                     f"`loop.optimizer` {loop.optimizer.rsplit('.', 1)[-1]}(lr={loop.lr:g}, weight_decay="
                     f"{loop.weight_decay:g}), {schedule}")
    optimizers, factory = _module_optimizers(task, model, name)
    own = algorithm.local.brings_optimizer
    _check_groups(name, factory, algorithm, loop, own)
    if own:
        task.schedule = None
        return _said(fabric, loop, algorithm, None, f"{type(algorithm).__name__} prescribes its own local "
                     f"optimizer; {name}.configure_optimizers() is not used (read only for its param groups; nor its "
                     f"lr schedulers); {schedule}")
    _check_closure(name, optimizers, algorithm, task.manual)
    _check_clipping(model, name, clip, task.manual)
    if getattr(task, "hidden", None):
        note(fabric, f"{name}.{', '.join(task.hidden)}, stepped in its optimizer_step, is replayed per client step "
                     "r·K+k as an `interval: \"step\"` scheduler (the step its optimizer_step takes there)")
    if task.schedule and (said := task.schedule.length_note(loop.rounds, task.trainer.num_training_batches)):
        note(fabric, said)
    first, group = optimizers[0], factory.groups[0]
    in_round = "constant" if task.schedule else loop.local_lr_schedule  # the module's own schedule wins
    sched = (f"its lr schedule {task.schedule.describe()} (replayed per client step r·K+k; `loop.lr_schedule` and "
             "`loop.local_lr_schedule` do not apply)") if task.schedule else (
        "constant lr (no lr scheduler; `loop.lr_schedule` does not apply)" if in_round == "constant" else
        f"the module's lr under `loop.local_lr_schedule` {in_round} within each round (no lr scheduler)")
    line = (f"local optimizer from {name}.configure_optimizers(): {' + '.join(describe(o) for o in optimizers)}"
            f"{_groups_said(factory)}; {sched}; {_clip(clip)}; `loop.lr`, `loop.optimizer`, `loop.momentum` and "
            "`loop.weight_decay` are not used")
    if not task.manual:
        _sgd_note(fabric, algorithm, first, group)
    lr = float(group["lr"] or group.get("initial_lr", 0.0)) or loop.lr  # a scheduler's warm-up may start at 0
    loop = dataclasses.replace(loop, lr=lr, weight_decay=float(group.get("weight_decay", 0.0)),
                               momentum=0.0, lr_schedule=LRSchedule(), local_lr_schedule=in_round)
    hint = (f"the module's local optimizer {type(first).__name__} at lr {group['lr']:g} (from "
            f"{name}.configure_optimizers()) may be too large for {type(algorithm).__name__}; lower it there")
    return _said(fabric, loop, algorithm, factory, line, hint)


def _said(fabric, loop, algorithm, factory, line: str, hint: str | None = None) -> LocalOptimization:
    """The result, its line printed from rank 0."""
    (fabric.print if fabric is not None else print)(f"fedlight: {line}")
    return LocalOptimization(loop=loop, algorithm=algorithm, optimizer=factory, effective=line, hint=hint)


def _prepare(task: Any, fabric, model, loop: LoopConfig, data, name: str) -> None:
    """The stand-in trainer attached, ``configure_model`` and ``setup("fit")`` called, something to train."""
    steps = loop.local_steps or (loop.local_epochs or 1) * (
        max(data.steps_per_epoch(c) for c in range(data.num_clients)) if data is not None else 1)
    task.module = model
    own = own_data(data)  # the module's own data hooks: no datamodule, as in Trainer.fit(model); setup already ran
    task.trainer = FedTrainer(model, loop.rounds, steps, fabric, None if own else getattr(data, "datamodule", None),
                              RunLoggers(task.record))
    attach(model, task.trainer)
    call_hook(model, "configure_model")
    if not (own and "fit" in data.datamodule.stages and data.datamodule.module is model):
        call_hook(model, "setup", "fit")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{name} has no trainable parameter (none with requires_grad=True, after configure_model): "
                          "there is nothing to train federatedly. Unfreeze at least one parameter")


def _module_optimizers(task: Any, model, name: str) -> tuple[list, ModuleOptimizers]:
    """``configure_optimizers()`` read: its optimizers, the factory that rebuilds them per client, the trainer's
    ``optimizers`` / ``lr_scheduler_configs`` and the task's schedule; several optimizers need manual optimisation
    (Lightning refuses them with automatic optimisation too)."""
    optimizers, configs = read_configure_optimizers(model.configure_optimizers(), name)
    if len(optimizers) > 1 and not task.manual:
        raise ConfigError(f"{name}.configure_optimizers() returns {len(optimizers)} optimizers, which Lightning, and "
                          "fedlight, train only with manual optimisation: set `self.automatic_optimization = False` "
                          "and step each in training_step (`opt_a, opt_b = self.optimizers()`), or return one "
                          "optimizer with param groups")
    factory = ModuleOptimizers(model, optimizers)  # before any replay of the schedule changes an lr
    configs = configs + hidden_schedulers(task, model, optimizers, configs, name)
    task.trainer.optimizers = optimizers
    task.trainer.lr_scheduler_configs = [SimpleNamespace(**c) for c in configs]
    task.schedule = Schedule(optimizers, configs)
    return optimizers, factory


def _check_groups(name: str, factory: ModuleOptimizers, algorithm, loop: LoopConfig, own: bool) -> None:
    """Refuse, naming the group, param groups whose lr or weight decay differ under a rule that cannot apply them."""
    differing = factory.differing()
    if not differing:
        return
    rule, (i, diff) = type(algorithm).__name__, differing[0]
    what = ", ".join(f"{k}={v:g}" for k, v in diff.items())
    first = ", ".join(f"{k}={factory.groups[0].get(k, 0.0):g}" for k in diff)
    why = (f"{rule} builds its own local optimizer with one lr and weight decay for every parameter" if own else
           f"{rule}'s local algebra reads one local lr" if _one_lr(algorithm.local) else
           f"`loop.local_lr_schedule: {loop.local_lr_schedule}` sets one lr for every parameter"
           if loop.local_lr_schedule != "constant" else None)
    if why is not None:
        raise ConfigError(f"{name}.configure_optimizers(): param group {i} ({what}) differs from group 0 ({first}); "
                          f"{why}, so it cannot honour the group. Use a rule that steps the module's optimizer "
                          "(fedavg, fedavgm, fedadam, fedsam ...), or give every group the same lr and weight decay")


def _check_closure(name: str, optimizers: list, algorithm, manual: bool) -> None:
    """An optimizer that needs a closure (LBFGS) re-evaluates the loss inside its step: FedAvg's client step takes it
    (Lightning's closure re-runs training_step on the batch); a rule that shapes the step cannot, and refuses."""
    from fedlight.core.rules import LocalUpdateRule
    from fedlight.tasks.lightning.stepping import needs_closure

    closing = [type(o).__name__ for o in optimizers if needs_closure(o)]
    if closing and not manual and type(algorithm.local) is not LocalUpdateRule:
        rule = type(algorithm).__name__
        raise ConfigError(f"{name}.configure_optimizers() returns {closing[0]}, whose step re-evaluates the loss "
                          f"through a closure; {rule} shapes the local step (its own gradients and corrections), "
                          "which a closure cannot re-run: train it under a rule whose client step is FedAvg's (fedavg, "
                          "fedavgm, fedadam), or return an optimizer that steps without a closure (SGD, Adam ...)")


def _check_clipping(model, name: str, clip: float | None, manual: bool) -> None:
    """An overridden ``configure_gradient_clipping`` decides the clip (the Trainer passes it its own settings):
    with `loop.max_grad_norm` a number as well, the gradients would be clipped twice."""
    if clip is not None and not manual and overrides(model, "configure_gradient_clipping"):
        raise ConfigError(f"{name}.configure_gradient_clipping clips the gradients itself, and `loop.max_grad_norm` "
                          f"{clip:g} would clip them before it: set `--loop.max_grad_norm auto` (no clip of "
                          "fedlight's) and clip in configure_gradient_clipping, or remove the override")


def _one_lr(part: Any, depth: int = 0) -> bool:
    """A client rule whose algebra (or one of its parts) reads the one local lr (``Σ_k η_k``: SCAFFOLD's
    correction) or sets it (FedSWA)."""
    if isinstance(part, InRoundLR) or hasattr(part, "lr_sum"):
        return True
    parts = part if isinstance(part, (list, tuple)) else list(vars(part).values()) if hasattr(part, "__dict__") else []
    return depth < 3 and any(_one_lr(p, depth + 1) for p in parts if not isinstance(p, (int, float, str, bool)))


def _groups_said(factory: ModuleOptimizers) -> str:
    differing = factory.differing()
    if not differing:
        return ""
    return "; param groups honoured: " + ", ".join(
        f"group {i} " + ", ".join(f"{k}={v:g}" for k, v in diff.items()) for i, diff in differing)


def _clip(clip: float | None) -> str:
    return (f"gradient clip {clip:g} (`loop.max_grad_norm`)" if clip is not None else
            "no gradient clip (`loop.max_grad_norm: auto` clips only fedlight's own models; set a number to clip)")


ADAPTIVE = ("adam", "ada", "rms", "lamb", "lion", "sophia", "shampoo")  # per-coordinate preconditioned steps


def _sgd_note(fabric, algorithm, first, group) -> None:
    """A rule whose local algebra is written for SGD steps, run with another optimizer: refused before round 1 for
    an adaptive one (its per-coordinate scaling rewrites the rule's correction and perturbation terms: not the
    published rule, and FedWMSAM with Adam diverged, 0.13 → 18.97 train loss, issue 59); said in one line for another
    (e.g. SGD variants), whose steps keep the rule's direction."""
    import torch

    from fedlight.core.rules import LocalUpdateRule

    if type(algorithm.local) is LocalUpdateRule or isinstance(first, torch.optim.SGD):
        return
    rule, opt = type(algorithm).__name__, type(first).__name__
    if any(k in opt.lower() for k in ADAPTIVE):
        raise ConfigError(f"{rule}'s local algebra is written for plain SGD steps, and the module's {opt} (from "
                          "configure_optimizers) would rescale each coordinate of its steps: that is not "
                          f"{rule}. Return torch.optim.SGD from configure_optimizers to run the rule as published, "
                          "or train with a rule that steps any optimizer (fedavg, fedavgm, fedadam) or one written "
                          "for adaptive local steps (fedadamw, local_adam, fedlada)")
    note(fabric, f"{rule}'s local algebra is written for plain SGD steps; here its direction is stepped by {opt} at "
                 f"lr {group['lr']:g} (the module's), and the lr in its algebra is that lr. Return torch.optim.SGD "
                 "from configure_optimizers to run the rule as published")
