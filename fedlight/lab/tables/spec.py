"""A *table spec* (``recipes/tables/*.yaml``): a base recipe, a grid of overrides, the paper's values, and what
``fedlight reproduce`` and ``fedlight tune`` read from it::

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
    curves: [server/momentum_variance]  # optional: more panels in curves*.png (per-round keys of metrics.jsonl)
    notes: how this setup differs from the paper's
    tune: {...}                       # optional: the search of `fedlight tune` (:mod:`fedlight.lab.tuning.space`)

Overrides are ``fedlight fit`` flags without the dashes (``loop.rounds: 2`` → ``--loop.rounds 2``). A column
may also carry ``metric:``; columns that differ only in it share one set of runs (e.g. rounds to 70 % and to 72 %).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlight.config import locate
from fedlight.errors import ConfigError, check
from fedlight.lab.tables import report as rep

SHRINK_KEYS = {"rounds": "loop.rounds", "subset": "data.init_args.subset", "test_subset": "data.init_args.test_subset"}
SPEC_KEYS = {"title", "base", "metric", "also", "overrides", "rows", "columns", "cell_overrides", "paper", "notes",
             "seeds", "slurm", "baseline", "tune", "curves"}


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
    """The spec ``name`` names: a path, else a name under ./recipes/tables/, else a bundled one (:mod:`locate`)."""
    return locate.find(name, "table")


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
    curves = spec.get("curves", [])
    check(isinstance(curves, list) and all(isinstance(k, str) and k for k in curves),
          f"{where}: `curves` must be a list of per-round keys of metrics.jsonl (e.g. [server/momentum_variance]), "
          f"got {curves!r}")
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
    """The spec's base recipe, found as ``--config`` finds one (``recipes/X.yaml``: ./recipes/, then the bundled)."""
    return locate.find(spec["base"], "recipe")


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


def with_params(overrides: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with the trial's values: one under an override given as a whole mapping (a row's ``algorithm:
    {class_path: ..., init_args: ...}``) goes into that mapping, so that the class it names takes it."""
    import copy

    out = copy.deepcopy(overrides)
    for key, value in params.items():
        owner = next((k for k in out if key.startswith(k + ".") and isinstance(out[k], dict)), None)
        if owner is None:
            out[key] = value
            continue
        node = out[owner]
        *head, last = key[len(owner) + 1:].split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = value
    return out
