"""Tasks: what a batch is, what a client minimises, how the global model is evaluated (see :mod:`.base`).

* :class:`Classification` — ``(x, y)``, cross-entropy; accuracy (the default for fedlight's own datasets);
* :class:`Regression` — ``(x, y)`` with float targets, MSE; MSE / MAE / R²;
* :class:`TextClassification` — dict batches (``input_ids``, ``attention_mask``, ``labels``); accuracy, F1, MCC;
* :class:`LanguageModeling` — int64 token ids, next-token cross-entropy; perplexity, token accuracy;
* :class:`LightningTask` — a LightningModule's own ``training_step`` / ``test_step`` / ``configure_optimizers``.
"""

from __future__ import annotations

from typing import Any

from fedlight.tasks.base import Task
from fedlight.tasks.classification import Classification
from fedlight.tasks.language import LanguageModeling
from fedlight.tasks.lightning.task import LightningTask, is_lightning_module
from fedlight.tasks.regression import Regression
from fedlight.tasks.text import TextClassification

TASKS = ("Classification", "Regression", "TextClassification", "LanguageModeling", "LightningTask")

__all__ = ["TASKS", "Classification", "LanguageModeling", "LightningTask", "Regression", "Task",
           "TextClassification", "resolve_task"]


def resolve_task(task: Task | None, model: Any, data: Any) -> Task:
    """The run's task: the one given, else a LightningModule's own, else the data module's default
    (``data.default_task()``; classification for fedlight's datasets)."""
    if task is not None:
        return task
    if is_lightning_module(model):
        return LightningTask()
    default = getattr(data, "default_task", None)
    return default() if callable(default) else Classification()
