"""Text classification (GLUE conventions): dict batches, cross-entropy; accuracy, F1 and Matthews correlation."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from fedlight.errors import ConfigError
from fedlight.tasks.base import Task, check_class_count, check_vocab, eval_outputs, guard, outputs

HEADLINES = ("acc", "f1", "mcc", "loss")


class TextClassification(Task):
    """Batches are dicts ``{"input_ids", "attention_mask", ..., "labels"}``; the model is called with every key but
    ``labels`` (a Hugging Face ``...ForSequenceClassification`` or any module taking those keywords) and returns
    logits ``[B, num_classes]`` (or an object with ``.logits``).

    Reports ``test_acc``, ``test_f1`` (binary F1 of class 1 for two classes, as GLUE's MRPC/QQP; macro F1 otherwise),
    ``test_mcc`` (Matthews correlation, GLUE's CoLA metric) and ``test_loss``.

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
        from torchmetrics.classification import (
            BinaryF1Score,
            MulticlassAccuracy,
            MulticlassF1Score,
            MulticlassMatthewsCorrCoef,
        )

        n = self.num_classes
        f1 = BinaryF1Score() if n == 2 else MulticlassF1Score(num_classes=n, average="macro")
        return {"acc": MulticlassAccuracy(num_classes=n, average="micro"), "f1": f1,
                "mcc": MulticlassMatthewsCorrCoef(num_classes=n), "loss": MeanMetric()}

    def update(self, metrics, model, batch, forward) -> None:
        y = batch["labels"]
        logits = outputs(forward(model, **_inputs(batch))).float()
        metrics["loss"].update(F.cross_entropy(logits, y), len(y))
        metrics["acc"].update(logits, y)
        metrics["mcc"].update(logits.argmax(-1), y)
        metrics["f1"].update(logits.argmax(-1) if self.num_classes == 2 else logits, y)

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


def _inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}
