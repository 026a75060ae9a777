"""``self.trainer`` while fedlight calls a LightningModule's hooks: a small stand-in with federated meanings.

No Lightning ``Trainer`` runs. The attributes modules read are given these meanings (docs/lightning.md):

* ``current_epoch`` = the round ``r`` (0-based); ``max_epochs`` = ``loop.rounds`` (R);
* ``global_step`` = Lightning's count of optimizer steps, for a client as a Trainer fitting that client alone would
  count them had it trained every round before: automatic optimisation ``r·K + k`` (one per batch), manual
  optimisation ``r·S + s`` (``S``: the optimizer steps such a client takes in a round, every ``opt.step()`` of every
  optimizer; ``s``: those taken so far in this one); during evaluation after round ``r``: ``(r+1)·K`` / ``(r+1)·S``;
* ``max_steps`` = ``estimated_stepping_batches`` = ``R·K`` (K: the largest client's local steps), so a warm-up or
  a OneCycle schedule spans the whole run of one client;
* ``num_training_batches`` = ``K``; ``is_last_batch`` = the client's last local step of its round;
* ``strategy`` = Fabric's strategy (``SingleDeviceStrategy`` on one process, ``DDPStrategy`` on several);
  ``world_size`` / ``global_rank`` / ``local_rank`` / ``num_devices`` = fedlight's processes, as Fabric counts them;
* ``logger`` / ``loggers`` = the run's TensorBoard (a Lightning ``TensorBoardLogger`` whose ``experiment`` is the
  run's ``SummaryWriter`` on ``RUN/tb``), then the trackers ``--loggers`` names (MLflow, W&B, CSV), as Lightning
  lists them (``None`` / ``[]`` with ``--loggers none``);
* ``callback_metrics`` = the values logged so far (the last client's and the last evaluation's);
* ``optimizers`` / ``lr_scheduler_configs`` = what ``configure_optimizers`` returned (the optimizer that steps a
  client is built per client and round; see ``self.optimizers()``).

Any other attribute raises :class:`NotUnderFedlight` naming it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from fedlight.errors import ConfigError

PROVIDED = ("global_step", "current_epoch", "max_epochs", "max_steps", "estimated_stepping_batches",
            "num_training_batches", "is_last_batch", "strategy", "num_devices", "num_nodes", "world_size",
            "global_rank", "local_rank", "node_rank", "is_global_zero", "precision", "callback_metrics",
            "logged_metrics", "lightning_module", "optimizers", "lr_scheduler_configs", "training", "testing",
            "validating", "sanity_checking", "logger", "loggers", "datamodule", "accumulate_grad_batches",
            "progress_bar_callback", "fast_dev_run", "gradient_clip_val", "gradient_clip_algorithm",
            "precision_plugin")


class NotUnderFedlight(ConfigError, AttributeError):
    """A Trainer attribute fedlight does not provide (an ``AttributeError`` too, so ``hasattr`` says False)."""


class FedTrainer:
    """The stand-in ``self.trainer``; fedlight updates ``global_step``, ``current_epoch`` and the flags."""

    def __init__(self, module: Any, rounds: int, steps: int, fabric: Any = None, datamodule: Any = None,
                 run_loggers: Any = None) -> None:
        ws = fabric.world_size if fabric is not None else 1
        rank = fabric.global_rank if fabric is not None else 0
        local = fabric.local_rank if fabric is not None else 0
        d = self.__dict__
        d["_run_loggers"] = run_loggers  # fedlight.tasks.lightning.loggers.RunLoggers, when a run record writes
        d.update(lightning_module=module, max_epochs=rounds, max_steps=rounds * steps,
                 estimated_stepping_batches=rounds * steps, num_training_batches=steps, world_size=ws,
                 num_devices=ws, num_nodes=1, global_rank=rank, local_rank=local, node_rank=0,
                 is_last_batch=False, strategy=fabric.strategy if fabric is not None else _single_device(),
                 is_global_zero=rank == 0, global_step=0, current_epoch=0, callback_metrics={}, logged_metrics={},
                 optimizers=[], lr_scheduler_configs=[], training=False, testing=False, validating=False,
                 sanity_checking=False, datamodule=datamodule, accumulate_grad_batches=1,
                 progress_bar_callback=None, fast_dev_run=False, gradient_clip_val=None, gradient_clip_algorithm=None,
                 precision_plugin=_precision_plugin(),
                 precision=str(getattr(getattr(fabric, "_connector", None), "_precision_input", "32-true")))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotUnderFedlight(f"`self.trainer.{name}` is not available under fedlight: no Lightning Trainer runs. "
                               f"fedlight's stand-in provides {', '.join(PROVIDED)} (see docs/lightning.md)")

    @property
    def loggers(self) -> list:
        """The run's loggers as Lightning lists them: TensorBoard first, then the trackers (once started); within
        :meth:`muted`, Lightning's ``DummyLogger`` in their place."""
        found = self._run_loggers.all() if self._run_loggers is not None else []
        if found and self.__dict__.get("_muted"):
            from lightning.pytorch.loggers.logger import DummyLogger

            return [DummyLogger() for _ in found]
        return found

    @contextmanager
    def muted(self):
        """Within the block the loggers write nothing (``training_step`` run to evaluate the global model)."""
        self.__dict__["_muted"] = True
        try:
            yield
        finally:
            self.__dict__["_muted"] = False

    @property
    def logger(self) -> Any:
        """The first of :attr:`loggers` (``None`` without any), as Lightning's ``trainer.logger``."""
        found = self.loggers
        return found[0] if found else None

    def at(self, round: int, step: int, mode: str = "training") -> FedTrainer:
        """Set the round (``current_epoch``), ``global_step`` and which of training/testing is in progress."""
        self.current_epoch, self.global_step = round, step
        self.training, self.testing = mode == "training", mode == "testing"
        self.is_last_batch = False
        return self

    def __repr__(self) -> str:
        return f"FedTrainer(current_epoch={self.current_epoch}, global_step={self.global_step})"


def _precision_plugin() -> Any:
    """Lightning's own precision plugin, for ``self.clip_gradients`` (it clips the optimizer's parameters' gradients
    as the Trainer does; fedlight's precision has unscaled them already)."""
    from lightning.pytorch.plugins.precision import Precision

    return Precision()


def _single_device() -> Any:
    """Fabric's strategy of a one-process CPU run (the trainer outside a run, e.g. in a unit test)."""
    import torch
    from lightning.fabric.strategies import SingleDeviceStrategy

    return SingleDeviceStrategy(torch.device("cpu"))


def attach(module: Any, trainer: FedTrainer | None) -> None:
    """``module.trainer = trainer`` (and on every LightningModule inside it); ``None`` detaches. While attached,
    ``self.log`` outside the moments fedlight captures (e.g. a rule's own objective) keeps nothing."""
    module.trainer = trainer
    names = ("log", "log_dict", "optimizers", "manual_backward", "lr_schedulers")
    if trainer is None:
        for name in names:
            module.__dict__.pop(name, None)
    else:
        module.__dict__["log"] = module.__dict__["log_dict"] = _discard


def _discard(*args: Any, **kwargs: Any) -> None:
    return None
