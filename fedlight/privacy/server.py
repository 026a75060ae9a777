"""The server half of a private run: any server rule, fed the privatized mean of the clipped uploads.

Client-level DP (DP-FedAvg, McMahan et al. ICLR'18, and every rule on top): the float64 sum of the clipped uploads
gets ``N(0, σ²C²)`` once (``central``; with ``distributed`` the reporting clients added their shares), is divided
by the expected number of clients ``m`` (fixed denominator) or by the number that reported, and the inner server
rule runs on that mean as post-processing. Client weights are uniform: sample-count weights have unbounded
sensitivity.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS'21, Alg. 1): each client reports
``b_i = 1[‖Δ_i‖ ≤ C]``; ``b̄ = (Σ b_i + N(0, σ_b²))/m``; ``C ← C·exp(−η_C(b̄ − γ))``. The update's noise is
``σ_Δ = (σ^-2 − (2σ_b)^-2)^-1/2`` so that the pair of queries costs what one Gaussian query of ``σ`` does.
"""

from __future__ import annotations

import math
from typing import Any

from fedlight.algorithms.compose import ServerWrapper
from fedlight.core.rules import ServerRule
from fedlight.privacy import accountant, noise
from fedlight.privacy.local import ClipBound
from fedlight.privacy.settings import PrivacyConfig


def update_noise(sigma: float, count_noise: float) -> float:
    """``σ_Δ = (σ^-2 − (2σ_b)^-2)^-1/2`` (Andrew et al., Thm 1); needs ``2σ_b > σ`` (checked before round 1)."""
    return (sigma ** -2 - (2 * count_noise) ** -2) ** -0.5


def adaptive_clip(C: float, unclipped: float, target_quantile: float, clip_lr: float) -> float:
    """``C ← C·exp(−η_C(b̄ − γ))`` (Andrew et al., Alg. 1, geometric update)."""
    return C * math.exp(-clip_lr * (unclipped - target_quantile))


class PrivateServer(ServerWrapper):
    """``inner`` on the privatized mean (see the module docstring).

    Args:
        inner: the server rule.
        cfg: the privacy settings (σ resolved).
        sigma: ``σ``.
        bound: ``C``, shared with the client half.
        seed: the run seed (the noise streams derive from it and the round).
        num_clients: ``N``.
        per_round: ``m``, the clients sampled per round.
    """

    weighting = "uniform"

    def __init__(self, inner: ServerRule, cfg: PrivacyConfig, sigma: float, bound: ClipBound, seed: int,
                 num_clients: int, per_round: int) -> None:
        super().__init__(inner)
        self.weighting = "uniform"
        self.cfg, self.sigma, self.bound, self.seed = cfg, sigma, bound, seed
        self.N, self.m = num_clients, per_round
        self.count_noise = cfg.count_noise if cfg.count_noise is not None else per_round / 20  # σ_b
        self.update_sigma = update_noise(sigma, self.count_noise) if cfg.adaptive and sigma > 0 else sigma
        self.rounds = 0
        self.unclipped: float | None = None
        self.record_uses = 1
        """Record level: how often a record enters its client's gradients in one round (set by ``private``)."""
        if cfg.level == "record":
            self.weighting = inner.weighting  # the uploads are not clipped: sample weights reveal no record

    def privatize(self, sums: dict[str, Any], count: float, round: int) -> float | None:
        """Noise the float64 sums once (every process draws the same) and return the denominator."""
        cfg = self.cfg
        if cfg.level == "client" and cfg.placement == "central" and self.update_sigma > 0:
            gen = noise.generator(self.seed, round, noise.CENTRAL)
            for tree in noise.upload_trees(sums["delta"], sums["extras"]):
                noise.gaussian_(tree, self.update_sigma * self.bound.value, gen)
        if cfg.adaptive:
            b = float(sums["metrics"].pop("dp_unclipped"))
            gen = noise.generator(self.seed, round, noise.COUNT)
            self.unclipped = (b + self.count_noise * noise.scalar_normal(gen)) / self.m
        return float(self.m) if cfg.denominator == "fixed" and cfg.level != "record" else None

    def update(self, params, agg, info):
        x = self.inner.update(params, agg, info)
        self.rounds = info.round + 1
        if self.cfg.adaptive and self.unclipped is not None:
            self.bound.value = adaptive_clip(self.bound.value, self.unclipped, self.cfg.target_quantile,
                                             self.cfg.clip_lr)
        return x

    def epsilon(self) -> float:
        """ε(δ) after the rounds done: client level over the sampled rounds; local DP: of one upload; record level:
        of a record's uses so far (``record_uses`` per round, every round counted)."""
        if self.cfg.level == "record":
            return accountant.gaussian_epsilon(self.sigma, self.cfg.delta, self.rounds * self.record_uses)
        if self.cfg.level == "local":
            if self.cfg.mechanism == "laplace":
                return math.inf if self.sigma == 0 else 2 / self.sigma  # L1 diameter 2C over the scale σC
            return accountant.gaussian_epsilon(self.sigma, self.cfg.delta)
        return accountant.epsilon(self.sigma, self.N, self.m, self.rounds, self.cfg.delta)

    def diagnostics(self) -> dict[str, float]:
        out = {**self.inner.diagnostics(), "privacy/epsilon": self.epsilon(), "privacy/clip": self.bound.value}
        if self.unclipped is not None:
            out["privacy/unclipped_fraction"] = self.unclipped
        return out

    def summary(self) -> dict[str, Any]:
        """What summary.json records under ``privacy``."""
        cfg = self.cfg
        return {"level": cfg.level, "mechanism": cfg.mechanism, "placement": cfg.placement, "epsilon": self.epsilon(),
                "delta": cfg.delta, "noise_multiplier": self.sigma, "update_noise_multiplier": self.update_sigma,
                "clip": self.bound.value, "clip_start": cfg.clip, "adaptive": cfg.adaptive,
                "sampling_rate": self.m / self.N, "clients_per_round": self.m, "num_clients": self.N,
                "rounds": self.rounds, "denominator": cfg.denominator, **accountant.describe()}

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "clip": self.bound.value, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.bound.value, self.rounds = state["clip"], state["rounds"]
