"""The CPU sections of :mod:`fedlight.lab.benchmarks.cli`.

* :func:`overhead` (``--overhead``): the same FedAvg workload, in one process and interleaved round by round,
  through fedlight's real :class:`~fedlight.engine.loop.FederatedLoop`, through :class:`MinimalFedAvg` and (optionally)
  through the same loop with ``loop.client_parallelism: vmap``.
* :func:`multiprocess` (``--multiprocess``): ``fedlight fit`` in subprocesses with ``--devices 1`` and ``--devices 2``.
* :func:`many_clients` (``--many-clients``): SCAFFOLD with 10,000 stateful clients through a spilling
  :class:`~fedlight.engine.client_store.ClientStateStore`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlight.lab.benchmarks.workload import Workload, fedlight_loop, peak_rss_mb, rss_now_mb, timed


# ------------------------------------------------------------------------------------------------- the two loops
class MinimalFedAvg:
    """The reference: a lean FedAvg round written by hand, doing exactly fedlight's per-step work and no more.

    One model and one ``torch.optim.SGD(lr, weight_decay)`` reused for every client (plain SGD keeps no state);
    client tensors in memory on the device; per client: ``torch._foreach_copy_`` of the global model into the
    parameters, one ``randperm`` per epoch from the same generator fedlight uses (so both see the same batches),
    then per step: ``grad = None``, forward + cross-entropy (under bf16 autocast when asked), ``backward``,
    ``clip_grad_norm_(max_grad_norm)`` (the same joint-L2 clip as fedlight's), ``opt.step()`` and a device-side
    loss sum (no host sync); after the client, ``Σ n_i (y_i − x)`` in fp32 with ``_foreach`` ops; after the round,
    ``x += Σ / Σ n_i``. No evaluation, no logging, no checkpoints, no metrics.
    """

    def __init__(self, model: nn.Module, clients, w: Workload, device: torch.device, bf16: bool = False) -> None:
        self.model, self.w, self.device, self.bf16 = model.to(device), w, device, bf16
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=w.lr, weight_decay=w.weight_decay)
        self.x = [p.detach().clone() for p in self.params]
        self.clients = [(x.to(device), y.to(device)) for x, y in clients]

    def round(self, r: int) -> torch.Tensor:
        from fedlight.core.sampling import client_generator

        w, dev = self.w, self.device
        acc = [torch.zeros_like(p) for p in self.params]
        total, loss_sum = 0.0, torch.zeros((), device=dev)
        self.model.train()
        for cid, (x, y) in enumerate(self.clients):
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.x)
            n, gen = len(y), client_generator(w.seed, r, cid)
            epochs = -(-w.steps * w.batch // n)
            order = torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)]).to(dev)
            for s in range(w.steps):
                idx = order[s * w.batch:(s + 1) * w.batch]
                for p in self.params:
                    p.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss = F.cross_entropy(self.model(x[idx]), y[idx])
                loss.backward()
                if w.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.params, w.max_grad_norm)
                self.opt.step()
                loss_sum += loss.detach().float()
            with torch.no_grad():
                torch._foreach_add_(acc, torch._foreach_sub(self.params, self.x), alpha=float(n))
            total += n
        with torch.no_grad():
            torch._foreach_add_(self.x, acc, alpha=1.0 / total)
        return loss_sum / (w.steps * len(self.clients))


def _max_diff(a: list[torch.Tensor] | dict, b: list[torch.Tensor] | dict) -> float:
    a = list(a.values()) if isinstance(a, dict) else a
    b = list(b.values()) if isinstance(b, dict) else b
    return max(float((u.detach().double().cpu() - v.detach().double().cpu()).abs().max()) for u, v in zip(a, b))


# ------------------------------------------------------------------------------------------------- sections
def overhead(w: Workload, reps: int = 5, warmup: int = 2, vectorised: bool = True, accelerator: str = "cpu",
             precision: str = "32-true") -> dict[str, Any]:
    """Interleaved rounds: for r in warm-up + reps: a fedlight round, a minimal round (, a fedlight vmap round)."""
    clients = w.data()
    loop = fedlight_loop(w.model(), clients, w, accelerator, precision)
    device = loop.device
    minimal = MinimalFedAvg(w.model(), clients, w, device, bf16=precision == "bf16-mixed")
    vm = fedlight_loop(w.model(), clients, w, accelerator, precision, parallelism="vmap") if vectorised else None
    times: dict[str, list[tuple[float, float]]] = {"fedlight": [], "minimal": [], "vmap": []}
    for r in range(warmup + reps):
        t = {"fedlight": timed(lambda: loop.run_round(r), device),
             "minimal": timed(lambda: minimal.round(r), device)}
        if vm is not None:
            t["vmap"] = timed(lambda: vm.run_round(r), device)
        if r >= warmup:
            for k, v in t.items():
                times[k].append(v)
    med = {k: statistics.median(x[0] for x in v) for k, v in times.items() if v}
    cpu = {k: statistics.median(x[1] for x in v) for k, v in times.items() if v}
    res = {"workload": w.name, "clients": w.clients, "steps": w.steps, "batch": w.batch, "reps": reps,
           "warmup": warmup, "s_per_round": med, "cpu_s_per_round": cpu,
           "ratio": med["fedlight"] / med["minimal"], "cpu_ratio": cpu["fedlight"] / cpu["minimal"],
           "paired_ratios": [f[0] / m[0] for f, m in zip(times["fedlight"], times["minimal"])],
           "paired_cpu_ratios": [f[1] / m[1] for f, m in zip(times["fedlight"], times["minimal"])],
           "max_abs_diff_fedlight_vs_minimal": _max_diff(loop.x, minimal.x),
           "peak_rss_mb": peak_rss_mb()}
    if vm is not None:
        res["vmap_speedup"] = med["fedlight"] / med["vmap"]
        res["vmap_speedup_vs_minimal"] = med["minimal"] / med["vmap"]
        res["vmap_cpu_speedup"] = cpu["fedlight"] / cpu["vmap"]
        res["max_abs_diff_vmap_vs_minimal"] = _max_diff(vm.x, minimal.x)
        shutil.rmtree(vm.out_dir, ignore_errors=True)
    shutil.rmtree(loop.out_dir, ignore_errors=True)
    return res


def _fit_config(path: Path, rounds: int, steps: int, eval_every: int, tiny: bool = False) -> str:
    import yaml

    if tiny:
        data = {"class_path": "fedlight.data.Synthetic",
                "init_args": {"num_clients": 20, "dim": 784, "samples_per_client": 40, "batch_size": 8}}
        model_in, name = 784, "Synthetic(1, 1), dim 784, 20 clients (tiny)"
    elif os.environ.get("FEDLIGHT_DATA"):
        data = {"class_path": "fedlight.data.FashionMNIST",
                "init_args": {"num_clients": 100, "batch_size": 50,
                              "partition": {"class_path": "fedlight.data.Dirichlet",
                                            "init_args": {"alpha": 0.1, "by": "client"}}}}
        model_in, name = 784, "FashionMNIST, Dir(0.1) by client, 100 clients"
    else:
        data = {"class_path": "fedlight.data.Synthetic",
                "init_args": {"num_clients": 100, "dim": 784, "samples_per_client": 750, "batch_size": 50}}
        model_in, name = 784, "Synthetic(1, 1), dim 784, 100 clients × 600 train samples"
    cfg = {"seed": 0, "model": {"class_path": "fedlight.models.MLP",
                                "init_args": {"in_features": model_in, "hidden": [200, 200], "num_classes": 10}},
           "data": data, "algorithm": {"class_path": "fedlight.algorithms.FedAvg"},
           "loop": {"rounds": rounds, "clients_per_round": 10, "local_steps": steps, "lr": 0.05,
                    "weight_decay": 1e-3, "max_grad_norm": 10.0, "eval_every": eval_every, "progress": False}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return name


def _run_fit(cfg: Path, out: Path, devices: int, threads: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", str(cfg), "--devices", str(devices),
           "--accelerator", "cpu", "--out_dir", str(out), "--overwrite", "true"]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    t = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    later = rows[1:] if len(rows) > 1 else rows  # the first round pays one-off start-up costs
    fit_time = summary["wall_time_s"]
    return {"devices": devices, "process_wall_s": wall, "fit_wall_s": fit_time,
            "round_s_median": statistics.median(r["round_time_s"] for r in later),
            "eval_s_total": sum(r.get("eval_time_s", 0.0) for r in rows),
            "checkpoint_s_total": sum(r.get("checkpoint_time_s", 0.0) for r in rows),
            "eval_share": sum(r.get("eval_time_s", 0.0) for r in rows) / fit_time,
            "rank0_peak_rss_mb": usage.ru_maxrss / 1024, "final_test_acc": summary.get("final_test_acc"),
            "model": torch.load(out / "final_model.pt", weights_only=True)}


def multiprocess(rounds: int = 10, steps: int = 50, reps: int = 1, eval_every: int = 1,
                 workdir: str | None = None, tiny: bool = False, threads: int | None = None) -> dict[str, Any]:
    """``fedlight fit --devices 1`` vs ``--devices 2`` (CPU, gloo), interleaved ``reps`` times.

    ``threads`` sets ``OMP_NUM_THREADS`` for every process; unset, the 1-process run uses torch's default and
    Lightning gives each of the 2 processes ``cpus // 2`` threads."""
    root = Path(workdir or tempfile.mkdtemp(prefix="fedlight-bench-mp-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "bench_mlp.yaml"
    data_name = _fit_config(cfg, rounds, steps, eval_every, tiny)
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for i in range(reps):
        for n in (1, 2):
            runs[n].append(_run_fit(cfg, root / f"run_d{n}_{i}", n, threads))
    one, two = runs[1], runs[2]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    diff = max(_max_diff(a["model"], b["model"]) for a in one for b in two)
    res = {"data": data_name, "rounds": rounds, "local_steps": steps, "eval_every": eval_every, "reps": reps,
           "omp_num_threads": threads or os.environ.get("OMP_NUM_THREADS", "default"),
           "config": cfg.read_text(),
           "round_s": {1: med(one, "round_s_median"), 2: med(two, "round_s_median")},
           "fit_wall_s": {1: med(one, "fit_wall_s"), 2: med(two, "fit_wall_s")},
           "process_wall_s": {1: med(one, "process_wall_s"), 2: med(two, "process_wall_s")},
           "eval_share": {1: med(one, "eval_share"), 2: med(two, "eval_share")},
           "eval_s_total": {1: med(one, "eval_s_total"), 2: med(two, "eval_s_total")},
           "checkpoint_s_total": {1: med(one, "checkpoint_s_total"), 2: med(two, "checkpoint_s_total")},
           "rank0_peak_rss_mb": {1: max(r["rank0_peak_rss_mb"] for r in one),
                                 2: max(r["rank0_peak_rss_mb"] for r in two)},
           "final_test_acc": {1: one[0]["final_test_acc"], 2: two[0]["final_test_acc"]},
           "max_abs_diff_final_model": diff}
    res["speedup_round"] = res["round_s"][1] / res["round_s"][2]
    res["speedup_fit"] = res["fit_wall_s"][1] / res["fit_wall_s"][2]
    if workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return res


def many_clients(num_clients: int = 10_000, budget_mb: float = 512.0, rounds: int = 5, samples: int = 5,
                 spill_dir: str | None = None, clients_per_round: int = 10) -> dict[str, Any]:
    """SCAFFOLD, MLP 784-200-200-10: every client holds a ``c_i`` (0.8 MB); the store keeps ``budget_mb`` in
    memory and spills the rest. Compares the same rounds against an in-memory store holding only the states the
    measured rounds touch (same compute, no spill)."""
    from fedlight.core import params as P
    from fedlight.core.sampling import sample_clients
    from fedlight.engine.client_store import ClientStateStore
    from fedlight.run.files import atomic_torch_save

    w = Workload("mlp", clients=num_clients, steps=samples, batch=samples)
    g = torch.Generator().manual_seed(0)
    clients = [(torch.randn(samples, 1, 28, 28, generator=g), torch.randint(0, 10, (samples,), generator=g))
               for _ in range(num_clients)]
    spill = Path(spill_dir or tempfile.mkdtemp(prefix="fedlight-bench-spill-"))
    from fedlight.data import TensorClients

    data = TensorClients(clients, batch_size=samples, num_classes=10)
    del clients
    spilled = fedlight_loop(w.model(), None, w, algorithm="scaffold", data=data)
    memory = fedlight_loop(w.model(), None, w, algorithm="scaffold", data=data)
    for lp in (spilled, memory):
        lp.cfg.clients_per_round = clients_per_round
    spilled.state.store = ClientStateStore("cpu", budget_bytes=int(budget_mb * 2**20), spill_dir=spill / "client_state")
    base = P.zeros_like(spilled.x)
    per_client = P.nbytes(base)
    touched = {c for r in range(rounds + 1) for c in sample_clients(num_clients, clients_per_round, w.seed, r)}
    rss0 = rss_now_mb()
    t = time.perf_counter()
    for cid in range(num_clients):  # every client has been trained once before: c_i = cid·1e-6 (any values do)
        state = {"c_i": {k: torch.full_like(v, cid * 1e-6) for k, v in base.items()}}
        spilled.store.put(cid, state)
        if cid in touched:
            memory.store.put(cid, state)
    fill_s, rss_fill = time.perf_counter() - t, rss_now_mb()
    counters = {"get": [0, 0.0], "put": [0, 0.0]}

    def counted(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            counters[name][0] += 1
            counters[name][1] += time.perf_counter() - t0
            return out
        return wrapper

    spilled.store.get, spilled.store.put = counted("get", spilled.store.get), counted("put", spilled.store.put)
    ts: dict[str, list[float]] = {"spilled": [], "memory": []}
    for r in range(rounds + 1):  # round 0 is a warm-up
        for name, lp in (("spilled", spilled), ("memory", memory)):
            dt = timed(lambda: lp.run_round(r), lp.device)[0]
            if r > 0:
                ts[name].append(dt)
    diff = _max_diff(spilled.x, memory.x)
    rss_rounds, peak_rounds = rss_now_mb(), peak_rss_mb()
    spilled_n, disk_bytes = len(spilled.store._disk), spilled.store.disk_bytes
    ckpt, ckpt_s = spill / "last.ckpt", []
    for i in range(2):  # the first checkpoint also writes the in-memory states to files; the second follows a round
        if i:
            spilled.run_round(rounds + 1)
        t = time.perf_counter()
        atomic_torch_save({"store": spilled.store.state_dict()}, ckpt)
        ckpt_s.append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in ts.items()}
    n_get, n_put = counters["get"][0], counters["put"][0]
    res = {"num_clients": num_clients, "state_mb_per_client": per_client / 2**20,
           "state_gb_total": per_client * num_clients / 1e9, "budget_mb": budget_mb,
           "in_memory_mb": spilled.store.mem_bytes / 2**20, "spilled_clients": spilled_n,
           "disk_gb": disk_bytes / 1e9, "fill_s": fill_s,
           "fill_gb_per_s": per_client * num_clients / 1e9 / fill_s,
           "round_s": med, "spill_cost_per_round_s": med["spilled"] - med["memory"],
           "store_get_ms": 1e3 * counters["get"][1] / max(n_get, 1),
           "store_put_ms": 1e3 * counters["put"][1] / max(n_put, 1),
           "max_abs_diff_spilled_vs_memory": diff,
           "checkpoint_mb": ckpt.stat().st_size / 2**20, "checkpoint_s": ckpt_s,
           "rss_before_fill_mb": rss0, "rss_after_fill_mb": rss_fill, "rss_after_rounds_mb": rss_rounds,
           "peak_rss_rounds_mb": peak_rounds, "peak_rss_mb": peak_rss_mb()}
    for lp in (spilled, memory):
        shutil.rmtree(lp.out_dir, ignore_errors=True)
    if spill_dir is None:
        shutil.rmtree(spill, ignore_errors=True)
    return res


# ------------------------------------------------------------------------------------------------- report
def overhead_lines(o: dict[str, Any]) -> list[str]:
    """The ``--overhead`` section's report for one workload: the fedlight / minimal ratio (and the vmap speedup)."""
    s = o["s_per_round"]
    pr, pc = sorted(o["paired_ratios"]), sorted(o["paired_cpu_ratios"])
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    lines = [f"overhead {o['workload']}: fedlight {s['fedlight']:.4f} s/round, minimal {s['minimal']:.4f} s/round, "
             f"ratio {o['ratio']:.3f} (CPU-time ratio {o['cpu_ratio']:.3f}; per-rep ratios wall median "
             f"{statistics.median(pr):.3f} [quartiles {q(pr, 0.25):.3f}-{q(pr, 0.75):.3f}], CPU median "
             f"{statistics.median(pc):.3f} [{q(pc, 0.25):.3f}-{q(pc, 0.75):.3f}]; max |x_fedlight - x_minimal| "
             f"{o['max_abs_diff_fedlight_vs_minimal']:.2e})"]
    if "vmap" in s:
        lines.append(f"vectorised {o['workload']}: fedlight loop.client_parallelism=vmap {s['vmap']:.4f} s/round, "
                     f"speedup {o['vmap_speedup']:.2f}x over fedlight sequential, "
                     f"{o['vmap_speedup_vs_minimal']:.2f}x over minimal; CPU-time speedup {o['vmap_cpu_speedup']:.2f}x "
                     f"(max |x_vmap - x_minimal| {o['max_abs_diff_vmap_vs_minimal']:.2e})")
    return lines
