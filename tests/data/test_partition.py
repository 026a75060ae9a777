"""Partitioner invariants: sizes, disjointness/coverage, determinism, skew, bounded retries, caching."""

import time

import numpy as np
import pytest

from fedlight.data import IID, Dirichlet, Pathological
from fedlight.data.partition import PARTITION_TAG, partition_cached
from fedlight.errors import ConfigError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path / "cache"))


def balanced_labels(n=6000, num_classes=10, seed=0):
    return np.random.default_rng(seed).permutation(np.arange(n) % num_classes)


def rng(seed=0):
    return np.random.default_rng(seed)


def histogram(labels, parts, num_classes=10):
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def assert_partition(parts, n):
    """Every index in exactly one client, each client's array sorted."""
    flat = np.concatenate(parts)
    assert len(flat) == n
    assert np.array_equal(np.sort(flat), np.arange(n))
    assert all(np.all(np.diff(p) >= 0) for p in parts)


def test_iid_equal_split_and_partition():
    labels = balanced_labels(1003)
    parts = IID()(labels, 10, rng())
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert_partition(parts, 1003)


@pytest.mark.parametrize("alpha", [0.01, 0.1, 0.5, 10.0])
def test_dirichlet_by_client_equal_sizes_true_partition(alpha):
    labels = balanced_labels(6003)
    parts = Dirichlet(alpha)(labels, 100, rng(1))
    sizes = np.array([len(p) for p in parts])
    assert np.array_equal(sizes, np.array([61] * 3 + [60] * 97))  # n // N, remainder +1 on the first clients
    assert_partition(parts, 6003)


def test_dirichlet_with_replacement_duplicates_allowed():
    labels = balanced_labels(6000)
    parts = Dirichlet(0.05, with_replacement=True)(labels, 100, rng(2))
    assert all(len(p) == 60 for p in parts)
    flat = np.concatenate(parts)
    assert flat.min() >= 0 and flat.max() < 6000
    assert len(np.unique(flat)) < len(flat)  # skewed demand exhausts some class pools, which are reused


@pytest.mark.parametrize(
    "partitioner",
    [IID(), Dirichlet(0.3), Dirichlet(0.3, with_replacement=True), Dirichlet(0.3, by="class"), Pathological(2)],
    ids=repr,
)
def test_seed_determinism(partitioner):
    labels = balanced_labels(3000)
    a, b, c = (partitioner(labels, 20, rng(s)) for s in (7, 7, 8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_large_alpha_is_near_uniform_small_alpha_is_skewed():
    labels = balanced_labels(10000)
    flat = histogram(labels, Dirichlet(1e5)(labels, 20, rng(3))) / 500
    assert np.abs(flat[:-3] - 0.1).max() < 0.06  # the last clients take what is left of the pools
    assert np.abs(flat - 0.1).mean() < 0.02
    reused = histogram(labels, Dirichlet(1e5, with_replacement=True)(labels, 20, rng(3))) / 500
    assert np.abs(reused - 0.1).max() < 0.06
    skewed = histogram(labels, Dirichlet(0.05)(labels, 20, rng(3))) / 500
    assert (skewed > 0.05).sum(1).mean() < 3  # a few dominant classes per client
    assert skewed.max(1).mean() > 0.5


def test_dirichlet_by_class_partition_min_size_unequal():
    labels = balanced_labels(5000)
    parts = Dirichlet(0.5, by="class", min_size=20)(labels, 20, rng(4))
    sizes = np.array([len(p) for p in parts])
    assert_partition(parts, 5000)
    assert sizes.min() >= 20 and sizes.max() > sizes.min()


def test_dirichlet_by_class_impossible_min_size_raises_quickly():
    labels = balanced_labels(1000)
    with pytest.raises(ConfigError, match="min_size"):  # more than n in total: refused before any draw
        Dirichlet(0.5, by="class", min_size=200)(labels, 10, rng())
    start = time.process_time()  # this process's CPU seconds: a loaded machine's waits do not count
    with pytest.raises(ConfigError) as err:  # possible in principle, hopeless in practice
        Dirichlet(0.01, by="class", min_size=19, max_retries=50)(labels, 50, rng())
    assert time.process_time() - start < 5
    assert all(word in str(err.value) for word in ("min_size", "alpha", "num_clients", "50 tries"))


@pytest.mark.parametrize("alpha", [0, -1.0])
def test_dirichlet_alpha_must_be_positive(alpha):
    with pytest.raises(ConfigError, match="`alpha` must be > 0"):
        Dirichlet(alpha)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
def test_pathological_classes_per_client(k):
    labels = balanced_labels(6000)
    parts = Pathological(k)(labels, 20, rng(5))
    hist = histogram(labels, parts)
    assert np.all((hist > 0).sum(1) == k)
    assert_partition(parts, 6000)  # 20 * k >= 10 classes: every class is held by someone
    sizes = hist.sum(1)
    assert sizes.max() <= 1.5 * sizes.min()


def test_pathological_validation():
    with pytest.raises(ConfigError, match="classes_per_client"):
        Pathological(0)
    with pytest.raises(ConfigError, match="classes_per_client"):
        Pathological(11)(balanced_labels(100), 5, rng())


def test_partition_cache_matches_direct_call_and_is_reused(tmp_path):
    labels = balanced_labels(2000)
    direct = Dirichlet(0.5)(labels, 10, np.random.default_rng(np.random.SeedSequence([3, PARTITION_TAG])))
    first = partition_cached(Dirichlet(0.5), labels, 10, seed=3)
    files = list((tmp_path / "cache" / "partitions").iterdir())
    assert len(files) == 1 and files[0].suffix == ".pt"  # atomic write leaves no temp file behind
    second = partition_cached(Dirichlet(0.5), labels, 10, seed=3)
    other = partition_cached(Dirichlet(0.5), labels, 10, seed=4)
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(direct, first, second))
    assert len(list((tmp_path / "cache" / "partitions").iterdir())) == 2
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_repr_lists_settings():
    assert repr(Dirichlet(0.5, by="class")) == (
        "Dirichlet(alpha=0.5, by='class', with_replacement=False, min_size=10, max_retries=100)"
    )
    assert Dirichlet(0.5) == Dirichlet(0.5) and Dirichlet(0.5) != Dirichlet(0.6)
