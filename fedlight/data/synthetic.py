"""Data that needs no files: the Synthetic(alpha, beta) benchmark and bring-your-own client tensors."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fedlight.data.base import SUBSET_TEST_TAG, FederatedDataModule, positive_int, seeded, select
from fedlight.data.partition import Partitioner
from fedlight.errors import ConfigError

SYNTHETIC_TAG = 0x5E7A  # SeedSequence([seed, SYNTHETIC_TAG]) generates the whole Synthetic dataset


def _x(a: np.ndarray) -> Tensor:
    return torch.from_numpy(a.astype(np.float32))


def _y(a: np.ndarray) -> Tensor:
    return torch.from_numpy(a.astype(np.int64))


class Synthetic(FederatedDataModule):
    """Synthetic(alpha, beta) of FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", §5.1).

    Client ``k`` has its own softmax-regression model and input distribution::

        u_k ~ N(0, alpha),  W_k ~ N(u_k, 1) [dim x C],  b_k ~ N(u_k, 1) [C]
        B_k ~ N(0, beta),   v_k ~ N(B_k, 1) [dim],      x ~ N(v_k, Sigma),  Sigma_jj = j^-1.2
        y = argmax softmax(W_k^T x + b_k)

    ``alpha`` controls how much the local models differ, ``beta`` how much the local inputs differ. As in
    the released generator, the second argument of ``N(., .)`` is used as the standard deviation.
    Client sizes follow the paper's power law, ``floor(lognormal(size_mean, size_sigma)) + min_samples``,
    capped at ``max_samples`` (or all equal to ``samples_per_client``). Each client's last
    ``test_fraction`` of samples goes to the pooled test set. The data is a pure function of the ``seed``
    passed to :meth:`setup`. Inputs are float32 features (no normalisation, no augmentation); the clients
    are given by the generator, so ``partition`` must stay unset.

    Args:
        alpha: Spread of the per-client model means ``u_k`` (model heterogeneity).
        beta: Spread of the per-client input means ``B_k`` (input heterogeneity).
        num_clients: Number of clients.
        dim: Input dimension.
        num_classes: Number of classes.
        samples_per_client: If set, every client gets exactly this many samples (train + test).
        size_mean: Mean of the log of the client sizes (paper: 4).
        size_sigma: Std of the log of the client sizes (paper: 2).
        min_samples: Added to every lognormal size (paper: 50).
        max_samples: Upper bound on a client's size.
        test_fraction: Fraction of each client's samples held out for the test set, in [0, 1).
        batch_size: Client mini-batch size (FedProx used 10).
        partition: Not used; must be ``None``.
        test_subset: Keep only this many test samples (random, seeded by the run seed).
        augment: Ignored (no augmentation for feature vectors).
        eval_batch_size: Batch size of :meth:`test_batches`.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        num_clients: int = 30,
        dim: int = 60,
        num_classes: int = 10,
        samples_per_client: int | None = None,
        size_mean: float = 4.0,
        size_sigma: float = 2.0,
        min_samples: int = 50,
        max_samples: int = 2000,
        test_fraction: float = 0.2,
        batch_size: int = 10,
        partition: Partitioner | None = None,
        test_subset: int | None = None,
        augment: bool = True,
        eval_batch_size: int = 1000,
    ):
        if partition is not None:
            raise ConfigError(
                "`data.partition` is not used by Synthetic (each client has its own generator); "
                "remove it and use `data.alpha` / `data.beta` to set the heterogeneity"
            )
        if alpha < 0 or beta < 0:
            raise ConfigError(f"`data.alpha` and `data.beta` must be >= 0, got {alpha} and {beta}")
        for name, value in (
            ("dim", dim),
            ("num_classes", num_classes),
            ("min_samples", min_samples),
            ("max_samples", max_samples),
        ):
            positive_int(name, value)
        positive_int("samples_per_client", samples_per_client, optional=True)
        if max_samples < min_samples:
            raise ConfigError(f"`data.max_samples` ({max_samples}) must be >= `data.min_samples` ({min_samples})")
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"`data.test_fraction` must be in [0, 1), got {test_fraction}")
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            test_subset=test_subset,
            augment=augment,
            eval_batch_size=eval_batch_size,
        )
        self.alpha, self.beta, self.dim = float(alpha), float(beta), dim
        self.samples_per_client, self.size_mean, self.size_sigma = samples_per_client, size_mean, size_sigma
        self.min_samples, self.max_samples, self.test_fraction = min_samples, max_samples, test_fraction
        self._num_classes, self._input_shape = num_classes, (dim,)

    def _partition_desc(self) -> str:
        return f"Synthetic(alpha={self.alpha}, beta={self.beta}) per-client generators"

    def client_sizes(self, rng: np.random.Generator) -> np.ndarray:
        """Total (train + test) samples per client."""
        n = self.num_clients
        if self.samples_per_client is not None:
            return np.full(n, self.samples_per_client)
        sizes = rng.lognormal(self.size_mean, self.size_sigma, n).astype(np.int64) + self.min_samples
        return np.minimum(sizes, self.max_samples)

    def _build(self, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[np.ndarray]]:
        rng = seeded(seed, SYNTHETIC_TAG)
        n, d, c = self.num_clients, self.dim, self._num_classes
        sizes = self.client_sizes(rng)
        u = rng.normal(0, self.alpha, n)
        big_b = rng.normal(0, self.beta, n)
        sigma_sqrt = np.arange(1, d + 1, dtype=np.float64) ** -0.6  # sqrt of Sigma_jj = j^-1.2
        train_x, train_y, test_x, test_y = [], [], [], []
        for k in range(n):
            v = rng.normal(big_b[k], 1, d)
            w = rng.normal(u[k], 1, (d, c))
            b = rng.normal(u[k], 1, c)
            x = v + rng.standard_normal((sizes[k], d)) * sigma_sqrt
            y = np.argmax(x @ w + b, axis=1)
            m = sizes[k] - int(self.test_fraction * sizes[k])
            train_x.append(x[:m])
            train_y.append(y[:m])
            test_x.append(x[m:])
            test_y.append(y[m:])
        bounds = np.cumsum([len(y) for y in train_y])
        parts = np.split(np.arange(bounds[-1]), bounds[:-1])
        tx, ty = np.concatenate(test_x), np.concatenate(test_y)
        keep = select(len(ty), self.test_subset, seeded(seed, SUBSET_TEST_TAG))
        tx, ty = (tx, ty) if keep is None else (tx[keep], ty[keep])
        return _x(np.concatenate(train_x)), _y(np.concatenate(train_y)), _x(tx), _y(ty), parts


