"""A robust-aggregation rule for the tests: the server takes the coordinate-wise median of the client deltas."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedlight.core.rules import Algorithm, ClientResult, ServerRule


class MedianServer(ServerRule):
    """``Δ̄ = median_i Δ_i`` per coordinate (``ServerRule.aggregate`` override; the loop then hands it every
    kept client result, gathered from all processes in client order)."""

    def aggregate(self, results: Sequence[ClientResult], weighting: str = "samples") -> ClientResult:
        delta = {k: torch.stack([r.delta[k] for r in results]).median(dim=0).values for k in results[0].delta}
        return ClientResult(delta=delta, num_samples=sum(r.num_samples for r in results))


class MedianFedAvg(Algorithm):
    name = "median_fedavg"

    def __init__(self) -> None:
        super().__init__(server=MedianServer())
