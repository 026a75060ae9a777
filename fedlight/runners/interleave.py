"""Several pausable trainings advanced in turn, one step each, each on its own CUDA stream.

A *pausable training* is a generator that pauses (``yield``) after each step and returns its result: a runner's
``stepwise`` or :meth:`~fedlight.runners.stacked.StackedRunner.train_steps`. :func:`interleave` advances several of
them round-robin, step k of the first, step k of the second, …, each with its own

* CUDA stream (on CUDA): the host issues the next one's kernels while the device still runs the last one's, and
  kernels of different streams may run side by side;
* torch generator state (CPU and the device's), saved after each of its steps and restored before the next, so
  each draws what it would draw alone (each training seeds its generator itself on its first step);
* :mod:`contextvars` context, so a training paused inside a ``with`` block of context variables
  (:func:`fedlight.core.params.stacked`) keeps its own.

So each training runs exactly the operations it would run alone, in the same order on its own stream: the results
are bitwise those of running them one after another (``tests/loop/test_interleave.py``; on CUDA through the device
fixture). Ordering on the device: every stream first waits for the work queued before (broadcasts, buffers), and the
caller's stream waits for every stream before the results are handed on; between calls the streams are idle, so
memory freed on one stream is never reused while another stream still reads it.

On a CPU the same code runs without streams (the tests' route; nothing overlaps there).
"""

from __future__ import annotations

import contextvars
from collections.abc import Generator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(eq=False)
class Finished:
    """How one training ended: its return ``value``, or the ``error`` it raised (the others went on), and the torch
    generator state it left (``rng``), which a caller restores to continue as if it had run last."""

    value: Any = None
    error: BaseException | None = None
    rng: tuple | None = None


class Streams:
    """A pool of CUDA streams for one device (``None`` entries on other devices), made once and reused."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pool = torch.device(device), []

    def take(self, n: int) -> list[Any]:
        while len(self.pool) < n:
            self.pool.append(torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        return self.pool[:n]


def interleave(runs: list[Generator], streams: list[Any], device: torch.device) -> list[Finished]:
    """Advance ``runs`` round-robin to their ends (see the module docstring); how each ended, in order. A run that
    raises an :class:`Exception` stops there and the others go on; anything else (a ``KeyboardInterrupt``) closes
    every run and propagates."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    caller = torch.cuda.current_stream(dev) if cuda else None
    for st in streams:
        if st is not None:
            st.wait_stream(caller)
    scopes = [contextvars.copy_context() for _ in runs]
    rng: list[tuple | None] = [None] * len(runs)  # None: the run's first step, which seeds its generator itself
    done: list[Finished | None] = [None] * len(runs)
    try:
        while any(d is None for d in done):
            for i, run in enumerate(runs):
                if done[i] is not None:
                    continue
                if rng[i] is not None:
                    set_rng(rng[i], dev)
                with torch.cuda.stream(streams[i]) if streams[i] is not None else nullcontext():
                    try:
                        scopes[i].run(next, run)
                    except StopIteration as end:
                        done[i] = Finished(value=end.value)
                    except Exception as e:  # noqa: BLE001 - this run ends; the others go on (see the docstring)
                        done[i] = Finished(error=e)
                rng[i] = get_rng(dev)
                if done[i] is not None:
                    done[i].rng = rng[i]
    finally:
        if any(d is None for d in done):  # an abort: every run closes (its ``finally`` blocks run)
            for run in runs:
                run.close()
        if caller is not None:
            for st in streams:
                if st is not None:
                    caller.wait_stream(st)
    return done


def values(ends: list[Finished]) -> list[Any]:
    """Each run's return value, or the first error raised (for callers whose runs fail together)."""
    for end in ends:
        if end.error is not None:
            raise end.error
    return [end.value for end in ends]


def get_rng(dev: torch.device) -> tuple:
    """The CPU generator's state and, on CUDA, the device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None


def set_rng(state: tuple, dev: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], dev)
