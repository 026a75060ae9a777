"""ClientStateStore: in-memory and spilled round trips, the memory budget, checkpoints of a spilled store."""

from __future__ import annotations

import io
import os
import shutil

import pytest
import torch

from fedlight.engine.client_store import ClientStateStore
from fedlight.run.atomic import DamagedFile


def rich_state(seed: int) -> dict:
    """Every kind of leaf the store must keep bit for bit (odd sizes, 0-dim, NaN payloads, -0.0, ints, bools)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 3, generator=g)
    w[0, 0], w[0, 1], w[0, 2] = float("nan"), -0.0, float("inf")
    return {
        "c_i": {"w": w, "b": torch.randn(3, generator=g, dtype=torch.float64)},
        "m": [torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(2.5)],
        "count": torch.randint(0, 1 << 40, (4,), generator=g),
        "mask": torch.rand(6, generator=g) > 0.5,
        "pair": (torch.arange(3, dtype=torch.int32), 7),
        "step": seed,
        "name": "x",
    }


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def size(state) -> int:
    total = 0
    stack = [state]
    while stack:
        s = stack.pop()
        if isinstance(s, torch.Tensor):
            total += s.numel() * s.element_size()
        elif isinstance(s, dict):
            stack.extend(s.values())
        elif isinstance(s, (list, tuple)):
            stack.extend(s)
    return total


def test_round_trip_in_memory_is_a_private_copy():
    store = ClientStateStore()
    s = rich_state(0)
    store.put(3, s)
    assert store.get(9, "cpu") == {} and 3 in store and len(store) == 1
    got = store.get(3, "cpu")
    assert bitwise_equal(got, rich_state(0))
    got["c_i"]["w"].add_(1.0)  # the copy is private
    s["c_i"]["b"].zero_()  # put stored a copy
    assert bitwise_equal(store.get(3, "cpu"), rich_state(0))
    store.put(4, {})  # an empty state stores nothing
    assert store.ids() == [3]


def test_round_trip_spilled_is_bitwise(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_dir=tmp_path)
    for cid in range(3):
        store.put(cid, rich_state(cid))
    assert store.mem_bytes == 0 and len(store) == 3 and store.disk_bytes > 0
    assert len(list(tmp_path.glob("*.bin"))) == 3
    for cid in range(3):
        got = store.get(cid, "cpu")
        assert bitwise_equal(got, rich_state(cid))
        got["c_i"]["w"].add_(1.0)  # the file is mapped privately: writes never reach it
        assert bitwise_equal(store.get(cid, "cpu"), rich_state(cid))


def test_budget_is_respected_and_least_recent_spill_first(tmp_path):
    one = size({"a": torch.zeros(100)})
    store = ClientStateStore(budget_bytes=int(3.5 * one), spill_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    ref = {}
    for step in range(60):
        cid = int(torch.randint(0, 12, (), generator=g))
        n = int(torch.randint(20, 180, (), generator=g))
        ref[cid] = {"a": torch.randn(n, generator=g)}
        store.put(cid, ref[cid])
        in_memory = [c for c in store.ids() if c in store._mem]
        assert store.mem_bytes == sum(size(ref[c]) for c in in_memory) <= store.budget
        assert cid in in_memory or size(ref[cid]) > store.budget - 0  # the newest stays unless it alone is too big
        assert len(store) == len(ref) and len(list(tmp_path.glob("*.bin"))) == len(ref) - len(in_memory)
    assert all(bitwise_equal(store.get(c, "cpu"), ref[c]) for c in ref)


def test_state_survives_spill_and_unspill_bitwise(tmp_path):
    store = ClientStateStore(budget_bytes=size(rich_state(0)) + 1, spill_dir=tmp_path)
    store.put(0, rich_state(0))
    store.put(1, rich_state(1))  # pushes client 0 to disk
    assert 0 not in store._mem and 0 in store
    back = store.get(0, "cpu")
    store.put(0, back)  # back into memory; client 1 spills; client 0's old file is deleted
    assert 0 in store._mem and 1 not in store._mem
    assert len(list(tmp_path.glob("*.bin"))) == 1
    assert bitwise_equal(store.get(0, "cpu"), rich_state(0))
    assert bitwise_equal(store.get(1, "cpu"), rich_state(1))


def _save_load(d):
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_in_memory_and_materialized(tmp_path):
    plain = ClientStateStore()
    for cid in (1, 5):
        plain.put(cid, rich_state(cid))
    d = _save_load(plain.state_dict())
    assert set(d) == {"states"}  # the format of stores without a budget is unchanged
    budgeted = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "a")
    budgeted.load_state_dict(d)  # an old checkpoint into a budgeted store: spills as it loads
    assert budgeted.mem_bytes == 0 and budgeted.ids() == [1, 5]
    back = ClientStateStore()
    back.load_state_dict(_save_load(budgeted.state_dict(materialize=True)))
    for cid in (1, 5):
        assert bitwise_equal(back.get(cid, "cpu"), rich_state(cid))
    temp = ClientStateStore(budget_bytes=0)  # no spill_dir: a temporary folder, so checkpoints embed the data
    temp.put(2, rich_state(2))
    d = temp.state_dict()
    assert set(d) == {"states"} and bitwise_equal(_save_load(d)["states"][2], rich_state(2))


def test_spilled_checkpoint_references_files_and_keeps_them(tmp_path):
    spill = tmp_path / "client_state"
    store = ClientStateStore(budget_bytes=size(rich_state(0)), spill_dir=spill)
    for cid in range(4):
        store.put(cid, rich_state(cid))
    d1 = _save_load(store.state_dict())
    assert set(d1["spilled"]) == {0, 1, 2, 3} and d1["states"] == {}  # client 3 is written, and stays in memory
    assert 3 in store._mem and store.mem_bytes == size(rich_state(3))
    old = {int(c): spill / e["path"] for c, e in d1["spilled"].items()}  # named relative to the store's folder
    store.put(0, rich_state(10))  # supersedes client 0's file, which checkpoint 1 still references
    assert all(os.path.exists(p) for p in old.values())
    store.state_dict()  # checkpoint 2 written: checkpoint 1 may still be the newest complete one
    assert os.path.exists(old[0])
    d3 = _save_load(store.state_dict())  # checkpoint 3: nobody references the old file of client 0 any more
    assert not os.path.exists(old[0]) and os.path.exists(old[1])
    # resume in a fresh process: a new store over the same folder
    again = ClientStateStore(budget_bytes=size(rich_state(0)), spill_dir=spill)
    (spill / "c9-deadbeef-1.bin").write_bytes(b"left by a killed run")
    again.load_state_dict(d3)
    assert not (spill / "c9-deadbeef-1.bin").exists()
    want = {0: rich_state(10), 1: rich_state(1), 2: rich_state(2), 3: rich_state(3)}
    assert again.ids() == [0, 1, 2, 3]
    assert all(bitwise_equal(again.get(c, "cpu"), want[c]) for c in want)


def test_a_resume_keeps_the_files_the_checkpoint_before_names(tmp_path):
    """The previous checkpoint (checkpoints/prev.ckpt, the fallback when last.ckpt is damaged) stays loadable across
    a resume: before the next checkpoint and after it; its files go only once two later checkpoints no longer name
    them, as without the resume."""
    spill = tmp_path / "client_state"
    store = ClientStateStore(budget_bytes=0, spill_dir=spill)
    for cid in range(3):
        store.put(cid, rich_state(cid))
    d1 = _save_load(store.state_dict())
    store.put(0, rich_state(10))
    d2 = _save_load(store.state_dict())  # last.ckpt; d1 is prev.ckpt
    named = lambda d: {str(spill / e["path"]) for e in d["spilled"].values()}  # noqa: E731
    only_in_d1 = named(d1) - named(d2)
    assert len(only_in_d1) == 1
    again = ClientStateStore(budget_bytes=0, spill_dir=spill)  # resume in a fresh process from d2
    again.load_state_dict(d2)
    assert all(os.path.exists(f) for f in named(d1))  # prev.ckpt still loads
    shutil.copytree(spill, tmp_path / "copy")  # (a second store over the same folder would tidy it)
    fresh = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "copy")
    fresh.load_state_dict(d1)
    assert bitwise_equal(fresh.get(0, "cpu"), rich_state(0))
    again.put(1, rich_state(11))
    d3 = _save_load(again.state_dict())  # d2 becomes prev.ckpt
    assert all(os.path.exists(f) for f in named(d2)) and not any(os.path.exists(f) for f in only_in_d1)
    again.put(2, rich_state(12))
    d4 = _save_load(again.state_dict())  # d3 becomes prev.ckpt: d2's superseded file of client 1 goes
    assert sorted(os.listdir(spill)) == sorted(os.path.basename(f) for f in named(d3) | named(d4))  # no leak
    assert sorted(str(spill / f) for f in d2["previous"]) == sorted(named(d1))
    assert sorted(str(spill / f) for f in d4["previous"]) == sorted(named(d3))


def test_spilled_checkpoint_detects_missing_and_corrupt_files(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "s")
    store.put(0, rich_state(0))
    store.put(1, rich_state(1))
    d = _save_load(store.state_dict())
    path1 = tmp_path / "s" / d["spilled"][1]["path"]
    data = bytearray(open(path1, "rb").read())
    data[3] ^= 0xFF
    open(path1, "wb").write(bytes(data))
    again = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "s")
    again.load_state_dict(d)
    assert bitwise_equal(again.get(0, "cpu"), rich_state(0))
    with pytest.raises(DamagedFile, match="client 1's state file .* is damaged: .*CRC-32 mismatch"):
        again.get(1, "cpu")
    os.remove(tmp_path / "s" / d["spilled"][0]["path"])
    with pytest.raises(DamagedFile, match="client 0's state file .* is missing"):
        ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "s").load_state_dict(d)


def test_moved_run_directory(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "run" / "client_state")
    store.put(7, rich_state(7))
    d = _save_load(store.state_dict())
    (tmp_path / "run").rename(tmp_path / "moved")
    again = ClientStateStore(budget_bytes=0, spill_dir=tmp_path / "moved" / "client_state")
    again.load_state_dict(d)
    assert bitwise_equal(again.get(7, "cpu"), rich_state(7))


def test_scaffold_like_200_clients(tmp_path):
    """c_i⁺ = c_i − c + u_i for 20 sampled clients a round; a plain dict is the reference."""
    shapes = {"net.1.weight": (16, 12), "net.1.bias": (16,), "net.3.weight": (4, 16), "net.3.bias": (4,)}
    per_client = sum(torch.Size(s).numel() for s in shapes.values()) * 4
    store = ClientStateStore(budget_bytes=30 * per_client, spill_dir=tmp_path)
    ref: dict[int, dict] = {}
    g = torch.Generator().manual_seed(0)
    c = {k: torch.zeros(s) for k, s in shapes.items()}
    for r in range(25):
        sampled = torch.randperm(200, generator=g)[:20].tolist()
        delta_c = {k: torch.zeros(s) for k, s in shapes.items()}
        for cid in sampled:
            st = store.get(cid, "cpu")
            c_i = st.get("c_i", {k: torch.zeros(s) for k, s in shapes.items()})
            new = {k: c_i[k] - c[k] + torch.randn(shapes[k], generator=g) for k in shapes}
            for k in shapes:
                delta_c[k] += new[k] - c_i[k]
            store.put(cid, {"c_i": new})
            ref[cid] = {"c_i": {k: v.clone() for k, v in new.items()}}
            assert store.mem_bytes <= store.budget
        c = {k: c[k] + delta_c[k] / 200 for k in shapes}
        if r % 5 == 4:
            store.state_dict()
    assert len(store) == len(ref) > 150
    assert len(store._mem) == 30 and len(list(tmp_path.glob("*.bin"))) >= len(ref) - 30
    assert all(bitwise_equal(store.get(cid, "cpu"), ref[cid]) for cid in ref)


def test_export_does_not_release_files_of_the_last_checkpoint(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_dir=tmp_path)
    store.put(0, rich_state(0))
    d = store.state_dict()  # a checkpoint names client 0's file
    store.state_dict(materialize=True)  # an export in between
    store.put(0, rich_state(1))
    store.state_dict()  # the next checkpoint; the first one may still be the newest complete one
    assert os.path.exists(tmp_path / d["spilled"][0]["path"])


def test_states_without_tensor_bytes(tmp_path):
    store = ClientStateStore(budget_bytes=0, spill_dir=tmp_path)
    store.put(1, {"step": 3, "empty": torch.zeros(0, 5)})
    got = store.get(1, "cpu")
    assert got["step"] == 3 and got["empty"].shape == (0, 5)


def test_a_checkpoint_names_files_relative_to_the_run_directory_and_an_old_absolute_one_reads_inside_it(tmp_path):
    """A copied run directory reads its own files, also from a checkpoint of an older fedlight that named them by
    absolute path into the original, and deletes nothing outside itself."""
    run = tmp_path / "run"
    store = ClientStateStore()
    store.use_folder(run / "client_state" / "rank0", root=run)
    store.put(7, rich_state(7))
    d = _save_load(store.state_dict())
    assert d["spilled"][7]["path"].startswith("client_state/rank0/c7-")
    old = {**d, "spilled": {7: {**d["spilled"][7], "path": str(run / d["spilled"][7]["path"])}}}  # older format
    before = sorted(os.listdir(run / "client_state" / "rank0"))
    for i, ckpt in enumerate((d, old)):
        copy = shutil.copytree(run, tmp_path / f"copy{i}")
        again = ClientStateStore()
        again.use_folder(copy / "client_state" / "rank0", root=copy)
        again.load_state_dict(ckpt)
        assert again._disk[7]["path"].parent == copy / "client_state" / "rank0"
        assert bitwise_equal(again.get(7, "cpu"), rich_state(7))
        again.put(7, rich_state(8))
        again.state_dict(), again.state_dict(), again.state_dict()  # the superseded file is collected in the copy
    assert sorted(os.listdir(run / "client_state" / "rank0")) == before
