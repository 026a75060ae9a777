"""Wrong data is refused with one message naming the file (issue 13 items 5 and 8)."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import FashionMNIST, ImageFolder, TensorClients
from fedlight.data.cache import cached_decode
from fedlight.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path / "cache"))


def write_idx(path: Path, arr: bytes, dims: list[int], truncate: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"\x00\x00\x08" + bytes([len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + arr
    path.write_bytes(data[: len(data) - truncate])


def fake_fmnist(root: Path, n_images=60, n_labels=60, truncate=0, magic_ok=True):
    raw = root / "FashionMNIST" / "raw"
    for prefix, n in (("train", n_images), ("t10k", 20)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", bytes(n * 28 * 28), [n, 28, 28],
                  truncate if prefix == "train" else 0)
        m = n_labels if prefix == "train" else n
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", bytes(i % 10 for i in range(m)), [m])
    if not magic_ok:
        p = raw / "train-labels-idx1-ubyte"
        p.write_bytes(b"\x00\x00\x0d" + p.read_bytes()[3:])
    return raw


@pytest.mark.parametrize("kind,needle", [
    ("short_labels", "disagree"),
    ("truncated", "truncated"),
    ("bad_magic", "bad header"),
])
def test_fashion_mnist_files_are_checked(tmp_path, kind, needle):
    raw = fake_fmnist(tmp_path, n_labels=30 if kind == "short_labels" else 60, truncate=100 if kind == "truncated"
                      else 0, magic_ok=kind != "bad_magic")
    with pytest.raises(ConfigError, match=needle) as e:
        FashionMNIST(root=str(tmp_path), num_clients=2, batch_size=4).setup()
    assert str(raw) in str(e.value)
    fake_fmnist(tmp_path)
    FashionMNIST(root=str(tmp_path), num_clients=2, batch_size=4).setup()  # good files train


def _folder(tmp_path):
    for split, n in (("train", 4), ("test", 2)):
        for c, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            for i in range(n):
                p = tmp_path / "pets" / split / c / f"{i}.png"
                p.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (8, 8), color).save(p)


def test_non_image_file_is_one_message_naming_it(tmp_path):
    _folder(tmp_path)
    bad = tmp_path / "pets" / "train" / "cat" / "notes.jpg"
    bad.write_text("this is not a picture")
    with pytest.raises(ConfigError, match="not a readable image") as e:
        ImageFolder("pets", root=str(tmp_path), num_clients=2).setup()
    assert str(bad) in str(e.value)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FEDLIGHT_DATA": str(tmp_path),
           "FEDLIGHT_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-m", "fedlight", "fit", "--model", "fedlight.models.SmallCNN",
                          "--data", "fedlight.data.ImageFolder", "--data.init_args.path", "pets",
                          "--data.init_args.root", str(tmp_path),
                          "--data.init_args.num_clients", "2", "--loop.clients_per_round", "2",
                          "--loop.rounds", "1", "--out_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "notes.jpg" in res.stderr, res.stderr[-2000:]


def test_same_size_rewrite_is_not_served_stale(tmp_path):
    p = tmp_path / "a.ppm"
    Image.new("RGB", (4, 4), (255, 0, 0)).save(p)
    assert cached_decode([str(p)])[0, 0].eq(255).all()
    st = os.stat(p)
    Image.new("RGB", (4, 4), (0, 0, 255)).save(p)  # same format and size: same byte count
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the modification time put back
    assert os.stat(p).st_size == st.st_size
    again = cached_decode([str(p)])
    assert again[0, 2].eq(255).all() and again[0, 0].eq(0).all()


def test_float64_inputs_stay_float64_under_64_true(tmp_path):
    x = 1 + torch.arange(16, dtype=torch.float64).view(8, 2) * 1e-12  # not representable in float32
    y = torch.tensor([0, 1] * 4)
    data = TensorClients([(x[:4], y[:4]), (x[4:], y[4:])], test=(x, y), batch_size=4)
    fedlight.fit(torch.nn.Linear(2, 2).double(), data, fedlight.create("fedavg"),
                 LoopConfig(rounds=1, clients_per_round=2, local_steps=1, progress=False),
                 out_dir=str(tmp_path / "run"), accelerator="cpu", precision="64-true")
    xb, _ = next(data.client_batches(0, 1, torch.Generator().manual_seed(0)))
    assert xb.dtype == torch.float64
    assert torch.equal(xb.sort(dim=0).values, x[:4].sort(dim=0).values)
