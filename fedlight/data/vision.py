"""Image datasets: Fashion-MNIST, CIFAR-10/100, any ImageFolder, Tiny-ImageNet, OfficeHome.

Files are read from the data root (``root`` argument, else ``$FEDLIGHT_DATA``, else ``./data``), which may
be read-only. Image files are decoded once into uint8 tensors cached under ``$FEDLIGHT_CACHE``; with
``subset``, only the chosen files are decoded (unless the whole split is cached already), and the choice
is the same either way.
"""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedlight.data.augment import Chain, CropFlip
from fedlight.data.base import (
    SUBSET_TEST_TAG,
    SUBSET_TRAIN_TAG,
    FederatedDataModule,
    common_args,
    data_root,
    not_found,
    seeded,
    select,
)
from fedlight.data.cache import IMAGE_EXTENSIONS, cached_decode, decode_key, is_cached
from fedlight.data.partition import Partitioner
from fedlight.data.randaugment import RandAugment
from fedlight.errors import ConfigError


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (MNIST format, optionally gzipped) of unsigned bytes; a bad header or a truncated file is
    a :class:`ConfigError` naming the file."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}: {e}); delete it and download it again") from None
    if len(data) < 4 or data[:3] != b"\x00\x00\x08" or not 1 <= data[3] <= 4 or len(data) < 4 + 4 * data[3]:
        raise ConfigError(f"{path} is not an IDX file of unsigned bytes (bad header); delete it and download it again")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    need = 4 + 4 * ndim + int(np.prod(dims))
    if len(data) != need:
        raise ConfigError(f"{path} is {'truncated' if len(data) < need else 'longer than its header says'} "
                          f"({len(data)} bytes, header {dims} needs {need}); delete it and download it again")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def list_folder(split_dir: Path, classes: list[str] | None = None) -> tuple[list[str], np.ndarray, list[str]]:
    """Image files under ``split_dir/<class>/`` (sorted), their labels and the class names (sorted)."""
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    classes = classes if classes is not None else found
    extra = sorted(set(found) - set(classes))
    if extra:
        raise ConfigError(f"{split_dir} has class folders {extra[:5]} that the training split lacks")
    files, labels = [], []
    for c, name in enumerate(classes):
        folder = os.path.join(split_dir, name)
        if os.path.isdir(folder):
            names = sorted(e.name for e in os.scandir(folder) if e.name.lower().endswith(IMAGE_EXTENSIONS))
            files += [os.path.join(folder, n) for n in names]
            labels += [c] * len(names)
    return files, np.asarray(labels, dtype=np.int64), classes


