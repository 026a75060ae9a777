"""The rule contract: what a client does (``LocalUpdateRule``) and what the server does (``ServerRule``).

An algorithm is a pair of rules plus its shared hyperparameters (``Algorithm``). The defaults of every
method are FedAvg, so a rule overrides only the lines of its paper's pseudocode that differ.
Rules see only trainable parameters (``Params``); the loop averages BatchNorm statistics itself.
Nothing here imports the loop or the data module, so rules can be used from any Fabric script.
The messages the two halves exchange (``Broadcast``, ``ClientResult``, ``RoundInfo``) live in
:mod:`fedlight.core.messages` and are importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.core import precision as precisions
from fedlight.core.messages import Broadcast, ClientResult, RoundInfo
from fedlight.core.params import Params
from fedlight.core.spec import remember_init_args

__all__ = ["Broadcast", "ClientResult", "RoundInfo", "cross_entropy", "LocalContext", "LocalUpdateRule", "ServerRule",
           "Algorithm"]  # the messages of fedlight.core.messages among them, in the API page's order


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean-reduced cross-entropy of ``model`` on ``(x, y)``."""
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass(eq=False)
class LocalContext:
    """Everything one client's local training may touch. Built by the loop (or by your own script)."""

    broadcast: Broadcast
    """What the server sent this client this round (``y_{i,0}`` and any extras or scalars)."""
    optimizer: torch.optim.Optimizer
    """The local optimizer of this client's round: the rule's own (``make_optimizer``) or the loop's."""
    lr: float
    """``η_r``, the round's local learning rate (the optimizer starts with it)."""
    num_steps: int
    """``K``, the number of local steps this client will take."""
    params: Params
    """The model's live trainable parameters (``trainable(model)``), the tensors rules update in place."""
    client_id: int = 0
    """``i``, the client's id."""
    round: int = 0
    """``r``, the 0-based round."""
    state: dict[str, Any] = field(default_factory=dict)
    """This client's persistent state (``c_i``, momenta); the loop loads it before ``start`` and stores it after
    ``finish``. A client never seen before starts with an empty dict."""
    weight_decay: float = 0.0
    """``λ``, the weight decay the loop gives the local optimizer (``loop.weight_decay``); rules that fold weight
    decay into their own arithmetic read it here."""
    max_grad_norm: float | None = None
    """Joint L2 clip applied to the full direction ``d`` before the optimizer step; ``None`` disables."""
    fabric: Any = None
    """A ``lightning.Fabric`` for precision handling; ``None`` runs plain fp32 PyTorch."""
    objective: Callable[[nn.Module, Any], Tensor] | None = None
    """``objective(model, batch)`` → the mean training loss: the run's task's (the loop sets it; a script of your
    own passes one, e.g. :func:`cross_entropy` or ``fedlight.tasks.Regression().objective``). Required by
    :meth:`loss`: there is no default task."""
    step_index: int = 0
    """``k``: local steps taken so far (advanced by :meth:`apply`)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Per-client diagnostics a rule wants logged (averaged over clients by the loop)."""
    lr_sum: float = 0.0
    """``Σ_k η_k`` over the steps taken so far (``K·η_r`` when the lr is constant within the round)."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Per-client working memory of a rule for this round (not persisted); the runners put the module that trains
    the client under ``client_model`` (the run's model, or a runner's copy of it)."""

    def __post_init__(self) -> None:
        self._plain = precisions.plugin(self.fabric) is None

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """``objective(model, batch)`` under the Fabric precision plugin."""
        if self.objective is None:
            raise TypeError("LocalContext.objective is not set: pass the task's objective, e.g. "
                            "`objective=fedlight.core.rules.cross_entropy` for (x, y) classification batches")
        if self._plain:
            return self.objective(model, batch)
        return precisions.forward(self.fabric, self.objective, model, batch)

    def forward_backward(self, model: nn.Module, batch: Any) -> Tensor:
        """Loss at the current parameters; leaves the true-scale gradient ``g`` in ``.grad``.

        A loss with a client dimension (stacked clients, :mod:`fedlight.runners.stacked`) is summed for the backward:
        clients share no parameter, so each one's gradient lands in its own slice."""
        loss = self.loss(model, batch)
        total = loss if loss.dim() == 0 else loss.sum()
        if self._plain:
            total.backward()
        else:
            self.fabric.backward(total)
            self.fabric.strategy.precision.unscale_gradients(self.optimizer)
        return loss.detach()

    def grads(self) -> Params:
        """``.grad`` of every trainable parameter (zeros created for parameters that got none)."""
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return {k: p.grad for k, p in self.params.items()}

    def zero_grad(self) -> None:
        """Clear ``.grad`` of every trainable parameter."""
        for p in self.params.values():
            p.grad = None

    def apply(self, clip: bool = True, grads: list[Tensor] | None = None) -> None:
        """Step with the direction now in ``.grad``: clip (joint norm, unless ``clip=False`` because the rule
        clipped an earlier quantity itself), optimizer step, clear grads, ``k += 1``. ``grads``: the ``.grad``
        tensors when the rule already holds them (saves rebuilding the list every step)."""
        grads = list(self.grads().values()) if grads is None else grads
        self.lr_sum += self.optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            P.joint_clip_(grads, self.max_grad_norm if clip else None)
        if self._plain:
            self.optimizer.step()
        else:
            self.fabric.strategy.optimizer_step(self.optimizer)
        self.zero_grad()
        self.step_index += 1

    def set_lr(self, lr: float) -> None:
        """Set the local optimizer's learning rate (every parameter group), e.g. for an in-round schedule."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr


class LocalUpdateRule:
    """Client half of an algorithm: turns the broadcast into ``Δ_i``. The defaults are FedAvg.

    Override only the lines that differ: ``start`` (load the broadcast, set up per-client buffers),
    ``step`` (one local step on one batch; returns the loss), ``finish`` (build the upload).
    """

    needs_true_grad_norm: bool = False
    """True for rules that take gradient norms (SAM family): they refuse ``16-mixed`` precision."""
    stacked_unsupported: str | None = None
    """Why this rule cannot train stacked clients (``loop.client_parallelism: vmap``,
    :mod:`fedlight.runners.stacked`); ``None``: it can (its math is elementwise or goes through the per-client
    helpers of :mod:`fedlight.core.params`)."""

    scalar_uploads: str | None = None
    """What the rule uploads outside its tensors for the server (FedWMSAM's similarity); fedlight.privacy refuses it."""

    def make_optimizer(self, params: list[Tensor], lr: float, default: Callable[..., torch.optim.Optimizer]):
        """The local optimizer for one client's round; default: the loop's (SGD, wd 1e-3)."""
        return default(params, lr=lr)

    @property
    def brings_optimizer(self) -> bool:
        """Whether the rule builds its own local optimizer (FedAdamW, Local Adam ...) instead of the loop's."""
        return type(self).make_optimizer is not LocalUpdateRule.make_optimizer

    def start(self, model: nn.Module, ctx: LocalContext) -> None:
        """``y_{i,0} ← broadcast.params``."""
        P.copy_(ctx.params, ctx.broadcast.params)

    def step(self, model: nn.Module, batch: Any, ctx: LocalContext) -> Tensor:
        """``d = g``; clip; optimizer step."""
        loss = ctx.forward_backward(model, batch)
        ctx.apply()
        return loss

    def finish(self, model: nn.Module, ctx: LocalContext) -> ClientResult:
        """Upload ``Δ_i = y_{i,K} − y_{i,0}``."""
        return ClientResult(delta=P.sub(ctx.params, ctx.broadcast.params))


class ServerRule:
    """Server half of an algorithm: sends the broadcast and turns the averaged result into ``x_{r+1}``.

    Args:
        lr: ``η_g``, the server (global) learning rate.
    """

    summed_extras: frozenset[str] = frozenset()
    """Keys of ``ClientResult.extras`` the loop sums over clients instead of averaging."""
    weighting: str | None = None
    """How the loop weights client results in the mean: ``"samples"`` (by ``n_i``), ``"uniform"`` (``1/|S|``), or
    ``None`` to follow ``loop.weighting``. A rule whose paper writes a plain mean over ``S`` sets ``"uniform"``."""
    state_keys: tuple[str, ...] = ()
    """Attributes that make up the server state (tensors, dicts of tensors, floats); saved in checkpoints."""

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = lr

    def setup(self, params: Params) -> None:
        """Allocate state (e.g. ``m = 0``) shaped like the global parameters ``x_0``."""

    def broadcast(self, params: Params, info: RoundInfo, client_id: int) -> Broadcast:
        """What client ``client_id`` receives in round ``info.round``; default ``x_r``."""
        return Broadcast(params)

    def aggregate(self, results: Sequence[ClientResult], weighting: str = "samples") -> ClientResult:
        """Weighted mean of client results (the loop computes the same across processes itself).

        Provided for standalone scripts and robust-aggregation overrides.
        """
        w = [float(r.num_samples) if weighting == "samples" else 1.0 for r in results]
        total = sum(w)
        delta = P.lincomb((wi / total, r.delta) for wi, r in zip(w, results))
        extras = {
            k: P.lincomb((1.0 if k in self.summed_extras else wi / total, r.extras[k]) for wi, r in zip(w, results))
            for k in results[0].extras
        }
        metrics = {k: sum(float(r.metrics[k]) for r in results) / len(results) for k in results[0].metrics}
        return ClientResult(delta, int(sum(r.num_samples for r in results)), extras, metrics)

    def aggregates_itself(self) -> bool:
        """Whether this rule overrides :meth:`aggregate` (the loop then hands it every kept client result)."""
        return type(self).aggregate is not ServerRule.aggregate

    def update(self, params: Params, agg: ClientResult, info: RoundInfo) -> Params:
        """``x ← x + η_g·Δ̄``."""
        return P.add(params, agg.delta, self.lr)

    def diagnostics(self) -> dict[str, float]:
        """Per-round scalars to log under ``server/`` (e.g. ‖m‖)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.state_keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.state_keys:
            setattr(self, k, state[k])


class Algorithm:
    """A ``LocalUpdateRule`` + ``ServerRule`` pair, holding the hyperparameters both halves share.

    Subclasses build ``self.local`` and ``self.server`` in ``__init__`` from typed arguments (the recipe's
    ``algorithm.init_args``) and are registered with :func:`fedlight.core.registry.register`.
    """

    local: LocalUpdateRule
    server: ServerRule
    name: str = "custom"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        remember_init_args(cls)  # a Python-API run's config.yaml records the hyperparameters it was built with

    def __init__(self, local: LocalUpdateRule | None = None, server: ServerRule | None = None) -> None:
        self.local = local if local is not None else LocalUpdateRule()
        self.server = server if server is not None else ServerRule()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
