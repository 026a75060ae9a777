"""The module's optimizers and param groups, rebuilt for each client's round on the client's parameters.

``configure_optimizers`` builds its optimizers on the module's parameters once. A client trains the same
parameters (or, stacked, a client dimension of them), so each optimizer is rebuilt per client round with every
param group kept: the group's parameters (found by their position among the trainable parameters) and its own
hyperparameters (lr, weight decay, betas ...), as ``torch.optim`` applies them. Several optimizers (manual
optimisation) become one :class:`Joint` for the rule, and ``self.optimizers()`` lists them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

SKIP = ("params", "initial_lr")  # initial_lr: written by a scheduler, not a hyperparameter


class Joint:
    """Several client optimizers seen by the rule as one: the param groups of all, ``step``/``zero_grad`` of
    each. ``param_groups[0]`` is the first optimizer's first group (the lr the rule counts)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure: Any = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def optimizers_of(optimizer: Any) -> list[Any]:
    """The client optimizers behind ``ctx.optimizer`` (one, or those of a :class:`Joint`)."""
    return list(optimizer.optimizers) if isinstance(optimizer, Joint) else [optimizer]


class ModuleOptimizers:
    """``factory(params, lr=η)``: the module's optimizers rebuilt on ``params`` (the trainable parameters in
    ``named_parameters`` order, live or stacked), each group with its own hyperparameters; ``lr`` is not used
    (every group brings its own)."""

    def __init__(self, model: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        where = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
        self.specs = []
        for opt in optimizers:
            init = _init_args(type(opt))
            defaults = {k: v for k, v in opt.defaults.items() if k in init}
            groups = [(tuple(where[id(p)] for p in g["params"] if id(p) in where),
                       {k: v for k, v in g.items() if k not in SKIP}) for g in opt.param_groups]
            self.specs.append((type(opt), defaults, groups))

    @property
    def groups(self) -> list[dict[str, Any]]:
        """Every group's hyperparameters, optimizer after optimizer (as :class:`Joint` lists them)."""
        return [hyper for _, _, groups in self.specs for _, hyper in groups]

    def differing(self) -> list[tuple[int, dict[str, Any]]]:
        """``(index, {key: value})`` for each group whose lr or weight decay differs from the first group's."""
        groups = self.groups
        first = groups[0]
        out = []
        for i, g in enumerate(groups[1:], 1):
            diff = {k: g.get(k, 0.0) for k in ("lr", "weight_decay") if g.get(k, 0.0) != first.get(k, 0.0)}
            if diff:
                out.append((i, diff))
        return out

    def __call__(self, params: list[torch.Tensor], lr: float | None = None) -> Any:
        built = []
        for cls, defaults, groups in self.specs:
            kept = [{"params": [params[i] for i in pos], **hyper} for pos, hyper in groups if pos]
            built.append(cls(kept, **defaults))
        return built[0] if len(built) == 1 else Joint(built)


def describe(optimizer: torch.optim.Optimizer) -> str:
    """``SGD(lr=0.1, momentum=0.9)``: the class and the first group's set hyperparameters."""
    group = optimizer.param_groups[0]
    args = ", ".join(f"{k}={v}" for k, v in group.items() if k not in SKIP and (
        k in ("lr", "weight_decay") or (isinstance(v, (int, float, tuple)) and v and v is not True)))
    return f"{type(optimizer).__name__}({args})"


def _init_args(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
