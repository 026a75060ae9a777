"""FederatedDataModule: a train set split over clients, a global test set, batches built on the device.

Images are stored once as uint8 ``[n, C, H, W]`` on the device; a client is an index tensor into that
shared train tensor. A batch is gathered, augmented and normalised (float32) on the device, with all of a
call's randomness drawn up front on CPU from the caller's ``torch.Generator``.
"""

from __future__ import annotations

import inspect
import math
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedlight.core.spec import remember_init_args
from fedlight.data.augment import CropFlip, resize
from fedlight.data.device_copy import on_device
from fedlight.data.partition import IID, Partitioner, partition_cached
from fedlight.errors import ConfigError, DataNotFoundError

SUBSET_TRAIN_TAG = 0x5B71  # SeedSequence([seed, tag]) for the train subset
SUBSET_TEST_TAG = 0x5B72  # ... and the test subset

COMMON_ARGS = """
    num_clients: Number of clients the training set is split over.
    batch_size: Client mini-batch size (the last batch of an epoch may be smaller).
    partition: How the training set is split over clients (default: ``IID()``).
    root: Data folder; default ``$FEDLIGHT_DATA``, else ``./data``.
    subset: Keep only this many training samples (random, seeded by the run seed); for quick runs.
    test_subset: Keep only this many test samples (random, seeded by the run seed).
    augment: Apply the dataset's training augmentation (if it defines one).
    eval_batch_size: Batch size of :meth:`test_batches`.
"""


def common_args(cls: type) -> type:
    """Class decorator: append the shared ``Args:`` entries to the class docstring (for ``--help``).

    The class docstring must end with its own ``Args:`` section.
    """
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n" + textwrap.indent(inspect.cleandoc(COMMON_ARGS), "    ")
    return cls


