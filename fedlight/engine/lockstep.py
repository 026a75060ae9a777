"""Lockstep groups: one process advances several runs together, round by round.

Every member is an ordinary run (its own seed, partition, sampling, server and client states, record, checkpoints
and directory), written as the generator of its rounds' work (:func:`fedlight.config.api.fit_steps`, or
:meth:`FitDriver.fit_steps <fedlight.engine.driver.FitDriver.fit_steps>`). Each round, every member begins its round
and yields its :class:`~fedlight.engine.work.Work`; the group trains the union of the members' clients that can share
a chunk in one stacked runner (:func:`shares_chunk`: same stacked runner settings, local rule, optimizer, model
architecture, precision, round and lr), each client from its own run's broadcast, state and buffers; each member then
ends its round (aggregate, server update, record, checkpoint) with its own outcomes, in its own job order. Members
that evaluate in a round yield an :class:`~fedlight.engine.work.Evaluation`; those with the same test set are
evaluated in one pass (:mod:`fedlight.engine.lockstep_eval`).

Unions that cannot share a chunk (runs of different local rules in one ``--lockstep column`` process) train
interleaved: step k of each union in turn, each union on its own CUDA stream, so the host issues one union's kernels
while the device runs another's and small unions fill the device together (``streams``, :data:`STREAMS`); every
union's arithmetic is what it would be alone (:mod:`fedlight.runners.interleave`).

A member that diverges, fails or is stopped leaves the group (its generator ends, its record closes as the run's
would alone); the others go on.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from fedlight.engine.lockstep_eval import evaluate_together
from fedlight.engine.work import Evaluation, Work
from fedlight.errors import check
from fedlight.runners.base import run_to_end
from fedlight.runners.interleave import Streams, interleave, set_rng

STREAMS = ("auto", "on", "off")
"""``fedlight lockstep --streams``: the unions of a round (runs that cannot share a chunk, e.g. different local rules)
trained interleaved, each on its own CUDA stream (on), one after another (off), or interleaved on CUDA only (auto,
the default: on a CPU nothing overlaps)."""


@dataclass(eq=False)
class Member:
    name: str
    steps: Generator
    pending: Work | Evaluation | None = None
    result: Any = None
    """The run's return value (its summary), or the exception it ended with."""


