"""FederatedLoop: everything that is engineering, not math.

Owns Fabric, devices, precision, client sampling, seeds, the per-client state store, the local
optimizer and lr schedule, aggregation across processes, evaluation, logging and checkpoints. It
never special-cases an algorithm: it calls the rule contract of :mod:`fedlight.rules`.

Multi-process simulation is client-parallel: each rank trains its share of the round's clients on its
own copy of the one model instance; the weighted sums are all-reduced in float64. The model is
never wrapped in DDP.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedlight import params as P
from fedlight.aggregate import Accumulator
from fedlight.args import LoopConfig
from fedlight.errors import ConfigError
from fedlight.record import RunRecord
from fedlight.records import atomic_torch_save, fault, load_checkpoint, rss_mb, summarize
from fedlight.rules import Algorithm, LocalContext, RoundInfo
from fedlight.sampling import assign_clients, client_fails, client_generator, sample_clients, seed_client_torch
from fedlight.state import ClientStateStore


class Diverged(RuntimeError):
    """Training produced a non-finite loss, update or model (``loop.on_nonfinite: stop``)."""

    def __init__(self, round: int, what: str) -> None:
        super().__init__(f"round {round + 1}: {what}")
        self.round = round


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


class FederatedLoop:
    """Runs ``cfg.rounds`` rounds of ``algorithm`` on ``model`` and ``data`` and writes the run record.

    Args:
        fabric: a launched ``lightning.Fabric``.
        model: the one model instance reused by every client (converted and moved here).
        data: a :class:`~fedlight.data.FederatedDataModule` (``setup`` is called here).
        algorithm: the rule pair.
        cfg: loop settings.
        seed: the run seed; every random stream derives from it.
        out_dir: the run directory.
    """

    def __init__(self, fabric, model: nn.Module, data, algorithm: Algorithm, cfg: LoopConfig, seed: int,
                 out_dir: Path) -> None:
        self.fabric, self.data, self.algorithm, self.cfg, self.seed = fabric, data, algorithm, cfg, seed
        self.out_dir = Path(out_dir)
        self.device = fabric.device
        self.model = fabric.strategy.precision.convert_module(model).to(self.device)
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
            data.memory_format = torch.channels_last
        if cfg.compile:
            self.model.compile(**({} if cfg.compile is True else {"backend": cfg.compile}))
        self.local, self.server = algorithm.local, algorithm.server
        self.live = P.trainable(self.model)
        self.live_buffers = P.float_buffers(self.model)
        # BatchNorm step counters: never averaged; advanced by one client's K per round. Other integer buffers
        # (e.g. Swin's relative_position_index) are constants and are left alone.
        self.int_buffers = {n: b for n, b in self.model.named_buffers() if n.endswith("num_batches_tracked")}
        if fabric.world_size > 1:  # every rank starts from rank 0's initial model
            with torch.no_grad():
                for t in [*self.live.values(), *self.live_buffers.values()]:
                    torch.distributed.broadcast(t.data, src=0)
        self.x = P.clone(self.live)
        self.buffers = P.clone(self.live_buffers)
        budget = None if cfg.state_budget_mb is None else int(cfg.state_budget_mb * 2**20)
        spill = self.out_dir / "client_state" / f"rank{fabric.global_rank}" if budget is not None else None
        self.store = ClientStateStore(self.device if cfg.state_device == "device" else "cpu", budget_bytes=budget,
                                      spill_dir=spill)
        self.server.setup(self.x)
        self.start_round = 0
        self._last_row: dict[str, Any] | None = None
        self.diverged_at: int | None = None
        self._round_done = 0
        self.totals = {"bytes_up": 0, "bytes_down": 0, "wall_time_s": 0.0}
        opt_cls = _import(cfg.optimizer)
        extra = {"momentum": cfg.momentum} if cfg.optimizer == "torch.optim.SGD" else {}
        if cfg.client_parallelism == "vmap":
            from fedlight.stacked import check_supported

            check_supported(self.local, getattr(algorithm, "name", type(algorithm).__name__))
        self._opt_factory = lambda ps, lr: opt_cls(ps, lr=lr, weight_decay=cfg.weight_decay, **extra,
                                                  **cfg.optimizer_args)

    # ----------------------------------------------------------------------------------------- schedule
    def num_steps(self, client_id: int) -> int:
        if self.cfg.local_steps is not None:
            return self.cfg.local_steps
        return (self.cfg.local_epochs or 1) * self.data.steps_per_epoch(client_id)

    def round_lr(self, r: int) -> float:
        return self.cfg.lr_schedule.lr(self.cfg.lr, r, self.cfg.rounds)

    # ----------------------------------------------------------------------------------------- clients
    def run_client(self, client_id: int, info: RoundInfo) -> tuple[Any, Any, LocalContext]:
        """Train one client from the broadcast; returns (broadcast, result, context)."""
        bc = self.server.broadcast(self.x, info, client_id)
        P.copy_(self.live_buffers, self.buffers)
        K = self.num_steps(client_id)
        seed_client_torch(self.seed, info.round, client_id, self.device)
        optimizer = self.local.make_optimizer(list(self.live.values()), info.lr, self._opt_factory)
        ctx = LocalContext(broadcast=bc, optimizer=optimizer, lr=info.lr, num_steps=K, params=self.live,
                           client_id=client_id, round=info.round, state=self.store.get(client_id, self.device),
                           max_grad_norm=self.cfg.max_grad_norm, fabric=self.fabric,
                           weight_decay=self.cfg.weight_decay)
        self.model.train()
        self.local.start(self.model, ctx)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        gen = client_generator(self.seed, info.round, client_id)
        for batch in self.data.client_batches(client_id, K, gen):
            loss_sum.add_(self.local.step(self.model, batch, ctx))  # promotes in the kernel: no float64 temporary
        result = self.local.finish(self.model, ctx)
        result.num_samples = self.data.num_samples(client_id)
        result.metrics = {"train_loss": loss_sum / K, "delta_sqnorm": P.sqnorm(result.delta),
                          **ctx.metrics, **result.metrics}
        return bc, result, ctx

    def _train(self, mine: list[int], info: RoundInfo):
        """Train this rank's clients; yields ``(cid, broadcast, result, state, float buffers)`` in client order
        (sequential: each client's live buffers are read before the next client starts)."""
        if self.cfg.client_parallelism == "sequential":
            for cid in mine:
                bc, res, ctx = self.run_client(cid, info)
                yield cid, bc, res, ctx.state, P.float_buffers(self.model)
            return
        from fedlight.stacked import chunks, run_chunk

        states = {c: self.store.get(c, self.device) for c in mine}
        sig = {c: (self.data.batch_sizes(c, self.num_steps(c)), _keys(states[c])) for c in mine}  # sizes fix K too
        done = {}
        for part in chunks(mine, sig.__getitem__, self.cfg.vmap_chunk):
            for item in run_chunk(self, part, info, [states[c] for c in part]):
                done[item[0]] = item
        for cid in mine:  # the sequential order, so float64 sums match the sequential run's
            yield done.pop(cid)

    # ----------------------------------------------------------------------------------------- a round
    def run_round(self, r: int) -> dict[str, Any]:
        """Sample → train this rank's clients → all-reduce → server update. Returns the round's metrics row."""
        cfg, fabric = self.cfg, self.fabric
        t0 = time.perf_counter()
        sampled = sample_clients(self.data.num_clients, cfg.clients_per_round, self.seed, r)
        dropped = [c for c in sampled if client_fails(self.seed, r, c, cfg.client_dropout)]
        active = [c for c in sampled if c not in dropped]
        steps = {c: self.num_steps(c) for c in sampled}
        info = RoundInfo(round=r, lr=self.round_lr(r), num_steps=sum(steps.values()) / len(steps),
                         num_clients=self.data.num_clients, sampled=sampled)
        mine = assign_clients(active, [float(steps[c]) for c in active], fabric.world_size)[fabric.global_rank]
        acc = Accumulator(self.server.summed_extras, self.device)
        new_states: dict[int, dict] = {}
        skipped: list[int] = []
        x_start = self.x
        counts = {k: b.clone() for k, b in self.int_buffers.items()}
        clients: list[dict[str, Any]] = []  # this rank's clients (the lead's RoundRow gathers them over ranks)
        for cid, bc, res, state, buffers in self._train(mine, info):
            x_start = bc.params
            clients.append({"id": cid, "train_loss": float(res.metrics["train_loss"]), "num_samples": res.num_samples,
                            "delta_norm": float(res.metrics["delta_sqnorm"]) ** 0.5})
            fault("train", r + 1)
            if not bool(P.is_finite(res.delta) & torch.isfinite(torch.as_tensor(res.metrics["train_loss"]))):
                if cfg.on_nonfinite == "stop":
                    raise Diverged(r, f"client {cid} produced a non-finite loss or update")
                skipped.append(cid)  # skip_client: its update and state change are dropped
                continue
            w = float(res.num_samples) if (self.server.weighting or cfg.weighting) == "samples" else 1.0
            acc.add(res, w, buffers if cfg.aggregate_buffers else {}, bytes_down=bc.nbytes(), bytes_up=res.nbytes())
            if state:
                new_states[cid] = state
        P.copy_(self.int_buffers, counts)  # clients' forward passes do not count; the round advances them below
        t_train = time.perf_counter()
        new_states, skipped, layout = self._exchange(new_states, skipped, acc)
        row: dict[str, Any] = {"round": r + 1, "lr": info.lr, "clients_reported": len(active) - len(skipped),
                               "clients_dropped": len(dropped), "clients_skipped_nonfinite": len(skipped),
                               "sampled": sampled, "clients": clients}
        if layout is None:  # nobody reported: the model and the server state stay as they are
            row.update(bytes_down=0, bytes_up=0, round_time_s=time.perf_counter() - t0)
            return row
        acc.ensure(layout)
        agg, buffers, totals = acc.reduce(fabric)
        for c, st in new_states.items():
            self.store.put(c, st)
        x_old = self.x
        reported = [c for c in active if c not in skipped]
        x_new = self.server.update(self.x, agg, replace(info, sampled=reported))
        if not bool(P.is_finite(x_new)):
            raise Diverged(r, "the global model became non-finite")
        self.x = x_new
        if cfg.aggregate_buffers and buffers:
            self.buffers = {k: v.to(self.buffers[k].dtype) for k, v in buffers.items()}
        for b in self.int_buffers.values():
            b += round(info.num_steps)
        row["train_loss"] = float(agg.metrics["train_loss"])
        # flatness distance D = Σ_i w_i‖y_{i,K} − x_{r+1}‖² (FedNSAM Def. 1; the 1/S mean for equal-size clients),
        # from Σ w_i‖Δ_i‖², Δ̄ and U = x_{r+1} − y_0 (clients start from the broadcast point y_0)
        U = P.sub(self.x, x_start)
        row["flatness_distance"] = float(agg.metrics["delta_sqnorm_w"] - 2 * P.dot(agg.delta, U).double()
                                         + P.sqnorm(U))
        row["update_norm"] = float(P.norm(P.sub(self.x, x_old)))
        for k, v in agg.metrics.items():
            if k not in ("train_loss", "delta_sqnorm", "delta_sqnorm_w"):
                row[f"rule/{k}"] = float(v)
        for k, v in self.server.diagnostics().items():
            row[f"server/{k}"] = float(v)
        row["bytes_down"], row["bytes_up"] = int(totals["bytes_down"]), int(totals["bytes_up"])
        t_end = time.perf_counter()
        row["round_time_s"] = t_end - t0
        row["train_time_s"] = t_train - t0
        row["aggregate_time_s"] = t_end - t_train
        return row

    def _exchange(self, new_states: dict[int, dict], skipped: list[int], acc: Accumulator):
        """Share per-client states, skipped clients and the result layout across ranks (one small gather)."""
        layout = acc.layout()
        if self.fabric.world_size > 1:
            cpu = {c: _to(s, "cpu") for c, s in new_states.items()}
            gathered: list[Any] = [None] * self.fabric.world_size
            torch.distributed.all_gather_object(gathered, (cpu, skipped, layout))
            new_states = {c: _to(s, self.device) for part in gathered for c, s in part[0].items()}
            skipped = sorted(c for part in gathered for c in part[1])
            layout = next((part[2] for part in gathered if part[2] is not None), None)
        return new_states, skipped, layout

    # ----------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy and loss of the global model on the test set (batches strided over ranks)."""
        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        P.copy_(self.live, self.x)
        P.copy_(self.live_buffers, self.buffers)
        self.model.eval()
        acc = MulticlassAccuracy(num_classes=self.data.num_classes, average="micro").to(self.device)
        loss = MeanMetric().to(self.device)
        precision = self.fabric.strategy.precision
        for j, (xb, yb) in enumerate(self.data.test_batches()):
            if j % self.fabric.world_size != self.fabric.global_rank:
                continue
            with precision.forward_context():
                logits = self.model(precision.convert_input(xb))
            fault("eval", self._round_done + 1)
            loss.update(nn.functional.cross_entropy(logits.float(), yb, reduction="sum") / len(yb), len(yb))
            acc.update(logits.float(), yb)
        self.model.train()
        return {"test_acc": float(acc.compute()), "test_loss": float(loss.compute())}

    # ----------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self, rounds_done: int) -> dict[str, Any]:
        """Everything a resume needs, as private CPU copies (safe to write while the next round runs)."""
        return {
            "format": 1,
            "round": rounds_done,
            "params": _cpu_copy(self.x),
            "buffers": _cpu_copy(self.buffers),
            "int_buffers": _cpu_copy(self.int_buffers),
            "server": _cpu_copy(self.server.state_dict()),
            "store": self.store.state_dict(),  # states are replaced on put, never changed in place
            "totals": dict(self.totals),
            "meta": self.meta(),
        }

    def meta(self) -> dict[str, Any]:
        return {"algorithm": getattr(self.algorithm, "name", type(self.algorithm).__name__),
                "model": type(self.model).__name__,
                "shapes": {k: list(v.shape) for k, v in self.x.items()},
                "num_clients": self.data.num_clients, "seed": self.seed}

    def save(self, rounds_done: int, row: dict[str, Any] | None = None) -> None:
        """Write ``checkpoints/last.ckpt`` now (synchronously; :meth:`fit` writes in the background)."""
        if self.fabric.global_rank == 0:
            state = self.checkpoint_state(rounds_done)
            state["last_row"] = json.dumps(row) if row is not None else None
            atomic_torch_save(state, self.out_dir / "checkpoints" / "last.ckpt")
        self.fabric.barrier()

    def load(self, ckpt: Path | dict[str, Any]) -> None:
        """Continue from a checkpoint (a path, or one already loaded); refuses one of another run."""
        path = ckpt if not isinstance(ckpt, dict) else "(given)"
        ckpt = load_checkpoint(ckpt, map_location=self.device) if not isinstance(ckpt, dict) else ckpt
        problems = meta_differences(ckpt["meta"], self.meta())
        if problems:
            raise ConfigError(f"`resume` checkpoint {path} does not match this run: {'; '.join(problems)}")
        self.x = {k: v.to(self.device) for k, v in ckpt["params"].items()}
        self.buffers = {k: v.to(self.device) for k, v in ckpt["buffers"].items()}
        for k, v in ckpt["int_buffers"].items():
            self.int_buffers[k].copy_(v)
        self.server.load_state_dict(_to(ckpt["server"], self.device))
        self.store.load_state_dict(ckpt["store"])
        self.totals = dict(ckpt["totals"])
        self.start_round = int(ckpt["round"])
        self._last_row = json.loads(ckpt["last_row"]) if ckpt.get("last_row") else None

    # ----------------------------------------------------------------------------------------- fit
    def fit(self, record: RunRecord | None = None) -> dict[str, Any]:
        """Run the remaining rounds: train → evaluate → hand the row and (every ``save_every`` rounds) a checkpoint
        snapshot to the run record, which writes them in the background (see :mod:`fedlight.record`)."""
        cfg, fabric = self.cfg, self.fabric
        own = record is None
        if own:
            record = RunRecord(self.out_dir, rank0=fabric.global_rank == 0, rounds=cfg.rounds, progress=cfg.progress)
            record.open(None, tensorboard=False, fresh=False)
        try:
            record.begin(self.start_round, self._last_row)
            t_fit, wall0 = time.perf_counter(), self.totals["wall_time_s"]
            for r in range(self.start_round, cfg.rounds):
                row = self._fit_round(r, record)
                if row is None:
                    break
                self.totals["bytes_up"] += row["bytes_up"]
                self.totals["bytes_down"] += row["bytes_down"]
                self.totals["wall_time_s"] = wall0 + time.perf_counter() - t_fit
                row["rss_mb"] = rss_mb()
                snapshot = None
                if ((r + 1) % cfg.save_every == 0 or r + 1 == cfg.rounds) and fabric.global_rank == 0:
                    record.flush()  # the previous checkpoint is durable before the store drops files it named
                    t = time.perf_counter()
                    snapshot = self.checkpoint_state(r + 1)
                    row["checkpoint_time_s"] = time.perf_counter() - t  # the critical-path part: the snapshot
                record.round_done(row, snapshot)
            return self.finish(record)
        finally:
            if own:
                record.close()

    def _fit_round(self, r: int, record: RunRecord) -> dict[str, Any] | None:
        """Train and (when due) evaluate round ``r``; ``None`` when it diverged."""
        self._round_done = r
        record.phase("training", r)
        try:
            row = self.run_round(r)
        except Diverged as d:
            self.diverged_at = d.round + 1
            self.fabric.print(f"fedlight: stopped, diverged in {d}; the last good checkpoint is kept")
            return None
        if (r + 1) % self.cfg.eval_every == 0 or r + 1 == self.cfg.rounds:
            record.phase("evaluating", r)
            t = time.perf_counter()
            row.update(self.evaluate())
            row["eval_time_s"] = time.perf_counter() - t
        return row

    def finish(self, record: RunRecord) -> dict[str, Any]:
        """Write final_model.pt and summary.json from the global model and the record's rows."""
        record.flush()
        summary = summarize(record.rows, self.cfg.targets, self.totals)
        if self.diverged_at is not None:
            summary["diverged_at_round"] = self.diverged_at
        summary.update(record.summary_extra())
        state = None
        if self.fabric.global_rank == 0:
            P.copy_(self.live, self.x)
            P.copy_(self.live_buffers, self.buffers)
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        record.finish(summary, state)
        self.fabric.barrier()
        return summary


def meta_differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What makes a checkpoint's model and clients incompatible with this run (``key is A there and B here``)."""
    return [f"{key} is {there.get(key)!r} there and {here[key]!r} here"
            for key in ("algorithm", "model", "shapes", "num_clients", "seed") if there.get(key) != here[key]]


def _cpu_copy(obj: Any) -> Any:
    return _map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _to(obj: Any, device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def _keys(state: dict[str, Any]) -> tuple:
    """The nested key structure of a client state (clients stack only when theirs agree)."""
    return tuple((k, _keys(v)) if isinstance(v, dict) else (k,) for k, v in sorted(state.items()))
