"""The privacy accountant: dp-accounting (Google's library) for the sampling the loop really does, under a stated
neighbouring relation, composed over the noise each round really carried.

A :class:`Convention` is (sampling, relation, accountant). Supported, each with dp-accounting's own event:

* ``fixed`` sampling (``m`` of ``N`` clients uniformly without replacement each round), ``replace_one``, RDP:
  ``SampledWithoutReplacementDpEvent`` (Wang, Balle, Kasiviswanathan, AISTATS'19, Thm 27; ``N`` is public).
  Replacing one client's clipped upload moves the sum by up to the diameter ``2C``, and this event takes that
  sensitivity, so its Gaussian's noise multiplier is ``σ/2``.
* ``poisson`` sampling (each client independently with probability ``q = m/N``), ``add_remove`` (RDP or PLD) or
  ``replace_one`` (PLD): ``PoissonSampledDpEvent`` with noise multiplier ``σ`` (dp-accounting takes the per-client
  sensitivity ``C`` and doubles it itself for replace-one).

Not supported, refused in one line (:func:`why_not`): fixed-size sampling under add/remove (the sample size would
change with the population) or with PLD, and Poisson replace-one with RDP (dp-accounting has no such events).

ε is composed over a history of ``(g, rounds)`` segments, ``g`` the per-client noise multiplier a round really
had (``σ`` unless the distributed noise lost the shares of clients that did not report), so it never falls from one
round to the next and a run whose σ changed is accounted for what each round used.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from fedlight.errors import ConfigError

ORDERS = (*range(2, 33), 40, 48, 64, 96, 128)
"""RDP orders: integers (the subsampled-without-replacement bound is exact there; a fractional order costs the two
integer ones around it), three times faster than dp-accounting's default list and the same ε to 4 digits for
1,000 clients, 100 a round, σ 0.7-10, 30-300 rounds (measured against the default)."""
SIGMA_MAX = 1e4
"""The largest σ calibration searches (beyond it, no useful model trains)."""
SIGMA_MIN = 0.05
"""The smallest σ calibration searches (below it the accountants' grids explode; ε there is in the hundreds)."""
SAMPLINGS, RELATIONS, ACCOUNTANTS = ("fixed", "poisson"), ("replace_one", "add_remove"), ("rdp", "pld")
SUPPORTED = {("fixed", "replace_one", "rdp"), ("poisson", "add_remove", "rdp"), ("poisson", "add_remove", "pld"),
             ("poisson", "replace_one", "pld")}
History = tuple[tuple[float, int], ...]


def _lib():
    try:
        import dp_accounting
        from dp_accounting import pld, rdp
    except ImportError:
        raise ConfigError("`privacy` needs the dp-accounting package: pip install 'fedlight[privacy]'") from None
    return dp_accounting, rdp, pld


def default_relation(sampling: str) -> str:
    """The relation of an unset ``privacy.relation``: replace-one for fixed-size sampling, add/remove for Poisson."""
    return "add_remove" if sampling == "poisson" else "replace_one"


def why_not(sampling: str, relation: str, accountant: str) -> str | None:
    """Why (sampling, relation, accountant) cannot be accounted, in one line; ``None`` when it can."""
    if (sampling, relation, accountant) in SUPPORTED:
        return None
    if sampling == "fixed":
        return (f"`privacy.relation: {relation}` with `privacy.accountant: {accountant}` is not valid for fixed-size "
                "sampling (`loop.sampling: fixed`): it is accounted under replace-one by RDP only; use "
                "`loop.sampling: poisson` for add/remove or PLD")
    return ("`privacy.relation: replace_one` with Poisson sampling needs `privacy.accountant: pld` (dp-accounting's "
            "RDP has no replace-one Poisson event); or use `privacy.relation: add_remove`")


@dataclass(frozen=True)
class Convention:
    """How ε is accounted: the loop's sampling of ``per_round`` (expected, under Poisson) of ``num_clients``, the
    neighbouring relation and the accountant."""

    num_clients: int
    per_round: int
    sampling: str = "fixed"
    relation: str = "replace_one"
    accountant: str = "rdp"

    def event(self, g: float, rounds: int):
        """dp-accounting's event of ``rounds`` rounds at per-client noise multiplier ``g`` (std over ``C``)."""
        dp = _lib()[0]
        if self.sampling == "fixed":
            one = dp.SampledWithoutReplacementDpEvent(self.num_clients, self.per_round, dp.GaussianDpEvent(g / 2))
        else:
            one = dp.PoissonSampledDpEvent(self.per_round / self.num_clients, dp.GaussianDpEvent(g))
        return dp.SelfComposedDpEvent(one, rounds)

    def fresh(self):
        """An empty dp-accounting accountant of this convention."""
        dp, rdp, pld = _lib()
        rel = dp.NeighboringRelation.REPLACE_ONE if self.relation == "replace_one" else \
            dp.NeighboringRelation.ADD_OR_REMOVE_ONE
        return rdp.RdpAccountant(ORDERS, rel) if self.accountant == "rdp" else pld.PLDAccountant(rel)

    def epsilon(self, history: History, delta: float) -> float:
        """ε(δ) of the rounds in ``history`` (``inf`` if any had no noise; 0 for none)."""
        history = tuple((g, n) for g, n in history if n > 0)
        if not history:
            return 0.0
        if any(g == 0 for g, _ in history):
            return float("inf")
        if self.accountant == "rdp":  # the accountant's own composition: the sum of each segment's RDP
            rdp = _lib()[1]
            total = sum(n * _one_round(self, g) for g, n in history)
            return float(rdp.rdp_privacy_accountant.compute_epsilon(ORDERS, total, delta)[0])
        return _pld_epsilon(self, history, delta)

    def calibrate(self, target: float, delta: float, rounds: int, spent: History = ()) -> float:
        """The smallest σ whose ε(δ) after the ``spent`` rounds and ``rounds`` more at σ is at most ``target``
        (dp-accounting's ``calibrate_dp_mechanism``); a target no σ ≤ :data:`SIGMA_MAX` reaches is refused."""
        dp = _lib()[0]
        if self.epsilon((*spent, (SIGMA_MAX, rounds)), delta) > target:
            done = sum(n for _, n in spent)
            so_far = f" after the {done} rounds already trained (ε = {self.epsilon(spent, delta):.4g})" if done else ""
            raise ConfigError(f"`privacy.target_epsilon` {target:g} is out of reach{so_far}: even σ = {SIGMA_MAX:g} "
                              f"gives more over {rounds} more rounds at δ = {delta:g}; raise the target or δ, or "
                              "train fewer rounds")
        before = [self.event(g, n) for g, n in spent if n > 0]
        lo, hi = self._bracket(target, delta, rounds, spent)
        if lo == hi:
            return lo
        interval = dp.mechanism_calibration.ExplicitBracketInterval(lo, hi)
        make = lambda s: dp.ComposedDpEvent([*before, self.event(s, rounds)])  # noqa: E731
        return float(dp.calibrate_dp_mechanism(self.fresh, make, target, delta, interval, tol=1e-4))

    def _bracket(self, target: float, delta: float, rounds: int, spent: History) -> tuple[float, float]:
        """σ_lo < σ_hi with ε(σ_lo) > target ≥ ε(σ_hi), by doubling from 1 (never below :data:`SIGMA_MIN`, where
        PLD's grid of privacy losses would not fit in memory: a target reached there gets ``SIGMA_MIN``)."""
        eps = lambda s: self.epsilon((*spent, (s, rounds)), delta)  # noqa: E731
        s = 1.0
        if eps(s) > target:
            while eps(2 * s) > target:
                s *= 2
            return s, min(2 * s, SIGMA_MAX)
        while s / 2 >= SIGMA_MIN and eps(s / 2) <= target:
            s /= 2
        return (s, s) if s / 2 < SIGMA_MIN else (s / 2, s)

    def describe(self) -> dict[str, Any]:
        """What summary.json records of the convention."""
        how = ("fixed-size sampling without replacement (m of N)" if self.sampling == "fixed"
               else "Poisson sampling (each client with probability q = m/N)")
        return {"accountant": f"dp-accounting {self.accountant.upper()}, {how}, {self.relation.replace('_', '/')}",
                "accountant_version": metadata.version("dp-accounting"), "sampling": self.sampling,
                "relation": self.relation, "accountant_kind": self.accountant}

    def label(self) -> str:
        """The one-line name of the convention (console)."""
        return f"{self.accountant.upper()}, {self.sampling} sampling, {self.relation.replace('_', '/')}"


@functools.lru_cache(maxsize=64)
def _one_round(conv: Convention, g: float):
    """RDP of one round at ``g`` (array over :data:`ORDERS`)."""
    acc = conv.fresh()
    acc.compose(conv.event(g, 1))
    return acc._rdp


@functools.lru_cache(maxsize=64)
def _pld_epsilon(conv: Convention, history: History, delta: float) -> float:
    dp = _lib()[0]
    acc = conv.fresh()
    acc.compose(dp.ComposedDpEvent([conv.event(g, n) for g, n in history]))
    return float(acc.get_epsilon(delta))


def merge(history: list[list[float]], g: float) -> None:
    """Add one round at multiplier ``g`` to ``history`` (in place; consecutive equal ``g`` share a segment)."""
    if history and history[-1][0] == g:
        history[-1][1] += 1
    else:
        history.append([g, 1])


def round_multiplier(update_sigma: float, count_noise: float | None, relation: str) -> float:
    """The per-client noise multiplier of a round whose update got ``N(0, (σ_u C)²)`` and, under adaptive
    clipping, whose unclipped count got ``N(0, σ_b²)``: the two queries as one Gaussian vector query. The count moves
    by at most 1, half the diameter under replace-one (so it weighs as ``2σ_b`` there) and all of it under
    add/remove."""
    if count_noise is None:
        return update_sigma
    k = 2 * count_noise if relation == "replace_one" else count_noise
    return (update_sigma ** -2 + k ** -2) ** -0.5


def update_noise(sigma: float, count_noise: float, relation: str = "replace_one") -> float:
    """``σ_Δ`` such that the update and the count together cost one query of ``σ`` (Andrew et al., Thm 1):
    ``(σ^-2 − (2σ_b)^-2)^-1/2`` under replace-one, ``(σ^-2 − σ_b^-2)^-1/2`` under add/remove."""
    k = 2 * count_noise if relation == "replace_one" else count_noise
    return (sigma ** -2 - k ** -2) ** -0.5


# ------------------------------------------------------------------ the default convention, as functions
def epsilon(sigma: float, num_clients: int, per_round: int, rounds: int, delta: float) -> float:
    """ε(δ) after ``rounds`` rounds at σ: fixed-size sampling, replace-one, RDP (``inf`` for σ = 0)."""
    return Convention(num_clients, per_round).epsilon(((sigma, rounds),), delta)


def calibrate(target_epsilon: float, delta: float, num_clients: int, per_round: int, rounds: int) -> float:
    """:meth:`Convention.calibrate` for fixed-size sampling, replace-one, RDP."""
    return Convention(num_clients, per_round).calibrate(target_epsilon, delta, rounds)


def gaussian_epsilon(sigma: float, delta: float, count: int = 1, relation: str = "replace_one") -> float:
    """ε(δ) of ``count`` Gaussian queries ``N(0, σ²C²)`` on a value clipped to ``C`` without amplification by
    sampling: one locally privatized upload (``count = 1``), or a record's ``count`` uses in record-level DP-SGD.
    Replace-one: the neighbour may be any other clipped value (sensitivity the diameter ``2C``); add/remove: ``C``."""
    if count == 0:
        return 0.0
    if sigma == 0 or math.isnan(sigma):
        return float("inf")
    dp, rdp, _ = _lib()
    acc = rdp.RdpAccountant(ORDERS)
    acc.compose(dp.SelfComposedDpEvent(dp.GaussianDpEvent(sigma / 2 if relation == "replace_one" else sigma), count))
    return float(acc.get_epsilon(delta))
