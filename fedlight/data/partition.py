"""Partitioners: split a labelled training set over clients.

Each partitioner is a pure function of ``(labels, num_clients, rng)`` and returns one sorted index
array per client. ``repr(partitioner)`` lists every setting, so it keys the partition cache.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from fedlight.data.cache import cached, digest
from fedlight.errors import ConfigError

PARTITION_TAG = 0x9A27  # SeedSequence([seed, PARTITION_TAG]) seeds every partition


class Partitioner:
    """Base class: ``__call__(labels, num_clients, rng) -> list of sorted index arrays``."""

    needs_labels: bool = True
    """Whether the split reads class labels (a data set without them is refused before training)."""

    def __call__(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Split the indices ``0..len(labels)-1`` over ``num_clients`` clients."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(repr(self))


def _class_pools(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """One shuffled index array per class present in ``labels`` (classes in sorted order)."""
    _, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    pools = np.split(order, np.cumsum(np.bincount(inverse))[:-1])
    return [rng.permutation(pool) for pool in pools]


def _dirichlet(alpha: float, k: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` draws of Dir(alpha * 1_k); a row that underflows to zero (tiny alpha) becomes one-hot."""
    p = np.nan_to_num(rng.dirichlet(np.full(k, alpha), size=rows))
    for r in np.flatnonzero(p.sum(1) <= 0):
        p[r] = np.eye(k)[rng.integers(k)]
    return p


