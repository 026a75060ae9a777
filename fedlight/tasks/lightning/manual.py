"""Manual optimisation (``automatic_optimization = False``): the module's ``training_step`` steps the client's
optimizer itself (``self.optimizers()``, ``self.manual_backward``), under FedAvg's client and any rule whose client
is FedAvg's (the server-side family: FedAvgM, FedAdam, ...). A rule that shapes the local step cannot run it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core.rules import LocalContext, LocalUpdateRule
from fedlight.errors import ConfigError


class ManualLocalUpdate(LocalUpdateRule):
    """FedAvg's client, with each local step being one call of the module's ``training_step``. Gradients persist
    across the client's steps until the module zeroes them (gradient accumulation, as Lightning's Trainer keeps
    them); a client starts and ends its round with none."""

    stacked_unsupported = "a LightningModule with manual optimisation steps its optimizer inside training_step"

    def start(self, model: nn.Module, ctx: LocalContext) -> None:
        super().start(model, ctx)
        ctx.zero_grad()

    def step(self, model: nn.Module, batch: Any, ctx: LocalContext) -> Tensor:
        loss = ctx.loss(model, batch)
        hooks = ctx.scratch.get("lightning_hooks")
        if hooks is not None:
            hooks.batch_end(ctx.step_index)
            if ctx.step_index == ctx.num_steps - 1:
                hooks.end()
        ctx.step_index += 1
        return loss.detach() if isinstance(loss, Tensor) and loss.dim() == 0 else torch.zeros(())

    def finish(self, model: nn.Module, ctx: LocalContext):
        ctx.zero_grad()
        return super().finish(model, ctx)


def manual_algorithm(algorithm: Any, name: str) -> Any:
    """``algorithm`` with its client replaced by :class:`ManualLocalUpdate`; refused for a rule that shapes the
    local step, naming those that can run it."""
    if type(algorithm.local) is not LocalUpdateRule:
        raise ConfigError(f"{name} uses manual optimisation (automatic_optimization = False), which only rules that "
                          f"do not shape the local step can run: {', '.join(_plain_rules())}. "
                          f"{type(algorithm).__name__} shapes it; pick one of those, or set "
                          "`self.automatic_optimization = True`")
    out = copy.copy(algorithm)
    out.local = ManualLocalUpdate()
    return out


def _plain_rules() -> list[str]:
    from fedlight import create, list_algorithms  # fedlight's own rules registered first

    names = []
    for key in list_algorithms():
        try:
            if type(create(key).local) is LocalUpdateRule:
                names.append(key)
        except Exception:  # noqa: BLE001 - a rule that needs arguments is not listed
            continue
    return names
