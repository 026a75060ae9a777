"""Text classification (GLUE conventions): dict batches, cross-entropy; accuracy, F1 and Matthews correlation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedlight.errors import ConfigError
from fedlight.tasks.base import Task, check_class_count, check_vocab, eval_outputs, guard, outputs

HEADLINES = ("acc", "f1", "mcc", "loss")


class TextClassification(Task):
    """Batches are dicts ``{"input_ids", "attention_mask", ..., "labels"}``; the model is called with every key but
    ``labels`` (a Hugging Face ``...ForSequenceClassification`` or any module taking those keywords) and returns
    logits ``[B, num_classes]`` (or an object with ``.logits``).

    Reports ``test_acc``, ``test_f1`` (binary F1 of class 1 for two classes, as GLUE's MRPC/QQP; macro F1 over the
    classes that occur in the labels or predictions otherwise), ``test_mcc`` (Matthews correlation, GLUE's CoLA
    metric) and ``test_loss``. F1 and MCC are computed as GLUE does (scikit-learn's ``f1_score`` /
    ``matthews_corrcoef``) from the summed confusion matrix, in float64: a constant predictor has MCC 0 and a class
    never predicted nor present has F1 0 (:func:`mcc`, :func:`f1`).

    Args:
        num_classes: number of labels; default: the data module's ``num_classes``.
        headline: which metric is the run's headline: ``acc`` (default), ``f1``, ``mcc`` or ``loss``.
    """

    reports = ("acc", "f1", "mcc", "loss")
    higher = ("acc", "f1", "mcc")

    def __init__(self, num_classes: int | None = None, headline: str = "acc") -> None:
        if headline not in HEADLINES:
            raise ConfigError(f"`task.headline` must be one of {', '.join(HEADLINES)}, got {headline!r}")
        self.num_classes = num_classes
        self.headline = headline
        self.higher_is_better = headline != "loss"

    def setup(self, data: Any) -> None:
        if self.num_classes is None and getattr(data, "num_classes", None) is not None:
            self.num_classes = int(data.num_classes)

    def objective(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(outputs(model(**_inputs(batch))), batch["labels"])

    def metrics(self) -> dict[str, Any]:
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        from fedlight.tasks.confusion import ConfusionMetric  # torchmetrics (and what it imports) only when evaluating

        n = self.num_classes
        return {"acc": MulticlassAccuracy(num_classes=n, average="micro"), "f1": ConfusionMetric(n, f1),
                "mcc": ConfusionMetric(n, mcc), "loss": MeanMetric()}

    def update(self, metrics, model, batch, forward) -> None:
        y = batch["labels"]
        logits = outputs(forward(model, **_inputs(batch))).float()
        metrics["loss"].update(F.cross_entropy(logits, y), len(y))
        metrics["acc"].update(logits, y)
        metrics["mcc"].update(logits.argmax(-1), y)
        metrics["f1"].update(logits.argmax(-1), y)

    def check(self, model: nn.Module, data: Any) -> None:
        if self.num_classes is None or self.num_classes < 2:
            raise ConfigError(f"TextClassification needs the number of labels (>= 2), got {self.num_classes}; set "
                              "`--task.init_args.num_classes` or give the data module a `num_classes`")
        check_vocab(model, data)

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        self.check(model, data)
        for name, batch in (("training", train_batch), ("test", test_batch)):
            if not isinstance(batch, dict) or "labels" not in batch or "input_ids" not in batch:
                got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
                raise ConfigError(f"TextClassification needs dict batches with `input_ids` and `labels`; the {name} "
                                  f"batch is {got}")
        logits = guard("the model's forward pass", lambda: eval_outputs(model, fabric, **_inputs(train_batch)))
        check_class_count(logits, self.num_classes, "num_labels")
        super().probe(model, train_batch, test_batch, data, fabric)

    def __repr__(self) -> str:
        return f"TextClassification(num_classes={self.num_classes}, headline={self.headline!r})"


def mcc(cm: Tensor) -> float:
    """Matthews correlation of a confusion matrix ``cm[true, predicted]`` (Gorodkin's K-class form, as scikit-learn's
    ``matthews_corrcoef``): ``(c·s − Σ_k p_k t_k) / √((s² − Σ_k p_k²)(s² − Σ_k t_k²))`` with c correct, s samples,
    t_k true and p_k predicted counts of class k; 0 when a factor of the denominator is 0 (one class predicted, or
    one class present)."""
    cm = cm.double()
    t, p, c, s = cm.sum(1), cm.sum(0), cm.trace(), cm.sum()
    den = (s * s - p.dot(p)) * (s * s - t.dot(t))
    return 0.0 if den == 0 else float((c * s - t.dot(p)) / den.sqrt())


def f1(cm: Tensor) -> float:
    """F1 of a confusion matrix ``cm[true, predicted]``: two classes, F1 of class 1 (``2TP / (2TP + FP + FN)``, 0 when
    that is 0/0), as GLUE's MRPC/QQP; more, the mean of the per-class F1 over the classes present in the labels or
    the predictions (scikit-learn's ``average="macro"``)."""
    cm = cm.double()
    tp = cm.diagonal()
    den = cm.sum(0) + cm.sum(1)  # 2TP + FP + FN per class
    per = torch.where(den > 0, 2 * tp / den.clamp_min(1), torch.zeros_like(tp))
    if len(cm) == 2:
        return float(per[1])
    return float(per[den > 0].mean()) if bool((den > 0).any()) else 0.0


def _inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}
