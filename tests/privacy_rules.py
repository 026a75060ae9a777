"""Private rules for the multi-process test (tests/algorithms/mp_contract.py takes ``module:Class`` names)."""

from __future__ import annotations

import fedlight
from fedlight.privacy import PrivacyConfig, PrivateAlgorithm, private


def dp(name: str, seed: int = 0, num_clients: int = 4, per_round: int = 3, rounds: int = 2,
       **settings) -> PrivateAlgorithm:
    """Registered rule ``name`` under client-level DP (σ = 1, C = 0.05 unless ``settings`` say otherwise)."""
    cfg = PrivacyConfig(**{"noise_multiplier": 1.0, "clip": 0.05, "delta": 1e-3, **settings})
    return private(fedlight.create(name), cfg, seed, num_clients, per_round, rounds)


class DPScaffold(PrivateAlgorithm):
    """SCAFFOLD (an upload with an extra) under central client-level DP with adaptive clipping."""

    def __new__(cls):
        return dp("scaffold", adaptive=True, count_noise=1.0)
