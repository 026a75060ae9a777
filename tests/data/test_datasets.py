"""FederatedDataModule and the datasets: batches, normalisation, subsets, folders, errors.

Real files come from ``$FEDLIGHT_DATA`` (CI: ``../shared/data``), else ``../shared/data`` next to the repo;
tests that need them are skipped when neither exists. Everything else uses tiny generated datasets.
"""

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedlight.data import (
    CIFAR10,
    CIFAR100,
    IID,
    Dirichlet,
    FashionMNIST,
    ImageFolder,
    OfficeHome,
    Synthetic,
    TensorClients,
    TinyImageNet,
)
from fedlight.errors import ConfigError, DataNotFoundError

REPO = Path(__file__).resolve().parents[2]


def real_data_root() -> Path | None:
    env = os.environ.get("FEDLIGHT_DATA")
    candidates = [Path(env), REPO / env] if env else []
    candidates.append(REPO.parent / "shared" / "data")
    return next((p.resolve() for p in candidates if p.is_dir()), None)


REAL = real_data_root()
needs_fmnist = pytest.mark.skipif(
    REAL is None or not (REAL / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not available"
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path / "cache"))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def id_clients(sizes, dim=2):
    """Clients whose inputs carry a global sample id in column 0, so batches can be traced back."""
    clients, start = [], 0
    for n in sizes:
        ids = torch.arange(start, start + n, dtype=torch.float32)
        clients.append((torch.stack([ids] * dim, 1), torch.arange(n) % 3))
        start += n
    return clients


# ---------------------------------------------------------------- client_batches / test_batches
def test_client_batches_steps_sizes_and_epoch_coverage():
    data = TensorClients(id_clients([23, 7]), batch_size=10)
    data.setup("cpu", seed=0)
    assert data.num_samples(0) == 23 and data.steps_per_epoch(0) == 3
    batches = list(data.client_batches(0, 7, gen()))
    assert [len(y) for _, y in batches] == [10, 10, 3, 10, 10, 3, 10]
    x, y = batches[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    for epoch in (batches[0:3], batches[3:6]):  # every sample exactly once per epoch
        ids = torch.cat([b[0][:, 0] for b in epoch]).long()
        assert sorted(ids.tolist()) == list(range(23))
    first, second = (torch.cat([b[0][:, 0] for b in e]) for e in (batches[0:3], batches[3:6]))
    assert not torch.equal(first, second)  # a fresh permutation per epoch
    assert list(data.client_batches(0, 0, gen())) == []


def test_client_batches_same_generator_same_batches():
    data = TensorClients(id_clients([40, 40]), batch_size=8)
    data.setup()
    a, b, c = (list(data.client_batches(1, 12, gen(s))) for s in (5, 5, 6))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, c))
    assert torch.cat([x[:, 0] for x, _ in a]).min() >= 40  # only client 1's samples


def test_tensor_clients_test_set_and_labels():
    test = (torch.randn(25, 2), torch.arange(25) % 4)
    data = TensorClients(id_clients([5, 6]), test=test, eval_batch_size=10)
    data.setup()
    assert data.num_classes == 4 and data.input_shape == (2,)
    assert [len(y) for _, y in data.test_batches()] == [10, 10, 5]
    assert torch.equal(data.client_labels(1), torch.arange(6) % 3)
    no_test = TensorClients(id_clients([3]))
    no_test.setup()
    assert list(no_test.test_batches()) == []


def test_histogram_and_report():
    data = TensorClients(id_clients([9, 4, 6]), batch_size=4)
    data.setup()
    hist = data.class_histogram()
    assert hist.shape == (3, 3) and hist.sum(1).tolist() == [9, 4, 6]
    report = data.partition_report()
    assert "client" in report and "total 19 samples" in report


def test_setup_is_idempotent():
    data = TensorClients(id_clients([5, 5]))
    data.setup("cpu", 0)
    stored = data._train_x
    data.setup("cpu", 0)
    assert data._train_x is stored


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("arg", "value"), [("batch_size", 0), ("num_clients", -1), ("subset", 0), ("eval_batch_size", 1.5)]
)
def test_bad_settings_name_the_setting(arg, value):
    with pytest.raises(ConfigError, match=f"`data.{arg}` must be a positive integer"):
        FashionMNIST(**{arg: value})


def test_bad_partition_type():
    with pytest.raises(ConfigError, match="Partitioner"):
        FashionMNIST(partition="dirichlet")


# ---------------------------------------------------------------- CIFAR-100 (fake pickles) and missing files
def write_fake_cifar100(root: Path, n_train=120, n_test=40):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        data = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": list(np.arange(n) % 100)}
        with open(folder / name, "wb") as f:
            pickle.dump(data, f)
    return folder


