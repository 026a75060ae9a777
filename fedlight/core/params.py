"""Helpers on ``Params``: an ordered ``dict[str, Tensor]`` of a model's trainable parameters.

Every helper works tensor-list-at-once through ``torch._foreach_*`` kernels, so a rule's math
line costs a handful of kernel launches, not one per parameter tensor.

Stacked mode (``with stacked():``, used by ``loop.client_parallelism: vmap``): every tensor carries a leading
client dimension ``C``, and the reductions (``dot``, ``sqnorm``, ``norm``, ``cosine``, ``unit``, ``joint_clip_``)
are taken per client, returning shape-``[C]`` tensors that ``scale``/``unit`` broadcast back per client. A rule
written with these helpers therefore runs unchanged on C clients at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

Params = dict[str, Tensor]

_per_client_mode: ContextVar[bool] = ContextVar("fedlight_stacked", default=False)


@contextmanager
def stacked() -> Iterator[None]:
    """Within this block (entered only by the stacked runner, around the rule's calls) every tensor's dim 0
    indexes clients and reductions are per client. Scoped to the block and to the current thread/context."""
    token = _per_client_mode.set(True)
    try:
        yield
    finally:
        _per_client_mode.reset(token)


def in_stacked() -> bool:
    """Whether the current code runs inside :func:`stacked` (tensors carry a client dimension)."""
    return _per_client_mode.get()


def _per_client(s: Tensor, like: Tensor) -> Tensor:
    """A per-client ``[C]`` factor shaped to broadcast against a stacked ``[C, ...]`` tensor."""
    return s.reshape(-1, *([1] * (like.dim() - 1)))


def _norms(vals: list[Tensor]) -> Tensor:
    """Per-tensor L2 norms: shape ``[T]``, or ``[T, C]`` in stacked mode."""
    if _per_client_mode.get():
        return torch.stack([torch.linalg.vector_norm(v.reshape(v.shape[0], -1), dim=1) for v in vals])
    return torch.stack(torch._foreach_norm(vals))


def trainable(model: nn.Module) -> Params:
    """The live trainable parameters of ``model`` (the ``nn.Parameter`` objects, not copies)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def float_buffers(model: nn.Module) -> Params:
    """The live floating-point buffers of ``model`` (BatchNorm running statistics)."""
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}


def clone(p: Params) -> Params:
    """A detached copy."""
    return {k: v.detach().clone() for k, v in p.items()}


def zeros_like(p: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in p.items()}


def copy_(dst: Params, src: Params) -> Params:
    """``dst ← src`` in place (works on live parameters)."""
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(list(dst.values()), [src[k] for k in dst])
    return dst


def add(a: Params, b: Params, alpha: float = 1.0) -> Params:
    """``a + alpha·b`` as a new dict."""
    return dict(zip(a, torch._foreach_add(list(a.values()), [b[k] for k in a], alpha=alpha)))


def sub(a: Params, b: Params) -> Params:
    """``a − b`` as a new dict."""
    return dict(zip(a, torch._foreach_sub([v.detach() for v in a.values()], [b[k] for k in a])))


def scale(a: Params, s: float | Tensor) -> Params:
    """``s·a`` as a new dict (``s`` may be a per-client ``[C]`` tensor in stacked mode)."""
    if _per_client_mode.get() and isinstance(s, Tensor) and s.dim() == 1:
        return {k: v * _per_client(s, v).to(v.dtype) for k, v in a.items()}
    return dict(zip(a, torch._foreach_mul(list(a.values()), s)))


def lincomb(terms: Iterable[tuple[float, Params]]) -> Params:
    """``Σ_j s_j·p_j`` as a new dict."""
    terms = list(terms)
    s0, p0 = terms[0]
    out = scale(p0, s0)
    for s, p in terms[1:]:
        add_(out, p, s)
    return out


def add_(a: Params, b: Params, alpha: float = 1.0) -> Params:
    """``a ← a + alpha·b`` in place."""
    with torch.no_grad():
        torch._foreach_add_(list(a.values()), [b[k] for k in a], alpha=alpha)
    return a


