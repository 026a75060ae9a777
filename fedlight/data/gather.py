"""The device data path of stacked clients: the images once on the device, and one gather per stacked step.

:func:`fedlight.data.device_copy.on_device` keeps one device copy of a uint8 image tensor per process, whatever run
loads the same images (the runs of a lockstep group share it). :func:`plan` draws one client's batches exactly as
:meth:`FederatedDataModule.client_batches <fedlight.data.base.FederatedDataModule.client_batches>` does (the same
``randperm`` per epoch, then the augmentation parameters, from the client's own CPU generator) but returns them as
rows of the train set; :func:`stacked_batches` turns the plans of a chunk's clients into one gather, one batched
augmentation and one conversion per step. Every operation is per sample, so a stacked batch holds bitwise the batches
the clients would have drawn one by one (``tests/data/test_gather.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor


def supports(data) -> bool:
    """Whether ``data`` builds its batches with the base class's code (the only batches :func:`plan` reproduces)."""
    from fedlight.data.base import FederatedDataModule

    base = FederatedDataModule
    return isinstance(data, base) and all(getattr(type(data), m) is getattr(base, m) for m in
                                          ("client_batches", "step_order", "to_input", "_gather"))


def plan(data, client_id: int, num_steps: int, generator: torch.Generator) -> tuple[Tensor, Tensor | None, list]:
    """A client's ``num_steps`` batches as CPU tensors: the train-set rows of all its batches one after another
    ``[T]``, their augmentation parameters ``[T, w]`` (``None`` without augmentation) and the batch sizes, drawn from
    ``generator`` as ``client_batches`` draws them."""
    order, bounds = data.step_order(client_id, num_steps, generator)
    aug = data.augmentation if data.augment else None
    params = aug.sample(bounds[-1][1], generator) if aug is not None else None
    rows = torch.from_numpy(data._parts[client_id])[order]
    steps = [slice(a, b) for a, b in bounds]
    return (torch.cat([rows[s] for s in steps]),
            None if params is None else torch.cat([params[s] for s in steps]), [b - a for a, b in bounds])


def stacked_batches(data, plans: Sequence[tuple[Tensor, Tensor | None, list]]) -> Iterator[tuple[Tensor, Tensor]]:
    """The stacked batches ``(x [C, B, ...], y [C, B, ...])`` of the clients whose :func:`plan` s are given (equal
    batch sizes): per step one gather of the ``C·B`` rows, one augmentation, one conversion to model inputs."""
    dev = data.device
    rows = torch.stack([p[0] for p in plans]).to(dev)  # [C, T]: one copy for the chunk
    aug = data.augmentation if data.augment else None
    params = torch.stack([p[1] for p in plans]).to(dev) if aug is not None else None
    C, start = len(plans), 0
    for size in plans[0][2]:
        r = rows[:, start:start + size].reshape(-1)
        x = data._gather(data._train_x, r)
        if params is not None:
            x = aug.apply(x, params[:, start:start + size].reshape(C * size, -1))
        x, y = data.to_input(x), data._train_y[r]
        start += size
        yield _split(x, C), y.view(C, size, *y.shape[1:])


def _split(x: Tensor, C: int) -> Tensor:
    """``[C·B, ...]`` → ``[C, B, ...]`` as a view: the strides ``torch.stack`` of the ``C`` batches gives (each client's
    batch keeps its layout, channels-last included), so the stacked forward sees what it sees today."""
    return x.view(C, -1, *x.shape[1:])
