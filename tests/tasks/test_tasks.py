"""Tasks beyond image classification: targets and inputs keep their dtype, every built-in task trains and evaluates
with hand-checkable numbers, and a model that does not fit the data is refused before round 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import IID, Dirichlet, MarkovText, QuantitySkew, SyntheticRegression, TensorClients
from fedlight.errors import ConfigError
from fedlight.models import MLP, TinyGPT
from fedlight.tasks import Classification, LanguageModeling, Regression, TextClassification

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw):
    base = dict(rounds=2, clients_per_round=2, local_steps=3, lr=0.05, progress=False)
    return LoopConfig(**{**base, **kw})


def _regression_clients(n_clients=3, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_clients):
        x = torch.randn(n, 4, generator=g)
        out.append((x, x @ torch.tensor([1.3, 4.2, -4.1, 0.5]) + 0.25))
    return out


def test_float_targets_stay_float_and_train_a_regression(tmp_path):
    clients = _regression_clients()
    data = TensorClients(clients, test=clients[0])
    data.setup("cpu", 0)
    assert data._train_y.dtype == torch.float32
    assert torch.equal(data._train_y[:10], clients[0][1])  # not cast to int64 (was: 1.3 -> 1)
    assert data.num_classes is None
    s = fedlight.fit(MLP(in_features=4, hidden=[8], num_classes=1), TensorClients(clients, test=clients[0]),
                     loop=_cfg(rounds=3), task=Regression(), out_dir=str(tmp_path / "r"))
    assert s["headline"] == {"metric": "test_mse", "higher_is_better": False}
    assert {"final_test_mse", "final_test_mae", "final_test_r2", "final_test_loss"} <= set(s)
    assert s["final_test_mse"] == pytest.approx(s["final_test_loss"], rel=1e-6)
    assert s["best_test_mse"] == min(json.loads(r)["test_mse"] for r in
                                     (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())


def test_regression_metrics_against_hand_computation():
    model = nn.Linear(4, 1)
    x, y = _regression_clients(1, 16)[0]
    metrics = {k: v for k, v in Regression().metrics().items()}
    Regression().update(metrics, model, (x[:9], y[:9]), lambda m, *a: m(*a))
    Regression().update(metrics, model, (x[9:], y[9:]), lambda m, *a: m(*a))
    with torch.no_grad():
        pred = model(x).squeeze(-1)
    mse = float(((pred - y) ** 2).mean())
    assert float(metrics["mse"].compute()) == pytest.approx(mse, rel=1e-5)
    assert float(metrics["mae"].compute()) == pytest.approx(float((pred - y).abs().mean()), rel=1e-5)
    assert float(metrics["r2"].compute()) == pytest.approx(1 - mse / float(y.var(unbiased=False)), rel=1e-5)
    assert float(metrics["loss"].compute()) == pytest.approx(mse, rel=1e-5)


def test_token_inputs_stay_int64_and_per_token_targets_are_accepted(tmp_path):
    data = MarkovText(num_clients=4, vocab_size=6, seq_len=8, sequences_per_client=10)
    data.setup("cpu", 0)
    x, y = next(data.client_batches(0, 1, torch.Generator().manual_seed(0)))
    assert x.dtype == torch.int64 and y.dtype == torch.int64 and y.shape == x.shape  # 2-D per-token targets
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    s = fedlight.fit(TinyGPT(vocab_size=6, dim=8, layers=1, heads=2, max_len=8),
                     MarkovText(num_clients=4, vocab_size=6, seq_len=8, sequences_per_client=10),
                     loop=_cfg(lr=0.5), out_dir=str(tmp_path / "lm"))
    assert s["headline"] == {"metric": "test_perplexity", "higher_is_better": False}
    assert s["final_test_perplexity"] == pytest.approx(float(torch.exp(torch.tensor(s["final_test_loss"]))),
                                                       rel=1e-5)
    assert 1 < s["final_test_perplexity"] < 6 * 1.5  # near-uniform at worst over 6 tokens


def test_language_modeling_batch_forms_agree():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=7, dim=8, layers=1, heads=2, max_len=9)
    seq = torch.randint(0, 7, (3, 9))
    task = LanguageModeling()
    as_tensor = task.objective(model, seq)
    as_pair = task.objective(model, (seq[:, :-1], seq[:, 1:]))

    class HF(nn.Module):  # a Hugging Face-style model: keyword inputs, .logits, labels aligned with inputs
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask=None):
            return type("Out", (), {"logits": self.inner(input_ids)})()

    as_dict = task.objective(HF(), {"input_ids": seq[:, :-1], "attention_mask": torch.ones(3, 8, dtype=torch.long)})
    want = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 7), seq[:, 1:].reshape(-1))
    torch.testing.assert_close(as_tensor, want)
    torch.testing.assert_close(as_pair, want)
    want_dict = F.cross_entropy(model(seq[:, :-1])[:, :-1].reshape(-1, 7), seq[:, 1:-1].reshape(-1))
    torch.testing.assert_close(as_dict, want_dict)


def test_text_classification_reports_glue_metrics():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(20, 2, mode="sum")

        def forward(self, input_ids, attention_mask):
            return self.emb(input_ids, per_sample_weights=attention_mask.float())

    torch.manual_seed(0)
    model = Bag()
    ids = torch.randint(0, 20, (12, 5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.arange(12) % 2}
    task = TextClassification(num_classes=2, headline="mcc")
    metrics = task.metrics()
    task.update(metrics, model, batch, lambda m, **k: m(**k))
    with torch.no_grad():
        pred = model(ids, torch.ones_like(ids)).argmax(-1)
    y = batch["labels"]
    tp, tn = int(((pred == 1) & (y == 1)).sum()), int(((pred == 0) & (y == 0)).sum())
    fp, fn = int(((pred == 1) & (y == 0)).sum()), int(((pred == 0) & (y == 1)).sum())
    mcc = (tp * tn - fp * fn) / (((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)) ** 0.5 or 1)
    assert float(metrics["acc"].compute()) == pytest.approx((tp + tn) / 12)
    assert float(metrics["mcc"].compute()) == pytest.approx(mcc, abs=1e-6)
    assert float(metrics["f1"].compute()) == pytest.approx(2 * tp / (2 * tp + fp + fn) if tp else 0.0, abs=1e-6)
    assert task.higher_is_better and task.headline_key == "test_mcc"
    with pytest.raises(ConfigError, match="task.headline"):
        TextClassification(headline="bleu")


def test_a_model_data_mismatch_is_refused_before_round_1(tmp_path):
    """The headline recipe with CIFAR-10 data but a 100-class model: refused with the fix, nothing trained."""
    data = fedlight.data.Synthetic(num_clients=6, num_classes=10, dim=12, samples_per_client=20)
    with pytest.raises(ConfigError, match=r"outputs 100 scores per sample but the data has 10 classes.*num_classes 10"):
        fedlight.fit(MLP(in_features=12, hidden=[8], num_classes=100), data, loop=_cfg(), out_dir=str(tmp_path / "x"))
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_cli_mismatch_exits_2_before_training(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "fedlight", "fit", "--config", "recipes/quickstart.yaml",
                          "--model.init_args.num_classes", "100", "--out_dir", str(out), "--resume", "null"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "num_classes 10" in res.stderr and "Traceback" not in res.stderr
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("task, match", [
    (Regression(), "Regression needs floating-point targets"),
    (Classification(), "Classification needs integer class labels"),
])
def test_a_task_that_does_not_fit_the_targets_is_refused(tmp_path, task, match):
    clients = _regression_clients() if isinstance(task, Classification) else [
        (x, (y > 0).long()) for x, y in _regression_clients()]
    with pytest.raises(ConfigError, match=match):
        fedlight.fit(MLP(in_features=4, hidden=[8], num_classes=1 if isinstance(task, Regression) else 2),
                     TensorClients(clients, test=clients[0]), loop=_cfg(), task=task, out_dir=str(tmp_path / "t"))


def test_a_label_partition_of_unlabeled_data_is_refused():
    from torch.utils.data import TensorDataset

    from fedlight.data import DatasetClients

    x, y = _regression_clients(1, 40)[0]
    data = DatasetClients(TensorDataset(x, y), num_clients=4, partition=Dirichlet(0.5))
    with pytest.raises(ConfigError, match="splits by class label.*IID\\(\\) / QuantitySkew"):
        data.setup("cpu", 0)
    labelled = TensorClients([(x, y)])
    labelled.partition = Dirichlet(0.5)
    with pytest.raises(ConfigError, match="not class labels"):
        from fedlight.data.base import partition_labels

        partition_labels(Dirichlet(0.5), y, labelled)
    ok = DatasetClients(TensorDataset(x, y), num_clients=4, partition=QuantitySkew(0.5))
    ok.setup("cpu", 0)
    sizes = sorted(ok.num_samples(c) for c in range(4))
    assert sum(sizes) == 40 and min(sizes) >= 1 and len(set(sizes)) > 1


def test_quantity_skew_is_seeded_and_complete():
    import numpy as np

    parts = QuantitySkew(0.3)(np.zeros(100), 7, np.random.default_rng(0))
    again = QuantitySkew(0.3)(np.zeros(100), 7, np.random.default_rng(0))
    assert [p.tolist() for p in parts] == [p.tolist() for p in again]
    assert sorted(np.concatenate(parts).tolist()) == list(range(100)) and min(map(len, parts)) >= 1


def test_natural_split_from_a_per_sample_client_id():
    from torch.utils.data import TensorDataset

    from fedlight.data import DatasetClients

    x = torch.arange(30, dtype=torch.float32).unsqueeze(1)
    role = torch.tensor([i % 4 for i in range(30)])
    data = DatasetClients(TensorDataset(x, role), client_fn=lambda s: int(s[1]), batch_size=4)
    data.setup("cpu", 0)
    assert data.num_clients == 4 and [data.num_samples(c) for c in range(4)] == [8, 8, 7, 7]
    got = torch.cat([b[0] for b in data.client_batches(2, 2, torch.Generator().manual_seed(0))])
    assert sorted(got.squeeze(1).tolist()) == [v for v in range(30) if v % 4 == 2]


def test_synthetic_regression_is_a_function_of_the_seed():
    a, b, c = SyntheticRegression(num_clients=3), SyntheticRegression(num_clients=3), SyntheticRegression(num_clients=3)
    a.setup("cpu", 0), b.setup("cpu", 0), c.setup("cpu", 1)
    assert torch.equal(a._train_y, b._train_y) and not torch.equal(a._train_y, c._train_y)
    assert a._train_y.dtype == torch.float32 and a.num_classes is None
    assert isinstance(a.default_task(), Regression) and isinstance(MarkovText().default_task(), LanguageModeling)
    assert IID.needs_labels is False
