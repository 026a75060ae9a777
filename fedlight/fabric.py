"""A rule in your own Fabric script: :class:`ClientTrainer` runs one client's local round of any rule the way
``fedlight fit`` runs it, inside a loop you write.

It is the engine's own sequential client runner (:class:`~fedlight.runners.sequential.SequentialRunner`) and
float64 aggregation (:class:`~fedlight.engine.aggregate.Accumulator`) behind two calls, so what ``fedlight fit`` does
around the rule comes with it: the rule's own local optimizer (FedAdamW, FedLADA, Local Adam ...) or the loop's
(``loop.optimizer``, weight decay, clip), the whole broadcast (extras and scalars, e.g. FedWMSAM's ``α``), the rule's
per-client metrics merged into its upload (FedWMSAM's server reads ``similarity`` there), per-client state between
rounds, BatchNorm statistics (each client starts from the round's, the server averages them), the per-client torch
seed and the precision plugin. With the same model, batches, sampling and settings, a loop of your own gives
``fedlight fit``'s global model (``tests/test_fabric.py`` checks it for every registered rule).

Your loop keeps the server half (``server.broadcast`` and ``server.update``) and the data::

    trainer = ClientTrainer(fabric, model, algo, cross_entropy)
    x = trainer.x0  # algo.server is set up for it
    for r in range(rounds):
        info = RoundInfo(round=r, lr=lr, num_steps=K, num_clients=N, sampled=sample_clients(N, S, seed, r))
        results = [trainer.train(c, algo.server.broadcast(x, info, c), loaders[c], info) for c in info.sampled]
        x = algo.server.update(x, trainer.aggregate(results), info)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.params import Params
from fedlight.core.rules import Algorithm, Broadcast, ClientResult, RoundInfo
from fedlight.engine.aggregate import Accumulator, Reduced, rule_aggregate
from fedlight.engine.client_store import ClientStateStore
from fedlight.engine.local_schedule import local_schedule
from fedlight.engine.loop_state import step_counters
from fedlight.runners.base import ClientJob, ClientOutcome, OptimizerFactory, TrainSetup
from fedlight.runners.sequential import SequentialRunner

__all__ = ["ClientTrainer"]


class _Objective:
    """A plain ``objective(model, batch)`` as the task the runner asks for its client objective."""

    def __init__(self, fn: Callable[[nn.Module, Any], Tensor]) -> None:
        self.fn = fn

    def client_objective(self, ctx: Any) -> Callable[[nn.Module, Any], Tensor]:
        return self.fn


def _batch_size(batch: Any) -> int:
    """Rows in ``batch``: the length of its first tensor (a tensor, a tuple/list, or a dict of them)."""
    while not isinstance(batch, Tensor):
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        elif isinstance(batch, (tuple, list)):
            batch = batch[0]
        else:
            raise TypeError(f"cannot count the samples of a {type(batch).__name__} batch; pass `num_samples=`")
    return len(batch)


class ClientTrainer:
    """Runs one client's local round of ``algorithm`` on ``model`` the way ``fedlight fit`` does.

    Args:
        fabric: a ``lightning.Fabric`` (its device and precision: the model is converted and moved as ``fit`` does),
            or ``None`` for plain fp32 PyTorch on the model's device.
        model: the one model every client trains in turn (converted in place, like ``fit``'s).
        algorithm: the rule pair, e.g. ``fedlight.create("fedwmsam")`` or your own ``Algorithm``.
        objective: ``objective(model, batch)`` → the mean training loss, e.g. :func:`fedlight.cross_entropy`, or a
            :class:`fedlight.tasks.Task`.
        loop: where the local optimizer (``optimizer``, ``momentum``, ``weight_decay``, ``optimizer_args``), the clip
            (``max_grad_norm``), ``local_lr_schedule``, ``weighting`` and ``aggregate_buffers`` come from; default
            ``LoopConfig()``, ``fedlight fit``'s defaults (SGD, weight decay 1e-3, clip 10). Its rounds, sampling and
            learning rate are yours: the lr is ``info.lr``.
        optimizer: ``factory(params, lr=η)`` → the local optimizer, instead of ``loop``'s (a rule that brings its
            own, like FedAdamW, still uses its own).
        seed: the run seed; each client's round seeds torch from (seed, round, client), as ``fit`` does.
    """

    def __init__(self, fabric: Any, model: nn.Module, algorithm: Algorithm,
                 objective: Callable[[nn.Module, Any], Tensor] | Any, *, loop: LoopConfig | None = None,
                 optimizer: OptimizerFactory | None = None, seed: int = 0) -> None:
        cfg = loop if loop is not None else LoopConfig()
        if fabric is not None:
            model = fabric.strategy.precision.convert_module(model).to(fabric.device)
        self.fabric, self.model, self.algorithm, self.cfg = fabric, model, algorithm, cfg
        task = objective if hasattr(objective, "client_objective") else _Objective(objective)
        self.setup = TrainSetup(model=model, local=local_schedule(algorithm.local, cfg.local_lr_schedule,
                                                                  cfg.local_lr),
                                fabric=fabric, optimizer=optimizer or cfg.optimizer_factory(),
                                max_grad_norm=cfg.clip_norm, weight_decay=cfg.weight_decay, seed=seed, task=task)
        self.runner = SequentialRunner(self.setup)
        self.x0: Params = P.clone(P.trainable(model))
        """``x_0``: the model's trainable parameters as converted (a copy), the global model to start from; the
        server rule is set up for it (``algorithm.server.setup(x0)``, as ``fit`` does)."""
        algorithm.server.setup(self.x0)
        self.buffers: Params = P.clone(P.float_buffers(model))
        """The round's floating-point buffers (BatchNorm statistics): every client starts from them;
        :meth:`aggregate` replaces them with the clients' weighted mean."""
        self.states = ClientStateStore(self.setup.device)
        """Each client's persistent state (``ctx.state``) between its rounds."""
        self.last: Reduced | None = None
        """The last :meth:`aggregate`'s float64 means (``train_loss``, ``delta_sqnorm``, byte ``counters``)."""
        self._pending: dict[int, ClientOutcome] = {}
        self._info: RoundInfo | None = None

    def train(self, client_id: int, broadcast: Broadcast, batches: Iterable[Any], info: RoundInfo, *,
              num_steps: int | None = None, num_samples: int | None = None) -> ClientResult:
        """Client ``client_id``'s round ``info.round``: its stored state, the round's buffers, the rule's
        ``start``, one ``step`` per batch, ``finish``; returns its upload, the rule's metrics in ``metrics``.

        Args:
            broadcast: what the server sent this client (``algorithm.server.broadcast(x, info, client_id)``).
            batches: the client's ``K`` batches (a list or a ``DataLoader``: ``K`` is its length), moved to the
                Fabric's device here.
            info: the round: ``info.lr`` is the local learning rate, ``info.round`` seeds the client.
            num_steps: ``K`` for an iterable without a length (the first ``K`` batches are used).
            num_samples: ``n_i``, the client's weight under ``weighting: samples``; default the rows it trained on.
        """
        if num_steps is None:
            batches = batches if hasattr(batches, "__len__") else list(batches)
            num_steps = len(batches)  # type: ignore[arg-type]
        if num_steps < 1:
            raise ValueError(f"client {client_id}: no batches to train on")
        seen = [0]

        def stream():
            for batch in islice(batches, num_steps):
                seen[0] += _batch_size(batch)
                yield batch if self.fabric is None else self.fabric.to_device(batch)

        job = ClientJob(client_id=client_id, broadcast=broadcast, state=self.states.get(client_id, self.setup.device),
                        num_steps=num_steps, batch_sizes=(), num_samples=num_samples or 0, batches=stream)
        counters = {k: b.clone() for k, b in step_counters(self.model).items()}
        out = self.runner.train_one(job, info, self.buffers)
        for k, b in step_counters(self.model).items():  # a client's forward passes do not count (the loop's rule)
            b.copy_(counters[k])
        out.buffers = P.clone(out.buffers)  # the runner hands the live buffers, which the next client overwrites
        if num_samples is None:
            out.result.num_samples = job.num_samples = seen[0]
        self.states.put(client_id, out.state)
        self._pending[id(out.result)], self._info = out, info
        return out.result

    def aggregate(self, results: Sequence[ClientResult]) -> ClientResult:
        """The round's aggregate of ``results`` (from :meth:`train`), as ``fedlight fit`` computes it: float64
        weighted means (``loop.weighting`` unless the server rule sets its own), rule metrics averaged over clients,
        or the server rule's own ``aggregate``. The clients' BatchNorm statistics become the next round's
        :attr:`buffers`. Hand the result to ``algorithm.server.update``."""
        try:
            outs = [self._pending.pop(id(r)) for r in results]
        except KeyError:
            raise ValueError("aggregate() takes the results train() returned this round, each once") from None
        self._pending.clear()
        if not outs:
            raise ValueError("aggregate() needs at least one client result")
        server, cfg = self.algorithm.server, self.cfg
        samples = (server.weighting or cfg.weighting) == "samples"
        acc = Accumulator(server.summed_extras, self.setup.device)
        for o in outs:
            acc.add(o, float(o.result.num_samples) if samples else 1.0, o.buffers if cfg.aggregate_buffers else {},
                    bytes_down=o.job.broadcast.nbytes(), bytes_up=o.result.nbytes())
        hook, info = getattr(server, "privatize", None), self._info  # a private server's noise (fedlight.privacy)
        self.last = red = acc.reduce(None, hook and (lambda sums, n: hook(sums, n, info.round)))
        if cfg.aggregate_buffers and red.buffers:
            self.buffers = {k: v.to(self.buffers[k].dtype) for k, v in red.buffers.items()}
        for b in step_counters(self.model).values():  # BatchNorm step counters advance by the round's mean K
            b += round(info.num_steps)
        return rule_aggregate(server, red, [o.result for o in outs], cfg.weighting)

    @property
    def train_loss(self) -> float:
        """The last aggregated round's training loss: the mean over its clients of each one's mean over K steps."""
        if self.last is None:
            raise RuntimeError("no round aggregated yet")
        return float(self.last.train_loss)

    def load(self, params: Params) -> nn.Module:
        """Put the global model ``params`` and the round's :attr:`buffers` into :attr:`model` (to evaluate or save
        it); returns the model."""
        with torch.no_grad():
            P.copy_(P.trainable(self.model), params)
            P.copy_(P.float_buffers(self.model), self.buffers)
        return self.model
