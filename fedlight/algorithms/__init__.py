"""Every algorithm fedlight ships, one file per paper. Importing this package registers them all."""

from fedlight.algorithms.fedavg import FedAvg
from fedlight.algorithms.fedavgm import FedAvgM
from fedlight.algorithms.fedprox import FedProx

__all__ = ["FedAvg", "FedAvgM", "FedProx"]
