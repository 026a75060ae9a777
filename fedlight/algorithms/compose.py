"""Building blocks shared by several papers, so no algorithm file re-implements another's lines.

Client side: a local step is ``d = ∇ℓ(y + e) + Σ corrections``, then clip and the optimizer step.
  * a :class:`Perturbation` chooses ``e`` (SAM, ASAM, LESAM, NSAM, WMSAM; none for plain SGD);
  * each :class:`Correction` adds its drift term to ``d`` and keeps its own per-client bookkeeping
    (SCAFFOLD ``c − c_i``, FedDyn ``−∇L_i + α(y − x_r)``, FedProx ``μ(y − x_r)``).
:class:`ComposedClient` runs that step; FedGAMMA, for instance, is ``ComposedClient(SAM, [Scaffold])``.

Server side: :class:`ServerWrapper` wraps an inner :class:`~fedlight.core.rules.ServerRule` to add state and
broadcast extras (SCAFFOLD's ``c``, FedDyn's ``h``, FedLESAM's last global move), so variants such as
FedNSAM-S are a momentum server wrapped in the SCAFFOLD server.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.rules import Broadcast, ClientResult, LocalContext, LocalUpdateRule, RoundInfo, ServerRule
from fedlight.errors import check


@contextmanager
def bn_frozen(model: nn.Module):
    """Batch statistics still normalize, but running statistics are not updated (second SAM pass)."""
    saved = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training:
            saved.append((m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()))
            m.momentum = 0.0  # running ← (1 − 0)·running + 0·batch: unchanged
    try:
        yield
    finally:
        for m, momentum, nbt in saved:
            m.momentum = momentum
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)


class Perturbation:
    """Chooses the ascent offset ``e`` of one local step.

    ``uses_backprop`` says whether :meth:`__call__` runs its own forward/backward (two-backprop SAM);
    if so, the loss it returns is the step's reported loss and BatchNorm is frozen for the second pass.
    """

    uses_backprop: bool = False
    needs_true_grad_norm: bool = True
    """Whether ``e`` depends on a gradient norm (then fp16 loss scaling would corrupt it and ``16-mixed`` is
    refused). Perturbations built from parameter differences (LESAM, NSAM) set it False; WMSAM keeps it True."""

    def start(self, model: nn.Module, ctx: LocalContext) -> None:
        """Per-client set-up at the start of the round."""

    def __call__(self, model: nn.Module, batch: Any, ctx: LocalContext) -> tuple[Params | None, Tensor | None]:
        """Returns ``(e, loss)``; ``e = None`` means no perturbation."""
        raise NotImplementedError


class Correction:
    """A drift-correction term added to the local direction ``d`` (inside the clip)."""

    def start(self, model: nn.Module, ctx: LocalContext) -> None:
        """Load/initialise per-client state (``ctx.state``) and precompute constants."""

    def add(self, ctx: LocalContext, d: list[Tensor]) -> None:
        """Add the term to ``d`` (the gradients, in ``ctx.params`` order) in place."""

    def finish(self, ctx: LocalContext, result: ClientResult) -> None:
        """Update per-client state after K steps; add uploads to ``result.extras``."""


class ComposedClient(LocalUpdateRule):
    """``d = ∇ℓ(y + e) + Σ_j correction_j``; clip; optimizer step.

    Args:
        perturbation: how ``e`` is chosen (``None``: ``e = 0``, plain SGD).
        corrections: drift terms added to ``d``.
        grad_scale: multiplies ``∇ℓ(y + e)`` before the corrections (FedCM's α).
        clip_gradient_first: clip ``∇ℓ(y + e)`` alone, before the scale and the corrections, and not ``d``
            (the released FedCM/FedMoSWA code); False clips the whole direction ``d`` (ALGORITHMS.md §0).
    """

    def __init__(self, perturbation: Perturbation | None = None, corrections: Sequence[Correction] = (),
                 grad_scale: float = 1.0, clip_gradient_first: bool = False) -> None:
        self.perturbation = perturbation
        self.corrections = list(corrections)
        self.grad_scale = grad_scale
        self.clip_gradient_first = clip_gradient_first
        self.needs_true_grad_norm = perturbation is not None and perturbation.needs_true_grad_norm

    def start(self, model: nn.Module, ctx: LocalContext) -> None:
        super().start(model, ctx)
        if self.perturbation is not None:
            self.perturbation.start(model, ctx)
        for c in self.corrections:
            c.start(model, ctx)

    def step(self, model: nn.Module, batch: Any, ctx: LocalContext) -> Tensor:
        e, loss = (None, None) if self.perturbation is None else self.perturbation(model, batch, ctx)
        if e is None:
            loss_e = ctx.forward_backward(model, batch)  # g = ∇ℓ(y)
        else:
            ctx.zero_grad()
            P.add_(ctx.params, e)  # y + e
            frozen = bn_frozen(model) if self.perturbation.uses_backprop else _null()
            with frozen:
                loss_e = ctx.forward_backward(model, batch)  # g' = ∇ℓ(y + e)
            P.add_(ctx.params, e, alpha=-1.0)  # restore y
        d = list(ctx.grads().values())
        with torch.no_grad():
            if self.clip_gradient_first:
                P.joint_clip_(d, ctx.max_grad_norm)  # clip(∇ℓ(y + e)) alone
            if self.grad_scale != 1.0:
                torch._foreach_mul_(d, self.grad_scale)
            for c in self.corrections:
                c.add(ctx, d)
        ctx.apply(clip=not self.clip_gradient_first, grads=d)
        return loss if loss is not None else loss_e

    def finish(self, model: nn.Module, ctx: LocalContext) -> ClientResult:
        result = super().finish(model, ctx)
        for c in self.corrections:
            c.finish(ctx, result)
        return result


@contextmanager
def _null():
    yield


class ServerWrapper(ServerRule):
    """Wraps an inner server rule; subclasses add state, broadcast extras and an update step around it."""

    def __init__(self, inner: ServerRule) -> None:
        super().__init__(inner.lr)
        self.inner = inner
        self.summed_extras = frozenset(self.summed_extras | inner.summed_extras)
        if self.weighting is None:
            self.weighting = inner.weighting  # a plain mean written by the inner rule's paper holds for the whole rule

    def setup(self, params: Params) -> None:
        self.inner.setup(params)

    def broadcast(self, params: Params, info: RoundInfo, client_id: int) -> Broadcast:
        return self.inner.broadcast(params, info, client_id)

    def aggregate(self, results, weighting: str = "samples") -> ClientResult:
        return self.inner.aggregate(results, weighting)

    def aggregates_itself(self) -> bool:
        return self.inner.aggregates_itself()

    def update(self, params: Params, agg: ClientResult, info: RoundInfo) -> Params:
        return self.inner.update(params, agg, info)

    def diagnostics(self) -> dict[str, float]:
        return self.inner.diagnostics()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), **{k: getattr(self, k) for k in self.state_keys}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        for k in self.state_keys:
            setattr(self, k, state[k])


RELEASED_CHOICES = ("paper", "released")
"""The values of every "as released" setting of a rule (``clip_order``, ``first_round``, ``perturbation`` ...):
``paper`` is fedlight's reading of the paper (the default), ``released`` the authors' released code's behaviour."""


def released(setting: str, value: str) -> bool:
    """Whether an "as released" setting selects the released code (ConfigError unless ``paper``/``released``)."""
    check(value in RELEASED_CHOICES, f"`algorithm.{setting}` must be 'paper' or 'released', got {value!r}")
    return value == "released"


def state_params(ctx: LocalContext, key: str) -> Params:
    """The client's persistent vector ``ctx.state[key]``, created as zeros shaped like the model."""
    if key not in ctx.state:
        ctx.state[key] = P.zeros_like(ctx.broadcast.params)
    return ctx.state[key]


def values(p: Params, like: Params) -> list[Tensor]:
    """``p``'s tensors in the key order of ``like``."""
    return [p[k] for k in like]
