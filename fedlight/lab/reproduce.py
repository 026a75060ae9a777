"""``fedlight reproduce SPEC``: re-run a paper table with one command and put the paper's numbers next to ours.

A *table spec* (``recipes/tables/*.yaml``) names a base recipe, a grid of overrides and the paper's values::

    title: FedWMSAM (NeurIPS'25) Table 1 — test accuracy (%) after 500 rounds
    base: recipes/fedwmsam_mlp_fmnist_dir0.1.yaml
    metric: final_test_acc            # final_test_<m> | best_test_<m> | last_test_<m>:<k> | rounds_to_target:<t>
    also: [best_test_acc]             #   | seconds_per_round | final_train_loss; `also`: extra metrics (no paper
                                      #   value); <m>: a metric the task reports (acc, mse, perplexity, mcc, ...)
    overrides: {loop.eval_every: 1}   # applied to every cell
    rows:    {fedavg: {algorithm: {class_path: fedlight.algorithms.FedAvg}}, ...}
    columns: {dir0.1: {}, dir0.6: {data.init_args.partition.init_args.alpha: 0.6}, ...}
    cell_overrides: {fedadamw/vit: {algorithm.init_args.blocks: hessian}}
    paper:   {fedavg: {dir0.1: 82.26, dir0.6: 86.84}, ...}   # null or absent: the paper has no number
    baseline: fedavg                  # optional: each cell's gap to this row (paired by seed), sign vs the paper's
    notes: how this setup differs from the paper's

Overrides are ``fedlight fit`` flags without the dashes (``loop.rounds: 2`` → ``--loop.rounds 2``). A column
may also carry ``metric:``; columns that differ only in it share one set of runs (e.g. rounds to 70 % and to 72 %).
Cell ``row/col`` runs, for seed k, as the subprocess ``python -m fedlight.config.cli fit --config BASE <overrides>
--seed k --out_dir OUT/<row>/<col>/seed<k> --resume auto``: ``--jobs`` is process parallelism, finished runs
are skipped, interrupted ones resume, and ``reproduce.json`` keeps another command from reusing a run folder.
Accuracies are in %, like the papers' tables.

Launchers: ``--launcher local`` (default) runs the processes here, ``--jobs`` at a time (or ``--per-gpu N`` per
visible GPU); ``--launcher slurm`` submits them as Slurm jobs through submitit (:mod:`fedlight.lab.slurm`), requeued
with ``--resume auto`` on preemption or time-out. Either way each run folder keeps ``fit.log`` and ``job.json``, and
``--status`` shows where every run stands (:mod:`fedlight.lab.jobs`).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlight.config.cli import recipes_dir
from fedlight.errors import ConfigError, check
from fedlight.lab import gpu_share
from fedlight.lab import report as rep
from fedlight.lab.jobs import Children

SHRINK_KEYS = {"rounds": "loop.rounds", "subset": "data.init_args.subset", "test_subset": "data.init_args.test_subset"}
SPEC_KEYS = {"title", "base", "metric", "also", "overrides", "rows", "columns", "cell_overrides", "paper", "notes",
             "seeds", "slurm", "baseline"}


@dataclass
class Cell:
    row: str
    col: str
    metric: str
    overrides: dict[str, Any]
    run_key: str  # runs live in OUT/<run_key>/seed<k>, run_key = <row>/<column>
    values: dict[str, list] = field(default_factory=dict)  # metric -> per-seed value (None: not reached)
    diverged: int = 0  # seeds whose run stopped on a non-finite model (their values are the last good round's)
    revisions: list = field(default_factory=list)  # per seed: git revision of its run, "missing", or "earlier"
    earlier: int = 0  # seeds whose values come from an earlier table.csv (``--previous``), not a run under --out

    @property
    def name(self) -> str:
        return f"{self.row}/{self.col}"


# ------------------------------------------------------------------------------------------------ the spec
def find_spec(name: str) -> Path:
    p = Path(name)
    for cand in (p, recipes_dir() / "tables" / p, recipes_dir() / "tables" / f"{name}.yaml"):
        if cand.is_file():
            return cand
    raise ConfigError(f"table spec {name!r} not found (looked at {p} and {recipes_dir() / 'tables'})")


def load_spec(path: Path) -> dict[str, Any]:
    import yaml

    spec = yaml.safe_load(Path(path).read_text()) or {}
    where = f"table spec {path}"
    check(isinstance(spec, dict), f"{where} must be a mapping")
    check(not set(spec) - SPEC_KEYS, f"{where}: unknown keys {sorted(set(spec) - SPEC_KEYS)}")
    for k in ("title", "base", "metric", "rows"):
        check(k in spec, f"{where} lacks `{k}`")
    check(isinstance(spec["rows"], dict) and spec["rows"], f"{where}: `rows` must map names to overrides")
    spec.setdefault("columns", {"result": {}})
    for part in ("rows", "columns", "cell_overrides"):
        for name, ov in (spec.get(part) or {}).items():
            check(isinstance(ov, dict) or ov is None, f"{where}: {part}.{name} must be a mapping of overrides")
            check("/" not in name or part == "cell_overrides", f"{where}: {part} name {name!r} must not hold '/'")
    for m in spec_metrics(spec):
        rep.check_metric(m)
    unknown = {f"{r}/{c}" for r, cols in (spec.get("paper") or {}).items() for c in (cols or {})}
    unknown -= {f"{r}/{c}" for r in spec["rows"] for c in spec["columns"]}
    unknown |= set(spec.get("cell_overrides") or {}) - {f"{r}/{c}" for r in spec["rows"] for c in spec["columns"]}
    check(not unknown, f"{where}: `paper`/`cell_overrides` name cells that are not in the grid: {sorted(unknown)}")
    check(spec.get("baseline") is None or spec["baseline"] in spec["rows"],
          f"{where}: `baseline` must name a row ({', '.join(spec['rows'])}), got {spec.get('baseline')!r}")
    return spec


def spec_metrics(spec: dict[str, Any]) -> list[str]:
    return [spec["metric"], *spec.get("also", []), *(c["metric"] for c in spec["columns"].values()
                                                     if c and "metric" in c)]


def check_task_metrics(spec: dict[str, Any]) -> None:
    """Refuse, before any run starts, a table metric the base recipe's task does not report."""
    produced = task_metrics(base_path(spec))
    if produced is None:
        return
    missing = sorted({k for m in spec_metrics(spec) if (k := rep.curve_key(m)) is not None} - set(produced))
    check(not missing, f"table spec metric(s) {', '.join(missing)} are not reported by the task of {spec['base']} "
          f"(it reports {', '.join(produced)}); use one of those, e.g. `metric: final_{produced[0]}`")


