"""Vectorised clients (``loop.client_parallelism: vmap``): several clients of a round trained as one.

Each parameter, BatchNorm buffer, broadcast vector, per-client state and batch gets a leading client
dimension ``C``. The forward pass is ``torch.func.vmap`` of ``functional_call`` over that dimension, so one
kernel serves C clients; the backward of ``Σ_c ℓ_c(y_c)`` leaves every client's own gradient in its slice
(clients share no parameter). The rule's code runs unchanged inside :func:`fedlight.core.params.stacked`, where the
helpers of :mod:`fedlight.core.params` reduce per client; elementwise optimizers (SGD, Adam, AdamW) act per client
by construction.

Which clients go together: those with the same number of local steps and batch sizes (so their batches stack)
and the same per-client state keys (a first-time client has none yet). A rule that computes something other
than elementwise or per-client math declares ``stacked_unsupported`` with the reason; the loop then refuses
``vmap`` before training starts.

Randomness: the data order and augmentation of every client come from its own generator, as in sequential
training; the torch generator (dropout) is seeded once per chunk from its first client and vmap draws
different masks per client, so models with dropout are statistically, not bitwise, equivalent to sequential.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Generator, Iterator
from dataclasses import replace
from typing import Any

import torch

from fedlight.core import params as P
from fedlight.core import precision as precisions
from fedlight.core.params import Params
from fedlight.core.rules import Broadcast, ClientResult, LocalUpdateRule, RoundInfo
from fedlight.core.sampling import seed_client_torch
from fedlight.errors import ConfigError
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup, context, outcome, run_to_end
from fedlight.runners.forward import StackedContext, StackedForward
from fedlight.runners.guard import (
    auto_chunk,
    cause,
    client_footprint,
    free_bytes,
    is_oom,
    out_of_memory,
    say,
    tree_bytes,
)
from fedlight.runners.sequential import SequentialRunner
from fedlight.runners.stacking import _keys, chunk_finite, groups, slice_tree, stack_tree

__all__ = ["StackedRunner", "check_supported"]


def check_supported(local: LocalUpdateRule, name: str) -> None:
    why = local.stacked_unsupported
    if why is not None:
        raise ConfigError(f"`loop.client_parallelism: vmap` cannot run {name}: {why}. "
                          "Use `loop.client_parallelism: sequential` for this algorithm")


# ------------------------------------------------------------------------------------- the runner
class StackedRunner:
    """Trains the clients of a round in stacked chunks (see the module docstring).

    Args:
        setup: the run's model, rule, Fabric and optimizer.
        chunk: at most this many clients per chunk (bounds memory); ``None``: a whole group; ``"auto"``: from the
            free memory and the measured per-client footprint (:mod:`fedlight.runners.guard`), on the first round.
        compile: ``torch.compile`` the stacked loss (forward, and through AOTAutograd the backward): ``False``,
            ``True`` (inductor) or a backend name (``"aot_eager"`` in CPU tests). Shapes are static within a
            chunk, so a run compiles once per distinct (chunk size, batch size).

    It cannot break a run: a failure while compiling or first running a compiled shape falls back to the eager
    stacked loss, and if that fails too to :class:`SequentialRunner` (one line each, kept in :attr:`fallbacks`);
    a chunk that runs out of memory is halved and redone, exactly as if ``chunk`` had been that size from the start
    (every chunk starts from its jobs' broadcasts and reseeds from its first client).
    """

    def __init__(self, setup: TrainSetup, chunk: int | str | None = None, compile: bool | str = False) -> None:
        self.setup, self.chunk = setup, chunk
        self.forward = StackedForward.shared(setup.model, setup.fabric, compile)
        self.fallbacks: list[str] = []
        """One line per fallback taken (compile → eager stacked → sequential, out of memory → smaller chunks)."""
        self.sequential: SequentialRunner | None = None
        self._ran: set = set()  # shapes the current forward ran once without error
        self._compile_failed = False  # the eager forward is a fallback: its own first failure falls back too

    holds_round = True
    """:meth:`train` holds every outcome of the round before it yields the first (the loop decides finiteness of
    the whole round with one host sync)."""

    @property
    def name(self) -> str:
        return "sequential" if self.sequential is not None else "stacked"

    @property
    def description(self) -> str:
        """The runner that trains now: ``stacked, compiled`` (``with CUDA graphs``), ``stacked, eager`` or
        ``sequential``."""
        if self.sequential is not None:
            return "sequential"
        f = self.forward
        return f"stacked, {'eager' if not f.compiled else 'compiled'}" + (
            " with CUDA graphs" if f.compile == "reduce-overhead" else "")

    def train(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> Iterator[ClientOutcome]:
        yield from run_to_end(self.train_steps(jobs, info, buffers))

    def train_steps(self, jobs: list[ClientJob], info: RoundInfo,
                    buffers: Params) -> Generator[None, None, list[ClientOutcome]]:
        """:meth:`train` paused after each stacked step; the outcomes in job order (a lockstep group advances
        several unions' trainings in turn, :mod:`fedlight.runners.interleave`)."""
        if self.chunk == "auto":
            self.chunk = self._auto_chunk(jobs)
        done: dict[int, ClientOutcome] = {}  # by position: a lockstep group's runs share client ids
        signature = [(j.batch_sizes, _keys(j.state)) for j in jobs]  # equal sizes fix K too
        for group in groups(range(len(jobs)), signature.__getitem__):
            pos = 0
            while pos < len(group):
                part = group[pos : pos + (self.chunk or len(group))]
                outs = yield from self._guarded([jobs[i] for i in part], info, buffers)
                if outs is None:  # out of memory: self.chunk is smaller now, redo from the same client
                    continue
                done.update(zip(part, outs))
                pos += len(part)
        return [done.pop(i) for i in range(len(jobs))]  # job order, so float64 sums match the sequential runner's

    def _guarded(self, jobs: list[ClientJob], info: RoundInfo,
                 buffers: Params) -> Generator[None, None, list[ClientOutcome] | None]:
        """One chunk's training (:meth:`chunk_steps`), with the fallbacks of the class docstring; ``None`` when the
        chunk must be redone."""
        if self.sequential is not None:  # its outcomes hold the live buffers: copies, as the chunk is kept whole
            return [replace(o, buffers=P.clone(o.buffers)) for o in self.sequential.train(jobs, info, buffers)]
        shape = (len(jobs), jobs[0].batch_sizes, _keys(jobs[0].state))
        first = shape not in self._ran
        try:
            if first and self.forward.compiled:
                outs = yield from self._first_compiled(jobs, info, buffers)
            else:
                outs = yield from self.chunk_steps(jobs, info, buffers)
        except Exception as e:  # noqa: BLE001 - any failure of a first compiled run falls back (see the docstring)
            if is_oom(e):
                self._split(jobs, e)
                return None
            if isinstance(e, ConfigError) or not (first and (self.forward.compiled or self._compile_failed)):
                raise
            self._fall_back(e)
            return (yield from self._guarded(jobs, info, buffers))
        self._ran.add(shape)
        return outs

    def _first_compiled(self, jobs, info, buffers) -> Generator[None, None, list[ClientOutcome]]:
        if not self._ran:
            say(self.setup, "fedlight: compiling the stacked step (first round only; tens of seconds for a "
                            "ResNet)...")
        t = time.perf_counter()
        outs = yield from self.chunk_steps(jobs, info, buffers)
        say(self.setup, f"fedlight: compiled the stacked step for {len(jobs)} clients in "
                        f"{time.perf_counter() - t:.1f} s (its first run included)")
        return outs

    def _fall_back(self, e: BaseException) -> None:
        s = self.setup
        if self.forward.compile == "reduce-overhead":  # graphs → compiled without graphs → eager → sequential
            self.forward, self._compile_failed = type(self.forward).shared(s.model, s.fabric, True), True
            line = (f"the CUDA graphs of the stacked step failed ({cause(e)}); training goes on compiled without "
                    "graphs. Force a choice with `--loop.compile true` or `--loop.compile false` (eager stacked)")
        elif self.forward.compiled:
            self.forward, self._compile_failed = type(self.forward).shared(s.model, s.fabric, False), True
            line = (f"torch.compile of the stacked step failed ({cause(e)}); training goes on with the eager stacked "
                    "runner. Force a choice with `--loop.compile false` (eager stacked) or "
                    "`--loop.client_parallelism sequential`")
        else:
            self.sequential = SequentialRunner(s)
            line = (f"the eager stacked runner failed too ({cause(e)}); training goes on with the sequential runner. "
                    "Force it with `--loop.client_parallelism sequential`")
        self._ran.clear()
        self.fallbacks.append(line)
        say(s, f"fedlight: {line}")

    def _split(self, jobs: list[ClientJob], e: BaseException) -> None:
        s = self.setup
        if len(jobs) == 1:
            raise out_of_memory("stacked", jobs[0].client_id, s.device) from None
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
        self.chunk = -(-len(jobs) // 2)
        if not any(f.startswith("out of memory") for f in self.fallbacks):
            say(s, f"fedlight: out of memory with {len(jobs)} stacked clients; redoing them in chunks of "
                   f"{self.chunk} (same numbers; set `--loop.vmap_chunk {self.chunk}` to start there)")
        self.fallbacks.append(f"out of memory with {len(jobs)} stacked clients: chunks of {self.chunk} from then on")

    def _auto_chunk(self, jobs: list[ClientJob]) -> int:
        """``loop.vmap_chunk: auto``: clients per chunk from the free memory and one client's measured footprint."""
        s, job = self.setup, jobs[0]
        batch = next(iter(job.batches()))
        per_client = client_footprint(s.model, batch, functools.partial(precisions.forward, s.fabric, s.task.objective),
                                      tree_bytes(job.state))
        free = free_bytes(s.device)
        chunk = auto_chunk(free, per_client, len(jobs))
        say(s, f"fedlight: loop.vmap_chunk auto: {chunk} clients per chunk ({free / 2**20:.0f} MiB free, "
               f"~{per_client / 2**20:.1f} MiB per client)")
        return chunk

    def train_chunk(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> list[ClientOutcome]:
        """Train ``jobs`` together from their broadcasts."""
        return run_to_end(self.chunk_steps(jobs, info, buffers))

    def chunk_steps(self, jobs: list[ClientJob], info: RoundInfo,
                    buffers: Params) -> Generator[None, None, list[ClientOutcome]]:
        """How this runner trains one chunk, paused after each step: :meth:`stepwise` (a subclass may split it)."""
        return self.stepwise(jobs, info, buffers)

    def stepwise(self, jobs: list[ClientJob], info: RoundInfo,
                 buffers: Params) -> Generator[None, None, list[ClientOutcome]]:
        """``train_chunk`` paused after each stacked step (a runner that interleaves chunks advances several)."""
        s = self.setup
        ctx = self.begin(jobs, info, buffers)
        loss_sum = torch.zeros(len(jobs), device=s.device, dtype=torch.float64)
        with P.stacked():
            s.local.start(s.model, ctx)
            for batch in stacked_batches(jobs):
                loss_sum.add_(s.local.step(s.model, batch, ctx))
                yield
            result = s.local.finish(s.model, ctx)
        return self.end(jobs, result, ctx, loss_sum)

    def begin(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> StackedContext:
        """The chunk's stacked context (broadcasts, parameters, buffers and states stacked), the torch generator
        seeded from its first client."""
        s, C = self.setup, len(jobs)
        bc = Broadcast(params=stack_tree([j.broadcast.params for j in jobs], "broadcast.params"),
                       extras=stack_tree([j.broadcast.extras for j in jobs], "broadcast.extras"),
                       scalars=stack_tree([j.broadcast.scalars for j in jobs], "broadcast.scalars"))
        seed_client_torch(s.seed, info.round, jobs[0].client_id, s.device)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in bc.params.items()}
        stacked_buffers = {k: v.expand(C, *v.shape).clone() for k, v in buffers.items()} if all(
            j.buffers is None for j in jobs) else stack_tree([j.buffers for j in jobs], "buffers")
        return context(s, replace(jobs[0], broadcast=bc), info, params,
                       stack_tree([j.state for j in jobs], "client state"), cls=StackedContext,
                       buffers=stacked_buffers, forward=self.forward)

    def end(self, jobs: list[ClientJob], result: ClientResult, ctx: StackedContext,
            loss_sum: torch.Tensor) -> list[ClientOutcome]:
        """The chunk's outcomes (slices of its stacks) and their finiteness, decided for the chunk at once."""
        s, C = self.setup, len(jobs)
        copy = s.fabric is not None and s.fabric.world_size > 1  # views would travel to other ranks with their stacks
        outs = [self._slice(job, i, C, result, ctx, loss_sum, ctx.buffers, copy) for i, job in enumerate(jobs)]
        ok = chunk_finite(result.delta, torch.stack([o.train_loss for o in outs]))
        for i, o in enumerate(outs):
            o.finite_flag = ok[i]
        return outs

    @staticmethod
    def _slice(job, i, C, result, ctx, loss_sum, buffers, copy=False) -> ClientOutcome:
        """Client ``i``'s outcome: views into the chunk's stacks (the round end reads them; the client store copies
        what it keeps), so slicing launches no copy per client and tensor; copies with ``copy``."""
        res = ClientResult(delta=slice_tree(result.delta, i, C, copy), extras=slice_tree(result.extras, i, C, copy),
                           metrics=slice_tree(result.metrics, i, C, copy), upload_scalars=result.upload_scalars)
        return outcome(job, res, slice_tree(ctx.metrics, i, C, copy), loss_sum[i],
                       slice_tree(ctx.state, i, C, copy), slice_tree(buffers, i, C, copy))


def stacked_batches(jobs: list[ClientJob]) -> Iterator[Any]:
    """The chunk's stacked batches, step by step: one gather per step (:mod:`fedlight.data.gather`) when every job
    draws from one data module that allows it, else each client's own batches stacked (the same tensors)."""
    src = [j.source for j in jobs]
    if all(x is not None and x[0] is src[0][0] and x[2] is j.batches for x, j in zip(src, jobs)):
        from fedlight.data import gather  # on first use: a runner import pulls no data module (fedlight.fabric)

        return gather.stacked_batches(src[0][0], [draw() for _, draw, _ in src])
    return (stack_tree(b, "batch") for b in zip(*(j.batches() for j in jobs)))
