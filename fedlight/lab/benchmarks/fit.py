"""The round as a user waits for it: ``fedlight fit`` of a recipe against a minimal hand-written loop of the same work.

``python tools/bench.py --fit-wall`` (the default section). Both sides run in fresh processes with one torch thread
(``OMP_NUM_THREADS=1``), interleaved (fit, minimal, minimal, fit, ...), and are timed in WALL seconds from the start
of the work (config, data decode and partition, model) to the end of the last round; both load the same libraries
(torch, Lightning, fedlight) before the clock starts, so imports are excluded alike:

* **fit**:
  ``fedlight.config.cli.main(["fit", "--config", <recipe with shortened rounds>, ...])``: everything a user gets
  (Fabric, run directory and lock, config.yaml, metrics.jsonl, TensorBoard with per-client histograms, a checkpoint
  every round written by the background thread, summary.json, final_model.pt).
* **minimal**: the same recipe's data module, model and seeds, then a hand-written FedAvg loop: per round the same
  sampled clients, per client one SGD (lr schedule, weight decay), the same batches (one ``randperm`` per epoch
  from the client's generator), joint clip, a device-side loss sum, weighted mean of the updates, and evaluation of
  the test set after each round (as ``eval_every: 1``). Nothing written.

Printed: each side's wall seconds, the per-pair ratio fit/minimal (median and spread), the ratio of medians, the CPU
seconds of fit's background threads (process CPU minus main-thread CPU: the checkpoint writer and the TensorBoard
event writer), the load average around every run, and the max |difference| of the two final models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()

RECIPE = "recipes/fedavg_mlp_fmnist_dir0.1.yaml"


def shortened(recipe: Path, rounds: int, out: Path, tiny: bool = False) -> Path:
    """``recipe`` with ``loop.rounds`` set (and, ``tiny``, synthetic data and one local step: a smoke test)."""
    import yaml

    cfg = yaml.safe_load(recipe.read_text())
    cfg["loop"]["rounds"] = rounds
    cfg["loop"]["progress"] = False
    if tiny:
        cfg["data"] = {"class_path": "fedlight.data.Synthetic",
                       "init_args": {"num_clients": 12, "dim": 784, "samples_per_client": 20, "batch_size": 10}}
        cfg["loop"].update(local_epochs=None, local_steps=2, clients_per_round=3)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


# ------------------------------------------------------------------------------------------------- the two sides
def side_fit(config: Path, out: Path) -> dict[str, Any]:
    from fedlight.config import cli

    code = cli.main(["fit", "--config", str(config), "--accelerator", "cpu", "--out_dir", str(out),
                     "--overwrite", "true"])
    if code != 0:
        raise SystemExit(f"fedlight fit exited {code}")
    import torch

    summary = json.loads((out / "summary.json").read_text())
    return {"final_test_acc": summary["final_test_acc"], "final_train_loss": summary["final_train_loss"],
            "model": {k: v for k, v in torch.load(out / "final_model.pt", weights_only=True).items()}}


def side_minimal(config: Path, out: Path) -> dict[str, Any]:
    """The hand-written loop (see the module docstring)."""
    import torch
    import yaml

    from fedlight.core.spec import build

    cfg = yaml.safe_load(config.read_text())
    loop, seed = cfg["loop"], cfg.get("seed", 0)
    torch.manual_seed(seed)
    model = build(cfg["model"])
    data = build(cfg["data"])
    data.setup("cpu", seed)
    params = [p for p in model.parameters() if p.requires_grad]
    x = [p.detach().clone() for p in params]
    acc = None
    for r in range(loop["rounds"]):
        _round(model, params, x, data, loop, seed, r)
        acc = _evaluate(model, params, x, data)
    return {"final_test_acc": acc, "model": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _round(model, params, x, data, loop: dict, seed: int, r: int) -> None:
    import torch
    import torch.nn.functional as F

    from fedlight.core.sampling import client_generator, sample_clients

    lr = loop["lr"] * loop.get("lr_schedule", {}).get("decay", 1.0) ** r \
        if loop.get("lr_schedule", {}).get("kind") == "exponential" else loop["lr"]
    total, sums = 0.0, [torch.zeros_like(p) for p in params]
    loss_sum = torch.zeros(())
    model.train()
    for c in sample_clients(data.num_clients, loop["clients_per_round"], seed, r):
        with torch.no_grad():
            torch._foreach_copy_(params, x)
        opt = torch.optim.SGD(params, lr=lr, weight_decay=loop.get("weight_decay", 0.0))
        idx, B = data._client_idx[c], data.batch_size
        n, gen = len(idx), client_generator(seed, r, c)
        K = loop.get("local_steps") or (loop.get("local_epochs") or 1) * math.ceil(n / B)
        order = torch.cat([torch.randperm(n, generator=gen) for _ in range(math.ceil(K / math.ceil(n / B)))])
        starts = [e * n + a for e in range(len(order) // n) for a in range(0, n, B)][:K]
        rows = idx[order]
        for s in starts:
            end = min(s + B, (s // n + 1) * n)
            batch = rows[s:end]
            for p in params:
                p.grad = None
            loss = F.cross_entropy(model(data.to_input(data._train_x[batch])), data._train_y[batch])
            loss.backward()
            if loop.get("max_grad_norm"):
                torch.nn.utils.clip_grad_norm_(params, loop["max_grad_norm"])
            opt.step()
            loss_sum += loss.detach()
        with torch.no_grad():
            torch._foreach_add_(sums, torch._foreach_sub(params, x), alpha=float(n))
        total += n
    with torch.no_grad():
        torch._foreach_add_(x, sums, alpha=1.0 / total)
    float(loss_sum)  # the user sees the round's loss


def _evaluate(model, params, x, data) -> float:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        torch._foreach_copy_(params, x)
        model.eval()
        right, loss, count = 0, torch.zeros(()), 0
        for xb, yb in data.test_batches():
            logits = model(xb)
            right += int((logits.argmax(1) == yb).sum())
            loss += F.cross_entropy(logits, yb, reduction="sum")
            count += len(yb)
    float(loss)
    return right / count


def _import_libraries() -> None:
    """Both sides load the same libraries before the clock starts (torch's own lazy imports, e.g. of
    ``torch._dynamo`` at the first optimizer step, come with Lightning): the ratio compares the work, not imports.
    What ``fit`` imports lazily beyond them (TensorBoard, matplotlib) is part of its work."""
    import lightning  # noqa: F401
    import torch.optim  # noqa: F401

    import fedlight.config.api  # noqa: F401
    import fedlight.config.cli  # noqa: F401
    import fedlight.core.spec  # noqa: F401
    import fedlight.data  # noqa: F401
    import fedlight.engine.loop  # noqa: F401
    import fedlight.models  # noqa: F401


def run_side(side: str, config: Path, out: Path, t_start: float) -> dict[str, Any]:
    """Run one side in this process, timed from the start of the work (the modules a user's script or the
    ``fedlight`` command imports first are loaded; what they import lazily is part of the work)."""
    import torch

    _import_libraries()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    imports = time.perf_counter() - t_start
    t, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    res = (side_fit if side == "fit" else side_minimal)(config, out)
    wall, cpu, main = time.perf_counter() - t, time.process_time() - cpu, time.thread_time() - main
    model = res.pop("model")
    torch.save(model, out.parent / f"{out.name}.model.pt")
    return {"side": side, "wall_s": wall, "imports_s": imports, "cpu_s": cpu, "main_thread_cpu_s": main,
            "background_cpu_s": cpu - main,
            "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "threads": torch.get_num_threads(), **res}


# ------------------------------------------------------------------------------------------------- orchestration
def fit_wall(reps: int = 6, rounds: int = 5, recipe: str = RECIPE, workdir: str | None = None,
             tiny: bool = False) -> dict[str, Any]:
    """``reps`` interleaved pairs of fresh processes (the order alternates so drift cancels); see the module doc."""
    import torch

    from fedlight.config import locate

    root = Path(workdir or tempfile.mkdtemp(prefix="fedlight-bench-fit-"))
    here = locate.find(recipe)
    root.mkdir(parents=True, exist_ok=True)
    config = shortened(here, rounds, root / "recipe.yaml", tiny)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
    runs: dict[str, list[dict[str, Any]]] = {"fit": [], "minimal": []}
    for i in range(reps):
        for side in (("fit", "minimal") if i % 2 == 0 else ("minimal", "fit")):
            out = root / f"{side}{i}"
            res = subprocess.run([sys.executable, "-m", "fedlight.lab.benchmarks.fit", side, str(config), str(out)],
                                 capture_output=True, text=True, env=env, timeout=3600)
            if res.returncode != 0:
                raise RuntimeError(f"{side} run {i} failed:\n{res.stderr[-3000:]}")
            runs[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
    fit, mini = runs["fit"], runs["minimal"]
    ratios = [f["wall_s"] / m["wall_s"] for f, m in zip(fit, mini)]
    a = torch.load(root / "fit0.model.pt", weights_only=True)
    b = torch.load(root / "minimal0.model.pt", weights_only=True)
    return {"recipe": recipe, "rounds": rounds, "reps": reps, "config": config.read_text(), "runs": runs,
            "ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "wall_median": {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()},
            "cpu_ratios": [f["cpu_s"] / m["cpu_s"] for f, m in zip(fit, mini)],
            "background_cpu_s_median": statistics.median(r["background_cpu_s"] for r in fit),
            "threads": {k: sorted({r["threads"] for r in v}) for k, v in runs.items()},
            "final_test_acc": {k: v[0]["final_test_acc"] for k, v in runs.items()},
            "max_abs_diff_final_model": max(float((a[k].double() - b[k].double()).abs().max()) for k in b)}


def _walls(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['wall_s']:.2f}" for r in runs)


def report_lines(f: dict[str, Any]) -> list[str]:
    w, lo, hi = f["wall_median"], *f["ratio_spread"]
    loads = [ld for v in f["runs"].values() for r in v for ld in r["load_1m"]]
    return [
        f"fit-wall {f['recipe']} ({f['rounds']} rounds, {f['reps']} interleaved pairs, threads fit "
        f"{f['threads']['fit']} minimal {f['threads']['minimal']}): wall ratio fedlight fit / minimal median "
        f"{f['ratio_median']:.3f}, spread {lo:.3f}-{hi:.3f}; ratio of medians {w['fit'] / w['minimal']:.3f}",
        f"  wall s per run: fit median {w['fit']:.2f} [{_walls(f['runs']['fit'])}], minimal median "
        f"{w['minimal']:.2f} [{_walls(f['runs']['minimal'])}]",
        f"  CPU seconds (all threads) ratio fit / minimal median {statistics.median(f['cpu_ratios']):.3f}, spread "
        f"{min(f['cpu_ratios']):.3f}-{max(f['cpu_ratios']):.3f} (not counting time spent descheduled)",
        f"  fit background threads (checkpoint + TensorBoard writers) CPU {f['background_cpu_s_median']:.3f} s per "
        f"run ({100 * f['background_cpu_s_median'] / w['fit']:.2f} % of its wall); load average (1 min) during "
        f"the runs {min(loads):.2f}-{max(loads):.2f}; final test acc fit {f['final_test_acc']['fit']:.4f} minimal "
        f"{f['final_test_acc']['minimal']:.4f}; max |final model difference| {f['max_abs_diff_final_model']:.2e}"]


def main(argv: list[str] | None = None) -> int:
    """``python -m fedlight.lab.benchmarks.fit SIDE CONFIG OUT``: one timed side; prints its JSON line."""
    p = argparse.ArgumentParser(prog="python -m fedlight.lab.benchmarks.fit")
    p.add_argument("side", choices=("fit", "minimal"))
    p.add_argument("config", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    res = run_side(a.side, a.config, a.out, T_START)
    sys.stdout.flush()
    print("\n" + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
