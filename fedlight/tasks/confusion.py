"""A torchmetrics metric of the summed confusion matrix (kept apart so importing the tasks does not import
torchmetrics, which pulls in the optional NLP packages when they are installed)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric


class ConfusionMetric(Metric):
    """A metric of the summed confusion matrix (``update(predicted, target)``; summed across processes)."""

    full_state_update = False

    def __init__(self, num_classes: int, fn: Callable[[Tensor], float]) -> None:
        super().__init__()
        self.num_classes, self.fn = num_classes, fn
        self.add_state("cm", default=torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        idx = target.long() * self.num_classes + preds.long()
        self.cm += torch.bincount(idx, minlength=self.num_classes**2).view(self.num_classes, self.num_classes)

    def compute(self) -> Tensor:
        return torch.tensor(self.fn(self.cm), dtype=torch.float64)