def task_metrics(recipe: Path) -> tuple[str, ...] | None:
    """The ``test_*`` keys the recipe's task reports: its ``task``, else its data module's default task; None when
    only a run can tell (a LightningModule's own test_step)."""
    import yaml

    from fedlight.core.spec import build

    cfg = yaml.safe_load(recipe.read_text()) or {}
    try:
        if cfg.get("task"):
            return build(cfg["task"]).metric_names()
        if _is_lightning_module((cfg.get("model") or {}).get("class_path")) or not cfg.get("data"):
            return None
        return build(cfg["data"]).default_task().metric_names()
    except (ConfigError, ImportError, TypeError, ValueError, AttributeError):
        return None


def _is_lightning_module(path: str | None) -> bool:
    import importlib

    if not path or "." not in path:
        return False
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    # by the class's own bases, so a plain nn.Module does not import Lightning (seconds at every `--status`)
    return isinstance(cls, type) and any(c.__name__ == "LightningModule" and c.__module__.split(".")[0] in
                                         ("lightning", "pytorch_lightning") for c in cls.__mro__)


def base_path(spec: dict[str, Any]) -> Path:
    p = Path(spec["base"])
    return p if p.is_file() else recipes_dir().parent / p


def cells(spec: dict[str, Any]) -> list[Cell]:
    """The grid, column by column. Runs live in OUT/<row>/<column>/seed<k>; columns that differ only in their
    ``metric`` (e.g. accuracy after 1000 rounds and rounds to 78 % of the same runs) share the runs of the first
    such column."""
    cols = {c: dict(v or {}) for c, v in spec["columns"].items()}
    out, first = [], {}
    for col, cov in cols.items():
        metric = cov.pop("metric", spec["metric"])
        for row, rov in spec["rows"].items():
            extra = (spec.get("cell_overrides") or {}).get(f"{row}/{col}") or {}
            ov = {**(spec.get("overrides") or {}), **cov, **(rov or {}), **extra}
            owner = first.setdefault((row, json.dumps([cov, extra], sort_keys=True, default=str)), col)
            out.append(Cell(row, col, metric, ov, f"{row}/{owner}"))
    return out