class TensorClients(FederatedDataModule):
    """Bring your own data: one ``(x, y)`` pair of tensors per client, plus an optional global test set.

    Floating inputs are passed through as float32 (no normalisation, no augmentation), integer inputs (token ids)
    as they are; targets keep their dtype: integer class labels, float regression targets of any shape, or per-token
    int64 targets (pass the matching ``task``). Without ``test``, :meth:`test_batches` yields nothing.

    Args:
        clients: One ``(inputs [n_i, ...], labels [n_i])`` pair per client; every client needs >= 1 sample.
        test: Global test set ``(inputs, labels)``, or ``None``.
        batch_size: Client mini-batch size (the last batch of an epoch may be smaller).
        eval_batch_size: Batch size of :meth:`test_batches`.
        num_classes: Number of classes; ``None`` infers ``max label + 1``.
    """

    def __init__(
        self,
        clients: list[tuple[Tensor, Tensor]],
        test: tuple[Tensor, Tensor] | None = None,
        batch_size: int = 50,
        eval_batch_size: int = 1000,
        num_classes: int | None = None,
    ):
        if not clients:
            raise ConfigError("`clients` must be a non-empty list of (inputs, labels) tensor pairs")
        for i, (x, y) in enumerate(list(clients) + ([test] if test is not None else [])):
            name = f"client {i}" if i < len(clients) else "test"
            if len(x) != len(y):
                raise ConfigError(f"{name}: targets must have one entry per input "
                                  f"(got inputs {tuple(x.shape)}, targets {tuple(y.shape)})")
        positive_int("num_classes", num_classes, optional=True)
        super().__init__(num_clients=len(clients), batch_size=batch_size, eval_batch_size=eval_batch_size)
        self.clients, self.test = list(clients), test
        self._num_classes = num_classes
        self._input_shape = tuple(clients[0][0].shape[1:])

    def _partition_desc(self) -> str:
        return "given clients"

    def _build(self, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[np.ndarray]]:
        x = torch.cat([cx.detach().cpu() for cx, _ in self.clients])
        y = torch.cat([cy.detach().cpu() for _, cy in self.clients])
        bounds = np.cumsum([len(cy) for _, cy in self.clients])
        parts = np.split(np.arange(bounds[-1]), bounds[:-1])
        if self.test is None:
            tx, ty = x[:0], y[:0]
        else:
            tx, ty = self.test[0].detach().cpu(), self.test[1].detach().cpu()
        return x, y, tx, ty, parts
