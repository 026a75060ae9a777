"""The noise: Gaussian and Laplace draws over a tree of tensors from seeded CPU generators.

Every stream derives from (seed, round[, client]) (:func:`fedlight.core.sampling.derive_seed`), never from the
process, so 1 and N processes, a resumed run and stacked clients draw the same numbers. A simulation's generator
is not a cryptographically secure one: see docs/privacy.md.
"""

from __future__ import annotations

import torch

from fedlight.core.params import Params
from fedlight.core.sampling import derive_seed

CENTRAL, CLIENT, COUNT = 101, 102, 103
"""Stream tags: the server's noise on the sum, a client's own noise, adaptive clipping's count noise."""


def generator(seed: int, round: int, tag: int, client: int = -1) -> torch.Generator:
    """A CPU generator for one noise stream of one round (and client)."""
    return torch.Generator().manual_seed(derive_seed(seed, round, tag, client + 1))


def gaussian_(tree: Params, std: float, gen: torch.Generator) -> None:
    """``v ← v + N(0, std²)`` elementwise for every tensor of ``tree`` in key order (drawn in float64 on the CPU,
    added in the tensor's dtype and device)."""
    for k in tree:
        v = tree[k]
        z = torch.randn(v.shape, generator=gen, dtype=torch.float64)
        v.add_(z.mul_(std).to(device=v.device, dtype=v.dtype))


def laplace_(tree: Params, scale: float, gen: torch.Generator) -> None:
    """``v ← v + Lap(0, scale)`` elementwise (inverse CDF of a uniform draw: ``−b·sign(u)·log(1 − 2|u|)``)."""
    for k in tree:
        v = tree[k]
        u = torch.rand(v.shape, generator=gen, dtype=torch.float64) - 0.5
        z = -scale * torch.sign(u) * torch.log1p(-2 * u.abs())
        v.add_(z.to(device=v.device, dtype=v.dtype))


def upload_trees(delta: Params, extras: dict[str, Params]) -> list[Params]:
    """Δ and every extra in a fixed order (``delta`` first, extras by name): what is clipped and noised."""
    return [delta, *(extras[e] for e in sorted(extras))]


def scalar_normal(gen: torch.Generator) -> float:
    """One ``N(0, 1)`` draw."""
    return float(torch.randn((), generator=gen, dtype=torch.float64))
