"""Loss landscapes and flatness of a trained global model.

* :func:`random_direction`: a filter-normalized random direction (Li et al. 2018, "Visualizing the Loss Landscape
  of Neural Nets"): each filter (slice along dim 0) of every weight gets the norm of the same filter of the model;
  biases and normalisation parameters (1-D tensors) get a zero direction.
* :func:`landscape_1d` / :func:`landscape_2d`: ``L(x + α·d₁ [+ β·d₂])`` on a grid.
* :func:`top_eigenvalue`: the top Hessian eigenvalue by power iteration on Hessian-vector products.
* :func:`sam_sharpness`: ``max_{‖e‖≤ρ} L(x + e) − L(x)``, by normalized projected gradient ascent on ``e``
  (the first step is SAM's ``e = ρ·g/‖g‖``), a lower bound on the true maximum.

The loss ``L`` is the sample-weighted mean of ``objective(model, batch)`` over ``batches`` (a list, or a
zero-argument callable returning a fresh iterable), with the model in eval mode (BatchNorm uses its running
statistics, dropout is off), so ``L`` is a deterministic function of the parameters. Only trainable parameters move.

:mod:`fedlight.lab.flatness.run` does the same for a run directory (``fedlight landscape`` and ``fedlight
sharpness``): the run's model, its data, and its task's objective as the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.errors import check

Objective = Callable[[nn.Module, Any], Tensor]
Batches = Iterable[Any] | Callable[[], Iterable[Any]]


# ------------------------------------------------------------------------------------------------ the loss
def _iter(batches: Batches) -> Iterable[Any]:
    return batches() if callable(batches) else batches


def samples_in(batch: Any) -> int:
    """Samples in a batch (a tensor, a tuple or a dict of them): the leading size of its first tensor (1 for
    tensor-free batches)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    for b in batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ():
        if isinstance(b, Tensor) and b.dim():
            return int(b.shape[0])
    return 1


