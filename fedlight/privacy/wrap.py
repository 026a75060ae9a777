"""``private(algorithm, ...)``: any rule pair with differential privacy, by composition (docs/privacy.md)."""

from __future__ import annotations

import sys

from torch import nn

from fedlight.core.rules import Algorithm
from fedlight.errors import check
from fedlight.privacy.accountant import Convention
from fedlight.privacy.local import ClientNoise, ClipBound, PrivateLocal
from fedlight.privacy.record import RecordLevel, check_rule
from fedlight.privacy.server import PrivateServer
from fedlight.privacy.settings import PrivacyConfig, relation, validate


class PrivateAlgorithm(Algorithm):
    """``inner`` with its client half wrapped in :class:`PrivateLocal` and its server half in
    :class:`PrivateServer`; keeps the inner rule's name (a run's directory and resume checks are the rule's)."""

    def __init__(self, inner: Algorithm, local: PrivateLocal, server: PrivateServer) -> None:
        super().__init__(local, server)
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def __repr__(self) -> str:
        return f"Private({self.inner!r})"


def noise_multiplier(cfg: PrivacyConfig, conv: Convention, rounds: int, say: bool = True) -> float:
    """``σ``: as given, or calibrated by the accountant to ``target_epsilon`` after ``rounds`` rounds (printed unless
    ``say`` is false: a resume, whose checkpoint decides the σ it continues with and says so)."""
    if cfg.noise_multiplier is not None:
        return cfg.noise_multiplier
    sigma = conv.calibrate(cfg.target_epsilon, cfg.delta, rounds)
    if say:
            print(f"fedlight: privacy: σ = {sigma:.6g} reaches ε = {cfg.target_epsilon:g} at δ = {cfg.delta:g} after "
              f"{rounds} rounds of {conv.per_round} of {conv.num_clients} clients ({conv.label()})", file=sys.stderr)
    return sigma


def check_model(model: nn.Module, cfg: PrivacyConfig, precision: str, aggregate_buffers: bool = True) -> None:
    """Refuse, before round 1, a model or precision the level cannot protect: running statistics (BatchNorm) that
    the loop would average over the clients outside the clip and the noise, per-example gradients that batch
    statistics mix (record level), or mixed precision at record level."""
    norms = [type(m).__name__ for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
    if cfg.level == "record":
        check(not norms, f"`privacy.level: record` needs per-example gradients, which {norms[0] if norms else ''}'s "
              "batch statistics mix; use a model with `norm: group` (GroupNorm: `--model.init_args.norm group`)")
        check(precision in ("32-true", "64-true"), f"`privacy.level: record` runs in 32-true or 64-true precision "
              f"only (per-example gradients without loss scaling or autocast), got {precision}; use --precision "
              "32-true")
    else:
        check(not norms or not aggregate_buffers, f"`privacy.level: {cfg.level}`: the model's "
              f"{norms[0] if norms else ''} running statistics would be averaged over the clients outside the clip "
              "and the noise and released with the model; use a model with `norm: group` (GroupNorm, "
              "`--model.init_args.norm group`), or `loop.aggregate_buffers: false`")


def private(algorithm: Algorithm, cfg: PrivacyConfig, seed: int, num_clients: int, per_round: int,
            rounds: int, record_uses: int = 1, sampling: str = "fixed", on_nonfinite: str = "stop",
            resumed: bool = False) -> PrivateAlgorithm:
    """``algorithm`` under ``cfg``; refuses (ConfigError, before round 1) what cannot be made private.
    ``per_round``: the clients sampled per round (expected under ``sampling: poisson``); ``record_uses``: record
    level, how often a record enters its client's gradients per round
    (:func:`fedlight.privacy.record.uses_per_round`); ``sampling``, ``on_nonfinite``: the loop's; ``resumed``: a
    calibrated σ is not printed (the checkpoint decides the σ a resume continues with:
    :meth:`PrivateServer.load_state_dict`)."""
    validate(cfg, num_clients, sampling, on_nonfinite)
    name = type(algorithm).__name__
    check(not algorithm.server.aggregates_itself(), f"`privacy`: {name}'s server rule aggregates the client results "
          "itself, so the noised sum never reaches it; run it without privacy")
    why = algorithm.local.scalar_uploads
    check(why is None, f"`privacy`: {name} uploads {why} outside its tensors, which no clip bounds; run it without "
          "privacy (or with its non-adaptive form)")
    conv = Convention(num_clients, per_round, sampling, relation(cfg, sampling), cfg.accountant)
    sigma = noise_multiplier(cfg, conv, rounds, say=not resumed)
    sigma_b = cfg.count_noise if cfg.count_noise is not None else per_round / 20
    k = 2 if conv.relation == "replace_one" else 1
    check(not cfg.adaptive or sigma == 0 or k * sigma_b > sigma, f"`privacy.count_noise` (σ_b = {sigma_b:g}"
          f"{'' if cfg.count_noise is not None else ', m/20'}) must exceed σ/{k} = {sigma / k:g} for adaptive "
          f"clipping under {conv.relation} (the update then gets σ_Δ = (σ^-2 − ({k}σ_b)^-2)^-1/2); raise "
          "`privacy.count_noise` or sample more clients")
    bound = ClipBound(cfg.clip)
    client_noise, record = None, None
    if cfg.level == "record":
        check_rule(algorithm.local, name)
        record = RecordLevel(sigma, cfg.clip, seed)
    elif cfg.level == "local":
        client_noise = ClientNoise(cfg.mechanism, sigma, seed)
    elif cfg.placement == "distributed":
        client_noise = ClientNoise("gaussian", sigma, seed)  # its scale: σ_Δ/√m, set by the server half
    local = PrivateLocal(algorithm.local, bound, client_noise, l1=cfg.mechanism == "laplace",
                         report_clipped=cfg.adaptive, record=record)
    server = PrivateServer(algorithm.server, cfg, sigma, bound, seed, conv, rounds,
                           client_noise if cfg.level == "client" else None)
    server.record_uses = record_uses
    if cfg.level != "record" and getattr(algorithm.server, "weighting", None) != "uniform":
        print("fedlight: privacy: client results are weighted uniformly (sample-count weights have unbounded "
              "sensitivity)", file=sys.stderr)
    return PrivateAlgorithm(algorithm, local, server)