class Lockstep:
    """Advances ``steps`` (name → a run's generator of work) together; :meth:`run` returns name → summary or the
    exception the run ended with."""

    def __init__(self, steps: dict[str, Generator], say=None, streams: str = "auto") -> None:
        check(streams in STREAMS, f"`fedlight lockstep --streams` is one of {', '.join(STREAMS)}, got {streams!r}")
        self.members = [Member(name, gen) for name, gen in steps.items()]
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.streams, self._streams, self._told = streams, None, False
        self.shared: list[int] = []
        """Per round, the size of each union trained (members sharing a chunk)."""
        self.interleaved: list[int] = []
        """Per round that interleaved its unions, how many."""

    def run(self) -> dict[str, Any]:
        try:
            for m in self.members:
                self._advance(m, None)
            while live := [m for m in self.members if m.pending is not None]:
                evals = [m for m in live if isinstance(m.pending, Evaluation)]
                if evals:
                    for m, (metrics, error) in zip(evals, evaluate_together([m.pending.driver for m in evals],
                                                                            self.say)):
                        self._advance(m, metrics, error)
                    continue
                parts = _parts(live)
                self.shared.extend(len(p) for p in parts)
                paused = self._to_interleave(parts)
                if paused:
                    self._train_interleaved(paused)
                for part in parts:
                    if part not in paused:
                        for m, outs in zip(part, self._train(part)):
                            self._advance(m, outs)
        finally:
            for m in self.members:  # an abort of the group (KeyboardInterrupt): each run closes its record
                if m.pending is not None:
                    m.steps.close()
        together = sum(n for n in self.shared if n > 1)
        inter = f"; {len(self.interleaved)} rounds trained up to {max(self.interleaved)} unions interleaved" + (
            " on CUDA streams" if self._streams is not None and self._streams.device.type == "cuda" else "") \
            if self.interleaved else ""
        self.say(f"fedlight lockstep: {len(self.members)} runs; {together} of {sum(self.shared)} run-rounds trained "
                 f"their clients in one stacked runner with other runs'{inter}")
        return {m.name: m.result for m in self.members}

    def _train(self, part: list[Member]) -> list[Any]:
        """The outcomes of each member's clients: trained together, or (when that fails) each run's own, lazily, so
        that a run's own failure is raised in the run (which leaves the group as it would stop alone)."""
        try:
            return train_together([m.pending for m in part])
        except Exception as e:  # noqa: BLE001 - see the docstring
            return self._each_alone(part, e)

    def _each_alone(self, part: list[Member], e: Exception) -> list[Any]:
        self.say(f"fedlight lockstep: training {len(part)} runs' clients together failed ({type(e).__name__}: "
                 f"{e}); each run trains its own this round")
        return [m.pending.run() for m in part]

    def _to_interleave(self, parts: list[list[Member]]) -> list[list[Member]]:
        """The unions of this round that train interleaved (``streams``: on; auto: on CUDA; off: none); says once
        when stacked unions cannot (``torch.compile``'s CUDA graphs)."""
        if self.streams == "off":
            return []
        stacked = [p for p in parts if _stacked(p[0].pending)]
        paused = [p for p in stacked if pausable(p[0].pending)]
        if not self._told and len(stacked) >= 2 and len(paused) < len(stacked):
            self._told = True
            self.say("fedlight lockstep: the unions train one after another, not interleaved on CUDA streams: "
                     "`loop.compile: reduce-overhead` (auto's route on CUDA) replays CUDA graphs from one memory "
                     "pool in stream order. `--loop.compile true` (compiled without graphs) lets them interleave")
        on = len(paused) >= 2 and (self.streams == "on" or paused[0][0].pending.runner.setup.device.type == "cuda")
        return paused if on else []

    def _train_interleaved(self, parts: list[list[Member]]) -> None:
        """The unions of ``parts`` trained at once, their stacked steps in turn, each on its own CUDA stream
        (:func:`~fedlight.runners.interleave.interleave`: bitwise each union trained alone); then each union's
        members end their rounds, from the torch generator state their union left (as if it had trained last)."""
        dev = parts[0][0].pending.runner.setup.device
        if self._streams is None or self._streams.device != dev:
            self._streams = Streams(dev)
        ends = interleave([together_steps([m.pending for m in p]) for p in parts], self._streams.take(len(parts)),
                          dev)
        self.interleaved.append(len(parts))
        for part, end in zip(parts, ends):
            set_rng(end.rng, dev)
            if end.error is None:
                outs = end.value
            elif len(part) == 1:  # the run's own failure, raised in the run as it would be alone
                outs = [_raising(end.error)]
            else:
                outs = self._each_alone(part, end.error)
            for m, o in zip(part, outs):
                self._advance(m, o)

    def _advance(self, m: Member, value: Any, error: Exception | None = None) -> None:
        """Hand ``m`` what it waits for (or raise ``error`` in it, where it waits) and take what it asks next."""
        try:
            m.pending = m.steps.throw(error) if error is not None else m.steps.send(value)
        except StopIteration as done:
            m.pending, m.result = None, done.value
        except Exception as e:  # noqa: BLE001 - the member leaves the group; the others go on
            m.pending, m.result = None, e
            self.say(f"fedlight lockstep: {m.name} left the group: {type(e).__name__}: {e}")


def pausable(work: Work) -> bool:
    """Whether ``work`` trains in a stacked runner whose steps can pause (:meth:`StackedRunner.train_steps
    <fedlight.runners.stacked.StackedRunner.train_steps>`), so that a group can interleave it with other unions;
    not with ``torch.compile``'s own CUDA graphs (``reduce-overhead``): its graphs share one memory pool whose reuse
    follows the order of their replays on one stream, so graphs replayed side by side on two streams could
    overwrite each other's memory."""
    return _stacked(work) and work.runner.forward.compile != "reduce-overhead"


def _stacked(work: Work) -> bool:
    """Whether ``work`` trains in a stacked runner (one that has not fallen back to the sequential runner)."""
    from fedlight.runners.stacked import StackedRunner

    return isinstance(work.runner, StackedRunner) and work.runner.sequential is None