def decode_subset(
    files: list[str], labels: np.ndarray, keep: int | None, rng: np.random.Generator, image_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Decode ``keep`` random files (all when ``None``); decodes only those unless the full split is cached."""
    idx = select(len(files), keep, rng)
    if idx is not None:
        key = decode_key(files, image_size)
        if not is_cached("images", key):
            return cached_decode([files[i] for i in idx], image_size), torch.from_numpy(labels[idx])
        return cached_decode(files, image_size, key)[torch.from_numpy(idx)], torch.from_numpy(labels[idx])
    return cached_decode(files, image_size), torch.from_numpy(labels)


def channel_stats(x: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (in [0, 1] units) of uint8 images ``[n, C, H, W]``, in chunks."""
    s = torch.zeros(x.shape[1], dtype=torch.float64)
    s2 = torch.zeros_like(s)
    for chunk in x.split(4096):
        c = chunk.to(torch.float64).div_(255)
        s += c.sum((0, 2, 3))
        s2 += c.square().sum((0, 2, 3))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = s / count
    std = (s2 / count - mean.square()).clamp_min(1e-12).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def image_pipeline(data: FederatedDataModule, native: int, resize: int | None, randaugment: RandAugment | None,
                   pad: int = 4) -> None:
    """Set ``data``'s device resize and training augmentation: crop (``pad`` pixels at the native size, scaled with
    the resize so the crop moves the same fraction of the image) and flip, then RandAugment when given."""
    if resize is not None and (isinstance(resize, bool) or not isinstance(resize, int) or resize < 1):
        raise ConfigError(f"`data.resize` must be a positive integer (e.g. 224) or null, got {resize!r}")
    if randaugment is not None and not isinstance(randaugment, RandAugment):
        raise ConfigError(f"`data.randaugment` must be a RandAugment (e.g. {{num_ops: 2, magnitude: 9}}), got "
                          f"{randaugment!r}")
    side = resize or native
    data.resize_to = resize
    data._input_shape = (3, side, side)
    crop = CropFlip(pad=round(pad * side / native), flip=True)
    data.augmentation = crop if randaugment is None else Chain((crop, randaugment))


def _common(self: FederatedDataModule, kw: dict) -> None:
    """Call ``FederatedDataModule.__init__`` with the common arguments picked from a subclass's ``locals()``."""
    FederatedDataModule.__init__(
        self,
        **{
            k: kw[k]
            for k in (
                "num_clients",
                "batch_size",
                "partition",
                "root",
                "subset",
                "test_subset",
                "augment",
                "eval_batch_size",
            )
        },
    )


@common_args
class FashionMNIST(FederatedDataModule):
    """Fashion-MNIST (28x28 grayscale, 10 classes), from ``<root>/FashionMNIST/raw/`` (torchvision layout).

    No augmentation; normalised with mean 0.2860, std 0.3530.

    Args:
        download: Download with torchvision when the files are missing (needs internet).
    """

    _num_classes, _input_shape = 10, (1, 28, 28)
    mean, std = (0.2860,), (0.3530,)

    def __init__(self, download: bool = False, **kwargs):
        super().__init__(**kwargs)  # the common arguments (listed in the docstring)
        self.download = download

    def _load_all(self, train: bool) -> tuple[Tensor, Tensor]:
        raw = data_root(self.root) / "FashionMNIST" / "raw"
        prefix = "train" if train else "t10k"
        names = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
        if not all((raw / n).is_file() or (raw / f"{n}.gz").is_file() for n in names) and self.download:
            from torchvision.datasets import FashionMNIST as TV

            TV(str(data_root(self.root)), train=train, download=True)
        found = [raw / n if (raw / n).is_file() else raw / f"{n}.gz" for n in names]
        if not all(p.is_file() for p in found):
            raise not_found(f"Fashion-MNIST ({', '.join(names)})", [raw], download=True)
        x, y = read_idx(found[0]), read_idx(found[1])
        if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or len(x) != len(y):
            raise ConfigError(f"Fashion-MNIST files disagree: {found[0]} holds images {list(x.shape)} and {found[1]} "
                              f"labels {list(y.shape)} (expected [n, 28, 28] and [n]); delete them and download again")
        return torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64))


@common_args
class CIFAR10(FederatedDataModule):
    """CIFAR-10 (32x32 RGB, 10 classes).

    Looks for the torchvision pickles ``<root>/cifar-10-batches-py``, else an ImageFolder copy with
    ``train/`` and ``test/`` class folders at ``<root>/cifar10-jpeg`` or ``<root>/cifar10`` (decoded once and
    cached). Augmentation: random crop 32 with 4 pixels of zero padding (in raw pixel space, i.e. black, as
    torchvision's ``RandomCrop`` on PIL images) and horizontal flip.

    Args:
        download: Download the torchvision pickles when no copy is found (needs internet).
        resize: Resize train and test images on the device to ``resize x resize`` (bilinear) right after the
            gather, e.g. 224 for ImageNet-pretrained ViT/Swin; the crop padding scales along (4 px at 32 -> 28
            at 224). None keeps 32x32.
        randaugment: Add RandAugment after the crop and flip (batched on the device, seeded per client).
    """

    _num_classes, _input_shape = 10, (3, 32, 32)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    augmentation = CropFlip(pad=4, flip=True)
    pickle_dir, folders, label_key, title = "cifar-10-batches-py", ("cifar10-jpeg", "cifar10"), "labels", "CIFAR-10"
    pickle_files = {True: [f"data_batch_{i}" for i in range(1, 6)], False: ["test_batch"]}

    def __init__(self, download: bool = False, resize: int | None = None, randaugment: RandAugment | None = None,
                 **kwargs):
        super().__init__(**kwargs)  # the common arguments (listed in the docstring)
        self.download = download
        image_pipeline(self, 32, resize, randaugment)

    def _download(self, root: Path) -> None:
        from torchvision import datasets

        getattr(datasets, type(self).__name__)(str(root), train=True, download=True)

    def _load(self, train: bool, keep: int | None, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        root = data_root(self.root)
        pickles = root / self.pickle_dir
        folders = [root / f for f in self.folders]
        if not pickles.is_dir() and not any((f / "train").is_dir() for f in folders) and self.download:
            self._download(root)
        if pickles.is_dir():
            paths = [pickles / f for f in self.pickle_files[train]]
            if not all(p.is_file() for p in paths):
                raise not_found(f"{self.title} ({', '.join(self.pickle_files[train])})", [pickles], download=True)
            xs, ys = [], []
            for p in paths:
                with open(p, "rb") as f:
                    d = pickle.load(f, encoding="latin1")
                xs.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(d[self.label_key], dtype=np.int64))
            x, y = np.concatenate(xs), np.concatenate(ys)
            idx = select(len(y), keep, rng)
            x, y = (x, y) if idx is None else (x[idx], y[idx])
            return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
        for folder in folders:
            if (folder / "train").is_dir() and (folder / "test").is_dir():
                classes = sorted(e.name for e in os.scandir(folder / "train") if e.is_dir())
                files, labels, _ = list_folder(folder / ("train" if train else "test"), classes)
                return decode_subset(files, labels, keep, rng)
        raise not_found(self.title, [pickles] + [f / "{train,test}" for f in folders], download=True)


