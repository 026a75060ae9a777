"""GLUE's F1 and MCC as GLUE computes them (scikit-learn's ``f1_score`` / ``matthews_corrcoef``): hand formulas on
edge cases and random cases to 1e-12, and scikit-learn itself when it is installed."""

import numpy as np
import pytest
import torch

from fedlight.tasks import TextClassification
from fedlight.tasks.confusion import ConfusionMetric
from fedlight.tasks.text import f1, mcc


def metric_value(fn, n, pred, true, chunks=3):
    m = ConfusionMetric(n, fn)
    for p, t in zip(np.array_split(pred, chunks), np.array_split(true, chunks)):  # summed over several batches
        m.update(torch.as_tensor(p), torch.as_tensor(t))
    return float(m.compute())


def mcc_by_covariance(pred, true, n):
    """MCC = cov(X, Y) / √(cov(X, X)·cov(Y, Y)) of the one-hot label and prediction matrices (0 if a variance is 0)."""
    x, y = np.eye(n)[true], np.eye(n)[pred]
    x, y = x - x.mean(0), y - y.mean(0)
    cxy, cxx, cyy = (x * y).sum(), (x * x).sum(), (y * y).sum()
    return 0.0 if cxx * cyy == 0 else cxy / np.sqrt(cxx * cyy)


def f1_by_counts(pred, true, n):
    """Binary: F1 of class 1; else the mean over classes in labels ∪ predictions of 2TP/(2TP + FP + FN)."""
    def one(k):
        tp = np.sum((pred == k) & (true == k))
        fp, fn = np.sum((pred == k) & (true != k)), np.sum((pred != k) & (true == k))
        return 0.0 if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)
    if n == 2:
        return one(1)
    present = sorted(set(true.tolist()) | set(pred.tolist()))
    return float(np.mean([one(k) for k in present]))


@pytest.mark.parametrize("pred, true", [
    ([0] * 8, [0, 1] * 4), ([1] * 8, [0, 1] * 4), ([0, 1] * 4, [1] * 8), ([2] * 9, [0, 1, 2] * 3),
    ([0] * 7, [0, 0, 0, 0, 1, 1, 1]), ([1] * 7, [0, 0, 0, 0, 1, 1, 1]),  # unbalanced: torchmetrics gave ±0.109
    ([1] * 1043, [1] * 721 + [0] * 322), ([0] * 1043, [1] * 721 + [0] * 322),  # CoLA's dev split: 721 / 322
])
def test_a_constant_predictor_or_a_single_class_has_mcc_0(pred, true):
    n = max(max(pred), max(true)) + 1
    assert metric_value(mcc, max(n, 2), np.array(pred), np.array(true)) == 0.0


def test_edge_cases_by_hand():
    cm = torch.tensor([[5, 0], [0, 3]])
    assert mcc(cm) == 1.0 and f1(cm) == 1.0
    assert mcc(torch.tensor([[0, 5], [3, 0]])) == -1.0 and f1(torch.tensor([[0, 5], [3, 0]])) == 0.0
    assert f1(torch.tensor([[4, 0], [0, 0]])) == 0.0  # no positive label, none predicted: 0 (scikit-learn's value)
    # tp 3, tn 4, fp 1, fn 2: (12 − 2)/√(4·5·5·6) and 2·3/(6 + 1 + 2)
    cm = torch.tensor([[4, 1], [2, 3]])
    assert mcc(cm) == pytest.approx(10 / np.sqrt(600), abs=1e-15) and f1(cm) == pytest.approx(6 / 9, abs=1e-15)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_random_cases_match_the_definitions_to_1e_12(n, seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(5, 400))
    true = rng.integers(0, n, size)
    pred = np.where(rng.random(size) < 0.6, true, rng.integers(0, n - (seed % 2), size))  # some classes unpredicted
    got_mcc, got_f1 = metric_value(mcc, n, pred, true), metric_value(f1, n, pred, true)
    assert got_mcc == pytest.approx(mcc_by_covariance(pred, true, n), abs=1e-12)
    assert got_f1 == pytest.approx(f1_by_counts(pred, true, n), abs=1e-12)
    try:
        from sklearn.metrics import f1_score, matthews_corrcoef
    except ImportError:
        return
    assert got_mcc == pytest.approx(matthews_corrcoef(true, pred), abs=1e-12)
    assert got_f1 == pytest.approx(f1_score(true, pred, average="binary" if n == 2 else "macro"), abs=1e-12)


def test_the_task_reports_them_from_logits():
    task = TextClassification(num_classes=2, headline="mcc")
    metrics = task.metrics()
    logits = torch.tensor([[2.0, 0.0]] * 6)  # always class 0
    batch = {"input_ids": torch.zeros(6, 3, dtype=torch.long), "labels": torch.tensor([0, 1, 0, 1, 0, 0])}
    task.update(metrics, None, batch, lambda m, **k: logits)
    assert float(metrics["mcc"].compute()) == 0.0 and float(metrics["f1"].compute()) == 0.0
    assert float(metrics["acc"].compute()) == pytest.approx(4 / 6)
