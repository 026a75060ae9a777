"""``RoundRow``: what one round reports (one line of ``metrics.jsonl``); ``RoundPlan`` and ``Collected``: who takes part
in a round and what the loop keeps of its clients."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.rules import ClientResult, RoundInfo
from fedlight.engine.aggregate import Accumulator, Reduced


@dataclass
class RoundRow:
    """The loop's account of one round; :meth:`as_dict` is the ``metrics.jsonl`` line (without evaluation)."""

    round: int
    """1-based."""
    lr: float
    """The lr of the round's first local step (the first param group's)."""
    sampled: list[int]
    clients_reported: int
    clients_dropped: int
    clients_skipped_nonfinite: int
    clients: list[dict[str, Any]]
    """Per kept client: ``id``, ``train_loss``, ``delta_norm`` (‖Δ_i‖), ``num_samples``."""
    round_time_s: float = 0.0
    train_time_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    train_loss: float | None = None
    flatness_distance: float | None = None
    """``Σ_i w_i‖y_{i,K} − x_{r+1}‖² / Σ_i w_i`` (FedNSAM Def. 1; the 1/S mean for equal-size clients)."""
    update_norm: float | None = None
    """``‖x_{r+1} − x_r‖``."""
    rule: dict[str, float] = field(default_factory=dict)
    """The rule's per-client diagnostics, averaged over clients."""
    server: dict[str, float] = field(default_factory=dict)
    """The server rule's diagnostics."""
    aggregate_time_s: float | None = None
    lr_last: float | None = None
    """The lr of the round's last local step, when it differs from the first (an in-round schedule)."""

    @classmethod
    def of(cls, plan, got, lrs: tuple[float, float] | None = None) -> RoundRow:
        info = plan.info
        first, last = lrs if lrs is not None else (info.lr, info.lr)
        return cls(round=info.round + 1, lr=first, lr_last=None if last == first else last, sampled=list(info.sampled),
                   clients_reported=len(plan.active) - len(got.skipped), clients_dropped=len(plan.dropped),
                   clients_skipped_nonfinite=len(got.skipped), clients=got.clients)

    def timed(self, t0: float, t_train: float) -> RoundRow:
        """Stamp the wall times: the whole round since ``t0``, training until ``t_train``, the rest after it."""
        end = time.perf_counter()
        self.round_time_s, self.train_time_s, self.aggregate_time_s = end - t0, t_train - t0, end - t_train
        return self

    def measure(self, red: Reduced, x: Params, x_old: Params, y0: Params, server: dict[str, Any],
                clients: bool = True) -> None:
        """Fill the aggregate statistics from the reduced sums and the new global model ``x``; ``clients=False``: a
        round nobody reported to (released by the server anyway): no client statistics."""
        # flatness distance from Σ w_i‖Δ_i‖², Δ̄ and U = x_{r+1} − y_0 (clients start from the broadcast y_0):
        # Σ w‖Δ_i − U‖²/Σw = mean‖Δ‖² − 2⟨Δ̄, U⟩ + ‖U‖²
        U = P.sub(x, y0)
        vals = torch.stack([red.train_loss.double(),
                            red.delta_sqnorm - 2 * P.dot(red.result.delta, U).double() + P.sqnorm(U),
                            P.norm(P.sub(x, x_old)).double(),
                            *(torch.as_tensor(v, dtype=torch.float64, device=U[next(iter(U))].device)
                              for v in red.result.metrics.values())]).tolist()  # one host sync
        self.train_loss, self.flatness_distance, self.update_norm = vals[:3]
        self.rule = dict(zip(red.result.metrics, vals[3:]))
        if not clients:
            self.train_loss, self.flatness_distance, self.rule = None, None, {}
        self.server = {k: float(v) for k, v in server.items()}
        self.bytes_down, self.bytes_up = int(red.counters["bytes_down"]), int(red.counters["bytes_up"])

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("rule", "server") and v is not None}
        out.update({k if "/" in k else f"rule/{k}": v for k, v in self.rule.items()})  # "train/..": a task's logs
        out.update({k if "/" in k else f"server/{k}": v for k, v in self.server.items()})  # "privacy/..": a wrapper's
        return out


def client_entries(stats: list[tuple[int, int, Tensor, Tensor]]) -> list[dict[str, Any]]:
    """Per-client log entries from (id, n_i, mean loss, ‖Δ‖²) with one host sync for all clients."""
    if not stats:
        return []
    vals = torch.stack([torch.stack([loss.double(), sq.double().sqrt()]) for _, _, loss, sq in stats]).tolist()
    return [{"id": c, "train_loss": v[0], "delta_norm": v[1], "num_samples": n}
            for (c, n, _, _), v in zip(stats, vals)]


@dataclass
class RoundPlan:
    """Who takes part in a round (identical on every rank) and which of them this rank trains."""

    info: RoundInfo
    dropped: list[int]
    """Sampled clients that fail to report (``loop.client_dropout``)."""
    active: list[int]
    """Sampled clients that train."""
    mine: list[int]
    """The active clients this rank trains."""


@dataclass
class Collected:
    """What this rank keeps of its trained clients, then (after :meth:`FederatedLoop._exchange`) of all ranks'."""

    acc: Accumulator
    states: dict[int, dict] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)
    """Per-client log entries: id, train_loss, delta_norm, num_samples (client order)."""
    results: list[tuple[int, ClientResult]] = field(default_factory=list)
    """Kept client results, only when the server rule overrides ``aggregate``."""
    start: dict[str, Tensor] | None = None
    """``y_0``, where the clients started (for the flatness distance)."""
    layout: Any = None
