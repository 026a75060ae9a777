"""Bring a LightningDataModule or any map-style ``Dataset``: its samples, transforms and collate, split over clients.

A client is a list of sample indices into the train dataset. Its batches are built by indexing the dataset and
calling the collate function, in an order drawn from the (seed, round, client) generator exactly as fedlight's own
data modules draw it, so runs stay seeded, resumable bit for bit and equal on 1 or N processes. Evaluation uses the
test dataset (a datamodule's ``test_dataloader()``, else ``val_dataloader()``).

Clients come from the partitioner (labels read from the dataset's ``targets`` / ``labels``, or ``label_fn(sample)``),
or from ``client_fn(sample)`` — a per-sample client id, the natural split of LEAF-style data.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from fedlight.data.base import FederatedDataModule, partition_labels
from fedlight.data.labels import label_tensor, map_batch
from fedlight.data.partition import Partitioner, partition_cached
from fedlight.data.sampled import is_own, sampled_batches
from fedlight.errors import ConfigError


class DatasetClients(FederatedDataModule):
    """A map-style train ``Dataset`` split over clients, and a test ``Dataset``.

    Args:
        train: the training set (``len`` and ``__getitem__``); its transforms run when a batch is built.
        test: the test set, or ``None`` (then nothing is evaluated).
        num_clients: number of clients (ignored with ``client_fn``: one client per distinct id).
        batch_size: client mini-batch size.
        partition: how samples are split (default ``IID()``); label partitions read class labels.
        label_fn: ``sample -> class label``, when the dataset has no ``targets``/``labels`` attribute.
        client_fn: ``sample -> client id``: the natural split (one client per id, in sorted id order).
        collate_fn: how samples become a batch (default PyTorch's ``default_collate``).
        eval_batch_size: batch size of the test batches.
        num_classes: number of classes, when the labels do not tell (``None``: ``max label + 1``).
        drop_last: drop each epoch's incomplete last batch of a client, as ``DataLoader(drop_last=True)``.
    """

    map_labels: bool = True
    """String labels become class indices in the batches too (fedlight's own tasks need them); ``fit`` sets it
    ``False`` for a LightningModule with its own ``training_step``, whose batches stay as the loader yields them
    (the labels then only split the clients)."""

    def __init__(self, train: Dataset, test: Dataset | None = None, num_clients: int = 10, batch_size: int = 32,
                 partition: Partitioner | None = None, label_fn: Callable[[Any], Any] | None = None,
                 client_fn: Callable[[Any], Any] | None = None, collate_fn: Callable | None = None,
                 eval_batch_size: int = 256, num_classes: int | None = None, drop_last: bool = False) -> None:
        super().__init__(num_clients=num_clients, batch_size=batch_size, partition=partition,
                         eval_batch_size=eval_batch_size)
        self.drop_last = drop_last
        self.train, self.test = train, test
        self.label_fn, self.client_fn = label_fn, client_fn
        self.collate_fn = collate_fn or default_collate
        self._num_classes = num_classes
        self._class_to_idx: dict[Any, int] | None = None  # string labels: their class indices

    # ------------------------------------------------------------------ what subclasses change
    def _datasets(self) -> tuple[Dataset, Dataset | None]:
        return self.train, self.test

    def _test_loader(self) -> Any:
        if self.test is None:
            return ()
        return DataLoader(self.test, batch_size=self.eval_batch_size, shuffle=False, collate_fn=self.collate_fn)

    # ------------------------------------------------------------------ setup
    def setup(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        device = torch.device(device)
        if self._ready == (device, seed):
            return
        train, _ = self._datasets()
        if not hasattr(train, "__getitem__") or not hasattr(train, "__len__"):
            raise ConfigError(f"the train set {type(train).__name__} is not a map-style Dataset (`__len__` and "
                              "`__getitem__`); iterable datasets cannot be split over clients")
        labels = self._labels_of(train)
        parts = self._split(train, labels, seed)
        if self._num_classes is None and labels is not None and labels.dim() == 1 and not labels.is_floating_point():
            self._num_classes = int(labels.max()) + 1
        self._labels = None if labels is None or labels.is_floating_point() or labels.dim() != 1 \
            else labels.numpy().astype(np.int64)
        self._parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self._client_idx = [torch.from_numpy(p) for p in self._parts]
        self._scale = self._shift = None
        self.device, self._ready = device, (device, seed)

    def _labels_of(self, train: Dataset) -> Tensor | None:
        for attr in ("targets", "labels"):
            found = getattr(train, attr, None)
            if found is not None and not callable(found):
                labels, self._class_to_idx = label_tensor(found, f"the train set's `{attr}`", self.map_labels)
                return labels
        if self.label_fn is not None:
            labels, self._class_to_idx = label_tensor([self.label_fn(train[i]) for i in range(len(train))],
                                                      "`label_fn`", self.map_labels)
            return labels
        return None

    def _split(self, train: Dataset, labels: Tensor | None, seed: int) -> list[np.ndarray]:
        n = len(train)
        if self.client_fn is not None:
            ids = [self.client_fn(train[i]) for i in range(n)]
            order = sorted(set(ids))
            where = {c: j for j, c in enumerate(order)}
            parts: list[list[int]] = [[] for _ in order]
            for i, c in enumerate(ids):
                parts[where[c]].append(i)
            self.num_clients = len(parts)
            return [np.asarray(p) for p in parts]
        self._check_enough(n)
        if labels is None:
            if self.partition.needs_labels:
                raise ConfigError(f"`data.partition` {self.partition!r} splits by class label, but the train set "
                                  f"{type(train).__name__} has no `targets`/`labels`; pass `label_fn` (sample -> "
                                  "label) or use IID() / QuantitySkew(alpha)")
            labels = torch.zeros(n, dtype=torch.int64)
        parts = partition_cached(self.partition, partition_labels(self.partition, labels, self), self.num_clients,
                                 seed)
        for i, p in enumerate(parts):
            if len(p) == 0:
                raise ConfigError(f"client {i} of {self.num_clients} got no training samples from {self.partition!r};"
                                  " use fewer `num_clients` or a less skewed partition")
        return parts

    # ------------------------------------------------------------------ batches
    def client_batches(self, client_id: int, num_steps: int, generator: torch.Generator) -> Iterator[Any]:
        """``num_steps`` collated batches of one client, on the device, in the order of ``generator``."""
        self._require_setup()
        if num_steps <= 0:
            return
        train, _ = self._datasets()
        order, bounds = self.step_order(client_id, num_steps, generator)
        rows = self._client_idx[client_id][order].tolist()
        for start, end in bounds:
            yield self._to_device(self.collate_fn([train[i] for i in rows[start:end]]))

    test_loader_index: int | None = None
    """While :meth:`test_batches` yields from one of several test loaders, its index (Lightning's
    ``dataloader_idx``), else ``None``."""

    def test_batches(self) -> Iterator[Any]:
        self._require_setup()
        loaders = _loaders(self._test_loader())
        for idx, loader in enumerate(loaders):
            for batch in loader:
                self.test_loader_index = idx if len(loaders) > 1 else None
                yield self._to_device(batch)
        self.test_loader_index = None

    def _to_device(self, batch: Any) -> Any:
        from lightning.fabric.utilities.apply_func import move_data_to_device

        batch = map_batch(batch, self._class_to_idx if self.map_labels else None)
        batch = move_data_to_device(batch, self.device)
        if self.input_dtype == torch.float64:  # 64-true: floating inputs keep full precision
            from lightning.fabric.utilities.apply_func import apply_to_collection

            batch = apply_to_collection(batch, Tensor, lambda t: t.double() if t.is_floating_point() else t)
        return batch

    @property
    def num_test(self) -> int:
        _, test = self._datasets()
        return 0 if test is None else len(test)

    @property
    def num_train(self) -> int:
        return sum(len(p) for p in self._parts)

    def client_labels(self, client_id: int) -> Tensor:
        self._require_setup()
        if self._labels is None:
            raise ConfigError(f"{type(self).__name__}: the train set has no class labels")
        return torch.from_numpy(self._labels[self._parts[client_id]])

    def _partition_desc(self) -> str:
        return "client_fn (natural split)" if self.client_fn is not None else repr(self.partition)


class DataModuleLike(abc.ABC):
    """Any ``LightningDataModule``, from ``lightning.pytorch`` or ``pytorch_lightning`` (a class with
    ``prepare_data``, ``setup`` and ``train_dataloader``): the type of ``DataModuleClients.datamodule``, so nested
    command-line flags (``--data.init_args.datamodule.init_args.batch_size 16``) reach its arguments, without
    importing Lightning at ``import fedlight.data``."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        return all(callable(getattr(other, m, None)) for m in ("prepare_data", "setup", "train_dataloader")) or \
            NotImplemented


class DataModuleClients(DatasetClients):
    """A LightningDataModule split over clients: ``prepare_data()`` and ``setup("fit")`` are called; its
    ``train_dataloader()``'s dataset and collate function build the client batches (batch size: ``batch_size``, else
    the loader's); ``test_dataloader()`` (else ``val_dataloader()``) is the evaluation.

    Args:
        datamodule: a ``lightning.pytorch.LightningDataModule``, or its class-path spec (``{"class_path": ...,
            "init_args": {...}}``, as a recipe writes it), built here.
        num_clients, batch_size, partition, label_fn, client_fn, num_classes: as :class:`DatasetClients`.
    """

    def __init__(self, datamodule: DataModuleLike | dict, num_clients: int = 10, batch_size: int | None = None,
                 partition: Partitioner | None = None, label_fn: Callable[[Any], Any] | None = None,
                 client_fn: Callable[[Any], Any] | None = None, num_classes: int | None = None) -> None:
        super().__init__(train=None, num_clients=num_clients, batch_size=batch_size or 1, partition=partition,
                         label_fn=label_fn, client_fn=client_fn, num_classes=num_classes)
        self.datamodule, self._batch_size_given = _own_or_built(datamodule), batch_size
        self._loaded, self.batch_sampler = False, None

    def _datasets(self) -> tuple[Dataset, Dataset | None]:
        if not self._loaded:
            dm = self.datamodule
            dm.prepare_data()
            dm.setup("fit")
            loader = dm.train_dataloader()
            self.train, self.collate_fn = loader.dataset, loader.collate_fn or default_collate
            self.drop_last = bool(getattr(loader, "drop_last", False))
            self.batch_sampler = loader.batch_sampler if is_own(loader) else None
            if self._batch_size_given is None:
                self.batch_size = loader.batch_size or getattr(self.batch_sampler, "batch_size", None) or 1
            self._loaded = True
        return self.train, None

    def setup(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        super().setup(device, seed)
        if self.batch_sampler is not None and self.num_clients > 1:
            raise ConfigError(f"`data`: {self.datamodule!r}'s train loader draws its batches with its batch_sampler "
                              f"({type(self.batch_sampler).__name__}) over the whole train set, which fedlight "
                              f"follows for one client and cannot split over {self.num_clients}: set "
                              "`num_clients: 1`, or give the loader a batch_size")

    def client_batches(self, client_id: int, num_steps: int, generator: torch.Generator) -> Iterator[Any]:
        """The loader's ``batch_sampler``'s batches when it has one (:mod:`.sampled`), else as any client's."""
        if self.batch_sampler is None:
            yield from super().client_batches(client_id, num_steps, generator)
            return
        self._require_setup()
        for rows in sampled_batches(self.batch_sampler, num_steps, generator):
            yield self._to_device(self.collate_fn([self.train[i] for i in rows]))

    def steps_per_epoch(self, client_id: int) -> int:
        return len(self.batch_sampler) if self.batch_sampler is not None else super().steps_per_epoch(client_id)

    def _test_loader(self) -> Any:
        from fedlight.tasks.lightning.compat import misconfiguration_errors

        dm = self.datamodule
        for stage, name in (("test", "test_dataloader"), ("validate", "val_dataloader")):
            try:
                dm.setup(stage)
                return getattr(dm, name)()
            except (NotImplementedError, *misconfiguration_errors()):
                continue
        return ()

    @property
    def num_test(self) -> int:
        return sum(len(lo.dataset) for lo in _loaders(self._test_loader()) if hasattr(lo, "dataset"))


def _loaders(found: Any) -> list:
    """The test loaders: one, or each of a list, tuple or dict of them (several test sets, as Lightning takes)."""
    if isinstance(found, dict):
        return list(found.values())
    if isinstance(found, (list, tuple)) and found and all(hasattr(lo, "dataset") for lo in found):
        return list(found)
    return [found]


def _own_or_built(spec: Any) -> Any:
    """The datamodule built (:func:`_built`); a LightningModule that carries its own data hooks (Lightning's
    ``imagenet.py``) as :class:`fedlight.tasks.lightning.ModuleData`, so its ``setup`` runs with ``self.trainer``."""
    from fedlight.tasks.lightning.module_data import ModuleData, carries_data

    built = _built(spec)
    return ModuleData(built) if carries_data(built) else built


def _built(spec: Any) -> Any:
    """A datamodule given as a class-path spec (a mapping or jsonargparse's namespace), instantiated."""
    if hasattr(spec, "as_dict"):
        spec = spec.as_dict()
    if isinstance(spec, (dict, str)):
        from fedlight.core.spec import build

        return build(spec)
    return spec


def as_federated(data: Any) -> FederatedDataModule:
    """``data`` as a federated data module: itself, or a LightningDataModule wrapped in :class:`DataModuleClients`
    with its defaults (printed, so the user knows how to choose)."""
    if isinstance(data, FederatedDataModule):
        return data
    from fedlight.tasks.lightning.compat import is_lightning_datamodule
    from fedlight.tasks.lightning.module_data import ModuleData, carries_data

    if is_lightning_datamodule(data) or carries_data(data):
        own = carries_data(data)
        wrapped = DataModuleClients(ModuleData(data) if own else data)
        what = f"{type(data).__name__}'s own train_dataloader" if own else type(data).__name__
        inner = "fedlight.tasks.lightning.ModuleData(model)" if own else f"{type(data).__name__}(...)"
        print(f"fedlight: note: {what} split into {wrapped.num_clients} IID clients; pass "
              f"fedlight.data.DataModuleClients({inner}, num_clients=..., partition=...) to choose", file=sys.stderr)
        return wrapped
    raise ConfigError(f"`data` must be a fedlight data module (e.g. fedlight.data.FashionMNIST), a "
                      f"LightningDataModule or a LightningModule with its own train_dataloader, got "
                      f"{type(data).__name__}; wrap a Dataset in fedlight.data.DatasetClients(train, test)")
