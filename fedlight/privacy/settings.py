"""``privacy``: the differential-privacy settings of a run (a recipe section and ``--privacy.*`` flags).

A defining setting: it is part of the run directory's hash and a resume must agree on it. See docs/privacy.md.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from fedlight.errors import check
from fedlight.privacy.accountant import ACCOUNTANTS, RELATIONS, why_not

LEVELS = ("client", "local", "record")
MECHANISMS = ("gaussian", "laplace")
PLACEMENTS = ("central", "distributed")
DENOMINATORS = ("fixed", "actual")


@dataclass
class PrivacyConfig:
    """Differential privacy of the clients' uploads (docs/privacy.md)."""

    level: str = "client"
    """``client``: each sampled client's whole upload is clipped to ``clip`` and Gaussian noise ``N(0, σ²C²)`` is
    added to the sum (client-level DP); ``local``: each client privatizes its own upload (local DP, its own ε per
    upload); ``record``: example-level DP-SGD inside a client (each local step's per-example gradients clipped to
    ``clip``, ``N(0, σ²C²)`` added to their sum)."""
    mechanism: str = "gaussian"
    """``gaussian`` (every level) or ``laplace`` (``level: local`` only; the upload is then clipped in L1 norm)."""
    noise_multiplier: float | None = None
    """``σ``: the noise standard deviation in units of the clip ``C`` (Laplace: the scale ``b = σ·C``). ``None``:
    calibrated before round 1 from ``target_epsilon`` (client level)."""
    clip: float = 1.0
    """``C``: the bound on each client's whole upload norm (Δ and every extra the rule uploads); with ``adaptive``
    its starting value."""
    delta: float = 1e-5
    """``δ`` of the (ε, δ) guarantee; keep it below 1/(number of clients)."""
    target_epsilon: float | None = None
    """Calibrate ``σ`` so that ε(δ) after ``loop.rounds`` rounds equals this (client level); excludes
    ``noise_multiplier``."""
    placement: str = "central"
    """``central``: the server adds ``N(0, σ²C²)`` once to the sum; ``distributed``: each reporting client adds
    ``N(0, σ²C²/m)`` (m = ``loop.clients_per_round``), the form secure aggregation needs."""
    denominator: str = "fixed"
    """``fixed``: divide the noised sum by the expected number of clients ``m`` (the fixed-denominator estimator);
    ``actual``: by the number that reported."""
    adaptive: bool = False
    """Adaptive clipping (Andrew et al., NeurIPS'21): ``C ← C·exp(−η_C(b̄ − γ))`` after every round, ``b̄`` the
    noised fraction of clients whose upload norm was at most ``C``."""
    target_quantile: float = 0.5
    """``γ``: the quantile of the upload norms that adaptive clipping tracks."""
    clip_lr: float = 0.2
    """``η_C``: adaptive clipping's geometric step."""
    count_noise: float | None = None
    """``σ_b``: the noise std of the clipped-client count (adaptive clipping); ``None``: ``m/20`` as the paper
    recommends."""
    accountant: str = "rdp"
    """``rdp`` or ``pld``: dp-accounting's RDP or PLD accountant (PLD: Poisson sampling only, ``loop.sampling:
    poisson``)."""
    relation: str | None = None
    """The neighbouring relation the (ε, δ) guarantee is under: ``replace_one`` (one client's data replaced by
    another's; N public) or ``add_remove`` (one client added or removed; Poisson sampling only). ``None``: replace-one
    for fixed-size sampling, add/remove for Poisson."""


