"""Whole stacked steps in CUDA graphs (``loop.client_parallelism: graphs``).

The stacked runner's step (forward, backward, the rule's arithmetic, the optimizer update) launches a few hundred
kernels per step; here each chunk shape's step is captured once in a CUDA graph and replayed. Per chunk shape
(clients, batch sizes, state keys) the runner keeps a *static* context: parameters, BatchNorm buffers, broadcast,
client state, the rule's scratch and metrics, the batch, and the learning rate as a 0-dim device tensor (a float
would be baked into the graph, and every later round would replay round 1's lr). Each chunk:

1. builds its context and runs the rule's ``start`` eagerly, as the stacked runner does;
2. copies every tensor of that context into the static one (same paths; a path missing on either side is refused);
3. replays the rule's unchanged ``step`` K times, each after copying the step's batch into the static batch; the
   host-side bookkeeping of :meth:`~fedlight.core.rules.LocalContext.apply` (``step_index``, ``lr_sum``), which a
   replay skips, is done on the host per replay with the same float arithmetic;
4. copies (clones) the static tensors back into the chunk's context before the next chunk can overwrite them, and
   runs ``finish`` eagerly.

The update is ``p.addcmul_(g, -lr)`` with the lr tensor (:class:`TensorLRSGD`), which equals ``torch.optim.SGD``'s
``p.add_(g, alpha=-lr)`` bitwise on the CPU (both fused multiply-adds; tests/loop/test_runner_graphed.py checks it
over random tensors in float32 and float64); ``add_(g * -lr)`` would round twice. Only rules whose step reads no
Python value that changes between steps run here (:data:`EXACT_RULES`); others are refused before round 1.

On a CPU there are no graphs: :func:`capture` returns the step itself, called on the same static buffers, lr tensor
and clones, which is how the tests check everything but the capture. Not yet measured on a GPU (docs/speed.md), so
``auto`` does not take this route.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import Tensor

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.rules import RoundInfo
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup
from fedlight.runners.choice import blocker
from fedlight.runners.forward import StackedContext
from fedlight.runners.guard import cause, say
from fedlight.runners.stacked import StackedRunner, stacked_batches
from fedlight.runners.stacking import _keys

EXACT_RULES = {
    "LocalUpdateRule": (), "ComposedClient": ("SAMPerturbation", "NesterovPerturbation", "ScaffoldCorrection"),
}
"""Local rules (and the perturbations and corrections of a composed one) whose step reads no host value that
changes from step to step: FedAvg, FedSAM, FedNSAM, SCAFFOLD and their combinations."""


class TensorLRSGD(torch.optim.SGD):
    """Plain SGD (coupled weight decay, no momentum) reading the lr from the 0-dim tensor :attr:`lr` at each step;
    ``param_groups[0]["lr"]`` stays the float (what ``LocalContext.apply`` adds to ``lr_sum``)."""

    def __init__(self, params: list[Tensor], lr: Tensor, weight_decay: float) -> None:
        super().__init__(params, lr=float(lr), weight_decay=weight_decay)
        self.lr, self.weight_decay = lr, weight_decay

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the SGD signature
        neg = -self.lr
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                g = p.grad.add(p, alpha=self.weight_decay) if self.weight_decay else p.grad
                p.addcmul_(g, neg)  # = p.add_(g, alpha=-lr), the lr read at replay


def graphs_blocker(setup: TrainSetup) -> str | None:
    """Why the graphed route cannot train this setup exactly, or ``None``."""
    why = blocker("stacked", setup)
    if why is not None:
        return why
    local = setup.local
    parts = [type(local).__name__, *(type(x).__name__ for x in [getattr(local, "perturbation", None),
                                                               *getattr(local, "corrections", ())] if x is not None)]
    if parts[0] not in EXACT_RULES or not set(parts[1:]) <= set(EXACT_RULES[parts[0]]):
        return f"its step is not known to be capturable ({', '.join(parts)}; exact: FedAvg, FedSAM, FedNSAM, SCAFFOLD)"
    opt = setup.optimizer([torch.zeros(1, requires_grad=True)], lr=0.1)
    d = opt.defaults
    if type(opt) is not torch.optim.SGD or d.get("momentum") or d.get("nesterov") or d.get("maximize"):
        return f"the local optimizer is not plain SGD without momentum ({type(opt).__name__} {d})"
    scaler = getattr(getattr(setup.fabric, "strategy", None), "precision", None)
    if getattr(scaler, "scaler", None) is not None:
        return "16-mixed precision's loss scaler reads the host every step"
    return None


def capture(step: Callable[[], Tensor], device: torch.device) -> Callable[[], Tensor]:
    """``step`` captured in a CUDA graph (after a warm-up on a side stream, autocast's weight cache off): returns a
    replay that gives the captured loss. On a CPU, ``step`` itself."""
    if device.type != "cuda":
        return step
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step()
    finally:
        torch.set_autocast_cache_enabled(cache)

    def replay() -> Tensor:
        graph.replay()
        return loss

    return replay


def flat(ctx: StackedContext) -> dict[str, Any]:
    """Every per-chunk value of ``ctx`` by path (tensors, and the other leaves, which must agree between chunks)."""
    roots = {"params": ctx.params, "buffers": ctx.buffers, "state": ctx.state, "metrics": ctx.metrics,
             "scratch": {k: v for k, v in ctx.scratch.items() if k != "client_model"},
             "broadcast.params": ctx.broadcast.params, "broadcast.extras": ctx.broadcast.extras,
             "broadcast.scalars": ctx.broadcast.scalars}
    out: dict[str, Any] = {}

    def walk(tree: Any, path: str) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{path}.{k}")
        elif isinstance(tree, (list, tuple)) and not isinstance(tree, str):
            for i, v in enumerate(tree):
                walk(v, f"{path}[{i}]")
        else:
            out[path] = tree

    walk(roots, "")
    return out


def load(static: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Copy the chunk's tensors into the static ones (in place: the graph reads their memory)."""
    if static.keys() != fresh.keys():
        odd = sorted(static.keys() ^ fresh.keys())
        raise RuntimeError(f"the chunk's context differs from the captured one ({odd})")
    with torch.no_grad():
        for k, v in static.items():
            if isinstance(v, Tensor):
                v.copy_(fresh[k])
            elif v != fresh[k]:
                raise RuntimeError(f"{k} differs from the captured step's ({fresh[k]!r}, captured {v!r})")


def copy_tree(tree: Any) -> Any:
    """Clones of ``tree``'s tensors (dicts and lists rebuilt), so the next chunk's replays cannot reach them."""
    if isinstance(tree, Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copy_tree(v) for v in tree)
    return tree


class GraphedStep:
    """One chunk shape's static context, batch and lr tensor, and its captured step."""

    def __init__(self, runner: StackedRunner, ctx: StackedContext, batch: Any, lr: float) -> None:
        s = runner.setup
        self.ctx, self.model, self.local = ctx, s.model, s.local
        self.lr = torch.tensor(lr, device=s.device, dtype=next(iter(ctx.params.values())).dtype)
        ctx.optimizer = TensorLRSGD(list(ctx.params.values()), self.lr, ctx.optimizer.defaults["weight_decay"])
        self.batch = copy_tree(batch)
        self.tensors = flat(ctx)
        saved = {k: copy_tree(v) for k, v in self.tensors.items()}
        self.replay = capture(self._step, s.device)
        if s.device.type != "cuda":
            self._step()  # the warm-up a capture runs, so the CPU checks that the restore below undoes it
            self.replay = self._host_unchanged
        load(self.tensors, saved)  # undo the warm-up's updates

    def _step(self) -> Tensor:
        return self.local.step(self.model, self.batch, self.ctx)

    def _host_unchanged(self) -> Tensor:
        """The CPU's replay: the step called directly, then the host values a graph replay leaves alone put back
        (so the tests see the bookkeeping :meth:`run` does for a replay)."""
        ctx = self.ctx
        kept = ctx.lr_sum, ctx.step_index
        loss = self._step()
        ctx.lr_sum, ctx.step_index = kept
        return loss

    def run(self, fresh: StackedContext, batches: Any, info: RoundInfo) -> Generator[Tensor, None, None]:
        """The chunk's steps on the static context, from ``fresh``'s values; yields each step's loss (a copy)."""
        ctx = self.ctx
        load(self.tensors, flat(fresh))
        self.lr.fill_(info.lr)
        ctx.set_lr(info.lr)
        ctx.step_index, ctx.lr_sum = fresh.step_index, fresh.lr_sum
        for batch in batches:
            with torch.no_grad():
                for dst, src in zip(_leaves(self.batch), _leaves(batch), strict=True):
                    dst.copy_(src)
            lr_sum, k = ctx.lr_sum, ctx.step_index
            loss = self.replay().clone()
            ctx.lr_sum, ctx.step_index = lr_sum + ctx.optimizer.param_groups[0]["lr"], k + 1  # apply()'s, on the host
            yield loss
        fresh.step_index, fresh.lr_sum = ctx.step_index, ctx.lr_sum
        for name in ("params", "buffers", "state", "metrics", "scratch"):
            mine, theirs = getattr(ctx, name), getattr(fresh, name)
            theirs.update({k: copy_tree(v) for k, v in mine.items() if k != "client_model"})


def _leaves(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree
    return [t for x in items for t in _leaves(x)]


class GraphedStackedRunner(StackedRunner):
    """:class:`StackedRunner` whose steps replay a CUDA graph per chunk shape (see the module docstring); a failure
    of a shape's first run falls back to the eager stacked runner, then the sequential one (one line each)."""

    def __init__(self, setup: TrainSetup, chunk: int | str | None = None) -> None:
        super().__init__(setup, chunk, False)
        self.graphs: dict[tuple, GraphedStep] | None = {}
        self._compile_failed = True  # a first run that fails falls back (StackedRunner._guarded)

    @property
    def description(self) -> str:
        if self.graphs is None or self.sequential is not None:
            return super().description
        return "stacked, whole steps in CUDA graphs" if self.setup.device.type == "cuda" else \
            f"stacked, whole-step graph route (no CUDA graphs on {self.setup.device.type}: direct calls)"

    def _fall_back(self, e: BaseException) -> None:
        if self.graphs is None:
            return super()._fall_back(e)
        self.graphs = None
        self._ran.clear()
        line = (f"the CUDA graphs of the whole stacked step failed ({cause(e)}); training goes on with the eager "
                "stacked runner. Force it with `--loop.client_parallelism vmap`")
        self.fallbacks.append(line)
        say(self.setup, f"fedlight: {line}")

    def stepwise(self, jobs: list[ClientJob], info: RoundInfo,
                 buffers: Params) -> Generator[None, None, list[ClientOutcome]]:
        if self.graphs is None:
            return (yield from super().stepwise(jobs, info, buffers))
        s = self.setup
        ctx = self.begin(jobs, info, buffers)
        loss_sum = torch.zeros(len(jobs), device=s.device, dtype=torch.float64)
        with P.stacked():
            s.local.start(s.model, ctx)
            batches = stacked_batches(jobs)
            first = next(batches)
            step = self._graph(jobs, info, buffers, first)
            for loss in step.run(ctx, _chain(first, batches), info):
                loss_sum.add_(loss)
                yield
            result = s.local.finish(s.model, ctx)
        return self.end(jobs, result, ctx, loss_sum)

    def _graph(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params, batch: Any) -> GraphedStep:
        key = (len(jobs), jobs[0].batch_sizes, _keys(jobs[0].state))
        if key not in self.graphs:
            static = self.begin(jobs, info, buffers)
            self.setup.local.start(self.setup.model, static)
            self.graphs[key] = GraphedStep(self, static, batch, info.lr)
        return self.graphs[key]


def _chain(first: Any, rest: Any):
    yield first
    yield from rest
