"""What a client runner is handed and what it gives back.

A round hands a runner one :class:`ClientJob` per client it trains (broadcast, state, steps, batches); the runner
yields one :class:`ClientOutcome` per job, in job order. Runners differ only in *how* they execute the rule's
``start/step/finish`` (one client after another, or several stacked); what goes in and out is the same, so the
round neither knows nor cares which one ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.core.loop_config import COMPILE_MODES
from fedlight.core.params import Params
from fedlight.core.rules import Broadcast, ClientResult, LocalContext, LocalUpdateRule, RoundInfo

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""``factory(params, lr=η)`` → the loop's local optimizer (class, weight decay and extra arguments bound)."""


@dataclass(frozen=True)
class TrainSetup:
    """What every client of a run trains with (fixed for the run)."""

    model: nn.Module
    """The one model instance, on the device; runners load each client's parameters into it."""
    local: LocalUpdateRule
    fabric: Any
    """A launched ``lightning.Fabric`` (precision, device); ``None`` for plain fp32 PyTorch."""
    optimizer: OptimizerFactory
    max_grad_norm: float | None
    weight_decay: float
    seed: int
    task: Any
    """The run's :class:`~fedlight.tasks.Task`: its client objective becomes ``ctx.objective`` (required: the
    engine has no default task)."""

    @property
    def device(self) -> torch.device:
        return self.fabric.device if self.fabric is not None else next(self.model.parameters()).device


@dataclass(eq=False)
class ClientJob:
    """One client's work in one round."""

    client_id: int
    broadcast: Broadcast
    state: dict[str, Any]
    """The client's persistent state as stored (empty for a client never seen before)."""
    num_steps: int
    """``K``."""
    batch_sizes: tuple[int, ...]
    """Sizes of the ``K`` batches :attr:`batches` yields (runners group clients whose sizes agree)."""
    num_samples: int
    """``n_i``."""
    batches: Callable[[], Iterable[Any]]
    """Yields the client's ``K`` batches (seeded by (seed, round, client)); called once."""
    source: tuple[Any, Callable[[], Any], Callable] | None = None
    """``(data, draw, batches)``: the data module, ``draw()`` → :func:`fedlight.data.gather.plan` of the same batches
    (instead of :attr:`batches`, never both) and the :attr:`batches` it stands for, so a stacked chunk gathers all its
    clients' batches at once (only while :attr:`batches` is still that one: a job given other batches keeps them);
    ``None``: only :attr:`batches`."""
    buffers: Params | None = None
    """The floating-point buffers the client starts from, when they are not the round's (a lockstep group trains
    the clients of several runs, each from its own run's, in one stacked chunk)."""


@dataclass(eq=False)
class ClientOutcome:
    """One trained client: the rule's upload plus what the loop measures about it."""

    job: ClientJob
    result: ClientResult
    """The rule's upload; ``result.metrics`` holds the rule's own diagnostics only."""
    state: dict[str, Any]
    """The client's state after training (stored only if the client's update is kept)."""
    buffers: Params
    """Floating-point buffers (BatchNorm statistics) after training."""
    train_loss: Tensor
    """Mean training loss over the ``K`` steps (0-dim float64, on the device)."""
    delta_sqnorm: Tensor
    """``‖Δ_i‖²`` (0-dim float64), for the flatness distance and the per-client log."""
    finite_flag: Tensor | None = None
    """:meth:`finite`, when a stacked runner decided it for its whole chunk at once."""

    @property
    def client_id(self) -> int:
        return self.job.client_id

    def finite(self) -> Tensor:
        """0-dim bool: the loss and every entry of the upload are finite (no host sync)."""
        if self.finite_flag is not None:
            return self.finite_flag
        return P.is_finite(self.result.delta) & torch.isfinite(self.train_loss)


class ClientRunner(Protocol):
    """Trains the clients of a round: ``train(jobs, info, buffers)`` yields a :class:`ClientOutcome` per job,
    in job order (so float64 sums add up in the same order whatever the runner)."""

    name: str

    def train(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> Iterator[ClientOutcome]: ...


def context(setup: TrainSetup, job: ClientJob, info: RoundInfo, params: Params, state: dict[str, Any],
            cls: type[LocalContext] = LocalContext, **extra: Any) -> LocalContext:
    """The rule's :class:`LocalContext` for ``job`` (``cls``/``extra``: the stacked variant and its fields)."""
    optimizer = setup.local.make_optimizer(list(params.values()), info.lr, setup.optimizer)
    ctx = cls(broadcast=job.broadcast, optimizer=optimizer, lr=info.lr, num_steps=job.num_steps, params=params,
              client_id=job.client_id, round=info.round, state=state, max_grad_norm=setup.max_grad_norm,
              fabric=setup.fabric, weight_decay=setup.weight_decay, **extra)
    ctx.scratch["client_model"] = setup.model  # the module that trains: the run's, or a runner's copy (streams)
    ctx.objective = setup.task.client_objective(ctx)
    return ctx


def outcome(job: ClientJob, result: ClientResult, ctx_metrics: dict[str, Any], loss_sum: Tensor, state: dict,
            buffers: Params) -> ClientOutcome:
    """Stamp one client's outcome: sample count, the rule's metrics, the mean loss and ``‖Δ‖²``."""
    result.num_samples = job.num_samples
    result.metrics = {**ctx_metrics, **result.metrics}
    return ClientOutcome(job=job, result=result, state=state, buffers=buffers, train_loss=loss_sum / job.num_steps,
                         delta_sqnorm=P.sqnorm(result.delta))


def run_to_end(steps: Iterator[None]):
    """Drive a runner's ``stepwise`` generator to its end and return its value (the outcomes)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def compile_kwargs(compile: bool | str) -> dict[str, Any]:
    """``torch.compile`` keywords for a ``loop.compile`` value: ``True`` → inductor, a mode, else a backend name."""
    return {} if compile is True else {"mode": compile} if compile in COMPILE_MODES else {"backend": compile}
