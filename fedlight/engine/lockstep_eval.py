"""Evaluation batched over runs: the global models of a lockstep group's runs, evaluated in one pass over their
shared test set.

Runs evaluate together (on a GPU; on CPU see :data:`ON_CPU`) when they share the model architecture, the task type,
the precision (one Fabric) and the test set itself (``test_subset`` draws it from the run seed, so seeds with a
subset evaluate apart). Each test batch
goes once through ``vmap`` of ``functional_call`` over the runs' stacked parameters and buffers (eval mode), under the
precision plugin as a run's own evaluation; each run's task then adds its slice of the outputs to its own metrics,
through the same ``Task.update`` its own evaluation calls. Anything else (a run alone, several processes) is each
run's own :meth:`FitDriver.evaluate <fedlight.engine.driver.FitDriver.evaluate>`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call, vmap

from fedlight.run.files import fault
from fedlight.tasks.base import precision_forward


def evaluate_together(drivers: list, say=None) -> list[tuple[dict[str, float] | None, Exception | None]]:
    """Each driver's test metrics (as its own ``evaluate()``), those that can share a pass evaluated in one, or the
    error its own evaluation raised (a shared pass that fails is done again run by run, ``say`` says so once)."""
    out: dict[int, tuple] = {}
    for part in _parts(drivers):
        metrics = None
        if len(part) > 1:
            try:
                metrics = _evaluate(part)
            except Exception as e:  # noqa: BLE001 - each run's own evaluation decides what fails
                if say is not None:
                    say(f"fedlight lockstep: evaluating {len(part)} runs in one pass failed ({type(e).__name__}: "
                        f"{e}); each run evaluates alone")
        for j, d in enumerate(part):
            out[id(d)] = (metrics[j], None) if metrics is not None else _alone(d)
    return [out[id(d)] for d in drivers]


def _alone(driver) -> tuple[dict[str, float] | None, Exception | None]:
    try:
        return driver.evaluate(), None
    except Exception as e:  # noqa: BLE001 - handed to the run, which fails as it would alone
        return None, e


def _parts(drivers: list) -> list[list]:
    parts: list[list] = []
    for d in drivers:
        home = next((p for p in parts if _same_pass(p[0].loop, d.loop)), None)
        if home is None:
            parts.append([d])
        else:
            home.append(d)
    return parts


ON_CPU = False
"""Evaluate runs in one pass on CPU too: off, as there it costs more CPU time than the runs one by one (16 % for three
Fashion-MNIST MLPs, results/performance.md §12); the tests turn it on."""


def _same_pass(a, b) -> bool:
    if a.device.type == "cpu" and not ON_CPU:
        return False
    if a.fabric is not b.fabric or a.fabric.world_size > 1 or type(a.task) is not type(b.task):
        return False
    if type(a.model) is not type(b.model) or a.state.meta["shapes"] != b.state.meta["shapes"]:
        return False
    return _same_test_set(a.data, b.data)


def _same_test_set(a, b) -> bool:
    """The same test batches: one data module, or two of the same kind holding equal test tensors."""
    if a is b:
        return True
    x, y = (getattr(a, "_test_x", None), getattr(a, "_test_y", None))
    x2, y2 = (getattr(b, "_test_x", None), getattr(b, "_test_y", None))
    if type(a) is not type(b) or x is None or x2 is None or a.eval_batch_size != b.eval_batch_size:
        return False
    return x.shape == x2.shape and torch.equal(y, y2) and torch.equal(x, x2)


def _evaluate(drivers: list) -> list[dict[str, float]]:
    """One pass over the lead's test batches for every driver's global model."""
    lead = drivers[0].loop
    for d in drivers:
        fault("eval", d.loop.state.rounds_done)  # the kill-safety tests stop a run here
    params = {k: torch.stack([d.loop.state.params[k] for d in drivers]) for k in lead.state.params}
    buffers = {k: torch.stack([d.loop.state.buffers[k] for d in drivers]) for k in lead.state.buffers}
    model, was = lead.model, lead.model.training
    metrics = [{k: m.to(lead.device) for k, m in d.task.metrics().items()} for d in drivers]
    forward = precision_forward(lead.fabric)
    model.eval()
    try:
        with torch.no_grad():
            for batch in lead.data.test_batches():
                shared = _Outputs(model, params, buffers)
                for i, d in enumerate(drivers):
                    d.task.update(metrics[i], shared.run(i), batch, forward)
    finally:
        model.train(was)
    return [{f"test_{k}": float(m.compute()) for k, m in ms.items()} for ms in metrics]


class _Outputs:
    """The stacked outputs of one test batch, computed once (by the first run's call) and sliced per run."""

    def __init__(self, model, params, buffers) -> None:
        self.model, self.params, self.buffers, self.out = model, params, buffers, None

    def run(self, i: int):
        return _Run(self, i)

    def __call__(self, *args: Any, **kwargs: Any):
        if self.out is None:
            call = lambda p, b: functional_call(self.model, (p, b), args, kwargs)  # noqa: E731
            self.out = vmap(call, randomness="different")(self.params, self.buffers)
        return self.out


class _Run:
    """Run ``i``'s model as its task's ``update`` calls it: its slice of the stacked outputs."""

    def __init__(self, outputs: _Outputs, i: int) -> None:
        self.outputs, self.i = outputs, i

    def __call__(self, *args: Any, **kwargs: Any):
        return _take(self.outputs(*args, **kwargs), self.i)


def _take(out: Any, i: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[i]
    if isinstance(out, (tuple, list)):
        return type(out)(_take(o, i) for o in out)
    if isinstance(out, dict):
        return {k: _take(v, i) for k, v in out.items()}
    return out