def _raising(error: Exception):
    raise error
    yield  # a generator: the error is raised where the run reads its outcomes


def _parts(live: list[Member]) -> list[list[Member]]:
    """The members whose clients train together: equal :func:`shares_chunk` keys, first-seen order."""
    out: dict[Any, list[Member]] = {}
    for m in live:
        out.setdefault(shares_chunk(m.pending) or id(m), []).append(m)
    return list(out.values())


def train_together(works: list[Work]) -> list[Any]:
    """Train the clients of ``works`` (that :func:`shares_chunk` agrees on) in the first one's runner: each work's
    outcomes, in its job order. One work alone trains as it would alone (lazily).

    Its ``loop.vmap_chunk`` bounds the union's chunks; unset, the union is one chunk on a GPU, and on CPU chunks of at
    most one run's round: there a stacked step's cost per client grows with the stack (30 stacked MLP clients cost
    14 % more CPU time than 3 × 10, results/performance.md §12), so runs gain nothing from sharing a chunk."""
    if len(works) == 1:
        return [works[0].run()]
    return run_to_end(together_steps(works))


def together_steps(works: list[Work]) -> Generator[None, None, list[Any]]:
    """:func:`train_together`, eagerly (one work too), paused after each stacked step (:func:`pausable` works)."""
    lead, runner = works[0], works[0].runner
    if len(works) == 1:
        return [iter((yield from runner.train_steps(lead.jobs, lead.info, lead.buffers)))]
    jobs = [dataclasses.replace(j, buffers=w.buffers) for w in works for j in w.jobs]
    chunk = runner.chunk
    if chunk is None and runner.setup.device.type == "cpu":  # see CPU_CHUNK
        runner.chunk = max(len(w.jobs) for w in works)
    try:
        outs = yield from runner.train_steps(jobs, lead.info, lead.buffers)
    finally:
        runner.chunk = chunk
    cuts = [0]
    for w in works:
        cuts.append(cuts[-1] + len(w.jobs))
    return [iter(outs[a:b]) for a, b in zip(cuts, cuts[1:])]


def shares_chunk(work: Work) -> tuple | None:
    """What the clients of several runs must agree on to train as one stacked chunk (``loop.matmul_convs``' choice of
    convolutions included); ``None`` when this run's clients cannot share one (its runner is not stacked, or has
    fallen back to the sequential runner)."""
    if not _stacked(work):
        return None
    r = work.runner
    s = r.setup
    model = tuple((k, tuple(v.shape), v.dtype) for k, v in [*s.model.named_parameters(), *s.model.named_buffers()])
    matmul = tuple(n for n, m in s.model.named_modules() if any(m is c for c in r.forward.matmul_convs))
    return (type(r), r.forward.compile, matmul, type(s.model), model, describe(s.local), describe(s.optimizer),
            s.max_grad_norm, s.weight_decay, describe(s.task), id(s.fabric), work.info.round, work.info.lr)


def describe(obj: Any, depth: int = 3) -> Any:
    """A comparable description of a rule, optimizer factory or task: its type and its settings (numbers, strings,
    and nested rule objects), never its tensors or data."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (tuple, list)):
        return tuple(describe(v, depth - 1) for v in obj) if depth else len(obj)
    if isinstance(obj, functools.partial):
        return ("partial", describe(obj.func, depth), describe(obj.args, depth), describe(obj.keywords, depth))
    if isinstance(obj, dict):
        return tuple((k, describe(v, depth - 1)) for k, v in sorted(obj.items())) if depth else len(obj)
    if isinstance(obj, type) or callable(obj) and not hasattr(obj, "__dict__"):
        return getattr(obj, "__qualname__", repr(obj))
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if depth == 0 or not type(obj).__module__.startswith(("fedlight", "torch.optim", "functools")):
        return kind
    fields = {k: v for k, v in vars(obj).items() if not k.startswith("_") and _setting(v)}
    return (kind, describe(fields, depth - 1))


def _setting(v: Any) -> bool:
    """A value that can be a setting (not a tensor, module or data module)."""
    return v is None or isinstance(v, (bool, int, float, str, tuple, list, dict, functools.partial)) or (
        type(v).__module__.startswith("fedlight.") and not hasattr(v, "parameters") and not hasattr(v, "setup"))
