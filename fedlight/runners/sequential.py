"""The reference runner: clients one after another on the one model instance."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import torch

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.rules import RoundInfo
from fedlight.core.sampling import seed_client_torch
from fedlight.runners.base import ClientJob, ClientOutcome, TrainSetup, context, outcome, run_to_end
from fedlight.runners.guard import out_of_memory


class SequentialRunner:
    """Loads each client's broadcast into the model, runs the rule's ``start``, ``K`` × ``step``, ``finish``."""

    name = "sequential"

    def __init__(self, setup: TrainSetup) -> None:
        self.setup = setup
        self.live = P.trainable(setup.model)
        self.live_buffers = P.float_buffers(setup.model)

    def train(self, jobs: list[ClientJob], info: RoundInfo, buffers: Params) -> Iterator[ClientOutcome]:
        for job in jobs:
            try:
                out = self.train_one(job, info, buffers)
            except torch.OutOfMemoryError:
                raise out_of_memory("sequential", job.client_id, self.setup.device) from None
            yield out

    def train_one(self, job: ClientJob, info: RoundInfo, buffers: Params) -> ClientOutcome:
        return run_to_end(self.stepwise(job, info, buffers))

    def stepwise(self, job: ClientJob, info: RoundInfo, buffers: Params) -> Generator[None, None, ClientOutcome]:
        """``train_one`` paused after each local step (a runner that interleaves clients advances several)."""
        s, model = self.setup, self.setup.model
        P.copy_(self.live_buffers, buffers if job.buffers is None else job.buffers)
        seed_client_torch(s.seed, info.round, job.client_id, s.device)
        ctx = context(s, job, info, self.live, job.state)
        model.train()
        s.local.start(model, ctx)
        loss_sum = torch.zeros((), device=s.device, dtype=torch.float64)
        for batch in job.batches():
            loss_sum.add_(s.local.step(model, batch, ctx))  # promotes in the kernel: no float64 temporary
            yield
        result = s.local.finish(model, ctx)
        # the live buffers are read now, before the next client overwrites them
        return outcome(job, result, ctx.metrics, loss_sum, ctx.state, P.float_buffers(model))
