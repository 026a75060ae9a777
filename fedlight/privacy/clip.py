"""Clipping a client's whole upload: Δ and every extra the rule uploads, jointly, to norm ≤ C.

Works per client in stacked mode too (norms and factors of shape ``[C]``, :mod:`fedlight.core.params`). A factor of
exactly 1 leaves the upload bit for bit as it was (``x·1.0 == x``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedlight.core import params as P
from fedlight.core.rules import ClientResult
from fedlight.privacy.noise import upload_trees


def upload_norm(result: ClientResult, ord: int = 2) -> Tensor:
    """``‖(Δ, extras)‖`` joint over every tensor (float64; ``[C]`` in stacked mode); ``ord``: 2 or 1."""
    trees = upload_trees(result.delta, result.extras)
    if ord == 2:
        return sum(P.sqnorm(t) for t in trees).sqrt()
    dims = (lambda v: tuple(range(1, v.dim()))) if P.in_stacked() else (lambda v: tuple(range(v.dim())))
    return sum(v.detach().abs().sum(dim=dims(v), dtype=torch.float64) for t in trees for v in t.values())


def clip_upload(result: ClientResult, bound: float, ord: int = 2) -> Tensor:
    """Scale Δ and every extra by ``min(1, C/‖upload‖)`` (replacing the dicts); returns the norm before the clip."""
    norm = upload_norm(result, ord)
    factor = torch.clamp(bound / norm, max=1.0)
    result.delta = P.scale(result.delta, factor)
    result.extras = {e: P.scale(p, factor) for e, p in result.extras.items()}
    return norm
