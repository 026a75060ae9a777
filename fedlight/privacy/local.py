"""The client half of a private run: any client rule, its upload clipped (and, by placement, noised) at ``finish``.

The wrapped rule trains exactly as without privacy; only the upload it returns is changed, so no rule knows it is
private (as :class:`~fedlight.core.schedule.InRoundLR` wraps a rule for an in-round schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlight.core.rules import ClientResult, LocalUpdateRule
from fedlight.core.wrap import LocalWrapper
from fedlight.errors import ConfigError
from fedlight.privacy import noise
from fedlight.privacy.clip import clip_upload
from fedlight.privacy.record import RecordLevel


@dataclass
class ClipBound:
    """``C``, shared by the server half (which moves it under adaptive clipping) and the client half (which reads
    it). One per process; every process computes the same values."""

    value: float


@dataclass
class ClientNoise:
    """Noise a client adds to its own clipped upload: ``kind`` ``gaussian`` (std ``scale``) or ``laplace`` (scale
    ``b``), in units of ``C``; ``count_scale``: the std it adds to its clipped-or-not report under adaptive clipping
    (``placement: distributed``: its share of the count query's noise, ``σ_b/√m``)."""

    kind: str
    scale: float
    seed: int
    count_scale: float = 0.0


class PrivateLocal(LocalWrapper):
    """``inner`` whose upload (Δ and every extra) is clipped to ``‖·‖ ≤ C`` and, with ``client_noise``, noised.

    Args:
        inner: the client rule.
        bound: ``C`` (read at every ``finish``).
        client_noise: the client's own noise (local DP, or the distributed placement); ``None``: none here.
        l1: clip in L1 norm (the Laplace mechanism's sensitivity); else L2.
        report_clipped: add ``dp_unclipped`` (1 when the norm was ≤ C) to the metrics, for adaptive clipping.
        record: record-level DP-SGD in every local step instead (the upload is then not clipped).
    """

    def __init__(self, inner: LocalUpdateRule, bound: ClipBound, client_noise: ClientNoise | None = None,
                 l1: bool = False, report_clipped: bool = False, record: RecordLevel | None = None) -> None:
        super().__init__(inner)
        self.bound, self.client_noise, self.record = bound, client_noise, record
        self.ord, self.report_clipped = 1 if l1 else 2, report_clipped
        self.stacked_unsupported = inner.stacked_unsupported or (
            None if client_noise is None and record is None else "a client's own DP noise is drawn per client id "
            "(privacy.level: local or record, or privacy.placement: distributed); use loop.client_parallelism: "
            "sequential")

    def start(self, model, ctx):
        self.inner.start(model, ctx)
        if self.record is not None:
            self.record.install(model, ctx)

    def finish(self, model, ctx) -> ClientResult:
        result = self.inner.finish(model, ctx)
        if result.upload_scalars:
            raise ConfigError(f"`privacy`: {type(self.inner).__name__} uploads {result.upload_scalars} scalars "
                              "outside its tensors, which the clip cannot bound; run it without privacy")
        if self.record is not None:  # record level: each step's gradient was privatized; the upload is not clipped
            return result
        C = self.bound.value
        norm = clip_upload(result, C, self.ord)
        cn = self.client_noise
        if self.report_clipped:
            b = (norm <= C).double()
            if cn is not None and cn.count_scale > 0:  # its share of the count's noise, sent in fixed point (2^-24,
                # as secure aggregation's integers): the shares' float64 sum is exact, whatever the order
                z = noise.scalar_normal(noise.generator(cn.seed, ctx.round, noise.COUNT, ctx.client_id))
                b = (b + cn.count_scale * z).mul(2.0 ** 24).round().div(2.0 ** 24)
            result.metrics["dp_unclipped"] = b
        if cn is not None:
            gen = noise.generator(cn.seed, ctx.round, noise.CLIENT, ctx.client_id)
            add = noise.gaussian_ if cn.kind == "gaussian" else noise.laplace_
            for tree in noise.upload_trees(result.delta, result.extras):
                add(tree, cn.scale * C, gen)
        return result