def validate(cfg: PrivacyConfig, num_clients: int | None = None, sampling: str | None = None,
             on_nonfinite: str | None = None) -> None:
    """Refuse bad settings in one line each (exit 2, before round 1); warn on a δ above 1/N. ``sampling``: the
    loop's (``loop.sampling``), checked against the relation and accountant when given; ``on_nonfinite``: the
    loop's (``loop.on_nonfinite``), checked against the placement when given."""
    check(cfg.level in LEVELS, f"`privacy.level` must be one of {', '.join(LEVELS)}, got {cfg.level!r}")
    check(cfg.mechanism in MECHANISMS, f"`privacy.mechanism` must be one of {', '.join(MECHANISMS)}, got "
          f"{cfg.mechanism!r}")
    check(cfg.mechanism == "gaussian" or cfg.level == "local", "`privacy.mechanism: laplace` is for `privacy.level: "
          "local` only; client-level DP adds Gaussian noise (its accountant is Gaussian)")
    check(cfg.placement in PLACEMENTS, f"`privacy.placement` must be one of {', '.join(PLACEMENTS)}, got "
          f"{cfg.placement!r}")
    check(cfg.denominator in DENOMINATORS, f"`privacy.denominator` must be one of {', '.join(DENOMINATORS)}, got "
          f"{cfg.denominator!r}")
    check(cfg.accountant in ACCOUNTANTS, f"`privacy.accountant` must be one of {', '.join(ACCOUNTANTS)}, got "
          f"{cfg.accountant!r}")
    check(cfg.relation is None or cfg.relation in RELATIONS, f"`privacy.relation` must be one of "
          f"{', '.join(RELATIONS)} or null, got {cfg.relation!r}")
    _numbers(cfg)
    check(cfg.clip > 0, f"`privacy.clip` (C) must be > 0, got {cfg.clip}")
    check(0 < cfg.delta < 1, f"`privacy.delta` (δ) must be in (0, 1), got {cfg.delta}")
    check(cfg.noise_multiplier is None or cfg.noise_multiplier >= 0,
          f"`privacy.noise_multiplier` (σ) must be >= 0, got {cfg.noise_multiplier}")
    check((cfg.noise_multiplier is None) != (cfg.target_epsilon is None), "set exactly one of "
          "`privacy.noise_multiplier` (σ) and `privacy.target_epsilon` (σ is then calibrated)")
    check(cfg.target_epsilon is None or cfg.target_epsilon > 0,
          f"`privacy.target_epsilon` must be > 0, got {cfg.target_epsilon}")
    check(cfg.target_epsilon is None or cfg.level == "client", "`privacy.target_epsilon` calibrates client-level "
          f"DP; for `privacy.level: {cfg.level}` give `privacy.noise_multiplier`")
    check(not cfg.adaptive or cfg.level == "client", "`privacy.adaptive: true` is client-level DP's adaptive "
          "clipping; set `privacy.level: client`")
    check(0 < cfg.target_quantile < 1, f"`privacy.target_quantile` (γ) must be in (0, 1), got {cfg.target_quantile}")
    check(cfg.clip_lr > 0, f"`privacy.clip_lr` (η_C) must be > 0, got {cfg.clip_lr}")
    check(cfg.count_noise is None or cfg.count_noise > 0,
          f"`privacy.count_noise` (σ_b) must be > 0, got {cfg.count_noise}")
    if sampling is not None:
        _convention(cfg, sampling)
    check(on_nonfinite != "skip_client" or cfg.level != "client" or cfg.placement != "distributed",
          "`loop.on_nonfinite: skip_client` with `privacy.placement: distributed`: a client skipped for its own "
          "non-finite update would take its share of the noise with it, so the noise would depend on its data; use "
          "`loop.on_nonfinite: stop`, or `privacy.placement: central`")
    if num_clients is not None and cfg.delta > 1 / num_clients:
        warnings.warn(f"`privacy.delta` ({cfg.delta:g}) is above 1/(number of clients) = {1 / num_clients:g}: "
                      "such a δ allows releasing a client's data outright; choose δ < 1/N", stacklevel=2)


def _numbers(cfg: PrivacyConfig) -> None:
    """Every number given is finite (NaN passes every comparison; ∞ is no noise multiplier or clip)."""
    for key in ("noise_multiplier", "clip", "delta", "target_epsilon", "target_quantile", "clip_lr", "count_noise"):
        v = getattr(cfg, key)
        check(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
              f"`privacy.{key}` must be a finite number, got {v!r}")


def relation(cfg: PrivacyConfig, sampling: str) -> str:
    """The neighbouring relation of the run: as set, else the sampling's own (:func:`accountant.default_relation`)."""
    from fedlight.privacy.accountant import default_relation

    return cfg.relation if cfg.relation is not None else default_relation(sampling)


def _convention(cfg: PrivacyConfig, sampling: str) -> None:
    """Refuse a (sampling, relation, accountant) the accountant cannot account (client level), and what Poisson
    sampling makes private: the number of clients that took part."""
    if cfg.level == "client":
        why = why_not(sampling, relation(cfg, sampling), cfg.accountant)
        check(why is None, why or "")
        check(sampling == "fixed" or cfg.denominator == "fixed", "`privacy.denominator: actual` divides by how many "
              "clients took part, which Poisson sampling makes private; use `privacy.denominator: fixed`")
        check(sampling == "fixed" or cfg.placement == "central", "`privacy.placement: distributed` with Poisson "
              "sampling: the noise on the sum would depend on how many clients took part; use `placement: central`")
    else:
        check(cfg.accountant == "rdp", f"`privacy.accountant: {cfg.accountant}` is for client-level DP; "
              f"`privacy.level: {cfg.level}` is accounted by RDP")
