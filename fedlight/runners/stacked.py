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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn.utils.stateless import _reparametrize_module

from fedlight.core import params as P
from fedlight.core import precision as precisions
from fedlight.core.params import Params
from fedlight.core.rules import Broadcast, ClientResult, LocalContext, LocalUpdateRule, RoundInfo
from fedlight.core.sampling import seed_client_torch
from fedlight.errors import ConfigError
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup, compile_kwargs, context, outcome
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


def check_supported(local: LocalUpdateRule, name: str) -> None:
    why = local.stacked_unsupported
    if why is not None:
        raise ConfigError(f"`loop.client_parallelism: vmap` cannot run {name}: {why}. "
                          "Use `loop.client_parallelism: sequential` for this algorithm")


class _Bound:
    """Calls ``model`` with one client's parameters and buffers (inside vmap: one slice of the stack)."""

    def __init__(self, model: nn.Module, params: Params, buffers: Params) -> None:
        self.model, self.params, self.buffers = model, params, buffers
        self._fedlight_module = model  # what a task reads to reach the module behind the binding

    def __call__(self, *args, **kwargs):
        return functional_call(self.model, (self.params, self.buffers), args, kwargs)

    def __getattr__(self, name: str):
        """Any other method of the model (a LightningModule's ``training_step``) runs with this client's tensors."""
        attr = getattr(self.model, name)
        if not callable(attr):
            return attr

        def bound(*args, **kwargs):
            with _reparametrize_module(self.model, {**self.params, **self.buffers}):
                return attr(*args, **kwargs)

        return bound


class StackedForward:
    """Per-client losses ``[C]`` of stacked parameters: ``vmap`` of ``functional_call``, optionally compiled.

    Under mixed precision inputs stay float32 (autocast casts weights and inputs itself: under vmap it does not
    cast a batched float32 weight to meet an input already in bf16). Eager BatchNorm under vmap + autocast
    fails on CUDA ("Expected running_mean to have type BFloat16"): vmap's batching rule calls the kernel without
    the float32 affine weight, which is what licenses a bf16 input next to float32 statistics. Eager stacked
    runs therefore feed BatchNorm float32 inputs (a forward pre-hook, only inside this call); compiled runs need
    no hook, inductor decomposes the normalisation.
    """

    def __init__(self, model: nn.Module, fabric: Any, compile: bool | str = False) -> None:
        self.model = model
        self.precision = None if fabric is None else fabric.strategy.precision
        self.mixed = isinstance(self.precision, MixedPrecision)
        self.compiled = bool(compile)
        self.norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        fn = self._losses
        if compile:
            fn = torch.compile(fn, dynamic=False, **compile_kwargs(compile))
        self.fn = fn

    @classmethod
    def shared(cls, model: nn.Module, fabric: Any, compile: bool | str = False) -> StackedForward:
        """One instance per (model, precision, compile), so loops over the same model reuse compiled code."""
        precision = None if fabric is None else fabric.strategy.precision
        key = (cls.__name__, type(precision).__name__, str(getattr(precision, "precision", "")), compile)
        per_model = model.__dict__.setdefault("_fedlight_stacked_forwards", {})  # dies with the model
        if key not in per_model:
            per_model[key] = cls(model, fabric, compile)
        return per_model[key]

    def _losses(self, params: Params, buffers: Params, batch: Any, objective: Callable) -> Tensor:
        model, precision = self.model, self.precision

        def one(p: Params, b: Params, batch_c: Any) -> Tensor:
            with precision.forward_context() if precision is not None else nullcontext():
                return objective(_Bound(model, p, b), batch_c)

        return vmap(one, randomness="different")(params, buffers, batch)

    def __call__(self, params: Params, buffers: Params, batch: Any, objective: Callable) -> Tensor:
        if self.precision is not None and not self.mixed:
            batch = self.precision.convert_input(batch)  # e.g. float64 for 64-true
        with _float32_inputs(self.norms) if self.mixed and not self.compiled else nullcontext():
            return self.fn(params, buffers, batch, objective)


