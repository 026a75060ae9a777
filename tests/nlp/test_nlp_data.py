"""GLUE and LEAF Shakespeare from local files: what the batches hold, the splits used, the cache."""

from __future__ import annotations

import pytest
import torch
from nlp_fixtures import PLAY, sentences, write_glue, write_shakespeare

from fedlight.data import GLUE, IID, Shakespeare
from fedlight.data import glue as glue_mod
from fedlight.data.shakespeare import LETTERS
from fedlight.errors import ConfigError
from fedlight.tasks import LanguageModeling, TextClassification


def test_glue_batches_are_int64_dicts_of_the_training_split(glue_root, tokenizer):
    data = GLUE("SST-2", tokenizer=tokenizer, root=str(glue_root), num_clients=4, batch_size=8, partition=IID())
    data.setup("cpu", 0)
    assert (data.num_train, data.num_test, data.num_classes) == (48, 16, 2)
    batch = next(data.client_batches(0, 1, torch.Generator().manual_seed(0)))
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert all(v.dtype == torch.int64 for v in batch.values()) and batch["input_ids"].shape[0] == 8
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert bool((ids[:, 0] == tokenizer.bos_token_id).all())  # <s> sentence </s>
    assert bool(((ids == tokenizer.pad_token_id) == (mask == 0)).all())
    # the test batches are dev.tsv, in file order, labelled as written
    test = list(data.test_batches())
    _, dev_labels = sentences(16, 2)
    assert torch.cat([b["labels"] for b in test]).tolist() == dev_labels
    first = tokenizer(sentences(16, 2)[0][0])["input_ids"]
    assert test[0]["input_ids"][0, :len(first)].tolist() == first


def test_glue_default_task_and_label_sets(glue_root, tokenizer):
    assert GLUE("CoLA", tokenizer=tokenizer).default_task().headline == "mcc"
    task = GLUE("rte", tokenizer=tokenizer).default_task()
    assert isinstance(task, TextClassification) and task.headline == "acc"
    mnli = GLUE("mnli", tokenizer=tokenizer, root=str(glue_root), num_clients=2, partition=IID())
    mnli.setup("cpu", 0)
    assert mnli.num_classes == 3 and mnli.num_test == 16  # dev_matched.tsv
    rte = GLUE("rte", tokenizer=tokenizer, root=str(glue_root), num_clients=2, partition=IID())
    rte.setup("cpu", 0)
    _, y = sentences(16, 2)
    assert torch.cat([b["labels"] for b in rte.test_batches()]).tolist() == [1 - v for v in y]  # entailment = 0
    pair = next(rte.test_batches())["input_ids"][0].tolist()
    assert pair.count(tokenizer.eos_token_id) == 3  # <s> A </s> </s> B </s>


def test_glue_parquet_folder_equals_the_tsv_one(tmp_path, glue_root, tokenizer):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    for split, n, seed in (("train", 48, 1), ("validation", 16, 2)):
        s, y = sentences(n, seed)
        (tmp_path / "sst2").mkdir(exist_ok=True)
        pq.write_table(pa.table({"sentence": s, "label": y, "idx": list(range(n))}),
                       tmp_path / "sst2" / f"{split}-00000-of-00001.parquet")
    a = GLUE("sst2", tokenizer=tokenizer, root=str(glue_root), num_clients=3, partition=IID())
    b = GLUE("sst2", tokenizer=tokenizer, root=str(tmp_path), num_clients=3, partition=IID())
    for d in (a, b):
        d.setup("cpu", 0)
    assert torch.equal(a._train_x, b._train_x) and torch.equal(a._test_y, b._test_y)


def test_glue_tokenizes_once_then_reads_the_cache(tmp_path, tokenizer, monkeypatch):
    write_glue(tmp_path)
    calls = []
    real = glue_mod.tokenize
    monkeypatch.setattr(glue_mod, "tokenize", lambda *a: calls.append(1) or real(*a))
    for _ in range(2):
        GLUE("cola", tokenizer=tokenizer, root=str(tmp_path), num_clients=2, partition=IID()).setup("cpu", 0)
    assert len(calls) == 2  # train and validation, the first time only
    GLUE("cola", tokenizer=tokenizer, root=str(tmp_path), max_length=9, num_clients=2, partition=IID()).setup("cpu", 0)
    assert len(calls) == 4  # max_length is part of the key
    (tmp_path / "CoLA" / "dev.tsv").write_text((tmp_path / "CoLA" / "dev.tsv").read_text().replace("good", "bad"))
    GLUE("cola", tokenizer=tokenizer, root=str(tmp_path), num_clients=2, partition=IID()).setup("cpu", 0)
    assert len(calls) == 5  # so is the file's content (only the changed split is tokenized again)


