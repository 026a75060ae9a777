"""Pausable trainings advanced in turn (:mod:`fedlight.runners.interleave`, issue 57): each draws from its own torch
generator state and its own context variables, as if it ran alone; one that fails leaves the others going."""

from __future__ import annotations

import pytest
import torch
from fedtest import DEVICES

from fedlight.core import params as P
from fedlight.runners.interleave import Streams, get_rng, interleave, values


def _draws(seed: int, steps: int, dev: str, stacked: bool = False):
    """Seeds torch on its first step (as a runner seeds from its first client), then draws once per step; in
    ``stacked`` it pauses inside :func:`~fedlight.core.params.stacked` and checks it stays so."""
    torch.manual_seed(seed)
    out = []
    with P.stacked() if stacked else _plain():
        for _ in range(steps):
            assert P.in_stacked() is stacked
            out.append(torch.rand(3, device=dev) + torch.randn(2, device=dev).sum())
            yield
    return torch.cat(out)


class _plain:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_runs_draw_and_end_as_alone(device):
    dev = torch.device(device)
    alone = []
    for seed, steps in ((1, 4), (2, 2), (3, 5)):
        gen = _draws(seed, steps, device, stacked=seed == 2)
        try:
            while True:
                next(gen)
        except StopIteration as end:
            alone.append((end.value, get_rng(dev)))
    ends = interleave([_draws(1, 4, device), _draws(2, 2, device, True), _draws(3, 5, device)],
                      Streams(dev).take(3), dev)
    for (value, rng), end in zip(alone, ends, strict=True):
        assert end.error is None and torch.equal(end.value, value)
        assert torch.equal(end.rng[0], rng[0]) and (rng[1] is None or torch.equal(end.rng[1], rng[1]))
    assert not P.in_stacked()


def test_a_failing_run_ends_alone_and_an_interrupt_closes_every_run():
    def failing():
        yield
        raise RuntimeError("planted")

    ends = interleave([failing(), _draws(0, 3, "cpu")], [None, None], torch.device("cpu"))
    assert isinstance(ends[0].error, RuntimeError) and ends[1].error is None and ends[1].value.shape == (9,)
    with pytest.raises(RuntimeError, match="planted"):
        values(ends)

    closed = []

    def guarded(i, stop_at=None):
        try:
            for k in range(5):
                if k == stop_at:
                    raise KeyboardInterrupt
                yield
        finally:
            closed.append(i)

    with pytest.raises(KeyboardInterrupt):
        interleave([guarded(0), guarded(1, stop_at=2), guarded(2)], [None] * 3, torch.device("cpu"))
    assert sorted(closed) == [0, 1, 2]