def flags(overrides: dict[str, Any]) -> list[str]:
    """``{"loop.rounds": 2, "algorithm": {...}}`` → ``["--loop.rounds", "2", "--algorithm", '{...}']``."""
    out = []
    for k, v in overrides.items():
        if isinstance(v, bool) or v is None:
            v = json.dumps(v)
        elif isinstance(v, (dict, list)):
            v = json.dumps(v)
        out += [f"--{k}", str(v)]
    return out


def shrink_overrides(text: str | None, spec: dict[str, Any], cell: Cell) -> dict[str, Any]:
    """``rounds=2,subset=512,test_subset=256`` (or any ``dotted.key=value``) → overrides; data keys the cell's
    data class does not take (Synthetic has no ``subset``) are skipped."""
    import yaml

    out: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        check("=" in item, f"`--shrink` takes key=value pairs, got {item!r}")
        k, v = item.split("=", 1)
        out[_shrink_key(k.strip())] = yaml.safe_load(v)
    data = yaml.safe_load(base_path(spec).read_text()).get("data") or {}
    for k, v in cell.overrides.items():
        if k == "data" and isinstance(v, dict) and "class_path" in v:
            data = v
    mod, _, name = data.get("class_path", "").rpartition(".")
    params = _init_params(getattr(__import__(mod, fromlist=[name]), name)) if mod else set()
    return {k: v for k, v in out.items() if not k.startswith("data.init_args.") or k.split(".")[2] in params}


def _shrink_key(key: str) -> str:
    """The ``fedlight fit`` setting a ``--shrink`` key names; one fit does not take is refused here, before any run
    starts (else every run would fail with it)."""
    import dataclasses
    import inspect

    from fedlight.config.api import fit
    from fedlight.core.loop_config import LoopConfig
    from fedlight.core.registry import closest

    if key in SHRINK_KEYS:
        return SHRINK_KEYS[key]
    top, _, rest = key.partition(".")
    tops = [n for n in inspect.signature(fit).parameters if not n.startswith("_")]
    loops = [f"loop.{f.name}" for f in dataclasses.fields(LoopConfig)]
    known = [*SHRINK_KEYS, *tops, *loops]
    bad = top not in tops or (top == "loop" and f"loop.{rest.split('.')[0]}" not in loops) or \
        (top in ("model", "data", "algorithm") and rest.split(".")[0] != "init_args")
    if bad:
        near = next((f"; did you mean {k!r}?" for k in loops if k == f"loop.{key}"), "") or closest(key, known)
        raise ConfigError(f"`--shrink`: {key!r} is not a setting of `fedlight fit`{near} (short keys: "
                          f"{', '.join(SHRINK_KEYS)}; else a dotted key such as loop.eval_every or "
                          "data.init_args.subset)")
    return key


def _init_params(cls: type) -> set[str]:
    """Constructor arguments of ``cls``, following ``**kwargs`` into the base classes (as jsonargparse does)."""
    import inspect

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return names


# ------------------------------------------------------------------------------------------------ running
IDENTITY = ("base", "flags")
"""The keys of a run's ``reproduce.json`` that say what experiment it is (``execution`` may differ on resume)."""

EXECUTION_FLAGS = ("--loop.client_parallelism", "--loop.vmap_chunk", "--loop.channels_last", "--loop.compile",
                   "--loop.state_budget_mb", "--loop.state_device", "--loop.save_every", "--loop.progress",
                   "--devices", "--num_nodes", "--accelerator", "--loggers")
"""``fedlight fit`` flags that change how a run executes, not what it computes (up to floating-point order)."""