def scale_(a: Params, s: float) -> Params:
    """``a ← s·a`` in place."""
    with torch.no_grad():
        torch._foreach_mul_(list(a.values()), s)
    return a


def dot(a: Params, b: Params) -> Tensor:
    """``⟨a, b⟩`` over all tensors, as a 0-dim tensor (no host sync); ``[C]`` in stacked mode."""
    if _per_client_mode.get():
        return sum((x.reshape(x.shape[0], -1) * b[k].reshape(x.shape[0], -1).to(x.dtype)).sum(1)
                   for k, x in a.items())
    return sum((x.flatten() @ b[k].flatten().to(x.dtype) for k, x in a.items()), torch.zeros((), device=_dev(a)))


def sqnorm(a: Params) -> Tensor:
    """``‖a‖²`` (joint over all tensors), a 0-dim float64 tensor; ``[C]`` in stacked mode."""
    return _norms(list(a.values())).double().square().sum(0)


def norm(a: Params) -> Tensor:
    """``‖a‖`` (joint L2 norm over all tensors), a 0-dim float64 tensor."""
    return sqnorm(a).sqrt()


def cosine(a: Params, b: Params) -> Tensor:
    """``cos(a, b)``; 0 when either vector is zero (never NaN)."""
    na, nb = norm(a), norm(b)
    denom = na * nb
    return torch.where(denom > 0, dot(a, b).double() / denom.clamp_min(1e-300), torch.zeros_like(denom))


def unit(a: Params, eps: float = 0.0) -> Params:
    """``a/‖a‖`` (``a/(‖a‖ + eps)`` when ``eps`` > 0); the zero vector when ``a`` is zero."""
    n = norm(a)
    inv = torch.where(n > 0, 1.0 / (n + eps).clamp_min(1e-300), torch.zeros_like(n))
    return scale(a, inv.to(_dtype(a)))


def nbytes(p: Params) -> int:
    """Bytes a tensor dict occupies on the wire (numel · element size)."""
    return sum(v.numel() * v.element_size() for v in p.values())


def numel(p: Params) -> int:
    return sum(v.numel() for v in p.values())


def flatten(p: Params) -> Tensor:
    """Concatenate into one 1-D tensor (keys in order)."""
    return torch.cat([v.reshape(-1) for v in p.values()])


def unflatten(flat: Tensor, like: Params) -> Params:
    """Inverse of :func:`flatten` (views into ``flat``)."""
    out, i = {}, 0
    for k, v in like.items():
        out[k] = flat[i : i + v.numel()].view_as(v)
        i += v.numel()
    return out


def is_finite(p: Params) -> Tensor:
    """A 0-dim bool tensor: every entry is finite (no host sync).

    NaN and ±inf always reach a tensor's min or max, so one ``aminmax`` reduction per tensor decides it: 10-17x
    cheaper on CPU than ``isfinite(v).all()`` (which materialises a bool tensor) and half the kernel launches.
    """
    vals = [v for v in p.values() if v.numel()]
    if not vals:
        return torch.ones((), dtype=torch.bool, device=_dev(p) if p else None)
    return torch.isfinite(torch.stack([m for v in vals for m in torch.aminmax(v)])).all()


def _dev(p: Params) -> torch.device:
    return next(iter(p.values())).device


def _dtype(p: Params) -> torch.dtype:
    return next(iter(p.values())).dtype


def joint_clip_(grads: list[Tensor], max_norm: float | None) -> None:
    """Clip a list of gradients to a joint L2 norm ``max_norm`` in place (no host sync)."""
    if max_norm is None or not grads:
        return
    total = torch.linalg.vector_norm(_norms(grads), dim=0)  # Tensor.norm's kernel without its Python dispatch
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if coef.device.type == "cpu" and bool((coef >= 1.0).all()):
        return  # a multiply by exactly 1 changes no bit; on CPU the test costs no device sync
    if _per_client_mode.get():
        for g in grads:
            g.mul_(_per_client(coef, g).to(g.dtype))
        return
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))
