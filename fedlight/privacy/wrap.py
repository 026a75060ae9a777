"""``private(algorithm, ...)``: any rule pair with differential privacy, by composition (docs/privacy.md)."""

from __future__ import annotations

import sys

from fedlight.core.rules import Algorithm
from fedlight.errors import check
from fedlight.privacy import accountant
from fedlight.privacy.local import ClientNoise, ClipBound, PrivateLocal
from fedlight.privacy.record import RecordLevel, check_rule
from fedlight.privacy.server import PrivateServer
from fedlight.privacy.settings import PrivacyConfig, validate


class PrivateAlgorithm(Algorithm):
    """``inner`` with its client half wrapped in :class:`PrivateLocal` and its server half in
    :class:`PrivateServer`; keeps the inner rule's name (a run's directory and resume checks are the rule's)."""

    def __init__(self, inner: Algorithm, local: PrivateLocal, server: PrivateServer) -> None:
        super().__init__(local, server)
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def __repr__(self) -> str:
        return f"Private({self.inner!r})"


def noise_multiplier(cfg: PrivacyConfig, num_clients: int, per_round: int, rounds: int) -> float:
    """``σ``: as given, or calibrated by the accountant to ``target_epsilon`` after ``rounds`` rounds (printed)."""
    if cfg.noise_multiplier is not None:
        return cfg.noise_multiplier
    sigma = accountant.calibrate(cfg.target_epsilon, cfg.delta, num_clients, per_round, rounds)
    print(f"fedlight: privacy: σ = {sigma:.6g} reaches ε = {cfg.target_epsilon:g} at δ = {cfg.delta:g} after "
          f"{rounds} rounds of {per_round} of {num_clients} clients (sampled without replacement)", file=sys.stderr)
    return sigma


def private(algorithm: Algorithm, cfg: PrivacyConfig, seed: int, num_clients: int, per_round: int,
            rounds: int, record_uses: int = 1) -> PrivateAlgorithm:
    """``algorithm`` under ``cfg``; refuses (ConfigError, before round 1) what cannot be made private.
    ``record_uses``: record level, how often a record enters its client's gradients per round
    (:func:`fedlight.privacy.record.uses_per_round`)."""
    validate(cfg, num_clients)
    name = type(algorithm).__name__
    check(not algorithm.server.aggregates_itself(), f"`privacy`: {name}'s server rule aggregates the client results "
          "itself, so the noised sum never reaches it; run it without privacy")
    why = algorithm.local.scalar_uploads
    check(why is None, f"`privacy`: {name} uploads {why} outside its tensors, which no clip bounds; run it without "
          "privacy (or with its non-adaptive form)")
    sigma = noise_multiplier(cfg, num_clients, per_round, rounds)
    sigma_b = cfg.count_noise if cfg.count_noise is not None else per_round / 20
    check(not cfg.adaptive or sigma == 0 or 2 * sigma_b > sigma, f"`privacy.count_noise` (σ_b = {sigma_b:g}"
          f"{'' if cfg.count_noise is not None else ', m/20'}) must exceed σ/2 = {sigma / 2:g} for adaptive clipping "
          "(the update then gets σ_Δ = (σ^-2 − (2σ_b)^-2)^-1/2); raise `privacy.count_noise` or sample more clients")
    bound = ClipBound(cfg.clip)
    client_noise, record = None, None
    if cfg.level == "record":
        check_rule(algorithm.local, name)
        record = RecordLevel(sigma, cfg.clip, seed)
    elif cfg.level == "local":
        client_noise = ClientNoise(cfg.mechanism, sigma, seed)
    elif cfg.placement == "distributed":
        client_noise = ClientNoise("gaussian", sigma / per_round ** 0.5, seed)  # Σ over m clients: N(0, σ²C²)
    local = PrivateLocal(algorithm.local, bound, client_noise, l1=cfg.mechanism == "laplace",
                         report_clipped=cfg.adaptive, record=record)
    server = PrivateServer(algorithm.server, cfg, sigma, bound, seed, num_clients, per_round)
    server.record_uses = record_uses
    if cfg.level != "record" and getattr(algorithm.server, "weighting", None) != "uniform":
        print("fedlight: privacy: client results are weighted uniformly (sample-count weights have unbounded "
              "sensitivity)", file=sys.stderr)
    return PrivateAlgorithm(algorithm, local, server)
