"""Language modelling: next-token cross-entropy; perplexity and token accuracy on the test set."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedlight.errors import ConfigError
from fedlight.tasks.base import Task, check_vocab, outputs

IGNORE = -100
"""Target value that does not count (padding), as in PyTorch and Hugging Face."""


class LanguageModeling(Task):
    """Next-token prediction. A batch is one of:

    * an int64 tensor of token ids ``[B, T]``: the model sees ``t[:, :-1]`` and predicts ``t[:, 1:]``;
    * a pair ``(x, y)`` of int64 ``[B, T]`` tensors: ``y`` holds the target of every position of ``x`` already;
    * a dict with ``input_ids`` (and optionally ``attention_mask``, ``labels``): Hugging Face's convention, the
      labels aligned with the inputs (default: the inputs, padding masked) and shifted here.

    The model returns logits ``[B, T, vocab]`` (or an object with ``.logits``). Targets equal to ``-100`` are ignored.
    Reports ``test_perplexity`` (``exp`` of the token-mean cross-entropy; the headline, lower is better),
    ``test_token_acc`` and ``test_loss`` (token-mean cross-entropy).
    """

    headline = "perplexity"
    higher_is_better = False
    reports = ("perplexity", "token_acc", "loss")
    higher = ("token_acc",)

    def objective(self, model: nn.Module, batch: Any) -> Tensor:
        logits, y = self._logits_targets(model, batch, lambda m, *a, **k: m(*a, **k))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)

    def metrics(self) -> dict[str, Any]:
        from torchmetrics import MeanMetric

        return {"perplexity": _ExpMean(), "token_acc": MeanMetric(), "loss": MeanMetric()}

    def update(self, metrics, model, batch, forward) -> None:
        logits, y = self._logits_targets(model, batch, forward)
        logits, y = logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
        keep = y != IGNORE
        n = int(keep.sum())
        if n == 0:
            return
        nll = F.cross_entropy(logits[keep], y[keep])
        for k in ("perplexity", "loss"):
            metrics[k].update(nll, n)
        metrics["token_acc"].update((logits[keep].argmax(-1) == y[keep]).double().mean(), n)

    @staticmethod
    def _logits_targets(model, batch, forward) -> tuple[Tensor, Tensor]:
        if isinstance(batch, Tensor):
            return outputs(forward(model, batch[..., :-1])), batch[..., 1:]
        if isinstance(batch, dict):
            ids = batch["input_ids"]
            labels = batch.get("labels")
            if labels is None:
                mask = batch.get("attention_mask")
                labels = ids if mask is None else torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE))
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            return outputs(forward(model, **inputs))[..., :-1, :], labels[..., 1:]
        x, y = batch
        return outputs(forward(model, x)), y

    def check(self, model: nn.Module, data: Any) -> None:
        check_vocab(model, data)

    def probe(self, model, train_batch, test_batch, data, fabric=None) -> None:
        ids = train_batch if isinstance(train_batch, Tensor) else (
            train_batch["input_ids"] if isinstance(train_batch, dict) else train_batch[0])
        if ids.dtype.is_floating_point:
            raise ConfigError(f"LanguageModeling needs integer token ids, but the batch holds {ids.dtype}; keep "
                              "token tensors int64 in the data module")
        super().probe(model, train_batch, test_batch, data, fabric)


@functools.cache
def _exp_mean_cls():
    from torchmetrics import MeanMetric

    class ExpMean(MeanMetric):
        """``exp`` of a weighted mean (perplexity from token-mean cross-entropy)."""

        def compute(self) -> Tensor:
            return torch.exp(super().compute())

    return ExpMean


def _ExpMean():  # noqa: N802 - built lazily so importing the task does not import torchmetrics
    return _exp_mean_cls()()