def test_cifar100_from_pickles(tmp_path):
    write_fake_cifar100(tmp_path)
    data = CIFAR100(root=str(tmp_path), num_clients=4, batch_size=16, partition=Dirichlet(0.5))
    data.setup()
    assert data.num_classes == 100 and data.input_shape == (3, 32, 32)
    assert sum(data.num_samples(i) for i in range(4)) == 120 and data.num_test == 40
    with open(tmp_path / "cifar-100-python" / "test", "rb") as f:
        raw = np.asarray(pickle.load(f)["data"][0], dtype=np.float32).reshape(3, 32, 32) / 255
    expected = (torch.from_numpy(raw) - torch.tensor(data.mean).view(3, 1, 1)) / torch.tensor(data.std).view(3, 1, 1)
    x, y = next(data.test_batches())
    assert torch.allclose(x[0], expected, atol=1e-5) and y[0] == 0


def test_augmentation_on_and_off(tmp_path):
    write_fake_cifar100(tmp_path)
    plain = CIFAR100(root=str(tmp_path), num_clients=2, batch_size=60, augment=False)
    aug = CIFAR100(root=str(tmp_path), num_clients=2, batch_size=60)
    plain.setup(), aug.setup()
    (xp, yp), (xa, ya) = next(plain.client_batches(0, 1, gen(1))), next(aug.client_batches(0, 1, gen(1)))
    assert torch.equal(yp, ya) and xa.shape == xp.shape  # same order: permutations are drawn first
    rows = plain._client_idx[0][torch.randperm(60, generator=gen(1))]
    assert torch.equal(xp, plain.to_input(plain._train_x[rows]))
    assert not torch.equal(xa, xp)


def test_fewer_samples_than_clients(tmp_path):
    write_fake_cifar100(tmp_path)
    with pytest.raises(ConfigError, match="num_clients"):
        CIFAR100(root=str(tmp_path), num_clients=10, subset=5).setup()


@pytest.mark.parametrize("cls", [FashionMNIST, CIFAR10, CIFAR100])
def test_missing_files_error_names_paths_and_fix(cls, tmp_path, monkeypatch):
    monkeypatch.delenv("FEDLIGHT_DATA", raising=False)
    with pytest.raises(DataNotFoundError) as err:
        cls(root=str(tmp_path / "nowhere")).setup()
    message = str(err.value)
    assert str(tmp_path / "nowhere") in message
    assert "FEDLIGHT_DATA" in message and "data.init_args.root" in message and "download: true" in message


# ---------------------------------------------------------------- real data
@needs_fmnist
def test_fashion_mnist_normalised_and_partitioned(monkeypatch):
    monkeypatch.setenv("FEDLIGHT_DATA", str(REAL))
    data = FashionMNIST(num_clients=10, partition=IID(), subset=2000)
    data.setup("cpu", seed=1)
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28) and data.num_test == 10000
    x = torch.cat([x for x, _ in data.test_batches()])
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02
    assert [data.num_samples(i) for i in range(10)] == [200] * 10
    assert data.class_histogram().sum() == 2000
    other = FashionMNIST(num_clients=10, subset=2000)
    other.setup("cpu", seed=2)
    assert not torch.equal(data._train_y, other._train_y)  # the subset is seeded by the run seed


@pytest.mark.skipif(REAL is None or not (REAL / "cifar10-jpeg").is_dir(), reason="CIFAR-10 JPEG copy not available")
def test_cifar10_from_jpeg_subset_decodes_only_the_subset(tmp_path):
    data = CIFAR10(root=str(REAL), num_clients=5, subset=300, test_subset=100)
    data.setup("cpu", seed=0)
    assert data._train_x.shape == (300, 3, 32, 32) and data._train_x.dtype == torch.uint8
    assert data.num_test == 100 and 0 <= data._train_y.min() and data._train_y.max() <= 9
    cached = list((tmp_path / "cache" / "images").iterdir())
    assert len(cached) == 2 and all(p.stat().st_size < 2_000_000 for p in cached)  # 400 images, not 60,000
    again = CIFAR10(root=str(REAL), num_clients=5, subset=300, test_subset=100)
    again.setup("cpu", seed=0)
    assert torch.equal(data._train_x, again._train_x)


# ---------------------------------------------------------------- generated folders
def save(path: Path, color, size=(8, 8), fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, fmt)