@contextmanager
def _float32_inputs(modules: list[nn.Module]):
    """Within the block, ``modules`` receive their first input cast to float32."""
    def hook(_m, args):
        return (args[0].float(), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(eq=False)
class StackedContext(LocalContext):
    """A :class:`~fedlight.core.rules.LocalContext` whose tensors carry a leading client dimension."""

    buffers: Params = field(default_factory=dict)
    """Stacked floating-point buffers (BatchNorm running statistics), one slice per client."""
    forward: StackedForward | None = None
    """Computes the per-client losses (set by :class:`StackedRunner`)."""

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """Per-client losses, shape ``[C]``."""
        forward = self.forward if self.forward is not None else StackedForward.shared(model, self.fabric)
        return forward(self.params, self.buffers, batch, self.objective)


# ------------------------------------------------------------------------------------- stacking helpers
def stack_tree(items: Sequence[Any], what: str) -> Any:
    """Stack tensors (dicts recursively) along a new dim 0; other values must agree across clients."""
    first = items[0]
    if isinstance(first, Tensor):
        return torch.stack(list(items))
    if isinstance(first, (tuple, list)):
        return type(first)(stack_tree([it[j] for it in items], f"{what}[{j}]") for j in range(len(first)))
    if isinstance(first, dict):
        keys = list(first)
        if any(list(it) != keys for it in items):
            raise ValueError(f"{what}: clients differ in keys")
        return {k: stack_tree([it[k] for it in items], f"{what}.{k}") for k in keys}
    if any(it != first for it in items):
        raise ConfigError(f"`loop.client_parallelism: vmap`: {what} differs between clients of a chunk "
                          f"({items!r}); use `loop.client_parallelism: sequential`")
    return first


def slice_tree(tree: Any, i: int, n: int) -> Any:
    """Client ``i``'s part of a stacked tree (copies, so the stack can be freed)."""
    if isinstance(tree, Tensor):
        return tree[i].clone() if tree.dim() > 0 and tree.shape[0] == n else tree
    if isinstance(tree, dict):
        return {k: slice_tree(v, i, n) for k, v in tree.items()}
    return tree


def groups(cids: Sequence[int], signature) -> list[list[int]]:
    """Clients grouped by ``signature(cid)``, groups and members in first-seen order."""
    out: dict[Any, list[int]] = {}
    for c in cids:
        out.setdefault(signature(c), []).append(c)
    return list(out.values())


def chunks(cids: Sequence[int], signature, size: int | None) -> list[list[int]]:
    """Group clients by ``signature(cid)`` (first-seen order), then cut groups into pieces of ``size``."""
    out = []
    for g in groups(cids, signature):
        step = size or len(g)
        out.extend(g[i : i + step] for i in range(0, len(g), step))
    return out


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

    @property
    def name(self) -> str:
        return "sequential" if self.sequential is not None else "stacked"

    @property
    def description(self) -> str:
        """The runner that trains now: ``stacked, compiled``, ``stacked, eager`` or ``sequential``."""
        if self.sequential is not None:
            return "sequential"
        return f"stacked, {'compiled' if self.forward.compiled else 'eager'}"

    def train(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> Iterator[ClientOutcome]:
        if self.chunk == "auto":
            self.chunk = self._auto_chunk(jobs)
        done: dict[int, ClientOutcome] = {}
        signature = {j.client_id: (j.batch_sizes, _keys(j.state)) for j in jobs}  # equal sizes fix K too
        by_id = {j.client_id: j for j in jobs}
        for group in groups([j.client_id for j in jobs], signature.__getitem__):
            pos = 0
            while pos < len(group):
                part = [by_id[c] for c in group[pos : pos + (self.chunk or len(group))]]
                outs = self._guarded(part, info, buffers)
                if outs is None:  # out of memory: self.chunk is smaller now, redo from the same client
                    continue
                done.update((o.client_id, o) for o in outs)
                pos += len(part)
        for job in jobs:  # job order, so float64 sums match the sequential runner's
            yield done.pop(job.client_id)

    def _guarded(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> list[ClientOutcome] | None:
        """``train_chunk``, with the fallbacks of the class docstring; ``None`` when the chunk must be redone."""
        if self.sequential is not None:  # its outcomes hold the live buffers: copies, as the chunk is kept whole
            return [replace(o, buffers=P.clone(o.buffers)) for o in self.sequential.train(jobs, info, buffers)]
        shape = (len(jobs), jobs[0].batch_sizes, _keys(jobs[0].state))
        first = shape not in self._ran
        try:
            outs = self._first_compiled(jobs, info, buffers) if first and self.forward.compiled else \
                self.train_chunk(jobs, info, buffers)
        except Exception as e:  # noqa: BLE001 - any failure of a first compiled run falls back (see the docstring)
            if is_oom(e):
                self._split(jobs, e)
                return None
            if isinstance(e, ConfigError) or not (first and (self.forward.compiled or self._compile_failed)):
                raise
            self._fall_back(e)
            return self._guarded(jobs, info, buffers)
        self._ran.add(shape)
        return outs

    def _first_compiled(self, jobs, info, buffers) -> list[ClientOutcome]:
        if not self._ran:
            say(self.setup, "fedlight: compiling the stacked step (first round only; tens of seconds for a "
                            "ResNet)...")
        t = time.perf_counter()
        outs = self.train_chunk(jobs, info, buffers)
        say(self.setup, f"fedlight: compiled the stacked step for {len(jobs)} clients in "
                        f"{time.perf_counter() - t:.1f} s (its first run included)")
        return outs

    def _fall_back(self, e: BaseException) -> None:
        s = self.setup
        if self.forward.compiled:
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
        s, C = self.setup, len(jobs)
        bc = Broadcast(params=stack_tree([j.broadcast.params for j in jobs], "broadcast.params"),
                       extras=stack_tree([j.broadcast.extras for j in jobs], "broadcast.extras"),
                       scalars=stack_tree([j.broadcast.scalars for j in jobs], "broadcast.scalars"))
        seed_client_torch(s.seed, info.round, jobs[0].client_id, s.device)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in bc.params.items()}
        stacked_buffers = {k: v.expand(C, *v.shape).clone() for k, v in buffers.items()}
        lead = replace(jobs[0], broadcast=bc)
        ctx = context(s, lead, info, params, stack_tree([j.state for j in jobs], "client state"), cls=StackedContext,
                      buffers=stacked_buffers, forward=self.forward)
        streams = [j.batches() for j in jobs]
        loss_sum = torch.zeros(C, device=s.device, dtype=torch.float64)
        with P.stacked():
            s.local.start(s.model, ctx)
            for batches in zip(*streams):
                batch = stack_tree(batches, "batch")
                loss_sum.add_(s.local.step(s.model, batch, ctx))
            result = s.local.finish(s.model, ctx)
        return [self._slice(job, i, C, result, ctx, loss_sum, stacked_buffers) for i, job in enumerate(jobs)]

    @staticmethod
    def _slice(job, i, C, result, ctx, loss_sum, buffers) -> ClientOutcome:
        res = ClientResult(delta=slice_tree(result.delta, i, C), extras=slice_tree(result.extras, i, C),
                           metrics=slice_tree(result.metrics, i, C), upload_scalars=result.upload_scalars)
        return outcome(job, res, slice_tree(ctx.metrics, i, C), loss_sum[i], slice_tree(ctx.state, i, C),
                       slice_tree(buffers, i, C))


def _keys(state: dict[str, Any]) -> tuple:
    """The nested key structure of a client state (clients stack only when theirs agree)."""
    return tuple((k, _keys(v)) if isinstance(v, dict) else (k,) for k, v in sorted(state.items()))
