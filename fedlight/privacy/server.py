"""The server half of a private run: any server rule, fed the privatized mean of the clipped uploads.

Client-level DP (DP-FedAvg, McMahan et al. ICLR'18, and every rule on top): the float64 sum of the clipped uploads
gets ``N(0, σ²C²)`` once (``central``; with ``distributed`` the reporting clients added their shares), is divided
by the expected number of clients ``m`` (fixed denominator) or by the number that reported, and the inner server
rule runs on that mean as post-processing. Client weights are uniform: sample-count weights have unbounded
sensitivity.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS'21, Alg. 1): each client reports
``b_i = 1[‖Δ_i‖ ≤ C]``; ``b̄ = (Σ b_i + N(0, σ_b²))/m``; ``C ← C·exp(−η_C(b̄ − γ))``. The update's noise is
``σ_Δ = (σ^-2 − (2σ_b)^-2)^-1/2`` so that the pair of queries costs what one Gaussian query of ``σ`` does. With
``distributed`` the clients add both noises: each adds ``N(0, σ_Δ²C²/m)`` to its upload and ``N(0, σ_b²/m)`` to
its ``b_i``, so the server sees neither query without its noise.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from fedlight.algorithms.compose import ServerWrapper
from fedlight.core.rules import ServerRule
from fedlight.errors import ConfigError
from fedlight.privacy import accountant, noise
from fedlight.privacy.accountant import Convention, update_noise
from fedlight.privacy.local import ClientNoise, ClipBound
from fedlight.privacy.settings import PrivacyConfig

__all__ = ["PrivateServer", "adaptive_clip", "update_noise"]


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
        convention: how ε is accounted (``N``, ``m``: the clients sampled per round, expected under Poisson).
        rounds: the rounds the run plans (``loop.rounds``): a ``target_epsilon`` run extended past them on resume
            recalibrates σ for the rounds left, or is refused when the target is spent.
        client_noise: the clients' own noise under ``placement: distributed`` (its scale follows σ).
    """

    weighting = "uniform"

    def __init__(self, inner: ServerRule, cfg: PrivacyConfig, sigma: float, bound: ClipBound, seed: int,
                 convention: Convention, rounds: int, client_noise: ClientNoise | None = None) -> None:
        super().__init__(inner)
        self.weighting = "uniform"
        self.cfg, self.bound, self.seed, self.conv, self.planned = cfg, bound, seed, convention, rounds
        self.N, self.m = convention.num_clients, convention.per_round
        self.count_noise = cfg.count_noise if cfg.count_noise is not None else self.m / 20  # σ_b
        self.client_noise = client_noise
        self.set_sigma(sigma)
        self.rounds = 0
        self.history: list[list[float]] = []
        """``[g, rounds]`` segments: the per-client noise multiplier each round really had (client level)."""
        self._g: float | None = None
        self.unclipped: float | None = None
        self.record_uses = 1
        """Record level: how often a record enters its client's gradients in one round (set by ``private``)."""
        if cfg.level == "record":
            self.weighting = inner.weighting  # the uploads are not clipped: sample weights reveal no record

    def set_sigma(self, sigma: float) -> None:
        """``σ`` and what follows from it: the update's noise ``σ_Δ`` and the distributed shares ``σ_Δ/√m``."""
        self.sigma = sigma
        adaptive = self.cfg.adaptive and sigma > 0
        self.update_sigma = update_noise(sigma, self.count_noise, self.conv.relation) if adaptive else sigma
        if self.client_noise is not None and self.cfg.level == "client":
            self.client_noise.scale = self.update_sigma / self.m ** 0.5  # Σ over m clients: N(0, σ_Δ²C²)
            if adaptive:  # the count query's noise too: Σ over m clients: N(0, σ_b²)
                self.client_noise.count_scale = self.count_noise / self.m ** 0.5

    def round_multiplier(self, reported: float) -> float:
        """The per-client noise multiplier of a round in which ``reported`` clients were summed: σ, unless the
        distributed noise lost the shares of the clients that did not report (their noise was never added)."""
        if self.cfg.placement != "distributed" or reported >= self.m or self.sigma == 0:
            return self.sigma
        share = math.sqrt(reported / self.m)  # both queries' noise: the reporting clients' shares only
        return accountant.round_multiplier(self.update_sigma * share, self.count_noise * share if self.cfg.adaptive
                                           else None, self.conv.relation)

    @property
    def releases_empty_rounds(self) -> bool:
        """Whether a round nobody reported to is released with its noise (on a zero sum) and counted, as the
        accountant's sampled Gaussian mechanism is: client level with the server's noise. (Distributed noise: nobody
        added any, and nothing the round releases depends on the data, so the model stays and the round costs no ε.)"""
        return self.cfg.level == "client" and self.cfg.placement == "central"

    def privatize(self, sums: dict[str, Any], count: float, round: int) -> float | None:
        """Noise the float64 sums once (every process draws the same) and return the denominator (``m`` when nobody
        reported, whatever the denominator setting)."""
        cfg = self.cfg
        self._g = self.round_multiplier(count)
        if cfg.level == "client" and cfg.placement == "central" and self.update_sigma > 0:
            gen = noise.generator(self.seed, round, noise.CENTRAL)
            for tree in noise.upload_trees(sums["delta"], sums["extras"]):
                noise.gaussian_(tree, self.update_sigma * self.bound.value, gen)
        if cfg.adaptive:  # the count's noise: the server's (central), else the clients' shares are in the sum
            b = float(sums["metrics"].pop("dp_unclipped"))
            if cfg.placement == "central":
                b += self.count_noise * noise.scalar_normal(noise.generator(self.seed, round, noise.COUNT))
            self.unclipped = b / self.m
        return float(self.m) if (cfg.denominator == "fixed" or count == 0) and cfg.level != "record" else None

    def update(self, params, agg, info):
        x = self.inner.update(params, agg, info)
        self.rounds = info.round + 1
        accountant.merge(self.history, self._g if self._g is not None else self.sigma)
        self._g = None
        if self.cfg.adaptive and self.unclipped is not None:
            self.bound.value = adaptive_clip(self.bound.value, self.unclipped, self.cfg.target_quantile,
                                             self.cfg.clip_lr)
        return x

    def epsilon(self) -> float:
        """ε(δ) after the rounds done: client level composed over the σ each round had; local DP: of one upload;
        record level: of a record's uses so far (``record_uses`` per round, every round counted)."""
        cfg = self.cfg
        if cfg.level == "record":
            return accountant.gaussian_epsilon(self.sigma, cfg.delta, self.rounds * self.record_uses,
                                               self.conv.relation)
        if cfg.level == "local":
            if cfg.mechanism == "laplace":
                return math.inf if self.sigma == 0 else 2 / self.sigma  # L1 diameter 2C over the scale σC
            return accountant.gaussian_epsilon(self.sigma, cfg.delta, relation=self.conv.relation)
        return self.conv.epsilon(tuple((g, int(n)) for g, n in self.history), cfg.delta)

    def convention_label(self) -> str:
        """Which ε this is: level, accountant, sampling and relation (console, trackers)."""
        return f"{self.cfg.level} level, {self.conv.label()}, δ = {self.cfg.delta:g}"

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
                "noise_multipliers": [list(h) for h in self.history], "clip": self.bound.value,
                "clip_start": cfg.clip, "adaptive": cfg.adaptive, "sampling_rate": self.m / self.N,
                "clients_per_round": self.m, "num_clients": self.N, "rounds": self.rounds,
                "denominator": cfg.denominator, "epsilon_convention": self.convention_label(), **self.conv.describe()}

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "clip": self.bound.value, "rounds": self.rounds,
                "sigma": self.sigma, "history": [list(h) for h in self.history], "planned": self.planned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.bound.value, self.rounds = state["clip"], state["rounds"]
        used = state.get("sigma", self.sigma)  # a checkpoint of before the history: every round at today's σ
        self.history = [list(h) for h in state.get("history", [[used, self.rounds]] if self.rounds else [])]
        if state.get("planned", self.planned) == self.planned or self.cfg.target_epsilon is None:
            self.set_sigma(used)  # the same plan: the σ it trained with (a recalibrated one too), bit for bit
        elif self.cfg.level == "client":
            self._extend(used)

    def _extend(self, used: float) -> None:
        """A ``target_epsilon`` run resumed with more (or fewer) rounds than it was calibrated for: the rounds left
        get the σ that brings the whole run to the target, composed with what the rounds done really used; a
        target already spent is refused (before the first new round)."""
        cfg, left = self.cfg, self.planned - self.rounds
        if left <= 0:
            self.set_sigma(used)
            return
        spent = tuple((g, int(n)) for g, n in self.history)
        eps = self.conv.epsilon(spent, cfg.delta)
        if eps >= cfg.target_epsilon * (1 - 1e-3):
            raise ConfigError(f"`privacy.target_epsilon` {cfg.target_epsilon:g} is spent: the {self.rounds} rounds "
                              f"trained at σ = {used:.6g} reached ε = {eps:.4g}, so {left} more rounds would exceed "
                              f"it; keep `loop.rounds` {self.rounds}, or start a new run with the target and rounds "
                              "you mean")
        sigma = self.conv.calibrate(cfg.target_epsilon, cfg.delta, left, spent)
        print(f"fedlight: privacy: the {self.rounds} rounds trained at σ = {used:.6g} spent ε = {eps:.4g}; the "
              f"{left} rounds left get σ = {sigma:.6g} so that ε = {cfg.target_epsilon:g} after {self.planned} "
              f"({self.conv.label()})", file=sys.stderr)
        self.set_sigma(sigma)
