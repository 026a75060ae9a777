"""``tools/data_parts.py``: a folder packed into parts with SHA-256s and reassembled byte for byte (a part missing or
damaged is named); CIFAR-10's decoded pickles hold exactly the pixels and order fedlight reads from the JPEG copy."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("data_parts", ROOT / "tools" / "data_parts.py")
parts_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parts_tool)


def make_folder(path: Path) -> Path:
    rng = np.random.default_rng(0)
    (path / "sub").mkdir(parents=True)
    (path / "a.bin").write_bytes(rng.integers(0, 256, 6000, dtype=np.uint8).tobytes())  # incompressible
    (path / "sub" / "b.txt").write_text("fedlight " * 500)
    (path / "empty").write_bytes(b"")
    return path


def test_pack_unpack_round_trip_and_damage(tmp_path, capsys):
    src = make_folder(tmp_path / "set")
    m = parts_tool.pack(src, tmp_path / "parts", part_mib=2000 / 2**20)  # parts of 2000 bytes
    assert len(m["parts"]) >= 3 and all(p["bytes"] <= 2000 for p in m["parts"])
    assert sum(p["bytes"] for p in m["parts"]) == m["bytes"]
    for p in m["parts"]:
        assert parts_tool.sha256(tmp_path / "parts" / p["name"]) == p["sha256"]
    again = parts_tool.pack(src, tmp_path / "parts2", part_mib=2000 / 2**20)
    assert again["sha256"] == m["sha256"]  # the same folder packs to the same bytes

    first = tmp_path / "parts" / m["parts"][0]["name"]
    kept = first.read_bytes()
    first.unlink()  # one part not brought yet: exit 3, the missing one named
    assert parts_tool.main(["unpack", str(tmp_path / "parts"), str(tmp_path / "there")]) == 3
    assert f"{len(m['parts']) - 1} of {len(m['parts'])} parts here; missing {first.name}" in capsys.readouterr().err
    first.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))  # damaged in transit: exit 2
    assert parts_tool.main(["unpack", str(tmp_path / "parts"), str(tmp_path / "there")]) == 2
    assert f"{first.name} differ from the manifest" in capsys.readouterr().err
    first.write_bytes(kept)
    assert parts_tool.main(["unpack", str(tmp_path / "parts"), str(tmp_path / "there")]) == 0
    out = tmp_path / "there" / "set"
    for f in ("a.bin", "sub/b.txt", "empty"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    assert parts_tool.unpack(tmp_path / "parts", tmp_path / "there") == out  # already there and matching: kept
    (out / "a.bin").write_bytes(b"changed")
    with pytest.raises(parts_tool.PartsError, match="exists and differs"):
        parts_tool.unpack(tmp_path / "parts", tmp_path / "there")
    assert json.loads((tmp_path / "parts" / "set.manifest.json").read_text())["files"]["sub/b.txt"]
    cut = parts_tool.resplit(tmp_path / "parts", part_mib=5000 / 2**20)  # the same stream, cut again
    assert cut["sha256"] == m["sha256"] and len(cut["parts"]) < len(m["parts"])
    assert len(list((tmp_path / "parts").glob("set.tar.xz.part*"))) == len(cut["parts"])
    assert parts_tool.unpack(tmp_path / "parts", tmp_path / "again") == tmp_path / "again" / "set"
    assert (tmp_path / "again" / "set" / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


def test_cifar10_pickles_hold_what_fedlight_reads_from_the_jpeg_copy(tmp_path, monkeypatch):
    from PIL import Image

    from fedlight.data import CIFAR10

    rng = np.random.default_rng(1)
    for split, n in (("train", 3), ("test", 1)):
        for c in ("airplane", "cat"):
            (tmp_path / "jpeg" / "cifar10-jpeg" / split / c).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(img).save(tmp_path / "jpeg" / "cifar10-jpeg" / split / c / f"{i:04d}.jpg")
    monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path / "cache"))
    parts_tool.cifar10_pickles(tmp_path / "pickles", tmp_path / "jpeg")
    assert sorted(os.listdir(tmp_path / "pickles" / "cifar-10-batches-py")) == [
        "batches.meta", "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"]
    for train in (True, False):
        for keep in (None, 3):  # a subset chooses the same images either way
            want = CIFAR10(root=str(tmp_path / "jpeg"))._load(train, keep, np.random.default_rng(5))
            got = CIFAR10(root=str(tmp_path / "pickles"))._load(train, keep, np.random.default_rng(5))
            assert want[0].shape[1:] == (3, 32, 32) and want[0].dtype == got[0].dtype
            assert (want[0] == got[0]).all() and (want[1] == got[1]).all()
