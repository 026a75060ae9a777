"""FederatedLoop: one round of federated training, everything that is engineering, not math.

It advances a :class:`~fedlight.engine.loop_state.LoopState` (global model, server state, client states, totals, rounds
done) by one round: plan (sampling, dropout, which rank trains whom), train the clients through a client runner,
share across ranks, reduce, ``server.update``. It owns Fabric, devices, precision, seeds, the local optimizer and
its schedule, and never special-cases an algorithm: it calls the rule contract of :mod:`fedlight.core.rules`.
Evaluation, checkpoints, resume and stops belong to the fit driver (:class:`~fedlight.engine.driver.FitDriver`).

Multi-process simulation is client-parallel: each rank trains its share of the round's clients on its own copy of
the one model instance; the weighted sums are all-reduced in float64. The model is never wrapped in DDP.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.params import Params
from fedlight.core.rules import Algorithm, ClientResult, RoundInfo
from fedlight.core.sampling import assign_clients, client_fails, client_generator, round_clients
from fedlight.data import gather
from fedlight.engine.aggregate import Accumulator, Reduced, rule_aggregate
from fedlight.engine.client_store import ClientStateStore
from fedlight.engine.local_schedule import local_schedule
from fedlight.engine.loop_state import LoopState, step_counters
from fedlight.engine.round_row import Collected, RoundPlan, RoundRow, client_entries
from fedlight.engine.work import Work, drive
from fedlight.run.files import fault, to_device
from fedlight.runners import ClientJob, SequentialRunner, TrainSetup, matmul_conv, select_runner
from fedlight.runners.base import OptimizerFactory
from fedlight.runners.guard import say
from fedlight.tasks import Task


class Diverged(RuntimeError):
    """Training produced a non-finite loss, update or model (``loop.on_nonfinite: stop``)."""

    def __init__(self, round: int, what: str) -> None:
        super().__init__(f"round {round + 1}: {what}")
        self.round = round


class FederatedLoop:
    """Trains the rounds of ``algorithm`` on ``model`` and ``data``: :meth:`run_round` advances :attr:`state`.

    Args:
        fabric: a launched ``lightning.Fabric``.
        model: the one model instance reused by every client (converted and moved here).
        data: a :class:`~fedlight.data.FederatedDataModule`, already ``setup``.
        algorithm: the rule pair.
        cfg: loop settings.
        seed: the run seed; every random stream derives from it.
        out_dir: the run directory (spilled client states go under it).
        task: the run's :class:`~fedlight.tasks.Task` (client objective, evaluation), e.g. ``data.default_task()``.
        optimizer: the local optimizer factory, replacing ``cfg.optimizer``'s (a LightningModule's own).
    """

    def __init__(self, fabric, model: nn.Module, data, algorithm: Algorithm, cfg: LoopConfig, seed: int,
                 out_dir: Path, task: Task, optimizer: OptimizerFactory | None = None) -> None:
        cfg = cfg.for_rule(algorithm)  # an unset loop.lr: the rule's own
        self.fabric, self.data, self.algorithm, self.cfg, self.seed = fabric, data, algorithm, cfg, seed
        self.task = task
        self.task.setup(data)  # learns what it needs from the data (e.g. the number of classes)
        self.out_dir = Path(out_dir)
        self.device = fabric.device
        self.model = fabric.strategy.precision.convert_module(model).to(self.device)
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
            data.memory_format = torch.channels_last
        self.server = algorithm.server
        self.local = local_schedule(algorithm.local, cfg.local_lr_schedule, cfg.local_lr)  # loop.local_lr_schedule
        self.live = P.trainable(self.model)
        self.live_buffers = P.float_buffers(self.model)
        if fabric.world_size > 1:  # every rank starts from rank 0's initial model
            with torch.no_grad():
                for t in [*self.live.values(), *self.live_buffers.values()]:
                    torch.distributed.broadcast(t.data, src=0)
        x = P.clone(self.live)
        self.server.setup(x)
        self.state = LoopState(params=x, buffers=P.clone(self.live_buffers), int_buffers=step_counters(self.model),
                               server=self.server, store=self._store(), meta=self._meta(x), task=self.task)
        setup = TrainSetup(model=self.model, local=self.local, fabric=fabric,
                           optimizer=optimizer or cfg.optimizer_factory(), task=self.task,
                           max_grad_norm=cfg.clip_norm, weight_decay=cfg.weight_decay, seed=seed)
        names = matmul_conv.select(self.model, cfg.matmul_convs)  # before the runner, whose forward reads it
        if cfg.matmul_convs:
            say(setup, f"fedlight: loop.matmul_convs {cfg.matmul_convs}: " + (
                f"{', '.join(names)} convolve as one batched matmul when clients train stacked" if names else
                f"no convolution has at most {cfg.matmul_convs} input channels; the setting changes nothing"))
        self.setup = setup
        self.runner, self.runner_reason = select_runner(cfg, setup, self.state.meta["algorithm"])
        self.custom_aggregate = self.server.aggregates_itself()

    @property
    def state_folder(self) -> Path:
        """Where this rank's client states are written: ``<out_dir>/client_state/rank<r>``."""
        return self.out_dir / "client_state" / f"rank{self.fabric.global_rank}"

    def _store(self) -> ClientStateStore:
        cfg = self.cfg
        budget = None if cfg.state_budget_mb is None else int(cfg.state_budget_mb * 2**20)
        spill = self.state_folder if budget is not None else None
        return ClientStateStore(self.device if cfg.state_device == "device" else "cpu", budget_bytes=budget,
                                spill_dir=spill)

    def _meta(self, x: Params) -> dict[str, Any]:
        """What a checkpoint must agree on to continue this run."""
        return {"algorithm": getattr(self.algorithm, "name", type(self.algorithm).__name__),
                "model": type(self.model).__name__, "shapes": {k: list(v.shape) for k, v in x.items()},
                "num_clients": self.data.num_clients, "seed": self.seed}

    @property
    def x(self) -> Params:
        """``x_r``: the global parameters (``state.params``)."""
        return self.state.params

    @property
    def buffers(self) -> Params:
        return self.state.buffers

    @property
    def int_buffers(self) -> Params:
        return self.state.int_buffers

    @property
    def store(self) -> ClientStateStore:
        return self.state.store

    def load_global(self) -> None:
        """Copy the global parameters and buffers into the model (to evaluate it or save it)."""
        P.copy_(self.live, self.state.params)
        P.copy_(self.live_buffers, self.state.buffers)

    def num_steps(self, client_id: int) -> int:
        if self.cfg.local_steps is not None:
            return self.cfg.local_steps
        return (self.cfg.local_epochs or 1) * self.data.steps_per_epoch(client_id)

    def round_lr(self, r: int) -> float:
        return self.cfg.lr_schedule.lr(self.cfg.lr, r, self.cfg.rounds)

    # ----------------------------------------------------------------------------------------- a round
    def run_round(self, r: int) -> dict[str, Any]:
        """Round ``r``, its clients trained by this run's runner (:meth:`round_steps`); returns its metrics row."""
        return drive(self.round_steps(r))

    def round_steps(self, r: int) -> Generator[Work, Any, dict[str, Any]]:
        """Round ``r`` (``state.rounds_done``, 0-based): plan → train this rank's clients (it yields their
        :class:`Work` and is sent the outcomes: a lockstep group trains several runs' together) → share across ranks →
        reduce → ``server.aggregate`` (if the rule overrides it) → ``server.update``. Afterwards
        ``state.rounds_done == r + 1``. Returns the round's metrics row."""
        st, t0 = self.state, time.perf_counter()
        if st.clock is None:  # this process's first round: the run's wall clock goes on from here
            st.clock = t0
        plan = self.plan(r)
        self.task.begin_round(plan.info)
        counts = {k: b.clone() for k, b in st.int_buffers.items()}
        outcomes = yield Work(self.jobs(plan), plan.info, st.buffers, self.runner)
        got = self._collect(outcomes, plan)
        P.copy_(st.int_buffers, counts)  # clients' forward passes do not count; the round advances them below
        t_train = time.perf_counter()
        got = self._exchange(got)
        row = RoundRow.of(plan, got, self.task.round_lrs(plan.info) or self.cfg.round_lrs(plan.info))
        empty = got.layout is None
        if empty and getattr(self.server, "releases_empty_rounds", False):  # a private server's: the noised 0 sum
            got.layout = self._upload_layout(plan)
        if got.layout is None:  # nobody reported: the model and the server state stay as they are
            st.rounds_done = r + 1
        else:
            got.acc.ensure(got.layout)
            hook = getattr(self.server, "privatize", None)  # a private server's (fedlight.privacy): noise added once
            red = got.acc.reduce(self.fabric, hook and (lambda sums, n: hook(sums, n, r)))
            x_old = st.params
            self._advance(r, red, got, plan)
            row.measure(red, st.params, x_old, got.start if got.start is not None else x_old,
                        self.server.diagnostics(), clients=not empty)
        return self._count(row.timed(t0, t_train).as_dict())

    def _upload_layout(self, plan: RoundPlan):
        """The sums' layout of one upload, from the rule's ``start`` and ``finish`` with no step on a new client (none
        of it kept, no buffer averaged): a round nobody reported to that the server releases anyway."""
        job = ClientJob(client_id=0, broadcast=self.server.broadcast(self.state.params, plan.info, 0), state={},
                        num_steps=0, batch_sizes=(), num_samples=0, batches=lambda: ())
        acc = Accumulator(self.server.summed_extras, self.device)
        acc.add(SequentialRunner(self.setup).train_one(job, plan.info, self.state.buffers), 0.0, {}, 0, 0)
        return acc.layout()

    def _count(self, row: dict[str, Any]) -> dict[str, Any]:
        """Add the round's bytes to the run's totals; the row becomes the state's last row (the driver completes
        it with the evaluation before a snapshot)."""
        self.state.totals["bytes_up"] += row["bytes_up"]
        self.state.totals["bytes_down"] += row["bytes_down"]
        self.state.last_row = row
        return row

    def _advance(self, r: int, red: Reduced, got: Collected, plan: RoundPlan) -> None:
        """The state after round ``r``: client states stored, ``x_{r+1}``, averaged buffers, step counters."""
        st, agg = self.state, self._aggregate(red, got)
        for c, s in got.states.items():
            st.store.put(c, s)
        x_new = self.server.update(st.params, agg, replace(plan.info, sampled=sorted(c["id"] for c in got.clients)))
        if not bool(P.is_finite(x_new)):
            raise Diverged(r, "the global model became non-finite")
        st.params = x_new
        if self.cfg.aggregate_buffers and red.buffers:
            st.buffers = {k: v.to(st.buffers[k].dtype) for k, v in red.buffers.items()}
        for b in st.int_buffers.values():
            b += round(plan.info.num_steps)
        st.rounds_done = r + 1

    def plan(self, r: int) -> RoundPlan:
        cfg = self.cfg
        sampled = round_clients(self.data.num_clients, cfg.clients_per_round, self.seed, r, cfg.sampling)
        dropped = [c for c in sampled if client_fails(self.seed, r, c, cfg.client_dropout)]
        active = [c for c in sampled if c not in dropped]
        steps = {c: self.num_steps(c) for c in sampled}
        info = RoundInfo(round=r, lr=self.round_lr(r), num_steps=sum(steps.values()) / max(len(steps), 1),
                         num_clients=self.data.num_clients, sampled=sampled)
        ws, rank = self.fabric.world_size, self.fabric.global_rank
        mine = assign_clients(active, [float(steps[c]) for c in active], ws)[rank]
        return RoundPlan(info=info, dropped=dropped, active=active, mine=mine)

    def jobs(self, plan: RoundPlan) -> list[ClientJob]:
        """One :class:`ClientJob` per client this rank trains (states are loaded here, lazily for batches)."""
        r, out, d = plan.info.round, [], self.data
        for c in plan.mine:
            K = self.num_steps(c)
            batches = lambda c=c, K=K: d.client_batches(c, K, client_generator(self.seed, r, c))  # noqa: E731
            out.append(ClientJob(
                client_id=c, broadcast=self.server.broadcast(self.state.params, plan.info, c),
                state=self.state.store.get(c, self.device), num_steps=K, batch_sizes=d.batch_sizes(c, K),
                num_samples=d.num_samples(c), batches=batches,
                source=(d, lambda c=c, K=K: gather.plan(d, c, K, client_generator(self.seed, r, c)), batches)
                if gather.supports(d) else None))
        return out

    def _collect(self, outcomes, plan: RoundPlan) -> Collected:
        """Apply the non-finite policy and add each kept client to the float64 sums (in client order)."""
        cfg = self.cfg
        got = Collected(acc=Accumulator(self.server.summed_extras, self.device))
        samples = (self.server.weighting or cfg.weighting) == "samples"
        stats = []
        for out, finite in self._decided(outcomes):
            fault("train", plan.info.round + 1)
            got.start = out.job.broadcast.params
            if not finite:
                if cfg.on_nonfinite == "stop":
                    raise Diverged(plan.info.round, f"client {out.client_id} produced a non-finite loss or update")
                got.skipped.append(out.client_id)  # skip_client: its update and state change are dropped
                continue
            got.acc.add(out, float(out.result.num_samples) if samples else 1.0,
                        out.buffers if cfg.aggregate_buffers else {}, bytes_down=out.job.broadcast.nbytes(),
                        bytes_up=out.result.nbytes())
            stats.append((out.client_id, out.result.num_samples, out.train_loss, out.delta_sqnorm))
            if out.state:
                got.states[out.client_id] = out.state
            if self.custom_aggregate:
                got.results.append((out.client_id, out.result))
        got.clients = client_entries(stats)
        got.layout = got.acc.layout()
        return got

    def _decided(self, outcomes):
        """``(outcome, finite)`` in client order, with one host sync per round for a runner that holds the round's
        outcomes anyway (the stacked one: :attr:`ClientOutcome.finite_flag` per chunk), else one per client."""
        window = list(outcomes) if getattr(self.runner, "holds_round", False) else None
        for part in [window] if window is not None else ([o] for o in outcomes):
            if part:
                yield from zip(part, torch.stack([o.finite() for o in part]).tolist())

    def _exchange(self, got: Collected) -> Collected:
        """Share states, skipped clients, per-client entries, results and the sum layout across ranks."""
        if self.fabric.world_size == 1:
            return got
        mine = (to_device(got.states, "cpu"), got.skipped, got.clients, to_device(got.results, "cpu"), got.layout)
        parts: list[Any] = [None] * self.fabric.world_size
        torch.distributed.all_gather_object(parts, mine)
        got.states = {c: to_device(s, self.device) for p in parts for c, s in p[0].items()}
        got.skipped = sorted(c for p in parts for c in p[1])
        got.clients = sorted((e for p in parts for e in p[2]), key=lambda e: e["id"])
        got.results = sorted(((c, to_device(res, self.device)) for p in parts for c, res in p[3]), key=lambda t: t[0])
        got.layout = next((p[4] for p in parts if p[4] is not None), None)
        return got

    def _aggregate(self, red: Reduced, got: Collected) -> ClientResult:
        """The reduced mean, or the server rule's own ``aggregate`` of every kept client result."""
        return rule_aggregate(self.server, red, [res for _, res in got.results], self.cfg.weighting)

