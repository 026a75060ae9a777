"""What ``configure_optimizers`` returns, read in every form Lightning accepts, and its lr schedulers replayed.

A client's lr at local step ``k`` of round ``r`` is what the module's schedulers give after the scheduler steps a
Lightning Trainer would have taken before that batch had the client trained every round before: an
``interval: "step"`` scheduler steps after every ``frequency``-th of the client's optimizer steps (global step
``r·K + k``), an ``interval: "epoch"`` one after every ``frequency``-th round. The schedulers are replayed on their
own optimizer (never the one that trains), once per distinct ``K``, and each value is kept.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fedlight.errors import ConfigError


def read_configure_optimizers(out: Any, name: str) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]]]:
    """``(optimizers, scheduler configs)`` from any return form of ``configure_optimizers``; each config is a dict
    with ``scheduler``, ``interval`` and ``frequency``."""
    optimizers: list[Any] = []
    scheds: list[Any] = []
    if isinstance(out, dict):
        out = [out]
    if isinstance(out, torch.optim.Optimizer):
        optimizers = [out]
    elif isinstance(out, (list, tuple)) and out and all(isinstance(o, dict) for o in out):
        for d in out:
            optimizers.append(d.get("optimizer"))
            if d.get("lr_scheduler") is not None:
                scheds.append(d["lr_scheduler"])
    elif isinstance(out, (list, tuple)) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        optimizers, scheds = list(out[0]), list(out[1]) if isinstance(out[1], (list, tuple)) else [out[1]]
    elif isinstance(out, (list, tuple)):
        optimizers = list(out)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        got = type(optimizers[0]).__name__ if optimizers else type(out).__name__
        raise ConfigError(f"{name}.configure_optimizers must return an optimizer (or a dict/list holding one), got "
                          f"{got}")
    configs = [_config(s, name) for s in scheds]
    return optimizers, configs


def _config(s: Any, name: str) -> dict[str, Any]:
    config = dict(s) if isinstance(s, dict) else {"scheduler": s}
    config.setdefault("interval", "epoch")
    config.setdefault("frequency", 1)
    sched = config.get("scheduler")
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(f"{name}.configure_optimizers returns ReduceLROnPlateau, which fedlight cannot replay (it "
                          "steps on a monitored validation value, and a federated run has no per-client one); use "
                          "a schedule by step or epoch, or `loop.lr_schedule`")
    if config["interval"] not in ("step", "epoch") or not hasattr(sched, "step"):
        raise ConfigError(f"{name}.configure_optimizers: an lr scheduler config needs a `scheduler` with `step()` and "
                          f"`interval` 'step' or 'epoch', got {config}")
    return config


def hidden_schedulers(task: Any, model: Any, optimizers: list, configs: list[dict[str, Any]],
                      name: str) -> list[dict[str, Any]]:
    """Schedulers an overridden ``optimizer_step`` steps (UvA-DL tutorial 5 keeps one on ``self`` and steps it per
    iteration there): each of the module's attributes that is an lr scheduler of one of ``optimizers`` and not
    returned by ``configure_optimizers`` is replayed as ``interval: "step"``, said once; during a client's round the
    attribute is a view whose ``step()`` changes nothing (``task.hidden`` keeps the originals)."""
    from fedlight.tasks.lightning.compat import overrides

    if not overrides(model, "optimizer_step"):
        return []
    known, ids = {id(c["scheduler"]) for c in configs}, {id(o) for o in optimizers}
    task.hidden = {k: v for k, v in vars(model).items() if hasattr(v, "step") and hasattr(v, "get_last_lr")
                   and id(getattr(v, "optimizer", None)) in ids and id(v) not in known}
    return [{"scheduler": s, "interval": "step", "frequency": 1} for s in task.hidden.values()]


class Schedule:
    """The lr of every param group of ``optimizers`` along a client's steps (see the module docstring)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], configs: list[dict[str, Any]]) -> None:
        ids = {id(o) for o in optimizers}
        self.configs = [c for c in configs if id(_optimizer_of(c)) in ids]
        self.groups = [g for o in optimizers for g in o.param_groups]
        self.start = [c["scheduler"].state_dict() for c in self.configs], [g["lr"] for g in self.groups]
        self.tables: dict[int, list[tuple[float, ...]]] = {}
        self._replaying: int | None = None  # the K whose table the schedulers' current state continues
        self.said = False  # the note of :meth:`unfollowed_calls` was given

    def __bool__(self) -> bool:
        return bool(self.configs)

    def describe(self) -> str:
        return " + ".join(f"{type(c['scheduler']).__name__} per {c['interval']}"
                          f"{'' if c['frequency'] == 1 else ' every ' + str(c['frequency'])}" for c in self.configs)

    def length_note(self, rounds: int, steps: int) -> str | None:
        """A scheduler whose own length (OneCycleLR's ``total_steps``, ``T_max``, PolynomialLR's ``total_iters``)
        differs from the steps it takes in this run (``R·K`` by step, ``R`` by epoch, over its frequency): what it
        is against the client's steps per round and the run's total, said before round 1; ``None`` when it fits."""
        for c in self.configs:
            sched, per_step = c["scheduler"], c["interval"] == "step"
            attr = next((a for a in LENGTHS if isinstance(getattr(sched, a, None), int) and
                         (a != "total_iters" or type(sched).__name__ == "PolynomialLR")), None)
            taken = (rounds * steps if per_step else rounds) // c["frequency"]
            if attr is None or getattr(sched, attr) == taken:
                continue
            n, unit = getattr(sched, attr), "steps" if per_step else "epochs (rounds)"
            share = f"the run takes {taken / n:.1%} of it" if n > taken else f"it ends after {n} of the run's {taken}"
            said = (f"{type(sched).__name__} ({attr}={n}) is sized for {n} {unit}, but a client takes {steps} steps "
                    f"per round and the run {rounds} rounds: {rounds * steps} steps in all, so {share}. Size it by the "
                    "run: `self.trainer.estimated_stepping_batches` (R·K steps) or `self.trainer.max_epochs` "
                    "(R rounds)")
            if attr == "total_steps" and n < taken:  # OneCycleLR raises past its end, under Lightning's Trainer too
                raise ConfigError(f"{said}; it cannot step past its total_steps (Lightning's Trainer would stop "
                                  "there too), or give fewer `loop.rounds` / `loop.local_steps`")
            return said
        return None

    def lrs(self, round: int, step: int, steps: int) -> tuple[float, ...]:
        """The lr of every group at local step ``step`` of round ``round`` for a client taking ``steps`` steps."""
        table = self.tables.setdefault(steps, [])
        if len(table) <= round * steps + step:
            self._replay(table, steps, (round + 1) * steps)
        return table[round * steps + step]

    def lr(self, round: int, step: int, steps: int) -> float:
        """The first group's lr (what the run reports as its lr)."""
        return self.lrs(round, step, steps)[0]

    def unfollowed_calls(self, calls: dict[int, int], round: int, steps: int) -> str | None:
        """Under manual optimisation: how the module's own ``sch.step()`` calls in one client's round ``round`` of
        ``steps`` steps (``calls``: by ``id`` of the scheduler) differ from what the schedulers' intervals step, and
        the interval that matches them, said once per run; ``None`` when they agree (or it was said)."""
        if self.said:
            return None
        for c in self.configs:
            f, n = c["frequency"], calls.get(id(c["scheduler"]), 0)
            by_step = ((round + 1) * steps) // f - (round * steps) // f
            m = by_step if c["interval"] == "step" else int((round + 1) % f == 0)
            if n != m:
                self.said = True
                fix = ("remove it from configure_optimizers if the lr should stay constant" if n == 0 else
                       f"return `\"interval\": \"step\", \"frequency\": {steps // n}` with it from configure_optimizers"
                       if steps % n == 0 else f"give it the interval and frequency that step it {n} times in {steps} "
                       "steps")
                return (f"manual optimisation: the module called {type(c['scheduler']).__name__}.step() {n} time(s) in "
                        f"a client's round {round + 1} of {steps} steps, where its `interval: {c['interval']}` "
                        f"(frequency {f}) steps it {m} time(s); fedlight steps the schedule by its interval (each "
                        f"client's lr at step r·K+k), not by the calls, so the lr differs from what Lightning's "
                        f"Trainer would give: {fix}")
        return None

    def _replay(self, table: list[tuple[float, ...]], steps: int, until: int) -> None:
        if self._replaying != steps:  # start over from the schedulers' initial state
            states, lrs = self.start
            for c, st in zip(self.configs, states):
                c["scheduler"].load_state_dict(st)
            for g, lr in zip(self.groups, lrs):
                g["lr"] = lr
            table.clear()
            self._replaying = steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing trains here
            for t in range(len(table), until):
                table.append(tuple(float(g["lr"]) for g in self.groups))
                self._after_step(t, steps)

    def _after_step(self, t: int, steps: int) -> None:
        for c in self.configs:
            if c["interval"] == "step" and (t + 1) % c["frequency"] == 0:
                c["scheduler"].step()
        if (t + 1) % steps == 0:
            for c in self.configs:
                if c["interval"] == "epoch" and ((t + 1) // steps) % c["frequency"] == 0:
                    c["scheduler"].step()


LENGTHS = ("total_steps", "T_max", "total_iters")  # OneCycleLR, CosineAnnealingLR, PolynomialLR


def _optimizer_of(config: dict[str, Any]) -> Any:
    return getattr(config["scheduler"], "optimizer", None)