def execution_args(text: str | None) -> list[str]:
    """Parse ``--fit-args``; only :data:`EXECUTION_FLAGS` are allowed (they do not change a cell's experiment)."""
    args = shlex.split(text or "")
    for a in args:
        if a.startswith("--") and a.split("=", 1)[0] not in EXECUTION_FLAGS:
            raise ConfigError(f"`--fit-args`: {a.split('=', 1)[0]} changes the experiment, not how it runs; put it in "
                              f"the table spec (or use --shrink). Allowed: {', '.join(EXECUTION_FLAGS)}")
    return args


@dataclass
class Run:
    cell: Cell
    seed: int
    path: Path  # OUT/<run_key>/seed<k>
    argv: list[str]  # `fedlight fit ...` arguments
    record: dict[str, Any]  # what made the run (kept in reproduce.json; another command must not reuse the folder)

    def valid(self) -> bool:
        mark = self.path / "reproduce.json"
        if not mark.is_file():
            return True
        made = json.loads(mark.read_text())
        return {k: made.get(k) for k in IDENTITY} == {k: self.record.get(k) for k in IDENTITY}

    def done(self) -> bool:
        return self.valid() and rep.finished(self.path)


def plan(spec, cs: list[Cell], seeds: list[int], out: Path, shrink: str | None,
         execution: list[str] | None = None, table: str | None = None) -> list[Run]:
    runs = []
    for c in cs:
        fl = flags({**c.overrides, **shrink_overrides(shrink, spec, c)})
        for k in seeds:
            path = out / c.run_key / f"seed{k}"
            argv = ["fit", "--config", str(base_path(spec)), *fl, "--seed", str(k), "--out_dir", str(path),
                    "--resume", "auto", *(execution or [])]
            runs.append(Run(c, k, path, argv, {"base": spec["base"], "flags": [*fl, "--seed", str(k)],
                                               "execution": list(execution or []),  # cell: tags of its trackers
                                               "cell": {"table": table, "row": c.row, "column": c.col, "seed": k}}))
    return runs


def run_one(run: Run, env: dict, call=None, mark: bool = True) -> str:
    """Run (or resume, or skip) one seed of one cell: 'done', 'diverged', 'skipped', 'failed', 'stopped' (by a
    signal, after a round: resumable) or 'conflict'. ``call`` runs the command (default ``subprocess.call``; it
    returns ``None`` when a stop came first and the command did not start); ``mark``: record the run's state in its
    ``job.json`` (for ``--status``)."""
    from fedlight.lab import jobs
    from fedlight.run.files import atomic_write_text

    if not run.valid():
        return "conflict"
    if rep.finished(run.path):
        return "skipped"
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.path / "reproduce.json", json.dumps(run.record, indent=1) + "\n")
    if mark:
        jobs.mark(run.path, state="running", pid=os.getpid(), host=jobs.host())
    with open(run.path / "fit.log", "a") as log:
        rc = (call or subprocess.call)([sys.executable, "-m", "fedlight.config.cli", *run.argv], stdout=log, stderr=log,
                                       env=env)
    status = outcome(run, rc) if rc is not None else "stopped"
    if mark:
        jobs.mark(run.path, state=status, rc=rc)
    return status


def outcome(run: Run, rc: int) -> str:
    """What a finished ``fedlight fit`` process left: done, diverged, stopped (exit 128 + signal) or failed."""
    from fedlight.run.stops import STOP_SIGNALS

    diverged = rep.finished(run.path) and (rep.read_summary(run.path) or {}).get("diverged_at_round") is not None
    if rc in {128 + int(getattr(signal, name)) for name in STOP_SIGNALS} and not rep.finished(run.path):
        return "stopped"
    if not rep.finished(run.path) or (rc != 0 and not diverged):
        return "failed"
    return "diverged" if diverged else "done"


