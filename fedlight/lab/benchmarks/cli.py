"""Benchmarks: what a fedlight round costs next to a minimal hand-written PyTorch FedAvg loop, and at scale.

Entry point: ``python tools/bench.py [sections] [options]`` (``--help``). Sections:

* ``--fit-wall`` (default): the round as a user waits for it: ``fedlight fit`` of the FedAvg Fashion-MNIST recipe
  (shortened rounds) against a minimal hand-written loop of the same work, wall time, one thread each, fresh
  processes, interleaved repeats; median and spread of the ratio (:mod:`fedlight.lab.benchmarks.fit`).
* ``--overhead``: the same FedAvg workload, in one process and interleaved round by round, through
  fedlight's real :class:`~fedlight.engine.loop.FederatedLoop` and through
  :class:`~fedlight.lab.benchmarks.cpu.MinimalFedAvg`; seconds per round of each (median after warm-up), their ratio,
  and the same loop with ``loop.client_parallelism: vmap`` (all clients of the round stacked,
  :mod:`fedlight.runners.stacked`) for the vectorised-client speedup (:mod:`fedlight.lab.benchmarks.cpu`, as are the
  next two).
* ``--multiprocess``: ``fedlight fit`` in subprocesses with ``--devices 1`` and ``--devices 2`` on an MLP /
  Fashion-MNIST recipe (Synthetic when ``FEDLIGHT_DATA`` is unset): speedup, eval share of the run time, peak
  RSS, and the max |difference| of the final models.
* ``--many-clients``: SCAFFOLD with 10,000 clients of the Fashion-MNIST MLP (about 8 GB of ``c_i``) through a
  :class:`~fedlight.engine.client_store.ClientStateStore` with a memory budget; process RSS and the per-round cost
  of the spill.
* ``--lora``: RoBERTa + LoRA on GLUE-shaped token batches (:mod:`fedlight.lab.benchmarks.nlp`, the ``nlp`` extra):
  tokens per second and bytes per round, and the state of 20 stateful clients (adapter-sized, not model-sized).
* ``--gpu``: ResNet-18-CIFAR at CIFAR-100 shapes, ``bf16-mixed``, every seed rule and FedAvg under each client
  runner (:mod:`fedlight.lab.benchmarks.gpu`): s/round, MFU, host/GPU time, peak memory. Needs CUDA; skipped (and
  said so) without it.

Nothing here asserts on time. Timings on shared machines are noisy: every comparison is interleaved and the
medians (and per-round CPU time) are printed next to each other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from fedlight.lab.benchmarks import fit as bench_fit
from fedlight.lab.benchmarks.cpu import many_clients, multiprocess, overhead, overhead_lines
from fedlight.lab.benchmarks.gpu import GPU_VARIANTS, gpu, report_lines
from fedlight.lab.benchmarks.workload import Workload, peak_rss_mb


# ------------------------------------------------------------------------------------------------- environment
def environment() -> dict[str, Any]:
    import lightning
    import numpy

    import fedlight

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        root = Path(__file__).resolve().parent.parent.parent
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        rev = f"{rev}{' + uncommitted changes' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
            "numpy": numpy.__version__, "fedlight": fedlight.__version__, "git": rev,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


# ------------------------------------------------------------------------------------------------- report
def report(results: dict[str, Any]) -> str:
    out = [f"command: {results['command']}", "environment: " + json.dumps(results["environment"])]
    if "fit_wall" in results:
        out += bench_fit.report_lines(results["fit_wall"])
    for o in results.get("overhead", []):
        out += overhead_lines(o)
        out.append(f"  ({o['clients']} clients x {o['steps']} steps x batch {o['batch']}; median of {o['reps']} "
                   f"rounds after {o['warmup']} warm-up; CPU s/round fedlight {o['cpu_s_per_round']['fedlight']:.4f}"
                   f" minimal {o['cpu_s_per_round']['minimal']:.4f}; peak RSS so far {o['peak_rss_mb']:.0f} MB)")
    if "multiprocess" in results:
        m = results["multiprocess"]
        out.append(f"multiprocess ({m['data']}, {m['rounds']} rounds, K={m['local_steps']}, eval every "
                   f"{m['eval_every']}, OMP_NUM_THREADS={m['omp_num_threads']}): s/round 1 proc {m['round_s'][1]:.3f}, "
                   f"2 procs {m['round_s'][2]:.3f}, "
                   f"speedup {m['speedup_round']:.2f}x (whole fit {m['speedup_fit']:.2f}x: {m['fit_wall_s'][1]:.1f} "
                   f"s vs {m['fit_wall_s'][2]:.1f} s); max |final model diff| {m['max_abs_diff_final_model']:.2e}")
        out.append(f"  eval share of fit time: 1 proc {100 * m['eval_share'][1]:.1f}%, 2 procs "
                   f"{100 * m['eval_share'][2]:.1f}%; checkpoints {m['checkpoint_s_total'][1]:.2f} s / "
                   f"{m['checkpoint_s_total'][2]:.2f} s; rank-0 peak RSS {m['rank0_peak_rss_mb'][1]:.0f} MB / "
                   f"{m['rank0_peak_rss_mb'][2]:.0f} MB; final test acc {m['final_test_acc'][1]} / "
                   f"{m['final_test_acc'][2]}")
    if "many_clients" in results:
        c = results["many_clients"]
        out.append(f"many clients (SCAFFOLD, MLP, {c['num_clients']} clients, {c['state_gb_total']:.2f} GB of c_i, "
                   f"budget {c['budget_mb']:.0f} MB): peak RSS {c['peak_rss_rounds_mb']:.0f} MB through the rounds, "
                   f"{c['peak_rss_mb']:.0f} MB with checkpoints (RSS before filling the store "
                   f"{c['rss_before_fill_mb']:.0f} MB, after {c['rss_after_fill_mb']:.0f} MB, after the rounds "
                   f"{c['rss_after_rounds_mb']:.0f} MB); {c['spilled_clients']} clients spilled ({c['disk_gb']:.2f} "
                   f"GB on disk), {c['in_memory_mb']:.0f} MB in memory")
        out.append(f"  s/round spilled {c['round_s']['spilled']:.4f}, in memory {c['round_s']['memory']:.4f}, spill "
                   f"cost {1e3 * c['spill_cost_per_round_s']:+.1f} ms/round (store get {c['store_get_ms']:.2f} ms, "
                   f"put {c['store_put_ms']:.2f} ms per client); filling {c['fill_s']:.1f} s "
                   f"({c['fill_gb_per_s']:.2f} GB/s); checkpoint of the store {c['checkpoint_mb']:.2f} MB, written in "
                   f"{c['checkpoint_s'][0]:.2f} s (first: flushes the in-memory states) / {c['checkpoint_s'][1]:.2f} "
                   f"s (next round); max |x_spilled - x_memory| {c['max_abs_diff_spilled_vs_memory']:.1e}")
    if "lora" in results:
        from fedlight.lab.benchmarks.nlp import report_lines as lora_lines

        out += lora_lines(results["lora"])
    if "gpu" in results:
        out += report_lines(results["gpu"])
    out.append(f"peak RSS of the bench process: {peak_rss_mb():.0f} MB")
    env = results["environment"]
    load = max(env.get("load_average_1m") or 0, env.get("load_average_1m_end") or 0)
    if env["logical_cpus"] and load > env["logical_cpus"] and env["torch_threads"] > 1:
        out.append(f"WARNING: load average {load} on {env['logical_cpus']} CPUs with {env['torch_threads']} torch "
                   "threads: multi-threaded timings on an oversubscribed machine are unreliable (a descheduled "
                   "OpenMP worker stalls every parallel op); rerun with --threads 1 (--mp-threads 1)")
    return "\n".join(out)


def parser(prog: str = "tools/bench.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit-wall", action="store_true",
                   help="whole `fedlight fit` of a recipe vs a minimal loop, wall time, 1 thread each (default)")
    p.add_argument("--fit-rounds", type=int, default=100,
                   help="--fit-wall: rounds of the shortened recipe (100: ~12 min for 6 pairs on 2 cores; fewer rounds "
                        "weigh the once-per-run start-up more: 20 rounds read 1.07 where 100 read 1.03)")
    p.add_argument("--fit-reps", type=int, default=6, help="--fit-wall: interleaved pairs of runs")
    p.add_argument("--recipe", default=bench_fit.RECIPE, help="--fit-wall: the recipe")
    p.add_argument("--overhead", action="store_true", help="fedlight vs the minimal loop, round by round, one process")
    p.add_argument("--multiprocess", action="store_true", help="fedlight fit --devices 1 vs 2 on CPU")
    p.add_argument("--many-clients", action="store_true", help="SCAFFOLD with 10,000 clients, spilled state")
    p.add_argument("--gpu", action="store_true", help="ResNet-18-CIFAR-100 bf16 per rule and runner (needs CUDA)")
    p.add_argument("--gpu-variants", default=None,
                   help="comma-separated algorithm[+sequential|+vmap|+reduce-overhead|+channels_last|+bn] "
                        "(default: every seed rule, FedAvg under each runner, BatchNorm)")
    p.add_argument("--lora", action="store_true", help="RoBERTa-LoRA tokens/s, bytes/round, state of 20 clients")
    p.add_argument("--lora-size", default="tiny", choices=("tiny", "small", "base"),
                   help="--lora: RoBERTa size (tiny: 2 x 32, the CPU default; base: RoBERTa-Base, for a GPU)")
    p.add_argument("--lora-seq", type=int, default=128, help="--lora: tokens per example (the paper's max length)")
    p.add_argument("--all", action="store_true", help="every section (the GPU one when CUDA is available)")
    p.add_argument("--workloads", default="mlp,lenet5", help="overhead workloads: mlp, lenet5 (comma-separated)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--reps", type=int, default=5, help="timed rounds per implementation (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-vmap", dest="vmap", action="store_false", help="skip the vectorised round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--mp-rounds", type=int, default=10)
    p.add_argument("--mp-steps", type=int, default=50)
    p.add_argument("--mp-reps", type=int, default=1)
    p.add_argument("--mp-eval-every", type=int, default=1)
    p.add_argument("--mp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS of every fit process (default: inherited; 1 on shared machines)")
    p.add_argument("--num-clients", type=int, default=10_000, help="--many-clients: clients with state")
    p.add_argument("--budget-mb", type=float, default=512.0, help="--many-clients: in-memory state budget")
    p.add_argument("--mc-rounds", type=int, default=5)
    p.add_argument("--spill-dir", default=None, help="--many-clients: where to spill (default: a temp folder)")
    p.add_argument("--tiny", action="store_true", help="2 clients x 3 steps x batch 8, 1 rep: a smoke test")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--out", default=None, help="also write the text report here")
    return p


def main(argv: list[str] | None = None, prog: str = "tools/bench.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser(prog).parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.tiny:
        a.clients, a.steps, a.batch, a.reps, a.warmup = 2, 3, 8, 1, 0
        a.mp_rounds, a.mp_steps, a.num_clients, a.budget_mb, a.mc_rounds = 2, 3, 40, 1.0, 1
    run_all = a.all
    sections = {k: run_all or getattr(a, k) for k in ("fit_wall", "overhead", "multiprocess", "many_clients", "gpu",
                                                      "lora")}
    if not a.lora and importlib.util.find_spec("transformers") is None:
        sections["lora"] = False  # --all without the nlp extra
    if not any(sections.values()):
        sections["fit_wall"] = True
    cmd = f"python {prog}" if prog.endswith(".py") else prog
    results: dict[str, Any] = {"command": " ".join([cmd, *argv]), "environment": environment()}
    if sections["fit_wall"]:
        results["fit_wall"] = bench_fit.fit_wall(1 if a.tiny else a.fit_reps, 1 if a.tiny else a.fit_rounds,
                                                 a.recipe, tiny=a.tiny)
        print("\n".join(bench_fit.report_lines(results["fit_wall"])), flush=True)
    if sections["overhead"]:
        results["overhead"] = []
        for name in a.workloads.split(","):
            w = Workload(name.strip(), clients=a.clients, steps=a.steps, batch=a.batch)
            results["overhead"].append(overhead(w, a.reps, a.warmup, a.vmap))
            print("\n".join(overhead_lines(results["overhead"][-1])), flush=True)
    if sections["multiprocess"]:
        results["multiprocess"] = multiprocess(a.mp_rounds, a.mp_steps, a.mp_reps, a.mp_eval_every, tiny=a.tiny,
                                               threads=a.mp_threads)
    if sections["many_clients"]:
        results["many_clients"] = many_clients(a.num_clients, a.budget_mb, a.mc_rounds, spill_dir=a.spill_dir)
    if sections["lora"]:
        from fedlight.lab.benchmarks import nlp as bench_nlp

        seq, stateful = (16, 3) if a.tiny else (a.lora_seq, 20)
        acc = "cuda" if a.lora_size == "base" and torch.cuda.is_available() else "cpu"
        results["lora"] = bench_nlp.lora(a.lora_size, a.clients, a.steps if a.tiny else 10, a.batch if a.tiny else 32,
                                         seq, a.reps, a.warmup, stateful, acc, "bf16-mixed" if acc == "cuda" else
                                         "32-true")
    if sections["gpu"] or (run_all and torch.cuda.is_available()):
        variants = tuple(v.strip() for v in a.gpu_variants.split(",")) if a.gpu_variants else GPU_VARIANTS
        results["gpu"] = gpu(a.reps, a.warmup, variants) if not a.tiny else gpu(1, 0, ("fedavg",), 2, 3, 8)
    results["environment"]["load_average_1m_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    text = report(results)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def cmd_bench(argv: list[str]) -> int:
    """``fedlight bench`` (``--peers``: :mod:`fedlight.lab.benchmarks.peers`)."""
    if "--peers" in argv:
        from fedlight.lab.benchmarks.peers import cmd_peers

        return cmd_peers([a for a in argv if a != "--peers"])
    return main(argv, prog="fedlight bench")
