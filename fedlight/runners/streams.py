"""Clients on CUDA streams with CUDA graphs (``loop.client_parallelism: streams``): for the models that cannot run
stacked exactly.

A chunk of C clients gets C copies of the model (slots), each compiled with CUDA graphs (``reduce-overhead``), and
their local steps are issued round-robin, step k of client 1, step k of client 2, …, each slot on its own CUDA
stream, so the kernels of different clients overlap on the device. On an H200 (issue 42, ResNet-18, 10 clients)
this took 2.15 s a round against 5.77 s for the compiled sequential runner, but 1.17 s for the stacked runner: its
place is the models the stacked runner cannot train exactly, those with dropout, where each client here draws the
masks sequential training draws. Without CUDA graphs it never paid (7.05 s eager, 5.97 s compiled: slower than the
sequential runner), so on CUDA it runs only with them (:func:`streams_compile`). On a CPU the same code runs without
streams or graphs (with ``loop.compile``'s backend), which is how the tests reach it.

Exact by construction: every client runs the sequential runner's own code
(:meth:`~fedlight.runners.sequential.SequentialRunner.stepwise`) on its own copy, with its own torch generator
state (saved after each of its steps and restored before the next, so dropout draws the masks sequential training
draws), so each client's arithmetic is the sequential runner's, operation for operation. One exception: BatchNorm
with ``momentum=None`` (a cumulative average, which reads the step counter ``num_batches_tracked``): sequential
clients continue one counter through the round, while every copy here starts the chunk from the run's counter.

The round-robin, the streams, the generator states and the ordering on the device are
:func:`fedlight.runners.interleave.interleave`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace

import torch

from fedlight.core.params import Params
from fedlight.core.rules import RoundInfo
from fedlight.errors import ConfigError
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup, compile_kwargs
from fedlight.runners.guard import out_of_memory
from fedlight.runners.interleave import Streams, interleave, values
from fedlight.runners.sequential import SequentialRunner


def streams_compile(compile: bool | str | None, device: torch.device) -> bool | str:
    """``loop.compile`` for the streams route: on CUDA only ``reduce-overhead`` (the default there; anything else is
    refused before training, with the measurement that says why); elsewhere as given (no graphs to add)."""
    if device.type != "cuda":
        return compile or False
    if compile in (None, "reduce-overhead"):
        return "reduce-overhead"
    raise ConfigError("`loop.client_parallelism: streams` runs with CUDA graphs only (`loop.compile: "
                      f"reduce-overhead`, its default), not `loop.compile: {compile}`: without graphs it was slower "
                      "than the sequential runner on an H200 (7.05 s eager, 5.97 s compiled, 5.77 s sequential "
                      "compiled; results/performance.md §6). Drop `loop.compile` or use `loop.client_parallelism: "
                      "sequential`")


class StreamsRunner:
    """Trains the clients of a round in chunks of ``chunk`` (``None``: all at once), one model copy per client.

    Args:
        setup: the run's model, rule, Fabric and optimizer.
        chunk: at most this many clients at once (each one a model copy with its gradients and optimizer state).
        compile: ``torch.compile`` each copy (as the sequential runner compiles its model): ``reduce-overhead`` on
            CUDA (:func:`streams_compile`); on a CPU ``False``, ``True`` or a backend name.
    """

    name = "streams"

    def __init__(self, setup: TrainSetup, chunk: int | None = None, compile: bool | str = False) -> None:
        self.setup, self.chunk, self.compile = setup, chunk, compile
        self.slots: list[SequentialRunner] = []
        self.streams = Streams(setup.device)
        self.cuda = setup.device.type == "cuda"

    @property
    def description(self) -> str:
        if self.cuda:
            return "streams, CUDA graphs"
        how = "compiled" if self.compile else "eager"
        return f"streams, {how} (no streams or CUDA graphs on {self.setup.device.type})"

    def _slots(self, n: int) -> list[SequentialRunner]:
        """``n`` slots: the run's model first, then copies of it (made once, reused every round)."""
        while len(self.slots) < n:
            model = self.setup.model if not self.slots else copy.deepcopy(self.setup.model)
            if self.compile:
                model.compile(**compile_kwargs(self.compile))
            self.slots.append(SequentialRunner(replace(self.setup, model=model)))
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
        counters = _counters(self.setup.model)
        for slot in slots[1:]:  # the copies count BatchNorm steps from the run's model (see the module docstring)
            for mine, run in zip(_counters(slot.setup.model), counters, strict=True):
                mine.copy_(run)
        return values(interleave([slot.stepwise(job, info, buffers) for slot, job in zip(slots, jobs, strict=True)],
                                 self.streams.take(len(jobs)), dev))


def _counters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
