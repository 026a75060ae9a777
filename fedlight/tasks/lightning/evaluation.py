"""The evaluation of the global model after a round, as Lightning's evaluation loop calls the module.

``on_<stage>_start``, ``on_<stage>_epoch_start``, per batch ``on_<stage>_batch_start``, the step,
``on_<stage>_batch_end``, then ``on_<stage>_epoch_end`` and ``on_<stage>_end``, with ``<stage>`` ``test`` when the
module has a ``test_step``, else ``validation``. Several test loaders: every one is evaluated, ``test_step`` gets
``dataloader_idx`` and what it logs is named ``<name>/dataloader_idx_<i>``, as Lightning names it. A module evaluated
by its ``training_step`` (its own step missing or logging nothing) still gets its own step and hooks called (the
tutorials' GAN writes its validation images in ``on_validation_epoch_end``), and what ``training_step`` writes to
``self.logger`` there is dropped: images it logs come from training only.
"""

from __future__ import annotations

from typing import Any

from fedlight.tasks.base import precision_forward
from fedlight.tasks.lightning.compat import overrides, takes_index
from fedlight.tasks.lightning.hooks import call_hook
from fedlight.tasks.lightning.logs import capture_logs, eval_reduce

STEPS = (("test_step", "test"), ("validation_step", "validation"))


def own_step(model: Any) -> tuple[Any, str] | None:
    """``(step(batch, i, idx), stage)`` of the module's own evaluation step, else ``None``."""
    for name, stage in STEPS:
        if overrides(model, name):
            fn = getattr(model, name)
            return _call(fn), stage
    return None


def _call(fn: Any):
    def step(batch, i, idx=None):
        if idx is not None:
            return fn(batch, i, idx)
        return fn(batch, i) if takes_index(fn) else fn(batch)

    return step


def run(task: Any, model: Any, batches: Any, fabric: Any, sums: dict, objects: dict) -> None:
    """Every batch through the evaluation step, the hooks around (see the module docstring)."""
    own = own_step(model)
    step = own[0] if own is not None and not task.by_loss else task.loss_step(model)
    stage = own[1] if own is not None else "test"
    hooked = task.trainer is not None and (own is not None or not task.by_loss)
    forward, epoch_logs, counts = precision_forward(fabric), {}, {}
    if hooked:
        call_hook(model, f"on_{stage}_start", sink=epoch_logs)
        call_hook(model, f"on_{stage}_epoch_start", sink=epoch_logs)
    for batch in batches:
        idx = getattr(task.data, "test_loader_index", None)
        i = counts[idx] = counts.get(idx, -1) + 1
        extra = () if idx is None else (idx,)
        if hooked:
            call_hook(model, f"on_{stage}_batch_start", batch, i, *extra, sink=epoch_logs)
        with capture_logs(model, step=False) as logs:
            if own is not None and task.by_loss:  # its own step runs too (it logs nothing), as Lightning runs it
                forward(_Step(own[0]), batch, i, idx)
            out = forward(_Step(step), batch, i, idx)
        if hooked:
            call_hook(model, f"on_{stage}_batch_end", out, batch, i, *extra, sink=epoch_logs)
        eval_reduce(_named(logs, idx), batch, sums, objects, task._values)
    if hooked:
        call_hook(model, f"on_{stage}_epoch_end", sink=epoch_logs)
        call_hook(model, f"on_{stage}_end", sink=epoch_logs)
        eval_reduce(epoch_logs, None, sums, objects, task._values)


def _named(logs: dict, idx: int | None) -> dict:
    return logs if idx is None else {f"{k}/dataloader_idx_{idx}": v for k, v in logs.items()}


class _Step:
    """``forward(_Step(step), batch, i, idx)`` runs ``step(batch, i, idx)`` under the precision plugin."""

    def __init__(self, step) -> None:
        self.step = step

    def __call__(self, batch, i, idx=None):
        return self.step(batch, i, idx)