def test_glue_truncates_to_max_length(glue_root, tokenizer):
    data = GLUE("rte", tokenizer=tokenizer, root=str(glue_root), max_length=8, num_clients=2, partition=IID())
    data.setup("cpu", 0)
    assert data._train_x.shape[-1] == 8


def test_shakespeare_one_client_per_role_next_character_pairs(tmp_path):
    write_shakespeare(tmp_path, roles=3, per_role=12)
    data = Shakespeare(root=str(tmp_path), batch_size=4)
    assert data.num_clients is None  # known after setup
    data.setup("cpu", 0)
    # roles have 12, 13, 14 samples; the last 10 % (1 sample each, rounded) is the test part
    assert data.num_clients == 3 and [data.num_samples(i) for i in range(3)] == [13, 12, 11]
    assert data.roles == ["THE_PLAY_ROLE2", "THE_PLAY_ROLE1", "THE_PLAY_ROLE0"] and data.num_test == 3
    x, y = next(data.client_batches(0, 1, torch.Generator().manual_seed(0)))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 80)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 80
    assert isinstance(data.default_task(), LanguageModeling) and data.vocab_size == 80
    for row in torch.cat([x, y[:, -1:]], 1):  # each sample decodes to 81 consecutive characters of the play
        assert "".join(LETTERS[i] for i in row.tolist()) in PLAY * 4


def test_shakespeare_train_test_folders_and_min_samples(tmp_path):
    write_shakespeare(tmp_path, roles=4, per_role=6)
    src = tmp_path / "shakespeare" / "data"
    for split in ("train", "test"):
        (src / split).mkdir()
        (src / split / "x.json").write_bytes((src / "all_data" / "all_data.json").read_bytes())
    data = Shakespeare(root=str(tmp_path), min_samples=8, num_clients=1)
    data.setup("cpu", 0)
    assert data.num_clients == 1 and data.num_samples(0) == 9 and data.num_test == 9  # role 3: 9 samples each


def test_shakespeare_without_files_says_where_it_looked(tmp_path):
    with pytest.raises(ConfigError, match="all_data"):
        Shakespeare(root=str(tmp_path)).setup("cpu", 0)


def test_shakespeare_user_split_evaluates_on_the_test_roles(tmp_path):
    import json

    write_shakespeare(tmp_path, roles=3, per_role=5)
    src = tmp_path / "shakespeare" / "data"
    blob = json.loads((src / "all_data" / "all_data.json").read_text())
    for split, users in (("train", blob["users"][:2]), ("test", blob["users"][2:])):
        (src / split).mkdir()
        part = {"users": users, "user_data": {u: blob["user_data"][u] for u in users}}
        (src / split / "s.json").write_text(json.dumps(part))
    data = Shakespeare(root=str(tmp_path))
    data.setup("cpu", 0)
    assert data.num_clients == 2 and data.num_train == 5 + 6 and data.num_test == 7  # role 2 only in test


def test_online_glue_reads_the_hub_copy_like_the_local_files(tmp_path, monkeypatch):
    """No local folder and the Hub reachable: ``datasets.load_dataset("nyu-mll/glue", task, split)`` is read into
    the same texts and labels as GLUE's TSV files (``datasets`` is stood in for: no network here)."""
    import sys
    import types

    from nlp_fixtures import write_glue

    from fedlight.data.glue import read_split

    write_glue(tmp_path / "local")
    monkeypatch.setattr("fedlight.models.hub.reachable", lambda timeout=3.0: True)  # as if the Hub answered
    calls = []

    class HubSplit(dict):
        _fingerprint = "f00d"

    def load_dataset(path, name, split):
        calls.append((path, name, split))
        texts, labels, _ = read_split(name, split == "train", tmp_path / "local")
        return HubSplit(sentence=[t[0] for t in texts], label=list(labels))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    for train in (True, False):
        texts, labels, key = read_split("sst2", train, tmp_path / "nowhere")
        want_texts, want_labels, _ = read_split("sst2", train, tmp_path / "local")
        assert texts == want_texts and labels.tolist() == want_labels.tolist() and key == "hub:f00d"
    assert calls[-2:] == [("nyu-mll/glue", "sst2", "train"), ("nyu-mll/glue", "sst2", "validation")]
