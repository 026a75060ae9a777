"""``self.logger`` / ``self.loggers`` of a LightningModule under fedlight: the run's own loggers, as Lightning lists
them.

``self.logger`` is Lightning's ``TensorBoardLogger`` on the run's ``RUN/tb`` whose ``experiment`` is the run's own
``SummaryWriter`` (what the module adds, e.g. ``self.logger.experiment.add_image(name, grid, self.current_epoch)``,
lands in the run's event files at the step it gives); ``log_metrics`` writes scalars there, ``log_hyperparams``
keeps the values in ``RUN/tb/hparams.yaml``. ``self.loggers`` is that logger, then the trackers ``--loggers`` names
(Lightning's ``MLFlowLogger``, ``WandbLogger``, ``CSVLogger``) once they are started (before round 1). On a process
other than global rank 0, and during the check of one batch before round 1, ``experiment`` is Lightning's dummy
experiment, which writes nothing (as Lightning's ``rank_zero_experiment``).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _tensorboard_class() -> type:
    from lightning.pytorch.loggers import TensorBoardLogger

    class RunTensorBoard(TensorBoardLogger):
        """Lightning's ``TensorBoardLogger`` writing through the run's ``SummaryWriter`` (never closing it)."""

        def __init__(self, record: Any) -> None:
            super().__init__(save_dir=str(record.out), name="", version="tb", default_hp_metric=False)
            self._record = record

        @property
        def experiment(self) -> Any:
            writer = self._record.summary_writer()
            if writer is None:
                from lightning.fabric.loggers.logger import _DummyExperiment

                return _DummyExperiment()
            return writer

        def log_hyperparams(self, params: Any, metrics: Any = None, step: int | None = None) -> None:
            if self._record.summary_writer() is None:  # nothing is written (Lightning's dummy has no file writer)
                return
            super().log_hyperparams(params, metrics, step)
            self.save()  # RUN/tb/hparams.yaml

        def finalize(self, status: str) -> None:
            """The run's writer is closed by the run, not by the module."""

    return RunTensorBoard


class RunLoggers:
    """The loggers of one run, read when the module asks (the trackers start after the module is prepared).

    Args:
        record: the run record (:class:`fedlight.run.record.RunRecord`), or ``None`` outside a run.
    """

    def __init__(self, record: Any) -> None:
        self.record = record
        self._tensorboard: Any = None

    def all(self) -> list:
        record = self.record
        if record is None:
            return []
        found = []
        if getattr(record, "tensorboard", True):
            if self._tensorboard is None:
                self._tensorboard = _tensorboard_class()(record)
            found.append(self._tensorboard)
        trackers = getattr(record, "trackers", None)
        if trackers is not None:
            found.extend(trackers.loggers.values())
        return found
