"""The messages of the rule contract: what the server sends a client (``Broadcast``), what a client sends back
(``ClientResult``), and what a server rule knows of the round (``RoundInfo``). Re-exported by
:mod:`fedlight.core.rules`, where the rules that read and write them live."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedlight.core import params as P
from fedlight.core.params import Params


@dataclass
class Broadcast:
    """Server → sampled client, once per round."""

    params: Params
    """Where the client starts (``y_{i,0}``), usually ``x_r``."""
    extras: dict[str, Params] = field(default_factory=dict)
    """Model-sized vectors sent along, e.g. ``{"c": c}`` (SCAFFOLD) or ``{"m": m}`` (FedNSAM)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Scalars sent along, e.g. ``{"alpha": α}`` (FedWMSAM)."""

    def nbytes(self) -> int:
        """Bytes on the wire, counting every tensor and 4 bytes per scalar."""
        return P.nbytes(self.params) + sum(P.nbytes(v) for v in self.extras.values()) + 4 * len(self.scalars)


@dataclass
class ClientResult:
    """Client → server. The loop averages these into one ``ClientResult`` handed to ``ServerRule.update``."""

    delta: Params
    """``Δ_i = y_{i,K} − y_{i,0}``."""
    num_samples: int = 0
    """The client's ``n_i``; filled by the loop, used for sample weighting."""
    extras: dict[str, Params] = field(default_factory=dict)
    """Model-sized uploads besides Δ (``{"delta_c": Δc_i}``). Averaged like Δ unless the server rule
    lists the key in ``ServerRule.summed_extras`` (then summed over clients)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Per-client scalars (floats or 0-dim tensors); the loop averages them uniformly over clients."""
    upload_scalars: int = 0
    """Extra scalars uploaded (e.g. FedAdamW's B block means), counted at 4 bytes each."""

    def nbytes(self) -> int:
        return P.nbytes(self.delta) + sum(P.nbytes(v) for v in self.extras.values()) + 4 * self.upload_scalars


@dataclass
class RoundInfo:
    """What a server rule may know about the current round (all identical on every process)."""

    round: int
    """0-based index ``r`` of the round being trained."""
    lr: float
    """The round's local learning rate ``η_r``."""
    num_steps: float
    """Mean ``K`` over the sampled clients (equal for equal-size clients)."""
    num_clients: int
    """``N``, all clients."""
    sampled: Sequence[int] = ()
    """Ids of ``S_r``, the clients sampled this round."""
