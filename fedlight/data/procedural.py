"""Procedural data for the tasks beyond classification (no files needed): a heterogeneous linear-regression
benchmark and per-client Markov-chain text for character-level language modelling.

Both are pure functions of the seed passed to :meth:`setup` and define their own clients (the natural split);
``partition`` is not used.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlight.data.base import FederatedDataModule, positive_int, seeded
from fedlight.errors import ConfigError

REGRESSION_TAG = 0x5E7B
TEXT_TAG = 0x5E7C


def _split(per_client: list[tuple[np.ndarray, np.ndarray]], test_fraction: float):
    """Train/test tensors and client index arrays from per-client ``(x, y)`` arrays (each client's tail is test)."""
    tr_x, tr_y, te_x, te_y, parts, at = [], [], [], [], [], 0
    for x, y in per_client:
        n_test = int(round(test_fraction * len(x)))
        cut = len(x) - n_test
        tr_x.append(x[:cut])
        tr_y.append(y[:cut])
        te_x.append(x[cut:])
        te_y.append(y[cut:])
        parts.append(np.arange(at, at + cut))
        at += cut
    cat = np.concatenate
    return (torch.from_numpy(cat(tr_x)), torch.from_numpy(cat(tr_y)), torch.from_numpy(cat(te_x)),
            torch.from_numpy(cat(te_y)), parts)


def _check_fraction(test_fraction: float) -> None:
    if not 0 <= test_fraction < 1:
        raise ConfigError(f"`data.test_fraction` must be in [0, 1), got {test_fraction!r}")


class SyntheticRegression(FederatedDataModule):
    """Heterogeneous linear regression, in the spirit of Synthetic(alpha, beta): client ``k`` has its own model
    and inputs::

        u_k ~ N(0, alpha),  w_k ~ N(u_k, 1) [dim],  b_k ~ N(u_k, 1)
        B_k ~ N(0, beta),   v_k ~ N(B_k, 1) [dim],  x ~ N(v_k, I)
        y = w_k·x / sqrt(dim) + b_k + noise·ε        (float32 targets, shape [n])

    Trained with :class:`fedlight.tasks.Regression` (its default task): MSE / MAE / R².

    Args:
        num_clients: Number of clients.
        dim: Input dimension.
        alpha: Spread of the per-client models (model heterogeneity).
        beta: Spread of the per-client input means (input heterogeneity).
        samples_per_client: Samples per client (train + test).
        noise: Standard deviation of the target noise.
        test_fraction: Each client's share held out for the pooled test set.
        batch_size: Client mini-batch size.
        eval_batch_size: Batch size of the test batches.
    """

    def __init__(self, num_clients: int = 20, dim: int = 10, alpha: float = 0.5, beta: float = 0.5,
                 samples_per_client: int = 100, noise: float = 0.1, test_fraction: float = 0.2, batch_size: int = 10,
                 eval_batch_size: int = 1000) -> None:
        positive_int("dim", dim)
        positive_int("samples_per_client", samples_per_client)
        _check_fraction(test_fraction)
        super().__init__(num_clients=num_clients, batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.dim, self.alpha, self.beta, self.noise = dim, alpha, beta, noise
        self.samples_per_client, self.test_fraction = samples_per_client, test_fraction
        self._input_shape = (dim,)

    def default_task(self):
        from fedlight.tasks import Regression

        return Regression()

    def _partition_desc(self) -> str:
        return f"SyntheticRegression(alpha={self.alpha}, beta={self.beta}) natural clients"

    def _build(self, seed: int):
        rng = seeded(seed, REGRESSION_TAG)
        clients = []
        for _ in range(self.num_clients):
            u, B = rng.normal(0, self.alpha), rng.normal(0, self.beta)
            w, b = rng.normal(u, 1, self.dim), rng.normal(u, 1)
            x = rng.normal(rng.normal(B, 1, self.dim), 1, (self.samples_per_client, self.dim))
            y = x @ w / np.sqrt(self.dim) + b + self.noise * rng.standard_normal(self.samples_per_client)
            clients.append((x.astype(np.float32), y.astype(np.float32)))
        return _split(clients, self.test_fraction)


class MarkovText(FederatedDataModule):
    """Character-level text from per-client Markov chains: every client mixes a shared transition matrix with its
    own (``skew`` sets how far apart clients' "dialects" are), and emits sequences of ``seq_len + 1`` tokens.

    A sample is ``(x, y)`` with int64 ``x = s[:-1]`` and per-token targets ``y = s[1:]``; trained with
    :class:`fedlight.tasks.LanguageModeling` (its default task): perplexity and token accuracy. The best possible
    perplexity is the chain's entropy rate, so a model's distance to it is readable.

    Args:
        num_clients: Number of clients.
        vocab_size: Number of distinct tokens.
        seq_len: Tokens per input sequence.
        sequences_per_client: Sequences per client (train + test).
        skew: Weight of each client's own transitions against the shared ones (0: IID clients).
        concentration: Dirichlet concentration of each transition row (small: predictable text).
        test_fraction: Each client's share held out for the pooled test set.
        batch_size: Client mini-batch size.
        eval_batch_size: Batch size of the test batches.
    """

    def __init__(self, num_clients: int = 20, vocab_size: int = 16, seq_len: int = 32, sequences_per_client: int = 40,
                 skew: float = 1.0, concentration: float = 0.2, test_fraction: float = 0.2, batch_size: int = 8,
                 eval_batch_size: int = 256) -> None:
        positive_int("vocab_size", vocab_size)
        positive_int("seq_len", seq_len)
        positive_int("sequences_per_client", sequences_per_client)
        _check_fraction(test_fraction)
        super().__init__(num_clients=num_clients, batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.vocab_size, self.seq_len, self.sequences_per_client = vocab_size, seq_len, sequences_per_client
        self.skew, self.concentration, self.test_fraction = skew, concentration, test_fraction
        self._input_shape = (seq_len,)

    def default_task(self):
        from fedlight.tasks import LanguageModeling

        return LanguageModeling()

    def _partition_desc(self) -> str:
        return f"MarkovText(skew={self.skew}) natural clients"

    def _build(self, seed: int):
        rng = seeded(seed, TEXT_TAG)
        V = self.vocab_size
        shared = rng.dirichlet(np.full(V, self.concentration), V)
        clients = []
        for _ in range(self.num_clients):
            own = rng.dirichlet(np.full(V, self.concentration), V)
            T = (shared + self.skew * own) / (1 + self.skew)
            seqs = _chain(T, rng, self.sequences_per_client, self.seq_len + 1)
            clients.append((seqs[:, :-1], seqs[:, 1:]))
        return _split(clients, self.test_fraction)


def _chain(T: np.ndarray, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """``n`` int64 sequences of ``length`` tokens from the chain ``T`` (uniform first token)."""
    V = len(T)
    cum = np.cumsum(T, axis=1)
    out = np.empty((n, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, V, n)
    for t in range(1, length):
        u = rng.random(n)
        out[:, t] = np.minimum((cum[out[:, t - 1]] < u[:, None]).sum(1), V - 1)
    return out

