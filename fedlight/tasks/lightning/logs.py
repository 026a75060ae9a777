"""``self.log`` captured while fedlight calls a LightningModule's hooks, reduced as Lightning reduces it.

Every call keeps Lightning's options: ``on_step`` / ``on_epoch`` (defaults by hook: a step hook logs on_step, an
epoch hook and the evaluation log on_epoch), ``reduce_fx`` (``mean`` weighted by the batch size, ``sum``, ``max``,
``min``), ``batch_size``; a value logged both on_step and on_epoch becomes ``<name>_step`` and ``<name>_epoch``, as
in Lightning. A torchmetrics object is computed at the epoch's end (then reset); on_step it gives the value its last
``forward`` returned. A client's round is its epoch (docs/lightning.md has the table).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.errors import ConfigError

OPTIONS = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx")  # self.log's positional order after value
REDUCE = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


@dataclass
class Logged:
    """One ``self.log`` call: the value and the options that decide how it is reduced."""

    value: Any
    batch_size: int | None
    reduce: str
    on_step: bool
    on_epoch: bool

    def names(self, name: str) -> list[tuple[str, bool]]:
        """``(key, is_step)`` for each place the value goes (forked names when logged both ways)."""
        both = self.on_step and self.on_epoch
        return ([(f"{name}_step" if both else name, True)] if self.on_step else []) + (
            [(f"{name}_epoch" if both else name, False)] if self.on_epoch else [])


def _reduce_name(fx: Any) -> str:
    name = fx.lower() if isinstance(fx, str) else getattr(fx, "__name__", None)
    if name not in REDUCE:
        raise ConfigError(f"`self.log(..., reduce_fx={fx!r})`: Lightning supports mean, sum, max and min only")
    return REDUCE[name]


@contextmanager
def capture_logs(module: nn.Module, step: bool = True):
    """Within the block, ``module.log`` and ``log_dict`` record ``{name: Logged}``; ``step``: the hook's defaults
    (a step hook logs on_step, an epoch hook or an evaluation on_epoch)."""
    logs: dict[str, Logged] = {}

    def entry(value, args, kwargs) -> Logged:
        opts = dict(zip(OPTIONS, args))
        opts.update({k: v for k, v in kwargs.items() if k in OPTIONS})
        on_step, on_epoch = opts.get("on_step"), opts.get("on_epoch")
        return Logged(value, kwargs.get("batch_size"), _reduce_name(opts.get("reduce_fx") or "mean"),
                      step if on_step is None else bool(on_step), (not step) if on_epoch is None else bool(on_epoch))

    def log(name, value, *args, **kwargs):
        logs[name] = entry(value, args, kwargs)

    def log_dict(dictionary, *args, **kwargs):
        for k, v in dictionary.items():
            logs[k] = entry(v, args, kwargs)

    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.__dict__["log"], module.__dict__["log_dict"] = log, log_dict
    try:
        yield logs
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)
        module.__dict__.update(saved)  # an enclosing capture keeps capturing


class ClientLogs:
    """One client's training logs over its round (its epoch): on_step values averaged over its steps, on_epoch
    values reduced by their ``reduce_fx``, torchmetrics objects computed at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, list] = {}  # key -> [reduce, total, weight]
        self.objects: dict[str, Any] = {}

    def add(self, logs: dict[str, Logged], batch: Any) -> dict[str, Tensor]:
        """Add one hook's logs; returns the latest value of each key (for ``trainer.callback_metrics``)."""
        from torchmetrics import Metric

        latest = {}
        for name, e in logs.items():
            for key, is_step in e.names(name):
                if isinstance(e.value, Metric):
                    if not is_step:
                        self.objects[key] = e.value
                        continue
                    value = e.value._forward_cache
                    if value is None:
                        continue
                else:
                    value = e.value
                value = torch.as_tensor(value).detach().double()
                if value.numel() != 1:
                    continue
                latest[key] = value
                reduce = "mean" if is_step else e.reduce
                weight = 1.0 if is_step or e.batch_size is None and batch is None else float(
                    e.batch_size if e.batch_size is not None else batch_size(batch))
                s = self.sums.setdefault(key, [reduce, None, 0.0])
                s[1] = _fold(reduce, s[1], value * weight if reduce == "mean" else value)
                s[2] += weight
        return latest

    def values(self, final: bool = False) -> dict[str, Any]:
        """The client's values so far; ``final``: also its torchmetrics objects (computed, then reset)."""
        out = {k: total / weight if reduce == "mean" else total for k, (reduce, total, weight) in self.sums.items()}
        if final:
            for k, m in self.objects.items():
                out[k] = m.compute().detach().double()
                m.reset()
        return out


def _fold(reduce: str, total: Tensor | None, value: Tensor) -> Tensor:
    if total is None:
        return value
    return total + value if reduce in ("mean", "sum") else torch.maximum(total, value) if reduce == "max" else \
        torch.minimum(total, value)


AGGREGATORS = {"mean": "MeanMetric", "sum": "SumMetric", "max": "MaxMetric", "min": "MinMetric"}


def eval_reduce(logs: dict[str, Logged], batch: Any, sums: dict, objects: dict, kinds: dict) -> None:
    """Add one evaluation call's on_epoch logs: values to a torchmetrics aggregator of their ``reduce_fx`` (they
    sync across processes in ``compute``), torchmetrics objects kept to compute once. On_step-only values are not
    reported (a run has no per-batch test row)."""
    from torchmetrics import Metric

    for name, e in logs.items():
        for key, is_step in e.names(name):
            if is_step:
                continue
            if isinstance(e.value, Metric):
                objects[key] = e.value
                continue
            value = torch.as_tensor(e.value).detach().double()
            kinds[key] = e.reduce
            if key not in sums:
                sums[key] = aggregator(e.reduce, value.device)
            if e.reduce == "mean":
                sums[key].update(value, float(e.batch_size if e.batch_size is not None else batch_size(batch)))
            else:
                sums[key].update(value)


def aggregator(reduce: str, device) -> Any:
    import torchmetrics.aggregation as agg

    return getattr(agg, AGGREGATORS[reduce])().to(device).set_dtype(torch.float64)


def batch_size(batch: Any) -> int:
    """The first dimension of the first tensor of ``batch`` (as Lightning infers it)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_size(item)
        if n:
            return n
    return 1