@common_args
class CIFAR100(CIFAR10):
    """CIFAR-100 (32x32 RGB, 100 fine classes), from the torchvision pickles ``<root>/cifar-100-python``.

    An ImageFolder copy at ``<root>/cifar100-jpeg`` or ``<root>/cifar100`` also works. Augmentation as CIFAR-10.

    Args:
        download: Download the torchvision pickles when no copy is found (needs internet).
        resize: Resize train and test images on the device to ``resize x resize`` (bilinear), e.g. 224.
        randaugment: Add RandAugment after the crop and flip (batched on the device, seeded per client).
    """

    _num_classes = 100
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    pickle_dir, folders, label_key, title = (
        "cifar-100-python",
        ("cifar100-jpeg", "cifar100"),
        "fine_labels",
        "CIFAR-100",
    )
    pickle_files = {True: ["train"], False: ["test"]}


@common_args
class ImageFolder(FederatedDataModule):
    """Any image collection laid out as ``<path>/train/<class>/*`` and ``<path>/test/<class>/*``.

    Classes are the sorted training folder names. Images are decoded as RGB.

    Args:
        path: Folder holding ``train/`` and ``test/``; a relative path is resolved against the data root.
        image_size: Resize every image to ``image_size x image_size`` (needed when sizes differ).
        mean: Per-channel normalisation mean in [0, 1] units; ``None`` computes it from the training images.
        std: Per-channel normalisation std; ``None`` computes it from the training images.
        crop_padding: Augmentation: random crop with this much zero padding (0: no crop).
        flip: Augmentation: random horizontal flips.
    """

    def __init__(
        self,
        path: str,
        image_size: int | None = None,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        crop_padding: int = 4,
        flip: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)  # the common arguments (listed in the docstring)
        if image_size is not None and (
            isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1
        ):
            raise ConfigError(f"`data.image_size` must be a positive integer or null, got {image_size!r}")
        if crop_padding < 0:
            raise ConfigError(f"`data.crop_padding` must be >= 0, got {crop_padding}")
        self.path, self.image_size, self.mean_arg, self.std_arg = path, image_size, mean, std
        self.augmentation = CropFlip(crop_padding, flip) if crop_padding > 0 or flip else None

    def folder(self) -> Path:
        """The dataset folder (``path`` resolved against the data root)."""
        return data_root(self.root) / Path(self.path).expanduser()

    def _build(self, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[np.ndarray]]:
        folder = self.folder()
        if not ((folder / "train").is_dir() and (folder / "test").is_dir()):
            raise not_found(f"image folder '{self.path}' with train/ and test/", [folder / "train", folder / "test"])
        classes = sorted(e.name for e in os.scandir(folder / "train") if e.is_dir())
        self._num_classes = len(classes)
        self.classes = classes
        out = super()._build(seed)
        self.mean, self.std = (self.mean_arg, self.std_arg) if self.mean_arg and self.std_arg else channel_stats(out[0])
        return out

    def _load(self, train: bool, keep: int | None, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        files, labels, _ = list_folder(self.folder() / ("train" if train else "test"), self.classes)
        return decode_subset(files, labels, keep, rng, self.image_size)


@common_args
class TinyImageNet(FederatedDataModule):
    """Tiny-ImageNet-200 (64x64 RGB, 200 classes) in the official layout ``<root>/tiny-imagenet-200``.

    Train: ``train/<wnid>/images/*.JPEG``; test: the official validation split ``val/images/*.JPEG`` with
    labels from ``val/val_annotations.txt`` (as in the papers). Augmentation: crop 64 with pad 4 + flip.

    Args:
        dirname: Name of the dataset folder under the data root.
        resize: Resize train and test images on the device to ``resize x resize`` (bilinear) right after the
            gather, e.g. 224; the crop padding scales along (4 px at 64 -> 14 at 224). None keeps 64x64.
        randaugment: Add RandAugment after the crop and flip (batched on the device, seeded per client).
    """

    _input_shape = (3, 64, 64)
    mean, std = (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)
    augmentation = CropFlip(pad=4, flip=True)

    def __init__(
        self,
        dirname: str = "tiny-imagenet-200",
        resize: int | None = None,
        randaugment: RandAugment | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)  # the common arguments (listed in the docstring)
        self.dirname = dirname
        image_pipeline(self, 64, resize, randaugment)

    def _load(self, train: bool, keep: int | None, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        base = data_root(self.root) / self.dirname
        ann = base / "val" / "val_annotations.txt"
        if not ((base / "train").is_dir() and ann.is_file()):
            raise not_found("Tiny-ImageNet (train/ and val/val_annotations.txt)", [base / "train", ann])
        wnids_file = base / "wnids.txt"
        wnids = (
            wnids_file.read_text().split()
            if wnids_file.is_file()
            else sorted(e.name for e in os.scandir(base / "train") if e.is_dir())
        )
        self._num_classes = len(wnids)
        index = {w: i for i, w in enumerate(wnids)}
        files, labels = [], []
        if train:
            for w in wnids:
                folder = base / "train" / w / "images"
                names = sorted(os.listdir(folder)) if folder.is_dir() else []
                files += [str(folder / n) for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
                labels += [index[w]] * (len(files) - len(labels))
        else:
            for line in sorted(ann.read_text().splitlines()):
                if line.strip():
                    name, wnid = line.split("\t")[:2]
                    files.append(str(base / "val" / "images" / name))
                    labels.append(index[wnid])
        return decode_subset(files, np.asarray(labels, dtype=np.int64), keep, rng, 64)


HOLDOUT_TAG = 0x0FF1  # SeedSequence([seed, HOLDOUT_TAG]) picks OfficeHome's held-out test images


@common_args
class OfficeHome(FederatedDataModule):
    """OfficeHome (65 classes, 4 domains) with domains as clients: ``<root>/OfficeHome/<Domain>/<class>/*``.

    Each domain is one client, or is split IID into ``clients_per_domain`` clients (clients are ordered by
    domain). The test set pools a held-out ``test_fraction`` of every domain (seeded by the run seed).
    ``subset`` draws from all images before the hold-out. ``partition`` is not used (must stay unset).
    A domain folder ``Real_World`` may also be spelled ``Real World`` (the official archive's name);
    ``<root>/OfficeHomeDataset_10072016`` is accepted as well.

    Args:
        domains: Domain folder names, one client group each.
        clients_per_domain: Clients per domain (each domain split IID).
        test_fraction: Fraction of each domain's images held out for the test set, in [0, 1).
        image_size: Images are resized to ``image_size x image_size``.
        mean: Per-channel normalisation mean in [0, 1] units; ``None`` computes it from the training images.
        std: Per-channel normalisation std; ``None`` computes it from the training images.
        crop_padding: Augmentation: random crop with this much zero padding (0: no crop).
        flip: Augmentation: random horizontal flips.
    """

    def __init__(
        self,
        domains: tuple[str, ...] = ("Art", "Clipart", "Product", "Real_World"),
        clients_per_domain: int = 1,
        test_fraction: float = 0.2,
        image_size: int = 64,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        crop_padding: int = 4,
        flip: bool = True,
        num_clients: int | None = None,
        batch_size: int = 50,
        partition: Partitioner | None = None,
        root: str | None = None,
        subset: int | None = None,
        test_subset: int | None = None,
        augment: bool = True,
        eval_batch_size: int = 1000,
    ):
        if partition is not None:
            raise ConfigError(
                "`data.partition` is not used by OfficeHome (each domain is a client group); remove it "
                "and set `data.clients_per_domain` instead"
            )
        if not domains:
            raise ConfigError("`data.domains` must name at least one domain, e.g. [Art, Clipart, Product, Real_World]")
        if isinstance(clients_per_domain, bool) or not isinstance(clients_per_domain, int) or clients_per_domain < 1:
            raise ConfigError(f"`data.clients_per_domain` must be a positive integer, got {clients_per_domain!r}")
        expected = len(domains) * clients_per_domain
        if num_clients is not None and num_clients != expected:
            raise ConfigError(
                f"`data.num_clients` ({num_clients}) must equal len(`data.domains`) x "
                f"`data.clients_per_domain` = {expected}; leave it unset"
            )
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"`data.test_fraction` must be in [0, 1), got {test_fraction}")
        num_clients = expected
        _common(self, locals())
        self.domains, self.clients_per_domain, self.test_fraction = tuple(domains), clients_per_domain, test_fraction
        self.image_size, self.mean_arg, self.std_arg = image_size, mean, std
        self._input_shape = (3, image_size, image_size)
        self.augmentation = CropFlip(crop_padding, flip) if crop_padding > 0 or flip else None

    def _partition_desc(self) -> str:
        return f"domains {list(self.domains)} x {self.clients_per_domain} client(s)"

    def _domain_dirs(self) -> list[Path]:
        root = data_root(self.root)
        bases = [root / "OfficeHome", root / "OfficeHomeDataset_10072016"]
        base = next((b for b in bases if b.is_dir()), bases[0])
        dirs = []
        for name in self.domains:
            options = [base / name, base / name.replace("_", " ")]
            found = next((d for d in options if d.is_dir()), None)
            if found is None:
                raise not_found(f"OfficeHome domain '{name}'", options if base.is_dir() else bases)
            dirs.append(found)
        return dirs

    def _build(self, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[np.ndarray]]:
        dirs = self._domain_dirs()
        classes = sorted({e.name for d in dirs for e in os.scandir(d) if e.is_dir()})
        self._num_classes = len(classes)
        files, labels, domain = [], [], []
        for k, d in enumerate(dirs):
            f, y, _ = list_folder(d, classes)  # a class missing in this domain just has no files
            files += f
            labels.append(y)
            domain += [k] * len(f)
        labels, domain = np.concatenate(labels), np.asarray(domain)
        keep = select(len(files), self.subset, seeded(seed, SUBSET_TRAIN_TAG))
        if keep is not None:
            files, labels, domain = [files[i] for i in keep], labels[keep], domain[keep]
        x = cached_decode(files, self.image_size)
        rng = seeded(seed, HOLDOUT_TAG)
        train_chunks, test_chunks = [], []
        for k in range(len(dirs)):
            pos = rng.permutation(np.flatnonzero(domain == k))
            n_test = int(round(self.test_fraction * len(pos)))
            test_chunks.append(pos[:n_test])
            train_chunks += [np.sort(c) for c in np.array_split(pos[n_test:], self.clients_per_domain)]
        train_idx = np.concatenate(train_chunks)
        test_idx = np.sort(np.concatenate(test_chunks))
        t = select(len(test_idx), self.test_subset, seeded(seed, SUBSET_TEST_TAG))
        test_idx = test_idx if t is None else test_idx[t]
        bounds = np.cumsum([len(c) for c in train_chunks])
        parts = np.split(np.arange(len(train_idx)), bounds[:-1])
        train_x, test_x = x[torch.from_numpy(train_idx)], x[torch.from_numpy(test_idx)]
        self.mean, self.std = (
            (self.mean_arg, self.std_arg) if self.mean_arg and self.std_arg else channel_stats(train_x)
        )
        y = torch.from_numpy(labels)
        return train_x, y[torch.from_numpy(train_idx)], test_x, y[torch.from_numpy(test_idx)], parts
