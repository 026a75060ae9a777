"""A train loader's own ``batch_sampler`` (UvA-DL tutorial 12's ``FewShotBatchSampler``: N classes × K shots, support
and query in each batch) as the client's batches: the sampler decides which samples form each batch, as Lightning's
Trainer iterates it. Its random choices (``torch`` and ``random``, as such samplers draw them) are seeded from the
client's generator, so a round's batches do not depend on what ran before (resume, processes)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch


def is_own(loader: Any) -> bool:
    """Whether ``loader`` was given a ``batch_sampler`` (a DataLoader built with ``batch_size`` has none of its own)."""
    return getattr(loader, "batch_size", 1) is None and getattr(loader, "batch_sampler", None) is not None


def sampled_batches(sampler: Any, num_steps: int, generator: torch.Generator) -> Iterator[list]:
    """The index lists of ``num_steps`` batches: the sampler's epochs one after another (each ``iter`` a new epoch, as
    Lightning starts one), under a seed drawn from ``generator``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            taken = 0
            while taken < num_steps:
                before = taken
                for indices in sampler:
                    yield [int(i) for i in indices]
                    taken += 1
                    if taken == num_steps:
                        break
                if taken == before:
                    return  # an empty sampler: nothing to yield
        finally:
            random.setstate(state)