def test_image_folder(tmp_path):
    for split, n in (("train", 6), ("test", 2)):
        for c, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            for i in range(n):
                save(tmp_path / "pets" / split / c / f"{i}.png", color)
    data = ImageFolder("pets", root=str(tmp_path), num_clients=3, batch_size=4)
    data.setup()
    assert data.num_classes == 2 and data.classes == ["cat", "dog"] and data.input_shape == (3, 8, 8)
    assert data._train_x[data._train_y == 1][:, 2].eq(255).all()  # dog images are blue
    assert np.allclose(data.mean, (0.5, 0, 0.5)) and data.num_test == 4
    resized = ImageFolder(str(tmp_path / "pets"), image_size=4, num_clients=2)
    resized.setup()
    assert resized.input_shape == (3, 4, 4)
    save(tmp_path / "pets" / "train" / "dog" / "big.png", (0, 0, 255), size=(9, 8))
    with pytest.raises(ConfigError, match="image_size"):
        ImageFolder("pets", root=str(tmp_path), num_clients=2).setup()
    with pytest.raises(DataNotFoundError, match="FEDLIGHT_DATA"):
        ImageFolder("nothing", root=str(tmp_path)).setup()


def test_tiny_imagenet_layout(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    wnids, colors = ["n02", "n01", "n03"], [(250, 0, 0), (0, 250, 0), (0, 0, 250)]
    (base / "val").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids))
    lines = []
    for w, color in zip(wnids, colors):
        for i in range(4):
            save(base / "train" / w / "images" / f"{w}_{i}.JPEG", color, size=(64, 64), fmt="JPEG")
        save(base / "val" / "images" / f"val_{w}.JPEG", color, size=(64, 64), fmt="JPEG")
        lines.append(f"val_{w}.JPEG\t{w}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines))
    data = TinyImageNet(root=str(tmp_path), num_clients=3, batch_size=4)
    data.setup()
    assert data.num_classes == 3 and data.input_shape == (3, 64, 64) and data.num_test == 3
    assert sorted(data._train_y.tolist()) == [0] * 4 + [1] * 4 + [2] * 4
    for label, color in enumerate(colors):  # label = position in wnids.txt; JPEG is lossy, colours approximate
        mean = data._test_x[data._test_y == label].float().mean((0, 2, 3))
        assert torch.allclose(mean, torch.tensor(color, dtype=torch.float32), atol=8)
    assert next(data.client_batches(0, 1, gen()))[0].shape == (4, 3, 64, 64)


def test_office_home_domains_as_clients(tmp_path):
    for domain, size in (("Art", (20, 12)), ("Real World", (10, 16))):  # the official archive spells it with a space
        for c in ("Bike", "Mug", "Pen"):
            for i in range(10):
                save(tmp_path / "OfficeHome" / domain / c / f"{i}.jpg", (i * 20, 0, 0), size=size)
    data = OfficeHome(domains=("Art", "Real_World"), clients_per_domain=2, image_size=8, root=str(tmp_path))
    assert data.num_clients == 4
    data.setup()
    assert data.num_classes == 3 and data.input_shape == (3, 8, 8)
    assert data.num_test == 12 and sum(data.num_samples(i) for i in range(4)) == 48  # 20% of 30 per domain
    assert [data.num_samples(i) for i in range(4)] == [12] * 4
    with pytest.raises(ConfigError, match="clients_per_domain"):
        OfficeHome(num_clients=5)
    with pytest.raises(ConfigError, match="partition"):
        OfficeHome(partition=IID())
    with pytest.raises(DataNotFoundError, match="Clipart"):
        OfficeHome(domains=("Clipart",), root=str(tmp_path)).setup()


# ---------------------------------------------------------------- Synthetic
def test_synthetic_is_determined_by_seed():
    a, b, c = Synthetic(num_clients=10), Synthetic(num_clients=10), Synthetic(num_clients=10)
    a.setup(seed=0), b.setup(seed=0), c.setup(seed=1)
    assert torch.equal(a._train_x, b._train_x) and torch.equal(a._test_y, b._test_y)
    assert a._train_x.shape != c._train_x.shape or not torch.equal(a._train_x, c._train_x)
    sizes = [a.num_samples(i) for i in range(10)]
    assert min(sizes) >= 40 and max(sizes) <= 1600  # 80% of [50, 2000]
    assert a.input_shape == (60,) and a.num_classes == 10 and a._train_x.dtype == torch.float32


def test_synthetic_equal_sizes_test_fraction_and_heterogeneity():
    data = Synthetic(alpha=1.0, beta=1.0, num_clients=20, samples_per_client=100)
    data.setup()
    assert [data.num_samples(i) for i in range(20)] == [80] * 20 and data.num_test == 400
    hist = data.class_histogram()
    assert (hist > 0).sum(1).mean() < 8  # clients see few classes: label skew from their own W_k, b_k
    with pytest.raises(ConfigError, match="partition"):
        Synthetic(partition=Dirichlet(0.1))
