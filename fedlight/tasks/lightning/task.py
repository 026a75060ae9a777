"""A LightningModule as the model: its ``training_step`` is the client objective, its ``test_step`` (else
``validation_step``) with ``self.log`` is the evaluation, its ``configure_optimizers`` the local optimizer and lr
schedule, its hooks are called at their federated moments (:mod:`.lightning_hooks`) and ``self.trainer`` is a
stand-in with federated meanings (:mod:`.lightning_trainer`). Modules from ``lightning.pytorch`` and from
``pytorch_lightning`` are treated alike (:mod:`.lightning_compat`).

``self.log`` / ``self.log_dict`` are captured while fedlight calls the module's hooks (no Trainer is needed and
Lightning does not warn): values logged while a client trains (``training_step``, the train hooks) become per-client
training metrics (``train/<name>``, the mean over the client's calls, then over clients); values logged in
``test_step`` and the test epoch hooks are reduced over the whole test set as Lightning reduces ``on_epoch`` values —
tensors and numbers by their batch-size-weighted mean, torchmetrics objects computed once at the end — and reported
as ``test_<name>`` (a ``test_``/``val_``/``test/``/``val/`` prefix of the logged name is dropped). A module whose
evaluation step is missing or logs nothing is evaluated by its ``training_step`` loss (``test_loss``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core.params import in_stacked
from fedlight.errors import ConfigError
from fedlight.tasks.base import LocalOptimization, Task, higher_is_better
from fedlight.tasks.lightning.compat import is_lightning_module, module_name, takes_index
from fedlight.tasks.lightning.hooks import ClientHooks, batch_output, call_hook, frozen, set_lrs
from fedlight.tasks.lightning.logs import ClientLogs, aggregator, batch_size, capture_logs
from fedlight.tasks.lightning.steps import GlobalSteps
from fedlight.tasks.lightning.trainer import FedTrainer, attach

PREFIXES = ("test_", "val_", "test/", "val/", "valid_", "validation_")

__all__ = ["LightningTask", "capture_logs", "is_lightning_module"]


class LightningTask(GlobalSteps, Task):
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
        self._values: dict[str, str] = {}  # names logged as plain values -> their reduce_fx
        self.trainer: FedTrainer | None = None  # attached by local_optimization
        self.module: Any = None
        self.schedule: Any = None  # the module's lr schedulers (lightning_schedule.Schedule), when it has any
        self.manual = False  # automatic_optimization = False
        self.by_loss = False  # evaluated by training_step's loss (no test_step/validation_step logging anything)
        self.round, self.steps = 0, 1
        self.optimization: LocalOptimization | None = None  # what local_optimization returned
        self.started = False  # on_fit_start was called
        self.hidden: dict[str, Any] = {}  # schedulers an overridden optimizer_step steps, by attribute (.schedule)
        self.data: Any = None
        self.record: Any = None  # the run record (set by the driver): the module's self.logger writes there
        self.output: Any = None  # what training_step last returned (on_train_batch_end's outputs are made of it)
        self.round_steps: dict[int, int] = {}  # manual optimisation: optimizer steps a client of K batches takes

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

    # ----------------------------------------------------------------------------------------- the run
    def local_optimization(self, fabric, model, algorithm, loop, data=None) -> LocalOptimization:
        """The module prepared (trainer attached, ``configure_model``), and the local optimization it brings
        (see :mod:`.optim`)."""
        from fedlight.tasks.lightning.optim import local_optimization

        self.data = data  # its test_loader_index: which of several test loaders a batch comes from
        self.optimization = local_optimization(self, fabric, model, algorithm, loop, data)
        return self.optimization

    @property
    def effective(self) -> str | None:
        return self.optimization.effective if self.optimization is not None else None

    @property
    def hint(self) -> str | None:
        return self.optimization.hint if self.optimization is not None else None

    def round_lrs(self, info: Any) -> tuple[float, float] | None:
        """The first group's lr at the round's first and last local step, by the module's schedule."""
        if not self.schedule:
            return None
        steps = max(1, round(info.num_steps))
        return self.schedule.lr(info.round, 0, steps), self.schedule.lr(info.round, steps - 1, steps)

    def begin_round(self, info: Any) -> None:
        """The round's state; before the run's first round (of this process, a resumed run's included), once its
        files are open so that ``self.logger`` writes: ``on_fit_start`` and ``on_train_start``."""
        self.round, self.steps = info.round, max(1, round(info.num_steps))
        if self.trainer is not None and not self.started:
            self.started = True
            self.trainer.at(self.round, self.step_offset(self.round, self.steps), "training")
            call_hook(self.module, "on_fit_start")
            call_hook(self.module, "on_train_start")

    def final_files(self, model: nn.Module) -> dict[str, Any]:
        """``final_model.ckpt``, which ``LightningModule.load_from_checkpoint`` loads (:mod:`.checkpoint`)."""
        from fedlight.tasks.lightning.checkpoint import NAME, lightning_checkpoint

        if self.trainer is None:
            return {}
        return {NAME: lightning_checkpoint(self.module, self.round, self.total_steps(self.round),
                                           self.trainer.datamodule)}

    def end(self, model: nn.Module) -> None:
        """After the last round: ``on_fit_end``, then the stand-in trainer is detached."""
        if self.trainer is not None:
            self.trainer.at(self.round, self.total_steps(self.round), "done")
            call_hook(model, "on_train_end")
            call_hook(model, "on_fit_end")
            call_hook(model, "teardown", "fit")
            model.__dict__.update(self.hidden)
            attach(model, None)

    # ----------------------------------------------------------------------------------------- training
    def objective(self, model: nn.Module, batch: Any, batch_idx: int = 0) -> Tensor | None:
        step = model.training_step
        out = self.output = step(batch, batch_idx) if takes_index(step) else step(batch)
        loss = out.get("loss") if isinstance(out, dict) else out
        if loss is None and (out is None or self.manual):
            return None
        if not isinstance(loss, Tensor):
            raise ConfigError(f"{module_name(model)}.training_step must return the loss tensor or a dict holding "
                              f"\"loss\", got {type(out).__name__}")
        return loss

    def client_objective(self, ctx: Any):
        """``training_step(batch, k)`` with ``k`` the client's local step, the lr of the module's schedule at the
        client's step ``r·K + k`` and the trainer's ``global_step`` / ``current_epoch`` set; its ``self.log``
        values (outside a stacked step, where they are per-client slices that cannot leave vmap) become
        ``train/<name>`` metrics. ``None`` from ``training_step`` skips the step."""
        sums = ctx.scratch.setdefault("lightning_logs", ClientLogs())
        trainer, K = self.trainer, ctx.num_steps
        if trainer is not None:
            trainer.at(ctx.round, self.step_offset(ctx.round, K))
        hooks = ctx.scratch["lightning_hooks"] = self._hooks(ctx) if trainer is not None else None

        def objective(model, batch):
            module, k = getattr(model, "_fedlight_module", model), ctx.step_index
            if self.schedule:
                set_lrs(ctx.optimizer, self.schedule.lrs(ctx.round, k, K))
            if hooks is not None:
                trainer.global_step, trainer.is_last_batch = ctx.round * K + k, k == K - 1  # (stacked clients)
                hooks.model = model
                if hooks.before_step(batch, k):  # on_train_batch_start returned -1: the client's round is over
                    return self._skipped(ctx, hooks)
            with capture_logs(module) as logs, hooks.trainer_optimizers() if hooks is not None else nullcontext():
                loss = self.objective(model, batch, k)
            again = ctx.scratch.get("lightning_closure")  # a closure optimizer's re-evaluation: Lightning's closure
            if hooks is not None and (again or ctx.scratch.get("lightning_out") != k):  # (SAM: the first one)
                ctx.scratch["lightning_out"] = k
                hooks.outputs = batch_output(self.output, loss, self.manual)
            if loss is None:
                loss = self._skipped(ctx, hooks)
            elif hooks is not None:
                hooks.before_backward(loss)
            if hooks is not None:
                logs.update(hooks.logs)
                hooks.logs.clear()
            if logs and not in_stacked() and (again or ctx.scratch.get("lightning_logged") != k):  # a rule evaluating
                ctx.scratch["lightning_logged"] = k  # the step twice (SAM) logs it once, at the first evaluation
                self._train_logs(logs, sums, ctx, batch)
            return loss

        return objective

    def _hooks(self, ctx: Any) -> ClientHooks:
        """The client's hooks on the module that trains it: the run's module, or a runner's copy of it (the streams
        runner's, ``ctx.scratch["client_model"]``), which gets the stand-in trainer too."""
        module = ctx.scratch.get("client_model")
        if not is_lightning_module(module):
            module = self.module
        elif getattr(module, "_trainer", None) is not self.trainer:
            attach(module, self.trainer)
        return ClientHooks(self, module, ctx)

    def _skipped(self, ctx: Any, hooks: Any) -> Tensor:
        """A zero loss (zero gradients) for a skipped step; its optimizer step is not taken."""
        if hooks is not None:
            hooks.skip = True
        return sum((p * 0).sum() for p in ctx.params.values())

    def _train_logs(self, logs: dict, sums: ClientLogs, ctx: Any, batch: Any = None, final: bool = False) -> None:
        """Add a hook's logs to the client's (:class:`.logs.ClientLogs`); its values so far become
        ``train/<name>`` (averaged over clients by the loop)."""
        latest = sums.add(logs, batch)
        for name, value in sums.values(final).items():
            ctx.metrics[f"train/{_strip(name)}"] = value
        if self.trainer is not None:
            self.trainer.callback_metrics.update(latest)

    # ----------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Any], fabric: Any = None) -> dict[str, float]:
        """The global model on the test batches, hooks and logs as Lightning's evaluation loop (:mod:`.evaluation`)."""
        from fedlight.tasks.lightning import evaluation

        sums: dict[str, Any] = {}
        objects: dict[str, Any] = dict(self._objects)  # every rank computes every metric (they sync in compute)
        if self.trainer is not None:
            self.trainer.at(self.round, self.total_steps(self.round), "testing")
        was = model.training
        model.eval()
        try:
            evaluation.run(self, model, batches, fabric, sums, objects)
        finally:
            model.train(was)
        return self._computed(model, sums, objects)

    def _computed(self, model, sums: dict, objects: dict) -> dict[str, float]:
        for name, reduce in self._values.items():  # a rank without test batches still takes part in the reduction
            sums.setdefault(name, aggregator(reduce, next(model.parameters()).device))
        # every rank computes (and so syncs) the metrics in the same order, whatever order it logged them in
        values = {k: float(sums[k].compute()) for k in sorted(sums)}
        for k in sorted(objects):
            values[k] = float(objects[k].compute())
            objects[k].reset()
        out = {f"test_{_strip(k)}": values[k] for k in [*sums, *objects]}
        self._objects.update(objects)
        if self.trainer is not None:
            self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in out.items()})
        return out

    def loss_step(self, model: nn.Module):
        """``step(batch, i, idx)``: the training loss logged as ``test_loss`` (a module without an evaluation step, or
        whose step logs nothing); what ``training_step`` writes to ``self.logger`` meanwhile is dropped."""
        module = getattr(model, "_fedlight_module", model)

        def by_loss(batch, i, idx=None):
            # the evaluation's capture; training_step's own logs are test metrics only when it returns nothing (a
            # GAN's manual step), which then steps nothing
            outer, optimizers = module.log, self.trainer.optimizers if self.trainer else []
            with capture_logs(module) as logs, frozen(module, optimizers), \
                    self.trainer.muted() if self.trainer else nullcontext():
                loss = self.objective(model, batch, i)
            if loss is not None:
                outer("test_loss", loss, batch_size=batch_size(batch))
            else:
                for name, e in logs.items():
                    outer(name, e.value, batch_size=e.batch_size, reduce_fx=e.reduce)

        return by_loss

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        from fedlight.tasks.lightning.probe import probe

        probe(self, model, train_batch, test_batch, fabric)

    def __repr__(self) -> str:
        return "LightningTask()"


def _strip(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name
