"""Vectorised clients (``loop.client_parallelism: vmap``): several clients of a round trained as one.

Each parameter, BatchNorm buffer, broadcast vector, per-client state and batch gets a leading client
dimension ``C``. The forward pass is ``torch.func.vmap`` of ``functional_call`` over that dimension, so one
kernel serves C clients; the backward of ``Σ_c ℓ_c(y_c)`` leaves every client's own gradient in its slice
(clients share no parameter). The rule's code runs unchanged inside :func:`fedlight.params.stacked`, where the
helpers of :mod:`fedlight.params` reduce per client; elementwise optimizers (SGD, Adam, AdamW) act per client
by construction.

Which clients go together: those with the same number of local steps and batch sizes (so their batches stack)
and the same per-client state keys (a first-time client has none yet). A rule that computes something other
than elementwise or per-client math declares ``stacked_unsupported`` with the reason; the loop then refuses
``vmap`` before training starts.

Randomness: the data order and augmentation of every client come from its own generator, as in sequential
training; the torch generator (dropout) is seeded once per chunk from its first client and vmap draws
different masks per client, so models with dropout are statistically, not bitwise, equivalent to sequential.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedlight import params as P
from fedlight.errors import ConfigError
from fedlight.params import Params
from fedlight.rules import Broadcast, ClientResult, LocalContext, LocalUpdateRule, RoundInfo
from fedlight.sampling import client_generator, seed_client_torch


def check_supported(local: LocalUpdateRule, name: str) -> None:
    why = local.stacked_unsupported
    if why is not None:
        raise ConfigError(f"`loop.client_parallelism: vmap` cannot run {name}: {why}. "
                          "Use `loop.client_parallelism: sequential` for this algorithm")


class _Bound:
    """Calls ``model`` with one client's parameters and buffers (inside vmap: one slice of the stack)."""

    def __init__(self, model: nn.Module, params: Params, buffers: Params) -> None:
        self.model, self.params, self.buffers = model, params, buffers

    def __call__(self, *args, **kwargs):
        return functional_call(self.model, (self.params, self.buffers), args, kwargs)


@dataclass(eq=False)
class StackedContext(LocalContext):
    """A :class:`~fedlight.rules.LocalContext` whose tensors carry a leading client dimension."""

    buffers: Params = field(default_factory=dict)
    """Stacked floating-point buffers (BatchNorm running statistics), one slice per client."""

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """Per-client losses, shape ``[C]``."""
        precision = None if self.fabric is None else self.fabric.strategy.precision
        if precision is not None and not isinstance(precision, MixedPrecision):
            batch = precision.convert_input(batch)  # e.g. float64 for 64-true
        # Mixed precision leaves inputs in float32: under vmap, autocast does not cast a batched float32 weight
        # to meet an input already cast to bf16/fp16 (conv2d dtype error); autocast casts both itself.
        objective = self.objective

        def one(p: Params, b: Params, batch_c: Any) -> Tensor:
            with precision.forward_context() if precision is not None else nullcontext():
                return objective(_Bound(model, p, b), batch_c)

        return vmap(one, randomness="different")(self.params, self.buffers, batch)


# ------------------------------------------------------------------------------------- stacking helpers
def stack_tree(items: Sequence[Any], what: str) -> Any:
    """Stack tensors (dicts recursively) along a new dim 0; other values must agree across clients."""
    first = items[0]
    if isinstance(first, Tensor):
        return torch.stack(list(items))
    if isinstance(first, dict):
        keys = list(first)
        if any(list(it) != keys for it in items):
            raise ValueError(f"{what}: clients differ in keys")
        return {k: stack_tree([it[k] for it in items], f"{what}.{k}") for k in keys}
    if any(it != first for it in items):
        raise ConfigError(f"`loop.client_parallelism: vmap`: {what} differs between clients of a chunk "
                          f"({items!r}); use `loop.client_parallelism: sequential`")
    return first


def slice_tree(tree: Any, i: int, n: int) -> Any:
    """Client ``i``'s part of a stacked tree (copies, so the stack can be freed)."""
    if isinstance(tree, Tensor):
        return tree[i].clone() if tree.dim() > 0 and tree.shape[0] == n else tree
    if isinstance(tree, dict):
        return {k: slice_tree(v, i, n) for k, v in tree.items()}
    return tree


def chunks(cids: Sequence[int], signature, size: int | None) -> list[list[int]]:
    """Group clients by ``signature(cid)`` (first-seen order), then cut groups into pieces of ``size``."""
    groups: dict[Any, list[int]] = {}
    for c in cids:
        groups.setdefault(signature(c), []).append(c)
    out = []
    for g in groups.values():
        step = size or len(g)
        out.extend(g[i : i + step] for i in range(0, len(g), step))
    return out


# ------------------------------------------------------------------------------------- one chunk
def run_chunk(loop, cids: list[int], info: RoundInfo, states: list[dict[str, Any]]):
    """Train ``cids`` together from their broadcasts; returns ``[(cid, broadcast, result, state, buffers)]``."""
    C, device, local = len(cids), loop.device, loop.local
    bcs = [loop.server.broadcast(loop.x, info, c) for c in cids]
    bc = Broadcast(params=stack_tree([b.params for b in bcs], "broadcast.params"),
                   extras=stack_tree([b.extras for b in bcs], "broadcast.extras"),
                   scalars=stack_tree([b.scalars for b in bcs], "broadcast.scalars"))
    K = loop.num_steps(cids[0])
    seed_client_torch(loop.seed, info.round, cids[0], device)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in bc.params.items()}
    buffers = {k: v.expand(C, *v.shape).clone() for k, v in loop.buffers.items()}
    optimizer = local.make_optimizer(list(params.values()), info.lr, loop._opt_factory)
    ctx = StackedContext(broadcast=bc, optimizer=optimizer, lr=info.lr, num_steps=K, params=params,
                         client_id=cids[0], round=info.round, state=stack_tree(states, "client state"),
                         max_grad_norm=loop.cfg.max_grad_norm, fabric=loop.fabric, buffers=buffers,
                         weight_decay=loop.cfg.weight_decay)
    model = loop.model
    model.train()
    streams = [loop.data.client_batches(c, K, client_generator(loop.seed, info.round, c)) for c in cids]
    loss_sum = torch.zeros(C, device=device, dtype=torch.float64)
    with P.stacked():
        local.start(model, ctx)
        for batches in zip(*streams):
            batch = tuple(torch.stack(parts) for parts in zip(*batches))
            loss_sum.add_(local.step(model, batch, ctx))
        result = local.finish(model, ctx)
    out = []
    for i, c in enumerate(cids):
        res = ClientResult(delta=slice_tree(result.delta, i, C), num_samples=loop.data.num_samples(c),
                           extras=slice_tree(result.extras, i, C), upload_scalars=result.upload_scalars)
        res.metrics = {"train_loss": loss_sum[i] / K, "delta_sqnorm": P.sqnorm(res.delta),
                       **slice_tree(ctx.metrics, i, C), **slice_tree(result.metrics, i, C)}
        out.append((c, bcs[i], res, slice_tree(ctx.state, i, C), slice_tree(buffers, i, C)))
    return out