def positive_int(name: str, value: object, optional: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a positive int (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"`data.{name}` must be a positive integer{' or null' if optional else ''}, got {value!r}")


def data_root(root: str | None) -> Path:
    """``root`` if given, else ``$FEDLIGHT_DATA``, else ``./data``."""
    return Path(root or os.environ.get("FEDLIGHT_DATA") or "data").expanduser()


def not_found(what: str, looked_in: list[Path], download: bool = False) -> DataNotFoundError:
    """A :class:`DataNotFoundError` listing every path looked in and how to fix it."""
    paths = "\n".join(f"  - {p.resolve()}" for p in looked_in)
    env = os.environ.get("FEDLIGHT_DATA")
    fix = (
        f"set FEDLIGHT_DATA (now {'=' + env if env else 'unset'}) or `data.init_args.root` to the folder that "
        "holds the dataset"
    )
    if download:
        fix += ", or set `data.init_args.download: true` when online"
    return DataNotFoundError(f"{what} not found. Looked in:\n{paths}\nFix: {fix}.")


def seeded(seed: int, tag: int) -> np.random.Generator:
    """``np.random.default_rng(SeedSequence([seed, tag]))``: one independent stream per use of the seed."""
    return np.random.default_rng(np.random.SeedSequence([seed, tag]))


def select(n: int, keep: int | None, rng: np.random.Generator) -> np.ndarray | None:
    """Sorted random indices of ``keep`` of ``n`` samples, or ``None`` to keep all."""
    if keep is None or keep >= n:
        return None
    return np.sort(rng.choice(n, size=keep, replace=False))


class FederatedDataModule:
    """Base: a train set split over clients, a global test set, batches built on the device.

    Subclasses set ``_num_classes``/``_input_shape`` (class or instance attributes), ``mean``/``std``
    (``None``: no normalisation) and ``augmentation``, and implement :meth:`_load_all` (or :meth:`_load`,
    or :meth:`_build` for datasets that define their own clients).

    Args:
        num_clients: Number of clients the training set is split over.
        batch_size: Client mini-batch size (the last batch of an epoch may be smaller).
        partition: How the training set is split over clients (default: ``IID()``).
        root: Data folder; default ``$FEDLIGHT_DATA``, else ``./data``.
        subset: Keep only this many training samples (random, seeded by the run seed); for quick runs.
        test_subset: Keep only this many test samples (random, seeded by the run seed).
        augment: Apply the dataset's training augmentation (if it defines one).
        eval_batch_size: Batch size of :meth:`test_batches`.
    """

    _num_classes: int | None = None
    _input_shape: tuple[int, ...] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augmentation: CropFlip | None = None
    resize_to: int | None = None
    """Side to which gathered images are resized on the device before augmentation, train and test."""
    interpolation: str = "bilinear"
    """How ``resize_to`` resizes (bilinear / bicubic); a pretrained model may set it (``adopt_preprocessing``)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        remember_init_args(cls)  # config.yaml of a Python-API run records the constructor arguments

    def __init__(
        self,
        num_clients: int = 100,
        batch_size: int = 50,
        partition: Partitioner | None = None,
        root: str | None = None,
        subset: int | None = None,
        test_subset: int | None = None,
        augment: bool = True,
        eval_batch_size: int = 1000,
    ):
        positive_int("num_clients", num_clients)
        positive_int("batch_size", batch_size)
        positive_int("eval_batch_size", eval_batch_size)
        positive_int("subset", subset, optional=True)
        positive_int("test_subset", test_subset, optional=True)
        if partition is not None and not isinstance(partition, Partitioner):
            raise ConfigError(
                f"`data.partition` must be a Partitioner such as IID() or Dirichlet(0.5), got {partition!r}"
            )
        self.num_clients = num_clients
        self.batch_size = batch_size
        self.partition = partition if partition is not None else IID()
        self.root = root
        self.subset = subset
        self.test_subset = test_subset
        self.augment = bool(augment)
        self.eval_batch_size = eval_batch_size
        self._ready: tuple[torch.device, int] | None = None

    # ------------------------------------------------------------------ subclass hooks
    def _load_all(self, train: bool) -> tuple[Tensor, Tensor]:
        """Return the whole train (or test) split: inputs (uint8 images or float features) and int64 labels."""
        raise NotImplementedError

    def _load(self, train: bool, keep: int | None, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        """Return ``keep`` random samples of a split (all when ``None``); override to subset before decoding."""
        x, y = self._load_all(train)
        idx = select(len(y), keep, rng)
        return (x, y) if idx is None else (x[torch.from_numpy(idx)], y[torch.from_numpy(idx)])

    def _build(self, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[np.ndarray]]:
        """Return ``(train_x, train_y, test_x, test_y, client index arrays)`` on CPU."""
        train_x, train_y = self._load(True, self.subset, seeded(seed, SUBSET_TRAIN_TAG))
        test_x, test_y = self._load(False, self.test_subset, seeded(seed, SUBSET_TEST_TAG))
        self._check_enough(len(train_y))
        parts = partition_cached(self.partition, partition_labels(self.partition, train_y, self), self.num_clients,
                                 seed)
        return train_x, train_y, test_x, test_y, parts

    def _partition_desc(self) -> str:
        """How the clients were formed, for reports and errors."""
        return repr(self.partition)

    def _check_enough(self, n: int) -> None:
        if n < self.num_clients:
            raise ConfigError(
                f"only {n} training samples for `data.num_clients`={self.num_clients} clients; lower "
                "`data.num_clients` or raise (or remove) `data.subset`"
            )

    # ------------------------------------------------------------------ setup
    def setup(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        """Load (cached), subset and partition the data, and move it to ``device``. Idempotent."""
        device = torch.device(device)
        if self._ready == (device, seed):
            return
        train_x, train_y, test_x, test_y, parts = self._build(seed)
        self._check_enough(len(train_y))
        if len(parts) != self.num_clients:
            raise ConfigError(f"the partition has {len(parts)} clients, expected `data.num_clients`={self.num_clients}")
        for i, p in enumerate(parts):
            if len(p) == 0:
                raise ConfigError(
                    f"client {i} of {self.num_clients} got no training samples from {self._partition_desc()}; use "
                    "fewer `data.num_clients`, a larger `data.subset`, or a less skewed partition (larger `alpha`)"
                )
        classes = is_class_labels(train_y)
        if self._num_classes is None and classes:
            self._num_classes = int(max(train_y.max().item(), test_y.max().item() if len(test_y) else 0)) + 1
        if self._input_shape is None:
            self._input_shape = tuple(train_x.shape[1:])
        self._labels = train_y.numpy().astype(np.int64) if classes else None
        self._parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self._train_x, self._train_y = on_device(train_x, device), label_tensor(train_y).to(device)
        self._test_x, self._test_y = on_device(test_x, device), label_tensor(test_y).to(device)
        self._client_idx = [torch.from_numpy(p).to(device) for p in self._parts]
        self._scale = self._shift = None
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            self._scale, self._shift = (1 / (255 * std)).to(device), (-mean / std).to(device)
        self.device = device
        self._ready = (device, seed)

    def _require_setup(self) -> None:
        if self._ready is None:
            raise RuntimeError(f"{type(self).__name__}.setup(device, seed) must be called first")

    # ------------------------------------------------------------------ properties
    @property
    def num_classes(self) -> int | None:
        """Number of classes (known after :meth:`setup` for folder datasets); ``None`` for targets that are not
        class labels (regression, per-token targets)."""
        if self._num_classes is None:
            self._require_setup()
        return None if self._num_classes is None else int(self._num_classes)

    def default_task(self):
        """The task a run on this data module trains for unless told otherwise: classification."""
        from fedlight.tasks import Classification

        return Classification()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input, e.g. ``(3, 32, 32)`` (known after :meth:`setup` for folder datasets)."""
        if self._input_shape is None:
            self._require_setup()
        return tuple(self._input_shape)

    @property
    def num_train(self) -> int:
        """Number of training samples after ``subset``."""
        self._require_setup()
        return len(self._train_y)  # (not the class labels: token and regression data have none)

    @property
    def num_test(self) -> int:
        """Number of test samples after ``test_subset``."""
        self._require_setup()
        return len(self._test_y)

    def num_samples(self, client_id: int) -> int:
        """Number of training samples of a client (with duplicates, if the partition has any)."""
        self._require_setup()
        return len(self._parts[client_id])

    drop_last: bool = False
    """Drop each epoch's last, incomplete batch (a ``DataLoader(drop_last=True)`` of the author's data); a client with
    fewer samples than ``batch_size`` still trains on one batch of all of them."""

    def steps_per_epoch(self, client_id: int) -> int:
        """``ceil(num_samples / batch_size)`` (``floor``, at least 1, with :attr:`drop_last`)."""
        return _per_epoch(self.num_samples(client_id), self.batch_size, self.drop_last)

    # ------------------------------------------------------------------ batches
    memory_format: torch.memory_format = torch.contiguous_format
    """Layout of 4-D input batches (the loop sets ``torch.channels_last`` for ``loop.channels_last``)."""

    input_dtype: torch.dtype = torch.float32
    """Floating dtype of model inputs; :func:`fedlight.fit` sets ``torch.float64`` under ``precision: 64-true`` so
    float64 data keeps its precision."""

    def to_input(self, x: Tensor) -> Tensor:
        """Model input from stored samples: uint8 images are normalised, floating features cast to ``input_dtype``,
        integer inputs (token ids) kept as they are."""
        if self._scale is None:
            if x.dtype != torch.uint8 and not x.dtype.is_floating_point:
                return x
            x = x if x.dtype == self.input_dtype else x.to(self.input_dtype)
        else:
            x = x.to(self.input_dtype) * self._scale.to(self.input_dtype) + self._shift.to(self.input_dtype)
        if x.dim() == 4 and self.memory_format is not torch.contiguous_format:
            x = x.contiguous(memory_format=self.memory_format)
        return x

    def client_batches(
        self, client_id: int, num_steps: int, generator: torch.Generator
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield exactly ``num_steps`` training batches ``(x float32, y int64)`` of one client, on the device.

        Steps walk epochs over the client's samples, each epoch in a fresh random order, its last batch
        possibly smaller (``drop_last=False``). Randomness comes only from ``generator`` (a CPU
        ``torch.Generator``): first one ``randperm`` per epoch needed, then the augmentation parameters of
        all samples; both are moved to the device once. Without augmentation, a round that uses every sample of the
        client converts the client's samples to model inputs once (not once per batch).
        """
        self._require_setup()
        if num_steps <= 0:
            return
        idx = self._client_idx[client_id]
        order, bounds = self.step_order(client_id, num_steps, generator)
        total = bounds[-1][1]
        aug = self.augmentation if self.augment else None
        params = aug.sample(total, generator).to(self.device) if aug is not None else None
        order = order.to(self.device)
        rows = idx[order]
        if aug is None and total >= len(idx) and self.resize_to is None \
                and self.memory_format is torch.contiguous_format:  # every sample is used: convert each once
            xs = self.to_input(self._train_x[idx])  # elementwise, so each batch is the same bits as converted alone
            yield from ((xs[order[start:end]], self._train_y[rows[start:end]]) for start, end in bounds)
            return
        for start, end in bounds:
            r = rows[start:end]
            x = self._gather(self._train_x, r)
            if aug is not None:
                x = aug.apply(x, params[start:end])
            yield self.to_input(x), self._train_y[r]

    def step_order(self, client_id: int, num_steps: int, generator: torch.Generator) -> tuple[Tensor, list]:
        """Positions (into the client's samples) of its next ``num_steps`` batches, and each step's ``[start, end)``
        in them: epochs of fresh permutations drawn from ``generator`` (one ``randperm`` per epoch)."""
        n = len(self._client_idx[client_id])
        bounds = _step_bounds(n, self.batch_size, num_steps, self.drop_last)
        epochs = math.ceil(num_steps / _per_epoch(n, self.batch_size, self.drop_last))
        order = torch.cat([torch.randperm(n, generator=generator) for _ in range(epochs)])[: bounds[-1][1]]
        return order, bounds

    def _gather(self, source: Tensor, rows: Tensor | slice) -> Tensor:
        """``source[rows]``, resized to ``resize_to`` when that is set."""
        x = source[rows]
        return x if self.resize_to is None else resize(x, self.resize_to, self.interpolation)

    def batch_sizes(self, client_id: int, num_steps: int) -> tuple[int, ...]:
        """The sizes of the ``num_steps`` batches :meth:`client_batches` yields for ``client_id``."""
        self._require_setup()
        n = len(self._client_idx[client_id])
        return tuple(b - a for a, b in _step_bounds(n, self.batch_size, num_steps, self.drop_last))

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield the global test set in ``eval_batch_size`` chunks: normalised, never augmented."""
        self._require_setup()
        for start in range(0, len(self._test_y), self.eval_batch_size):
            end = start + self.eval_batch_size
            yield self.to_input(self._gather(self._test_x, slice(start, end))), self._test_y[start:end]

    def client_labels(self, client_id: int) -> Tensor:
        """The labels of a client's training samples (on the device)."""
        self._require_setup()
        return self._train_y[self._client_idx[client_id]]

    # ------------------------------------------------------------------ reports
    def class_histogram(self) -> np.ndarray:
        """``[num_clients, num_classes]`` counts of each class per client (``[num_clients, 1]`` sizes when the
        targets are not class labels)."""
        self._require_setup()
        if self._labels is None:
            return np.array([[len(p)] for p in self._parts], dtype=np.int64)
        return np.stack([np.bincount(self._labels[p], minlength=self.num_classes) for p in self._parts])

    def partition_report(self, max_rows: int | None = 20) -> str:
        """A compact table of client sizes and class counts, plus a summary line.

        Args:
            max_rows: Show at most this many clients (the first ones); ``None`` shows all.
        """
        hist = self.class_histogram()
        sizes = hist.sum(1)
        num_classes = hist.shape[1]
        show_all = num_classes <= 20
        head = f"{'client':>6} {'n':>6} {'cls':>4}  " + (
            " ".join(f"{c:>5}" for c in range(num_classes)) if show_all else "top classes (class:count)"
        )
        lines = [f"{type(self).__name__}, {self._partition_desc()}, {self.num_clients} clients", head]
        rows = range(len(sizes)) if max_rows is None else range(min(max_rows, len(sizes)))
        for i in rows:
            h = hist[i]
            cells = (
                " ".join(f"{v:>5}" for v in h)
                if show_all
                else " ".join(f"{c}:{h[c]}" for c in np.argsort(-h, kind="stable")[:5] if h[c] > 0)
            )
            lines.append(f"{i:>6} {sizes[i]:>6} {(h > 0).sum():>4}  {cells}")
        if len(rows) < len(sizes):
            lines.append(f"   ... ({len(sizes) - len(rows)} more clients)")
        present = (hist > 0).sum(1)
        unique = len(np.unique(np.concatenate(self._parts)))
        lines.append(
            f"total {int(sizes.sum())} samples ({unique} distinct of {self.num_train}); client size "
            f"min {sizes.min()} / median {int(np.median(sizes))} / max {sizes.max()}; classes per client "
            f"min {present.min()} / mean {present.mean():.1f} / max {present.max()}"
        )
        return "\n".join(lines)


def is_class_labels(y: Tensor) -> bool:
    """Whether ``y`` holds one integer class label per sample."""
    return y.dim() == 1 and not y.dtype.is_floating_point and not y.dtype.is_complex


def label_tensor(y: Tensor) -> Tensor:
    """Targets as stored: integer targets as int64 (what losses index with), floating targets unchanged."""
    return y if y.dtype.is_floating_point else y.to(torch.int64)


def partition_labels(partition: Partitioner, y: Tensor, data) -> np.ndarray:
    """What the partitioner splits: the class labels, or (for a partitioner that needs none) one 0 per sample;
    a label partition of targets that are not class labels is refused."""
    if is_class_labels(y):
        return y.numpy().astype(np.int64)
    if getattr(partition, "needs_labels", True):
        raise ConfigError(f"`data.partition` {partition!r} splits by class label, but {type(data).__name__}'s "
                          f"targets are not class labels ({y.dtype}, shape {tuple(y.shape)}); use IID() or "
                          "QuantitySkew(alpha) for regression or token data")
    return np.zeros(len(y), dtype=np.int64)


def _per_epoch(n: int, bs: int, drop_last: bool = False) -> int:
    """Batches in an epoch of ``n`` samples: ``ceil(n / bs)``, or ``max(1, n // bs)`` when the last is dropped."""
    return max(1, n // bs) if drop_last else math.ceil(n / bs)


def _step_bounds(n: int, bs: int, num_steps: int, drop_last: bool = False) -> list[tuple[int, int]]:
    """``[start, end)`` of each step's batch in the concatenation of epochs (each a permutation of ``n``); with
    ``drop_last`` an epoch's incomplete last batch is not used."""
    per_epoch = _per_epoch(n, bs, drop_last)
    bounds = []
    for s in range(num_steps):
        e, k = divmod(s, per_epoch)
        bounds.append((e * n + k * bs, e * n + min((k + 1) * bs, n)))
    return bounds


remember_init_args(FederatedDataModule)
