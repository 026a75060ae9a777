"""Differential privacy for every rule, by composition (docs/privacy.md): clip + noise wrappers around any
:class:`~fedlight.core.rules.Algorithm` and the dp-accounting adapter. No rule knows it is private."""

from fedlight.privacy.settings import PrivacyConfig
from fedlight.privacy.wrap import PrivateAlgorithm, private

__all__ = ["PrivacyConfig", "PrivateAlgorithm", "private"]
