"""Clients on CUDA streams (``loop.client_parallelism: streams``): no grouped convolution, several clients at once.

The stacked runner turns C clients' convolutions into one grouped convolution, and cuDNN's grouped kernels bound
the round on a GPU (``results/performance.md`` §6). This runner keeps each client's model as it is (plain
convolutions on its own parameters): a chunk of C clients gets C copies of the model (slots), and their local
steps are issued round-robin, step k of client 1, step k of client 2, …, each slot on its own CUDA stream, so
the small kernels of different clients can overlap on the device. On a CPU the same code runs without streams.

Exact by construction: every client runs the sequential runner's own code
(:meth:`~fedlight.runners.sequential.SequentialRunner.stepwise`) on its own copy, with its own torch generator
state (saved after each of its steps and restored before the next, so dropout draws the masks sequential training
draws), so each client's arithmetic is the sequential runner's, operation for operation. One exception: BatchNorm
with ``momentum=None`` (a cumulative average, which reads the step counter ``num_batches_tracked``): sequential
clients continue one counter through the round, while every copy here starts the chunk from the run's counter.

Ordering on the device: every slot stream first waits for the work queued before the chunk (the broadcast, the
buffers), and the caller's stream waits for every slot before the outcomes are handed on.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Iterator
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from fedlight.core.params import Params
from fedlight.core.rules import RoundInfo
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup, compile_kwargs
from fedlight.runners.guard import out_of_memory
from fedlight.runners.sequential import SequentialRunner


class StreamsRunner:
    """Trains the clients of a round in chunks of ``chunk`` (``None``: all at once), one model copy per client.

    Args:
        setup: the run's model, rule, Fabric and optimizer.
        chunk: at most this many clients at once (each one a model copy with its gradients and optimizer state).
        compile: ``torch.compile`` each copy (as the sequential runner compiles its model): ``False``, ``True``, a
            mode or a backend name.
    """

    name = "streams"

    def __init__(self, setup: TrainSetup, chunk: int | None = None, compile: bool | str = False) -> None:
        self.setup, self.chunk, self.compile = setup, chunk, compile
        self.slots: list[SequentialRunner] = []
        self.streams: list[Any] = []
        self.cuda = setup.device.type == "cuda"

    @property
    def description(self) -> str:
        return f"streams, {'compiled' if self.compile else 'eager'}" + ("" if self.cuda else " (no streams on CPU)")

    def _slots(self, n: int) -> list[SequentialRunner]:
        """``n`` slots: the run's model first, then copies of it (made once, reused every round)."""
        while len(self.slots) < n:
            model = self.setup.model if not self.slots else copy.deepcopy(self.setup.model)
            if self.compile:
                model.compile(**compile_kwargs(self.compile))
            self.slots.append(SequentialRunner(replace(self.setup, model=model)))
            self.streams.append(torch.cuda.Stream(self.setup.device) if self.cuda else None)
        return self.slots[:n]

    def train(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> Iterator[ClientOutcome]:
        size = self.chunk or len(jobs)
        for pos in range(0, len(jobs), size):
            part = jobs[pos : pos + size]
            try:
                outs = self.train_chunk(part, info, buffers)
            except torch.OutOfMemoryError:
                raise out_of_memory("streams", part[0].client_id, self.setup.device) from None
            yield from outs  # job order, so float64 sums match the sequential runner's

    def train_chunk(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> list[ClientOutcome]:
        """The chunk's clients, one step each in turn, until every one has finished."""
        dev = self.setup.device
        slots = self._slots(len(jobs))
        streams = self.streams[: len(jobs)]
        counters = _counters(self.setup.model)
        for slot in slots[1:]:  # the copies count BatchNorm steps from the run's model (see the module docstring)
            for mine, run in zip(_counters(slot.setup.model), counters, strict=True):
                mine.copy_(run)
        caller = torch.cuda.current_stream(dev) if self.cuda else None
        for st in streams:
            if st is not None:
                st.wait_stream(caller)
        runs: list[Generator[None, None, ClientOutcome]] = [
            slot.stepwise(job, info, buffers) for slot, job in zip(slots, jobs, strict=True)]
        rng: list[tuple | None] = [None] * len(jobs)
        done: list[ClientOutcome | None] = [None] * len(jobs)
        while any(d is None for d in done):
            for i, run in enumerate(runs):
                if done[i] is None:
                    rng[i], done[i] = _advance(run, rng[i], streams[i], dev)
        if caller is not None:
            for st in streams:
                caller.wait_stream(st)
        return done


def _counters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]


def _advance(run: Generator, state: tuple | None, stream: Any, dev: torch.device) -> tuple[tuple, Any]:
    """One step of one client on its stream with its generator state; its outcome once it has finished."""
    if state is not None:  # None: the client's first step, which seeds its generator itself
        _set_rng(state, dev)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        try:
            next(run)
            result = None
        except StopIteration as finished:
            result = finished.value
    return _get_rng(dev), result


def _get_rng(dev: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None


def _set_rng(state: tuple, dev: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], dev)
