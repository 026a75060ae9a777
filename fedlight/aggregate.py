"""Weighted sums of client results within a rank and across ranks.

Sums are kept in float64, so the order in which clients are added (which depends on how they are
spread over processes) changes the result by far less than one float32 ulp: 1 and N processes agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedlight import params as P
from fedlight.rules import ClientResult


class Accumulator:
    """Running ``Σ w_i·Δ_i``, ``Σ w_i·extras_i`` (or plain sums), ``Σ w_i·buffers_i`` and metric means."""

    def __init__(self, summed_extras: frozenset[str] = frozenset(), device: torch.device | str = "cpu") -> None:
        self.summed = summed_extras
        self.device = torch.device(device)
        self.delta: dict[str, Tensor] | None = None
        self.extras: dict[str, dict[str, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.metrics: dict[str, Tensor] = {}
        self.scalars = {"weight": 0.0, "count": 0.0, "num_samples": 0.0, "bytes_down": 0.0, "bytes_up": 0.0}
        self.dtype: torch.dtype | None = None

    def add(self, res: ClientResult, w: float, buffers: dict[str, Tensor], bytes_down: int, bytes_up: int) -> None:
        if self.delta is None:
            self.dtype = next(iter(res.delta.values())).dtype
            self.delta = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in res.delta.items()}
            self.extras = {e: {k: torch.zeros_like(v, dtype=torch.float64) for k, v in p.items()}
                           for e, p in res.extras.items()}
            self.buffers = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in buffers.items()}
        dev = next(iter(self.delta.values())).device
        _axpy(self.delta, res.delta, w)
        for e, p in res.extras.items():
            _axpy(self.extras[e], p, 1.0 if e in self.summed else w)
        _axpy(self.buffers, buffers, w)
        for k, v in res.metrics.items():
            t = torch.as_tensor(v, dtype=torch.float64, device=dev).detach()
            self.metrics[k] = self.metrics.get(k, torch.zeros((), dtype=torch.float64, device=dev)) + t
        s = res.metrics["delta_sqnorm"]
        self.metrics["delta_sqnorm_w"] = self.metrics.get("delta_sqnorm_w", 0) + w * torch.as_tensor(
            s, dtype=torch.float64, device=dev)
        self.scalars["weight"] += w
        self.scalars["count"] += 1
        self.scalars["num_samples"] += res.num_samples
        self.scalars["bytes_down"] += bytes_down
        self.scalars["bytes_up"] += bytes_up

    def layout(self) -> list[tuple[str, tuple[int, ...], str]] | None:
        """(flat key, shape, dtype) of everything summed, so a rank with no clients can join the all-reduce."""
        if self.delta is None:
            return None
        return [(k, tuple(v.shape), str(self.dtype)) for k, v in self._all().items()]

    def ensure(self, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Create zero sums from another rank's ``layout`` when this rank trained no client."""
        if self.delta is not None:
            return
        dev = self.device
        self.dtype = getattr(torch, layout[0][2].split(".")[-1])
        self.delta = {}
        for key, shape, _ in layout:
            z = torch.zeros(shape, dtype=torch.float64, device=dev)
            kind, _, name = key.partition("/")
            if kind == "d":
                self.delta[name] = z
            elif kind == "e":
                e, _, k = name.partition("/")
                self.extras.setdefault(e, {})[k] = z
            elif kind == "b":
                self.buffers[name] = z
            else:
                self.metrics[name] = z

    def _all(self) -> dict[str, Tensor]:
        flat: dict[str, Tensor] = {}
        for k, v in self.delta.items():
            flat[f"d/{k}"] = v
        for e, p in self.extras.items():
            for k, v in p.items():
                flat[f"e/{e}/{k}"] = v
        for k, v in self.buffers.items():
            flat[f"b/{k}"] = v
        for k, v in self.metrics.items():
            flat[f"m/{k}"] = v
        return flat

    def reduce(self, fabric: Any) -> tuple[ClientResult, dict[str, Tensor], dict[str, float]]:
        """All-reduce (sum) across ranks and normalize. Every rank gets the same result."""
        flat = self._all()
        dev = next(iter(flat.values())).device
        scal = torch.tensor(list(self.scalars.values()), dtype=torch.float64, device=dev)
        if fabric is not None and fabric.world_size > 1:
            vec = torch.cat([P.flatten(flat), scal])
            vec = fabric.all_reduce(vec, reduce_op="sum")
            flat = P.unflatten(vec[: -len(scal)], flat)
            scal = vec[-len(scal):]
        s = dict(zip(self.scalars, scal.tolist()))
        W, n = s["weight"], s["count"]
        cast = lambda v, div: (v / div).to(self.dtype)  # noqa: E731
        delta = {k: cast(flat[f"d/{k}"], W) for k in self.delta}
        extras = {e: {k: cast(flat[f"e/{e}/{k}"], 1.0 if e in self.summed else W) for k in p}
                  for e, p in self.extras.items()}
        buffers = {k: flat[f"b/{k}"] / W for k in self.buffers}
        metrics = {k: flat[f"m/{k}"] / (W if k == "delta_sqnorm_w" else n) for k in self.metrics}
        agg = ClientResult(delta=delta, num_samples=int(s["num_samples"]), extras=extras, metrics=metrics)
        return agg, buffers, s


def _axpy(acc: dict[str, Tensor], x: dict[str, Tensor], w: float) -> None:
    # float64 += w·float32 in place: the add promotes each element itself (bit-identical to adding x.double()),
    # without allocating a float64 copy of every tensor per client (4x faster for ResNet-18 on CPU)
    if acc:
        torch._foreach_add_(list(acc.values()), [x[k].detach() for k in acc], alpha=w)