class IID(Partitioner):
    """Shuffle and split into equal parts (sizes differ by at most one)."""

    needs_labels = False

    def __call__(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


class QuantitySkew(Partitioner):
    """IID samples, unequal client sizes: the shares ``q ~ Dir(alpha·1_N)`` of a shuffled train set, each client
    given at least one sample (label-free, so it suits regression and token data too).

    Args:
        alpha: concentration; small values give very unequal sizes, large ones nearly equal.
    """

    needs_labels = False

    def __init__(self, alpha: float):
        if not alpha > 0:
            raise ConfigError(f"`data.partition.alpha` must be positive, got {alpha!r}")
        self.alpha = float(alpha)

    def __call__(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        n = len(labels)
        q = rng.dirichlet(np.full(num_clients, self.alpha))
        sizes = 1 + np.floor(q * (n - num_clients)).astype(np.int64)
        sizes[np.argsort(-q, kind="stable")[: n - int(sizes.sum())]] += 1  # hand out the rounding remainder
        cuts = np.cumsum(sizes)[:-1]
        return [np.sort(part) for part in np.split(rng.permutation(n), cuts)]


class Dirichlet(Partitioner):
    """Label skew from a Dirichlet distribution.

    ``by="client"`` (the convention of the seed papers' code): client ``j`` draws a class mix
    ``p_j ~ Dir(alpha * 1_C)`` and receives ``n // N`` samples (the first ``n % N`` clients one more);
    clients are filled in order, each sample's class drawn from ``p_j`` restricted (renormalised) to the
    classes that still have samples, so the result is a true partition (every sample exactly once). The
    last clients take what is left, so their mix can stray from ``p_j``; if ``p_j`` has no mass left on the
    remaining classes, the class is drawn uniformly among them.
    ``with_replacement=True`` mimics the released code: an exhausted class pool is reshuffled and reused,
    so a sample may appear in several clients, or twice in one (the result is then not a partition).

    ``by="class"`` (Hsu et al. 2019): each class is spread over the clients by ``Dir(alpha * 1_N)``, so
    client sizes differ. The draw is repeated (at most ``max_retries`` times) until every client has at
    least ``min_size`` samples, else :class:`ConfigError`.

    Args:
        alpha: Concentration; small values give strong skew, large values approach IID.
        by: ``"client"`` (per-client class mix, equal sizes) or ``"class"`` (per-class client mix).
        with_replacement: ``by="client"`` only: reuse exhausted class pools as the released code does.
        min_size: ``by="class"`` only: smallest acceptable client size.
        max_retries: ``by="class"`` only: how many draws to try before giving up.
    """

    def __init__(
        self,
        alpha: float,
        by: Literal["client", "class"] = "client",
        with_replacement: bool = False,
        min_size: int = 10,
        max_retries: int = 100,
    ):
        if not alpha > 0:
            raise ConfigError(f"`alpha` must be > 0 (small = skewed, large = near IID), got {alpha}")
        if by not in ("client", "class"):
            raise ConfigError(f"`by` must be 'client' or 'class', got {by!r}")
        if min_size < 0 or max_retries < 1:
            raise ConfigError(f"`min_size` must be >= 0 and `max_retries` >= 1, got {min_size} and {max_retries}")
        self.alpha = float(alpha)
        self.by = by
        self.with_replacement = bool(with_replacement)
        self.min_size = int(min_size)
        self.max_retries = int(max_retries)

    def __call__(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        if self.by == "class":
            return self._by_class(labels, num_clients, rng)
        return self._by_client(labels, num_clients, rng)

    def _by_client(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        pools = _class_pools(labels, rng)
        num_classes = len(pools)
        priors = _dirichlet(self.alpha, num_classes, num_clients, rng)
        quotas = np.full(num_clients, len(labels) // num_clients)
        quotas[: len(labels) % num_clients] += 1
        sizes = np.array([len(p) for p in pools])
        ptr = np.zeros(num_classes, dtype=np.int64)  # next unused position in each pool
        parts = []
        for j in range(num_clients):
            if self.with_replacement:
                counts = rng.multinomial(quotas[j], priors[j])
            else:
                counts = np.zeros(num_classes, dtype=np.int64)
                need = int(quotas[j])
                while need > 0:  # multinomial + clip + redraw == sequential draws restricted to open classes
                    room = sizes - ptr - counts
                    p = priors[j] * (room > 0)
                    p = p if p.sum() > 0 else (room > 0).astype(float)
                    take = np.minimum(rng.multinomial(need, p / p.sum()), room)
                    counts += take
                    need -= int(take.sum())
            chunks = []
            for c in np.flatnonzero(counts):
                k = int(counts[c])
                while k > 0:  # without replacement this loop runs once per class
                    if ptr[c] == sizes[c]:
                        pools[c] = rng.permutation(pools[c])
                        ptr[c] = 0
                    t = min(k, int(sizes[c] - ptr[c]))
                    chunks.append(pools[c][ptr[c] : ptr[c] + t])
                    ptr[c] += t
                    k -= t
            parts.append(np.sort(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.int64))
        return parts

    def _by_class(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        n = len(labels)
        fix = "lower `min_size`, raise `alpha`, or use fewer `num_clients`"
        if self.min_size * num_clients > n:
            raise ConfigError(
                f"Dirichlet(by='class'): `min_size`={self.min_size} x `num_clients`={num_clients} exceeds the "
                f"{n} training samples; {fix}"
            )
        pools = _class_pools(labels, rng)
        class_sizes = np.array([len(p) for p in pools])
        smallest = 0
        for _ in range(self.max_retries):
            q = _dirichlet(self.alpha, num_clients, len(pools), rng)  # [C, N]: class c's share per client
            cuts = np.floor(np.cumsum(q, axis=1) * class_sizes[:, None]).astype(np.int64)
            cuts[:, -1] = class_sizes
            counts = np.diff(cuts, axis=1, prepend=0)  # [C, N]
            smallest = int(counts.sum(0).min())
            if smallest >= self.min_size:
                parts = [[] for _ in range(num_clients)]
                for pool, row in zip(pools, cuts):
                    for j, chunk in enumerate(np.split(pool, row[:-1])):
                        parts[j].append(chunk)
                return [np.sort(np.concatenate(p)) for p in parts]
        raise ConfigError(
            f"Dirichlet(alpha={self.alpha}, by='class') gave some client fewer than `min_size`={self.min_size} "
            f"samples in all {self.max_retries} tries (best smallest client: {smallest}) with `num_clients`="
            f"{num_clients}; {fix}"
        )


class Pathological(Partitioner):
    """Each client holds ``classes_per_client`` classes (McMahan et al. 2017-style shards).

    Classes are dealt round-robin from a random class order, so each class is held by about
    ``N * classes_per_client / C`` clients, and each class's samples are split evenly among the clients
    holding it; client sizes are then about equal. When ``N * classes_per_client < C`` some classes are
    held by nobody, so the result covers only part of the training set.

    Args:
        classes_per_client: Number of distinct classes per client, in ``[1, num_classes]``.
    """

    def __init__(self, classes_per_client: int):
        if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, int) or classes_per_client < 1:
            raise ConfigError(f"`classes_per_client` must be a positive integer, got {classes_per_client!r}")
        self.classes_per_client = classes_per_client

    def __call__(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        pools = _class_pools(labels, rng)
        k, num_classes = self.classes_per_client, len(pools)
        if k > num_classes:
            raise ConfigError(
                f"`classes_per_client` ({k}) exceeds the number of classes in the training set ({num_classes})"
            )
        class_order = rng.permutation(num_classes)
        client_order = rng.permutation(num_clients)
        holders: list[list[int]] = [[] for _ in range(num_classes)]
        for slot in range(num_clients * k):  # k consecutive slots mod C are distinct classes
            holders[class_order[slot % num_classes]].append(int(client_order[slot // k]))
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for pool, owners in zip(pools, holders):
            for owner, chunk in zip(owners, np.array_split(pool, len(owners)) if owners else []):
                parts[owner].append(chunk)
        return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]


def partition_cached(partitioner: Partitioner, labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Run ``partitioner`` with ``np.random.default_rng(SeedSequence([seed, PARTITION_TAG]))``, cached on disk.

    The cache key is a hash of (labels, num_clients, repr(partitioner), seed).
    """

    def build() -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(np.random.SeedSequence([seed, PARTITION_TAG]))
        parts = partitioner(labels, num_clients, rng)
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return {
            "indices": torch.from_numpy(flat.astype(np.int64)),
            "sizes": torch.tensor([len(p) for p in parts], dtype=torch.int64),
        }

    key = digest("partition-v1", np.asarray(labels), num_clients, repr(partitioner), seed)
    out = cached("partitions", key, build)
    flat = out["indices"].numpy()
    return np.split(flat, np.cumsum(out["sizes"].numpy())[:-1])
