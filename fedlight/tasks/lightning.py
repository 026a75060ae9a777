"""A LightningModule as the model: its ``training_step`` is the client objective, its ``test_step`` (else
``validation_step``) with ``self.log`` is the evaluation, its ``configure_optimizers`` the local optimizer.

``self.log`` / ``self.log_dict`` are captured while fedlight calls the module's steps (no Trainer is needed and
Lightning does not warn): values logged in ``training_step`` become per-client training metrics (``train/<name>``,
the mean over the client's calls, then over clients); values logged in ``test_step`` are reduced over the whole test
set as Lightning reduces ``on_epoch`` values — tensors and numbers by their batch-size-weighted mean, torchmetrics
objects computed once at the end — and reported as ``test_<name>`` (a ``test_``/``val_``/``test/``/``val/``
prefix of the logged name is dropped).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.errors import ConfigError
from fedlight.params import in_stacked
from fedlight.tasks.base import Task, guard, higher_is_better, precision_forward

PREFIXES = ("test_", "val_", "test/", "val/", "valid_", "validation_")


def is_lightning_module(model: Any) -> bool:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover - lightning is a dependency
        return False
    return isinstance(model, LightningModule)


class LightningTask(Task):
    """The task a LightningModule brings (built by ``fit`` when the model is one; no need to pass it).

    Args:
        headline: the headline metric (a name ``test_step`` logs, without prefix); default: ``acc`` or the first
            logged name containing it, else ``loss``, else the first name logged.
        higher_is_better: the headline's direction; default: by its name (accuracy, F1, R², ... higher).
    """

    stacked_note = ("a LightningModule's training_step logs per client (force stacked clients with "
                    "`--loop.client_parallelism vmap`; values logged inside a stacked step are not kept)")

    def __init__(self, headline: str | None = None, higher_is_better: bool | None = None) -> None:
        self._headline, self._higher = headline, higher_is_better
        self.names: tuple[str, ...] | None = None  # learned by the probe (what test_step logs)
        self._objects: dict[str, Any] = {}  # logged torchmetrics objects, by logged name
        self._values: set[str] = set()  # names logged as plain values

    # ----------------------------------------------------------------------------------------- headline
    @property
    def headline(self) -> str:
        if self._headline is not None:
            return self._headline
        names = self.names or ()
        return next((n for n in names if n == "acc"), None) or next((n for n in names if "acc" in n), None) or (
            "loss" if "loss" in names else (names[0] if names else "loss"))

    @property
    def higher_is_better(self) -> bool:
        return self._higher if self._higher is not None else higher_is_better(self.headline)

    def metric_names(self) -> tuple[str, ...]:
        return tuple(f"test_{n}" for n in (self.names or ()))

    # ----------------------------------------------------------------------------------------- training
    def objective(self, model: nn.Module, batch: Any, batch_idx: int = 0) -> Tensor:
        out = model.training_step(batch, batch_idx)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise ConfigError(f"{_name(model)}.training_step must return the loss tensor or a dict holding "
                              f"\"loss\", got {type(out).__name__}")
        return loss

    def client_objective(self, ctx: Any):
        """``training_step(batch, k)`` with ``k`` the client's local step; its ``self.log`` values (outside a
        stacked step, where they are per-client slices that cannot leave vmap) become ``train/<name>`` metrics."""
        sums = ctx.scratch.setdefault("lightning_logs", {})

        def objective(model, batch):
            module = getattr(model, "_fedlight_module", model)  # the stacked runner passes a binding of the module
            with capture_logs(module) as logs:
                loss = self.objective(model, batch, ctx.step_index)
            if logs and not in_stacked():
                for name, (value, _) in logs.items():
                    if isinstance(value, (Tensor, int, float)):
                        s, n = sums.get(name, (0.0, 0))
                        sums[name] = (s + torch.as_tensor(value).detach().double(), n + 1)
                        ctx.metrics[f"train/{_strip(name)}"] = sums[name][0] / sums[name][1]
            return loss

        return objective

    # ----------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any], fabric: Any = None) -> dict[str, float]:
        step = _eval_step(model)
        forward = precision_forward(fabric)
        sums: dict[str, Any] = {}
        objects: dict[str, Any] = dict(self._objects)  # every rank computes every metric (they sync in compute)
        was = model.training
        model.eval()
        try:
            for i, batch in enumerate(batches):
                with capture_logs(model) as logs:
                    forward(_Step(step), batch, i)
                _reduce(logs, batch, sums, objects)
        finally:
            model.train(was)
        for name in self._values:  # a rank without test batches still takes part in the reduction
            sums.setdefault(name, _mean_metric(next(model.parameters()).device))
        out = {f"test_{_strip(k)}": float(m.compute()) for k, m in sums.items()}
        for k, metric in objects.items():
            out[f"test_{_strip(k)}"] = float(metric.compute())
            metric.reset()
        self._objects.update(objects)
        self._values.update(k for k in sums if k not in objects)
        return out

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        name = _name(model)
        from lightning.pytorch import LightningModule

        if type(model).training_step is LightningModule.training_step:
            raise ConfigError(f"{name} has no training_step: fedlight trains clients with it. Define "
                              "`training_step(self, batch, batch_idx)` returning the loss")
        _eval_step(model)
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), capture_logs(model):
                loss = guard("the LightningModule's training_step", lambda: self._probe_loss(model, train_batch,
                                                                                              fabric))
        finally:
            model.train(was)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise ConfigError(f"{name}.training_step must return a scalar loss, got "
                              f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}")
        logged = guard("the LightningModule's test_step", lambda: self.evaluate(model, [test_batch], fabric))
        if not logged:
            raise ConfigError(f"{name}'s {_eval_step(model).__name__} logs nothing: fedlight evaluates the global "
                              "model with what it logs. Call `self.log(\"test_acc\", acc)` (or a loss) in it")
        self.names = tuple(k[len("test_"):] for k in logged)
        if self.headline not in self.names:
            raise ConfigError(f"`task.headline` {self.headline!r} is not logged by {name}'s test_step (it logs "
                              f"{', '.join(self.names)})")

    @staticmethod
    def has_optimizer(model: nn.Module) -> bool:
        from lightning.pytorch import LightningModule

        return type(model).configure_optimizers is not LightningModule.configure_optimizers

    def optimizer(self, model: nn.Module) -> tuple[type, dict[str, Any], list[str]]:
        """The class and hyperparameters (first param group, ``lr`` included) of ``configure_optimizers()``, and a
        line for each part of its return that fedlight does not use (lr schedulers, more optimizers, more param
        groups): a round-based federated run sets the lr per round with ``loop.lr_schedule``."""
        opt = model.configure_optimizers()
        schedulers: list[Any] = []
        if isinstance(opt, dict):
            schedulers = [opt["lr_scheduler"]] if opt.get("lr_scheduler") is not None else []
            opt = opt.get("optimizer")
        elif isinstance(opt, (list, tuple)):
            if opt and isinstance(opt[0], (list, tuple)):  # ([optimizers], [schedulers])
                schedulers = list(opt[1]) if len(opt) > 1 else []
                opt = list(opt[0])
            else:
                opt = list(opt)
        optimizers = opt if isinstance(opt, list) else [opt]
        first = optimizers[0] if optimizers else None
        if not isinstance(first, torch.optim.Optimizer):
            raise ConfigError(f"{_name(model)}.configure_optimizers must return an optimizer (or a dict/list holding "
                              f"one), got {type(first).__name__}")
        name = f"{_name(model)}.configure_optimizers()"
        notes = []
        if schedulers:
            notes.append(f"{name} returns an lr scheduler, which is not used: fedlight sets the lr once per round "
                         "from `loop.lr_schedule` (set the schedule there)")
        if len(optimizers) > 1:
            notes.append(f"{name} returns {len(optimizers)} optimizers; only the first is used")
        if len(first.param_groups) > 1:
            notes.append(f"{name}'s optimizer has {len(first.param_groups)} param groups; the first group's "
                         "hyperparameters apply to every parameter")
        group = {k: v for k, v in first.param_groups[0].items() if k != "params"}
        return type(first), group, notes

    def __repr__(self) -> str:
        return "LightningTask()"


class _Step:
    """``forward(_Step(step), batch, i)`` runs ``step(batch, i)`` under the precision plugin."""

    def __init__(self, step) -> None:
        self.step = step

    def __call__(self, batch, i):
        return self.step(batch, i)


@contextmanager
def capture_logs(module: nn.Module):
    """Within the block, ``module.log(name, value, ...)`` and ``log_dict`` record ``{name: (value, batch_size)}``."""
    logs: dict[str, tuple[Any, int | None]] = {}

    def log(name, value, *args, batch_size=None, **kwargs):
        logs[name] = (value, batch_size)

    def log_dict(dictionary, *args, batch_size=None, **kwargs):
        for k, v in dictionary.items():
            logs[k] = (v, batch_size)

    module.__dict__["log"], module.__dict__["log_dict"] = log, log_dict
    try:
        yield logs
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _reduce(logs: dict[str, tuple[Any, int | None]], batch: Any, sums: dict, objects: dict) -> None:
    from torchmetrics import Metric

    for name, (value, bs) in logs.items():
        if isinstance(value, Metric):
            objects[name] = value
            continue
        value = torch.as_tensor(value).detach().double()
        if name not in sums:
            sums[name] = _mean_metric(value.device)
        sums[name].update(value, float(bs if bs is not None else _batch_size(batch)))


def _mean_metric(device) -> Any:
    from torchmetrics import MeanMetric

    return MeanMetric().to(device).set_dtype(torch.float64)


def _batch_size(batch: Any) -> int:
    """The first dimension of the first tensor of ``batch`` (as Lightning infers it)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = _batch_size(item)
        if n:
            return n
    return 1


def _eval_step(model: nn.Module):
    from lightning.pytorch import LightningModule

    for name in ("test_step", "validation_step"):
        if getattr(type(model), name) is not getattr(LightningModule, name):
            return getattr(model, name)
    raise ConfigError(f"{_name(model)} defines neither test_step nor validation_step: fedlight evaluates the global "
                      "model with one. Define `test_step(self, batch, batch_idx)` that calls `self.log(...)`")


def _strip(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _name(model: Any) -> str:
    return type(getattr(model, "_fedlight_module", model)).__name__