@contextmanager
def evaluating(model: nn.Module):
    """``model.eval()`` inside, the previous mode restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def loss(model: nn.Module, batches: Batches, objective: Objective) -> float:
    """``L``: the sample-weighted mean of ``objective`` over ``batches`` (model in eval mode, no gradients)."""
    total, n = 0.0, 0
    with torch.no_grad(), evaluating(model):
        for b in _iter(batches):
            k = samples_in(b)
            total += float(objective(model, b).double()) * k
            n += k
    check(n > 0, "the loss needs at least one batch (is the chosen split empty?)")
    return total / n


def loss_and_grad(model: nn.Module, batches: Batches, objective: Objective) -> tuple[float, Params]:
    """``(L, ∇L)`` with respect to the trainable parameters."""
    params = P.trainable(model)
    grad = P.zeros_like(params)
    total, n = 0.0, 0
    with evaluating(model):
        for b in _iter(batches):
            k = samples_in(b)
            val = objective(model, b)
            gs = torch.autograd.grad(val, list(params.values()), allow_unused=True)
            for key, g in zip(params, gs):
                if g is not None:
                    grad[key].add_(g.detach(), alpha=float(k))
            total += float(val.detach().double()) * k
            n += k
    check(n > 0, "the loss needs at least one batch (is the chosen split empty?)")
    return total / n, P.scale_(grad, 1.0 / n)


def hvp(model: nn.Module, batches: Batches, v: Params, objective: Objective) -> Params:
    """``H·v``, the Hessian of ``L`` (trainable parameters) times ``v``, by double backpropagation."""
    params = P.trainable(model)
    out = P.zeros_like(params)
    n = 0
    with evaluating(model):
        for b in _iter(batches):
            k = samples_in(b)
            ps = list(params.values())
            gs = torch.autograd.grad(objective(model, b), ps, create_graph=True, allow_unused=True)
            gv = sum(((g * v[key]).sum() for key, g in zip(params, gs) if g is not None),
                     torch.zeros((), device=ps[0].device, dtype=ps[0].dtype))
            if not gv.requires_grad:  # the loss is linear in every parameter on this batch
                n += k
                continue
            hs = torch.autograd.grad(gv, ps, allow_unused=True)
            for key, h in zip(params, hs):
                if h is not None:
                    out[key].add_(h.detach(), alpha=float(k))
            n += k
    check(n > 0, "the loss needs at least one batch (is the chosen split empty?)")
    return P.scale_(out, 1.0 / n)


# ------------------------------------------------------------------------------------------------ directions
def random_direction(model: nn.Module, seed: int = 0, norm: str = "filter", ignore_1d: bool = True) -> Params:
    """A random direction shaped like the trainable parameters.

    Args:
        model: the model whose parameters set the scale.
        seed: seeds the Gaussian draw (a CPU generator, so the direction is the same on every device).
        norm: ``"filter"`` (Li et al.: each filter, i.e. slice along dim 0, rescaled to the norm of the model's
            filter), ``"layer"`` (each tensor to the norm of the model's tensor) or ``"none"``.
        ignore_1d: zero the direction of 1-D tensors (biases, normalisation weights), as in Li et al.; otherwise
            they copy the parameter (the ``norm`` rule would make them ``±θ``-sized noise).
    """
    check(norm in ("filter", "layer", "none"), f"`norm` must be 'filter', 'layer' or 'none', got {norm!r}")
    gen = torch.Generator().manual_seed(int(seed))
    out: Params = {}
    for name, p in P.trainable(model).items():
        w = p.detach()
        d = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
        if w.dim() <= 1:
            d = torch.zeros_like(w) if ignore_1d else w.clone()
        elif norm == "filter":
            scale = w.flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1).clamp_min(1e-30)
            d = d * scale.view(-1, *([1] * (w.dim() - 1)))
        elif norm == "layer":
            d = d * (w.norm() / d.norm().clamp_min(1e-30))
        out[name] = d
    return out


@contextmanager
def _moved(model: nn.Module):
    """Yields ``set(offset)`` that puts the trainable parameters at ``x + offset``; restores ``x`` after."""
    live = P.trainable(model)
    x = P.clone(live)

    def set_offset(offset: Params | None) -> None:
        with torch.no_grad():
            for k, p in live.items():
                p.copy_(x[k] if offset is None else x[k] + offset[k])

    try:
        yield set_offset
    finally:
        set_offset(None)


def grid(points: int, span: float = 1.0) -> np.ndarray:
    """``points`` evenly spaced coordinates in ``[−span, span]`` (odd ``points`` include 0)."""
    check(isinstance(points, int) and points >= 2, f"`points` must be an integer >= 2, got {points!r}")
    check(span > 0, f"`span` must be > 0, got {span}")
    return np.linspace(-span, span, points)


def landscape_1d(model: nn.Module, batches: Batches, direction: Params, objective: Objective,
                 points: int = 21, span: float = 1.0) -> dict[str, np.ndarray]:
    """``L(x + α·d)`` for ``α`` in ``grid(points, span)``; returns ``{"alphas", "losses"}``."""
    alphas = grid(points, span)
    losses = np.empty(len(alphas))
    with _moved(model) as move:
        for i, a in enumerate(alphas):
            move(P.scale(direction, float(a)))
            losses[i] = loss(model, batches, objective)
    return {"alphas": alphas, "losses": losses}


def landscape_2d(model: nn.Module, batches: Batches, d1: Params, d2: Params, objective: Objective,
                 points: int = 21, span: float = 1.0) -> dict[str, np.ndarray]:
    """``L(x + α·d₁ + β·d₂)`` on a square grid; ``losses[i, j]`` is at ``(alphas[i], betas[j])``."""
    alphas = grid(points, span)
    losses = np.empty((len(alphas), len(alphas)))
    with _moved(model) as move:
        for i, a in enumerate(alphas):
            for j, b in enumerate(alphas):
                move(P.lincomb([(float(a), d1), (float(b), d2)]))
                losses[i, j] = loss(model, batches, objective)
    return {"alphas": alphas, "betas": alphas.copy(), "losses": losses}


# ------------------------------------------------------------------------------------------------ sharpness
def top_eigenvalue(model: nn.Module, batches: Batches, objective: Objective, iters: int = 20,
                   tol: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """Top Hessian eigenvalue of ``L`` by power iteration on Hessian-vector products.

    Power iteration converges to the eigenvalue of largest magnitude (away from a minimum that may be a negative
    one); it stops when the Rayleigh quotient changes by less than ``tol`` (relative) or after ``iters`` steps.

    Returns:
        ``{"eigenvalue", "iterations", "history"}`` (the Rayleigh quotient after each step).
    """
    check(isinstance(iters, int) and iters >= 1, f"`iters` must be a positive integer, got {iters!r}")
    gen = torch.Generator().manual_seed(int(seed))
    v = {k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
         for k, p in P.trainable(model).items()}
    v = P.unit(v)
    history: list[float] = []
    lam = 0.0
    for _ in range(iters):
        hv = hvp(model, batches, v, objective)
        lam = float(P.dot(v, hv))
        history.append(lam)
        nrm = float(P.norm(hv))
        if nrm == 0.0:
            break
        v = P.scale(hv, 1.0 / nrm)
        if len(history) > 1 and abs(history[-1] - history[-2]) <= tol * max(abs(history[-1]), 1e-12):
            break
    return {"eigenvalue": lam, "iterations": len(history), "history": history}


def sam_sharpness(model: nn.Module, batches: Batches, objective: Objective, rho: float = 0.05,
                  steps: int = 5, seed: int = 0) -> dict[str, Any]:
    """SAM sharpness ``max_{‖e‖≤ρ} L(x + e) − L(x)`` by ``steps`` normalized projected ascent steps.

    ``e ← Proj_{‖e‖≤ρ}(e + ρ·∇L(x+e)/‖∇L(x+e)‖)`` from ``e = 0``: step 1 is SAM's perturbation ``ρ·g/‖g‖``
    (at a stationary point, where ``g = 0``, a seeded random direction is used instead). The best value seen is
    returned, so more steps never lower the estimate.

    Returns:
        ``{"sharpness", "loss", "perturbed_loss", "sam_step" (the one-step value), "history"}``.
    """
    check(rho > 0, f"`rho` must be > 0, got {rho}")
    check(isinstance(steps, int) and steps >= 1, f"`steps` must be a positive integer, got {steps!r}")
    gen = torch.Generator().manual_seed(int(seed))
    base, g = loss_and_grad(model, batches, objective)
    e = P.zeros_like(g)
    history: list[float] = []
    with _moved(model) as move:
        for _ in range(steps):
            gn = float(P.norm(g))
            if not gn > 1e-12:
                g = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v) for k, v in g.items()}
                gn = float(P.norm(g))
            e = P.add(e, g, rho / gn)
            en = float(P.norm(e))
            if en > rho:
                e = P.scale(e, rho / en)
            move(e)
            val, g = loss_and_grad(model, batches, objective)
            history.append(val - base)
    best = max(history)
    return {"sharpness": best, "loss": base, "perturbed_loss": base + best, "sam_step": history[0],
            "history": history}
