"""A client rule around another (:class:`LocalWrapper`): what it does not override is the inner rule's. The in-round
learning-rate schedule (:class:`fedlight.core.schedule.InRoundLR`) and the privacy clip
(:class:`fedlight.privacy.local.PrivateLocal`) are such wrappers; the server side has
:class:`fedlight.algorithms.compose.ServerWrapper`."""

from __future__ import annotations

from fedlight.core.rules import LocalUpdateRule


class LocalWrapper(LocalUpdateRule):
    """Runs ``inner``: its optimizer, its declarations (true gradient norm, stacking, scalar uploads) and its
    ``start`` / ``step`` / ``finish``; a subclass overrides the part it changes."""

    def __init__(self, inner: LocalUpdateRule) -> None:
        self.inner = inner
        self.needs_true_grad_norm = inner.needs_true_grad_norm
        self.stacked_unsupported = inner.stacked_unsupported
        self.scalar_uploads = inner.scalar_uploads

    def make_optimizer(self, params, lr, default):
        return self.inner.make_optimizer(params, lr, default)

    @property
    def brings_optimizer(self) -> bool:
        return self.inner.brings_optimizer

    def start(self, model, ctx):
        self.inner.start(model, ctx)

    def step(self, model, batch, ctx):
        return self.inner.step(model, batch, ctx)

    def finish(self, model, ctx):
        return self.inner.finish(model, ctx)
