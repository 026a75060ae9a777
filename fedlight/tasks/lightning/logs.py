"""``self.log`` captured while fedlight calls a LightningModule's hooks, and test-set reduction as Lightning does."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


@contextmanager
def capture_logs(module: nn.Module):
    """Within the block, ``module.log(name, value, ...)`` and ``log_dict`` record ``{name: (value, batch_size)}``."""
    logs: dict[str, tuple[Any, int | None]] = {}

    def log(name, value, *args, batch_size=None, **kwargs):
        logs[name] = (value, batch_size)

    def log_dict(dictionary, *args, batch_size=None, **kwargs):
        for k, v in dictionary.items():
            logs[k] = (v, batch_size)

    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.__dict__["log"], module.__dict__["log_dict"] = log, log_dict
    try:
        yield logs
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)
        module.__dict__.update(saved)  # an enclosing capture keeps capturing


def _reduce(logs: dict[str, tuple[Any, int | None]], batch: Any, sums: dict, objects: dict) -> None:
    from torchmetrics import Metric

    for name, (value, bs) in logs.items():
        if isinstance(value, Metric):
            objects[name] = value
            continue
        value = torch.as_tensor(value).detach().double()
        if name not in sums:
            sums[name] = _mean_metric(value.device)
        sums[name].update(value, float(bs if bs is not None else _batch_size(batch)))


def _mean_metric(device) -> Any:
    from torchmetrics import MeanMetric

    return MeanMetric().to(device).set_dtype(torch.float64)


def _batch_size(batch: Any) -> int:
    """The first dimension of the first tensor of ``batch`` (as Lightning infers it)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = _batch_size(item)
        if n:
            return n
    return 1


