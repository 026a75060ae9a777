"""Regression: mean squared error training; MSE, MAE and R² on the test set."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from fedlight.errors import ConfigError
from fedlight.tasks.base import Task, outputs


class Regression(Task):
    """``(x, y)`` batches with floating targets ``y`` of any shape ``[B, ...]``; the model's output must hold as many
    numbers per sample (``[B, 1]`` for a scalar target ``[B]`` is fine).

    Reports ``test_mse`` (the headline, lower is better), ``test_mae``, ``test_r2`` (R² over all target entries)
    and ``test_loss`` (= MSE, the training objective on the test set).
    """

    headline = "mse"
    higher_is_better = False
    reports = ("mse", "mae", "r2", "loss")
    higher = ("r2",)

    def objective(self, model: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(_shaped(outputs(model(x)), y), y)

    def metrics(self) -> dict[str, Any]:
        from torchmetrics import MeanAbsoluteError, MeanMetric, MeanSquaredError, R2Score

        return {"mse": MeanSquaredError(), "mae": MeanAbsoluteError(), "r2": R2Score(), "loss": MeanMetric()}

    def update(self, metrics, model, batch, forward) -> None:
        x, y = batch
        pred = _shaped(outputs(forward(model, x)), y).float().reshape(-1)
        y = y.float().reshape(-1)
        for k in ("mse", "mae", "r2"):
            metrics[k].update(pred, y)
        metrics["loss"].update(F.mse_loss(pred, y), len(y))

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        _, y = train_batch
        if not y.dtype.is_floating_point:
            raise ConfigError(f"Regression needs floating-point targets, but the data's targets are {y.dtype}; for "
                              "class labels use `--task Classification`")
        super().probe(model, train_batch, test_batch, data, fabric)


def _shaped(pred: Tensor, y: Tensor) -> Tensor:
    """``pred`` in the shape of ``y`` when both hold the same numbers per sample (``[B, 1]`` vs ``[B]``)."""
    if pred.shape == y.shape:
        return pred
    if pred.numel() != y.numel():
        raise ValueError(f"the model predicts {tuple(pred.shape)} for targets of shape {tuple(y.shape)}; set the "
                         "model's output size to the number of targets per sample")
    return pred.reshape(y.shape)
