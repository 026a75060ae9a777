"""Classification: cross-entropy training, accuracy and mean cross-entropy on the test set."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedlight.errors import ConfigError
from fedlight.tasks.base import Task, check_class_count, eval_outputs, guard, outputs


class Classification(Task):
    """``(x, y)`` batches, integer labels ``y``; the model returns logits ``[B, num_classes]``.

    Reports ``test_acc`` (micro accuracy, the headline, higher is better) and ``test_loss`` (mean cross-entropy).

    Args:
        num_classes: the number of classes; default: the data module's ``num_classes``.
    """

    headline = "acc"
    higher_is_better = True
    reports = ("acc", "loss")
    higher = ("acc",)

    def __init__(self, num_classes: int | None = None) -> None:
        self.num_classes = num_classes

    def setup(self, data: Any) -> None:
        if self.num_classes is None and getattr(data, "num_classes", None) is not None:
            self.num_classes = int(data.num_classes)

    def objective(self, model: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(outputs(model(x)), y)

    def metrics(self) -> dict[str, Any]:
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        if self.num_classes is None or self.num_classes < 2:
            raise ConfigError(f"Classification needs at least 2 classes, got num_classes={self.num_classes}; for "
                              "real-valued targets use `--task Regression`")
        return {"acc": MulticlassAccuracy(num_classes=self.num_classes, average="micro"), "loss": MeanMetric()}

    def update(self, metrics, model, batch, forward) -> None:
        x, y = batch
        logits = outputs(forward(model, x)).float()
        metrics["loss"].update(F.cross_entropy(logits, y, reduction="sum") / len(y), len(y))
        metrics["acc"].update(logits, y)

    def check(self, model: nn.Module, data: Any) -> None:
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError(f"Classification needs at least 2 classes, got {self.num_classes}; for real-valued "
                              "targets use `--task Regression`")

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        _, y = train_batch
        if not isinstance(y, torch.Tensor):  # e.g. string labels, collated into a list
            guard("Classification", lambda: torch.as_tensor(y), train_batch)
        if y.dtype.is_floating_point:
            raise ConfigError("Classification needs integer class labels, but the data's targets are floating "
                              f"point ({y.dtype}); for real-valued targets use `--task Regression`")
        self.check(model, data)
        logits = guard("the model's forward pass", lambda: eval_outputs(model, fabric, train_batch[0]))
        check_class_count(logits, self.num_classes)
        super().probe(model, train_batch, test_batch, data, fabric)

    def __repr__(self) -> str:
        return f"Classification(num_classes={self.num_classes})"

