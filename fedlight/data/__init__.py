"""Federated datasets: a train set split over clients, a global test set, batches built on the device."""

from fedlight.data.augment import Chain, CropFlip
from fedlight.data.base import FederatedDataModule
from fedlight.data.glue import GLUE
from fedlight.data.mapstyle import DataModuleClients, DatasetClients, as_federated
from fedlight.data.partition import IID, Dirichlet, Partitioner, Pathological, QuantitySkew
from fedlight.data.procedural import MarkovText, SyntheticRegression
from fedlight.data.randaugment import RandAugment
from fedlight.data.shakespeare import Shakespeare
from fedlight.data.synthetic import Synthetic, TensorClients
from fedlight.data.vision import CIFAR10, CIFAR100, FashionMNIST, ImageFolder, OfficeHome, TinyImageNet

DATASETS = (
    "FashionMNIST",
    "CIFAR10",
    "CIFAR100",
    "ImageFolder",
    "TinyImageNet",
    "OfficeHome",
    "Synthetic",
    "TensorClients",
    "SyntheticRegression",
    "MarkovText",
    "DatasetClients",
    "DataModuleClients",
    "GLUE",
    "Shakespeare",
)
PARTITIONERS = ("IID", "Dirichlet", "Pathological", "QuantitySkew")

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "Chain",
    "DATASETS",
    "IID",
    "MarkovText",
    "PARTITIONERS",
    "CropFlip",
    "DataModuleClients",
    "DatasetClients",
    "Dirichlet",
    "FashionMNIST",
    "FederatedDataModule",
    "GLUE",
    "ImageFolder",
    "OfficeHome",
    "Partitioner",
    "Pathological",
    "QuantitySkew",
    "RandAugment",
    "Shakespeare",
    "Synthetic",
    "SyntheticRegression",
    "TensorClients",
    "TinyImageNet",
    "as_federated",
]