def run_env(jobs: int) -> dict[str, str]:
    """The environment of the ``fedlight fit`` processes: this fedlight first on the path, CPU threads shared; each
    stops (``SIGTERM``) if this process dies (:func:`fedlight.run.stops.die_with_parent`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(recipes_dir().parent),
                                                                     os.environ.get("PYTHONPATH")])),
               FEDLIGHT_PARENT_PID=str(os.getpid()))
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def run_local(runs: list[Run], jobs: int, per_gpu: str | None) -> dict[str, int]:
    """The local pool: ``jobs`` processes, or ``--per-gpu N|auto`` runs sharing each visible GPU (threads split,
    caches shared, memory bounded: :mod:`fedlight.lab.gpu_share`); says how many share a GPU and why."""
    want = gpu_share.parse_per_gpu(per_gpu)
    if want is None:
        return run_all(runs, jobs)
    import torch

    ngpu = torch.cuda.device_count()
    gpu_slots(1, ngpu)  # refuses a machine without a GPU
    left = len({r.path for r in runs if r.valid() and not rep.finished(r.path)})
    gib = min(torch.cuda.get_device_properties(g).total_memory for g in range(ngpu)) / 2**30 if want == "auto" else 0
    n, why = gpu_share.choose(want, left, max(1, gpu_share.cpu_cores() // ngpu), gib)
    env, shared = gpu_share.share_env(run_env(n * ngpu), n)
    print(f"fedlight reproduce: {n} run(s) at a time on each of {ngpu} GPU(s) ({why}); {shared}; the first run "
          "starts alone and the others once it has finished a round, so that only it compiles and decodes", flush=True)
    return run_all(runs, jobs, gpu_slots(n, ngpu), env=env, stagger=n * ngpu > 1)


def gpu_slots(per_gpu: int | None, num_gpus: int) -> list[str] | None:
    """``--per-gpu N`` with the local launcher: N slots per visible GPU (``CUDA_VISIBLE_DEVICES`` of each run)."""
    if not per_gpu:
        return None
    check(num_gpus > 0, "`--per-gpu` packs runs onto GPUs, but this machine shows none; use `--jobs N` for CPU "
          "processes")
    return [str(g) for g in range(num_gpus) for _ in range(per_gpu)]


def run_all(runs: list[Run], jobs: int, slots: list[str] | None = None, env: dict[str, str] | None = None,
            stagger: bool = False) -> dict[str, int]:
    """Run each distinct run folder once, ``jobs`` processes at a time (one per GPU slot with ``slots``), seed 0 of
    every cell first; print one line per run, then the table's throughput (rounds per second of all runs).
    ``stagger``: the first run to do starts alone, the others once it has finished a round (shared caches)."""
    import queue

    # Columns that differ only in their metric share runs; seed 0 of every cell first (a whole table soonest).
    todo = sorted({r.path: r for r in runs}.values(), key=lambda r: r.seed)
    jobs = len(slots) if slots else jobs
    env = env or run_env(jobs)
    free: queue.Queue = queue.Queue()
    for slot in slots or []:
        free.put(slot)
    lock, counts, t0, children = threading.Lock(), {}, time.time(), Children()
    before = {r.path: gpu_share.rounds_in(r.path) for r in todo}
    lead = next((r for r in todo if r.valid() and not rep.finished(r.path)), None) if stagger else None
    first = gpu_share.FirstRun(lead.path) if lead else None

    def go(run: Run) -> None:
        t = time.time()
        if first is not None and run is not lead:
            first.wait(lambda: bool(children.signal))
        slot = free.get() if slots else None
        try:
            if children.signal:  # stopping: start nothing new
                status = "not started"
            else:
                status = run_one(run, env if slot is None else {**env, "CUDA_VISIBLE_DEVICES": slot},
                                 call=children.call)
        finally:
            if slot is not None:
                free.put(slot)
            if run is lead:
                first.ended = True
        with lock:
            counts[status] = counts.get(status, 0) + 1
            hint = {"failed": f" — see {run.path / 'fit.log'}", "conflict": f" — {run.path} was made by another "
                    "command (reproduce.json); delete it or pass another --out",
                    "stopped": " — by a signal, after a round; the same command resumes it"}.get(status, "")
            if status == "failed":
                hint += gpu_share.memory_hint(run.path / "fit.log", env.get(gpu_share.FRACTION_ENV))
            print(f"[{sum(counts.values())}/{len(todo)}] {run.cell.run_key} seed{run.seed}: {status} "
                  f"({time.time() - t:.0f} s){hint}", flush=True)

    with children.forwarding(), ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(go, todo))
    wall = time.time() - t0
    rounds = sum(max(0, gpu_share.rounds_in(r.path) - before[r.path]) for r in todo)
    print(f"{len(todo)} runs in {wall:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; {rounds} rounds, {rounds / max(wall, 1e-9):.2f} rounds/s of the table ({jobs} at a time)", flush=True)
    if children.signal:
        counts["signal"] = children.signal
    return counts


# ------------------------------------------------------------------------------------------------ the table
def previous_values(path: Path) -> dict[tuple[str, str], tuple[list, list]]:
    """(cell, metric) -> (per-seed values, per-seed revisions) of an earlier ``table.csv`` of the same spec."""
    check(path.is_file(), f"--previous {path}: no such file; pass an earlier table.csv of this spec")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    check(bool(rows) and "values" in rows[0], f"--previous {path}: not a `fedlight reproduce` table.csv (it has no "
          "`values` column); pass the table.csv an earlier `fedlight reproduce` wrote")
    return {(r["cell"], r["metric"]): (json.loads(r["values"]), json.loads(r["revisions"]) if r.get("revisions")
                                       else []) for r in rows}


def collect(spec, runs: list[Run], previous: dict[tuple[str, str], tuple[list, list]] | None = None) -> None:
    """Fill each cell's per-seed values ("missing" where the seed's run is not finished). With ``previous``
    (:func:`previous_values`), a seed whose run is not finished here takes the earlier table's value, if it has one;
    a finished run here always wins."""
    for r in runs:
        ok = r.done()
        summary = rep.read_summary(r.path) if ok else None
        r.cell.diverged += ok and (summary or {}).get("diverged_at_round") is not None
        metrics = [r.cell.metric, *spec.get("also", [])]
        vals = {m: rep.metric_value(r.path, m) if ok else "missing" for m in metrics}
        rev = str(rep.revision(summary)) if ok else "missing"
        old = [(previous or {}).get((r.cell.name, m), ([], [])) for m in metrics]
        if previous and not ok and all(r.seed < len(v) and v[r.seed] != "missing" for v, _ in old):
            vals = {m: v[r.seed] for m, (v, _) in zip(metrics, old)}
            revs = old[0][1]
            rev = revs[r.seed] if r.seed < len(revs) and revs[r.seed] != "missing" else "earlier"
            r.cell.earlier += 1
        for m in metrics:
            r.cell.values.setdefault(m, []).append(vals[m])
        r.cell.revisions.append(rev)


# ------------------------------------------------------------------------------------------------ the command
def default_out(spec_path: Path, shrink: str | None) -> Path:
    tag = re.sub(r"[^A-Za-z0-9._]+", "-", (shrink or "").replace("=", "")).strip("-")
    return Path("runs") / "tables" / (spec_path.stem + (f"_shrink-{tag}" if tag else ""))


def cmd_reproduce(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fedlight reproduce", description="Run a paper table's cells (fedlight fit "
                                "processes); write table.md/table.csv: paper value, measured mean ± std, difference.")
    p.add_argument("spec", help="table spec YAML (or its name under recipes/tables/)")
    p.add_argument("--cells", default="*", help="glob(s) over 'row/column', comma-separated (default: all)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the spec's `seeds`, else 1)")
    p.add_argument("--shrink", default=None, help="e.g. rounds=2,subset=512,test_subset=256 (or dotted.key=value)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (separate processes)")
    p.add_argument("--out", default=None, help="output folder (default runs/tables/<spec>[_shrink-...])")
    p.add_argument("--fit-args", default=None, help="extra `fedlight fit` flags that change how runs execute, not "
                   "what they compute, e.g. \"--loop.client_parallelism vmap\" or \"--devices 2\"; an interrupted "
                   "run may resume with other ones")
    p.add_argument("--dry-run", action="store_true", help="print the fit commands and stop")
    p.add_argument("--table-only", action="store_true", help="run nothing; rebuild table.md/csv from finished runs")
    p.add_argument("--previous", default=None, metavar="TABLE_CSV", help="fill each seed whose run is not under "
                   "--out with its values in an earlier table.csv of this spec (e.g. the committed one, when the run "
                   "folders are gone); a run finished here always wins, and the table counts the borrowed seeds")
    p.add_argument("--status", action="store_true", help="print where every run stands (not started, pending, "
                   "running, stopped, done, failed with the last line of its fit.log) and stop")
    _cluster_arguments(p)
    a = p.parse_args(argv)
    spec_path = find_spec(a.spec)
    spec = load_spec(spec_path)
    check_task_metrics(spec)
    check(base_path(spec).is_file(), f"table spec {spec_path}: base recipe {spec['base']} not found")
    seeds = list(range(a.seeds if a.seeds is not None else int(spec.get("seeds", 1))))
    check(len(seeds) > 0 and a.jobs > 0, "`--seeds` and `--jobs` must be positive")
    out = Path(a.out) if a.out else default_out(spec_path, a.shrink)
    previous = previous_values(Path(a.previous)) if a.previous else None
    every = cells(spec)
    pats = [s.strip() for s in a.cells.split(",") if s.strip()]
    todo = [c for c in every if any(fnmatch.fnmatchcase(c.name, pt) for pt in pats)]
    check(len(todo) > 0, f"`--cells {a.cells}` matches none of: {', '.join(c.name for c in every)}")
    runs = plan(spec, every, seeds, out, a.shrink, execution_args(a.fit_args), table=spec_path.stem)
    chosen = [r for r in runs if any(r.cell is c for c in todo)]
    if a.dry_run:
        print("\n".join(shlex.join(["fedlight", *r.argv]) for r in {r.path: r for r in chosen}.values()))
        return 0
    if a.status:
        return _status(a, out, chosen)
    counts = {} if a.table_only else launch(a, spec, chosen, out)
    if counts.get("signal"):  # stopped: the runs stopped after their round; the same command continues them
        name = counts["signal"]
        print(f"fedlight reproduce: stopped by {name}: {counts.get('stopped', 0)} runs stopped after a finished "
              f"round, {counts.get('not started', 0)} not started; to continue, run the same command again: "
              f"{shlex.join(['fedlight', 'reproduce', *argv])}", file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, name))
    # The table holds the chosen cells and any other cell of the spec that already has a finished run.
    keep = {id(r.cell) for r in chosen} | {id(r.cell) for r in runs if r.done()}
    shown = [r for r in runs if id(r.cell) in keep]
    collect(spec, shown, previous)
    cs = list({id(r.cell): r.cell for r in shown}.values())
    done = list({r.path: (r.cell, r.path) for r in shown if r.done()}.values())
    command = shlex.join(["fedlight", "reproduce", *argv])
    print(rep.write_table(spec, spec_path, cs, done, seeds, out, command, a.shrink, a.jobs, a.previous))
    print(f"\nwrote {out / 'table.md'} and {out / 'table.csv'}")
    return 1 if counts.get("failed") or counts.get("conflict") or counts.get("stopped") else 0


# ------------------------------------------------------------------------------------------------ launchers
CLUSTER_FLAGS = ("partition", "time", "gpus", "cpus", "mem", "account", "sbatch", "per_gpu", "requeues")


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launchers", "where the runs execute; Slurm resources may also come from the spec's "
                             "`slurm:` mapping (flags win)")
    g.add_argument("--launcher", choices=("local", "slurm"), default="local", help="local: a process pool on this "
                   "machine (--jobs); slurm: one job per run, or per --per-gpu group, through submitit "
                   "(pip install 'fedlight[slurm]'), requeued with --resume auto on preemption or time-out")
    g.add_argument("--cluster", choices=("slurm", "local"), default="slurm", help="with --launcher slurm: submit "
                   "with sbatch (slurm), or rehearse with submitit's local executor, jobs as processes here (local)")
    g.add_argument("--per-gpu", default=None, metavar="N|auto", help="runs side by side per GPU: local launcher: N "
                   "processes per visible GPU (auto: as many as the runs to do, CPU cores and GPU memory allow; "
                   "threads split, compile and data caches shared, memory bounded, the choice printed); slurm: N "
                   "runs per GPU of each job (per job without --gpus)")
    g.add_argument("--partition", help="Slurm partition")
    g.add_argument("--time", help="time limit per job, as sbatch takes it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
                   "or D-HH:MM:SS (default 4:00:00); a job that reaches it is requeued and its runs resume")
    g.add_argument("--gpus", type=int, metavar="G", help="GPUs per job (default 0)")
    g.add_argument("--cpus", type=int, help="CPUs per job")
    g.add_argument("--mem", help="memory per job: GB as a plain number (64), or with sbatch's unit (64G, 4000M)")
    g.add_argument("--account", help="Slurm account")
    g.add_argument("--sbatch", action="append", metavar="KEY[=VALUE]", help="a further sbatch option, passed "
                   "unchanged, e.g. --sbatch qos=high --sbatch constraint=a100 --sbatch exclusive (repeatable)")
    g.add_argument("--requeues", type=int, help="time-outs a job may be requeued after (default 10; preemptions "
                   "are not counted)")
    g.add_argument("--wait", action="store_true", help="with --launcher slurm: wait for the jobs, then write the "
                   "table (default: submit, print the job ids and write the table of what has finished)")


def _slurm_flags(a: argparse.Namespace) -> dict[str, Any]:
    flags = {k: getattr(a, k) for k in CLUSTER_FLAGS}
    check(a.per_gpu != "auto", "`--per-gpu auto` packs runs onto this machine's GPUs (local launcher); give Slurm "
          "a number, e.g. --per-gpu 8")
    flags["per_gpu"] = gpu_share.parse_per_gpu(a.per_gpu)
    if a.sbatch:  # KEY=VALUE, or a bare KEY for sbatch's options without a value (--sbatch exclusive)
        pairs = [o.lstrip("-").partition("=") for o in a.sbatch]
        check(all(k for k, _, _ in pairs), f"`--sbatch` takes KEY=VALUE or KEY, got {a.sbatch!r}")
        flags["sbatch"] = {k: v if eq else True for k, eq, v in pairs}
    return flags


def launch(a: argparse.Namespace, spec: dict[str, Any], runs: list[Run], out: Path) -> dict[str, int]:
    """Run (local) or submit (slurm) the chosen runs; the counts of their outcomes (empty after a submission)."""
    if a.launcher == "local":
        slurm_only = [k for k in CLUSTER_FLAGS if k != "per_gpu" and getattr(a, k) is not None]
        check(a.cluster == "slurm" and not slurm_only and not a.wait,
              "`--cluster`, `--wait` and the Slurm resource flags need `--launcher slurm`")
        return run_local(runs, a.jobs, a.per_gpu)
    from fedlight.lab import slurm

    res = slurm.resources(spec, _slurm_flags(a))
    distinct = list({r.path: r for r in runs}.values())
    for r in distinct:
        if not r.valid():
            print(f"{r.cell.run_key} seed{r.seed}: conflict — {r.path} was made by another command (reproduce.json); "
                  "delete it or pass another --out", flush=True)
    todo = [r for r in distinct if r.valid() and not rep.finished(r.path)]
    handles = slurm.submit(todo, res, out, a.cluster, run_one, run_env) if todo else []
    print(f"submitted {len(todo)} runs in {len(handles)} jobs ({', '.join(h.job_id for h in handles) or '-'}); "
          f"see them with: fedlight reproduce {a.spec} --status" + (f" --out {a.out}" if a.out else ""), flush=True)
    if not a.wait:
        return {}
    slurm.wait(handles, a.cluster)
    from fedlight.lab import jobs

    counts: dict[str, int] = {}
    for r in todo:  # what the jobs left: a run stopped (scancel) or failed makes the command fail
        st = jobs.read(r.path).get("state")
        st = st if st in ("done", "diverged", "skipped", "failed") else "stopped"  # a job cancelled before it ran
        counts[st] = counts.get(st, 0) + 1
    return counts


def _status(a: argparse.Namespace, out: Path, runs: list[Run]) -> int:
    from fedlight.lab import jobs

    scheduler = None
    if any(jobs.read(r.path).get("launcher") == "slurm" for r in runs):  # submitted with sbatch: sacct knows more
        from fedlight.lab import slurm

        scheduler = slurm.scheduler_state(out)
    print(jobs.status_table(runs, scheduler))
    return 0
