"""Stacking and slicing the clients of a chunk: trees of tensors with a leading client dimension, and the groups of
clients that can share a chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlight.errors import ConfigError


def stack_tree(items: Sequence[Any], what: str) -> Any:
    """Stack tensors (dicts recursively) along a new dim 0; other values must agree across clients."""
    first = items[0]
    if isinstance(first, Tensor):
        return torch.stack(list(items))
    if isinstance(first, (tuple, list)):
        return type(first)(stack_tree([it[j] for it in items], f"{what}[{j}]") for j in range(len(first)))
    if isinstance(first, dict):
        keys = list(first)
        if any(list(it) != keys for it in items):
            raise ValueError(f"{what}: clients differ in keys")
        return {k: stack_tree([it[k] for it in items], f"{what}.{k}") for k in keys}
    if any(it != first for it in items):
        raise ConfigError(f"`loop.client_parallelism: vmap`: {what} differs between clients of a chunk "
                          f"({items!r}); use `loop.client_parallelism: sequential`")
    return first


def slice_tree(tree: Any, i: int, n: int, copy: bool = True) -> Any:
    """Client ``i``'s part of a stacked tree (copies, so the stack can be freed; views with ``copy=False``)."""
    if isinstance(tree, Tensor):
        return (tree[i].clone() if copy else tree[i]) if tree.dim() > 0 and tree.shape[0] == n else tree
    if isinstance(tree, dict):
        return {k: slice_tree(v, i, n, copy) for k, v in tree.items()}
    return tree


def chunk_finite(stacked: dict[str, Tensor], losses: Tensor) -> Tensor:
    """``[C]`` bool: client ``c``'s loss and every entry of its slice of ``stacked`` are finite. The per-client
    decision of :func:`fedlight.core.params.is_finite` (NaN and ±inf reach a min or max), for a chunk at once."""
    C = losses.shape[0]
    ends = [m for v in stacked.values() if v.numel() for m in torch.aminmax(v.reshape(C, -1), dim=1)]
    ok = torch.isfinite(losses)
    return ok & torch.isfinite(torch.stack(ends)).all(0) if ends else ok


def groups(cids: Sequence[int], signature) -> list[list[int]]:
    """Clients grouped by ``signature(cid)``, groups and members in first-seen order."""
    out: dict[Any, list[int]] = {}
    for c in cids:
        out.setdefault(signature(c), []).append(c)
    return list(out.values())


def chunks(cids: Sequence[int], signature, size: int | None) -> list[list[int]]:
    """Group clients by ``signature(cid)`` (first-seen order), then cut groups into pieces of ``size``."""
    out = []
    for g in groups(cids, signature):
        step = size or len(g)
        out.extend(g[i : i + step] for i in range(0, len(g), step))
    return out


def _keys(state: dict[str, Any]) -> tuple:
    """The nested key structure of a client state (clients stack only when theirs agree)."""
    return tuple((k, _keys(v)) if isinstance(v, dict) else (k,) for k, v in sorted(state.items()))
