"""fedlight: Lightning Fabric training recipes for federated optimization research."""

__version__ = "0.1.0"

from fedlight.api import fit  # noqa: E402
from fedlight.params import Params  # noqa: E402
from fedlight.registry import create, get_algorithm, list_algorithms, register  # noqa: E402
from fedlight.rules import (  # noqa: E402
    Algorithm,
    Broadcast,
    ClientResult,
    LocalContext,
    LocalUpdateRule,
    RoundInfo,
    ServerRule,
    cross_entropy,
)
from fedlight.sampling import sample_clients  # noqa: E402

__all__ = [
    "Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "Params", "RoundInfo",
    "ServerRule", "create", "cross_entropy", "fit", "get_algorithm", "list_algorithms", "register",
    "sample_clients",
]
