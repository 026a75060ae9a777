"""The ``tune:`` section of a table spec: what ``fedlight tune`` searches, on what budget, for what objective.

::

    tune:
      trials: 14                 # trials per row: the same budget for every row
      rounds: 100                # loop.rounds of every trial
      seeds: 1                   # seeds per trial (the objective is their mean)
      objective: best_test_acc   # best_test_<m> | final_test_<m> | last_test_<m>:<k> | rounds_to_target:<t>
      sampler: tpe               # tpe | random | grid, or {name: tpe, seed: 0, n_startup_trials: 5} (Optuna's own
                                 #   arguments of that sampler)
      pruner: median             # none | median | successive_halving, or {name: median, n_warmup_steps: 10}
      column: dir0.1             # the column whose cells the trials run (default: the first)
      space:                     # per row ("*": every row); a setting is a `fedlight fit` key
        "*": {loop.lr: {low: 0.003, high: 0.3, log: true}}
        fedwmsam: {algorithm.init_args.rho: {low: 0.01, high: 0.3}, algorithm.init_args.alpha: {choices: [0.1, 0.5]}}

A range (``low``/``high``, with ``log``, ``step``, ``int``) takes a numeric setting; ``choices`` any setting. Every
check here runs before a trial starts, and a bad section is one :class:`ConfigError` line (exit 2).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check
from fedlight.lab.tables import report as rep
from fedlight.lab.tables import spec as table_spec

KEYS = {"trials", "rounds", "seeds", "objective", "sampler", "pruner", "column", "space", "stale_after_s"}
SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "grid": "GridSampler"}
PRUNERS = {"none": "NopPruner", "median": "MedianPruner", "successive_halving": "SuccessiveHalvingPruner"}
RANGE_KEYS = {"low", "high", "log", "step", "int"}


@dataclass
class Tune:
    """A checked ``tune:`` section; ``space``: row -> setting -> its distribution (as in the spec)."""

    trials: int
    rounds: int
    objective: str
    column: str
    space: dict[str, dict[str, dict[str, Any]]]
    seeds: int = 1
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe"})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    stale_after_s: float = 3600.0  # a trial whose worker has not reported for this long is taken over

    def protocol(self, row: str, cell_overrides: dict[str, Any], shrink: str | None,
                 spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a row's study is made from; a study made from another protocol is refused (trials may grow).
        ``recipe``: the defining settings of the row's cell, the base recipe resolved with its overrides (those the
        trials set themselves, ``loop.rounds`` and the searched ones, left out): an edited base recipe is caught."""
        made = {"overrides": cell_overrides, "space": self.space[row], "objective": self.objective,
                "rounds": self.rounds, "seeds": self.seeds, "sampler": self.sampler, "pruner": self.pruner,
                "column": self.column, "shrink": shrink or ""}
        if spec is not None:
            from fedlight.run.directory import split_settings

            defining = split_settings(cell_config(spec, row, self.column))[0]
            made["recipe"] = {k: v for k, v in defining.items() if k not in self.space[row] and k != "loop.rounds"}
        return made

    def maximize(self, spec: dict[str, Any]) -> bool:
        if self.objective.startswith("rounds_to_target:"):
            return False
        key = rep.curve_key(self.objective)
        return bool((task_directions(table_spec.base_path(spec)) or {}).get(key, True))


def parse(spec: dict[str, Any], where: str) -> Tune:
    """The spec's ``tune:`` section, checked against the rows, the recipe's settings and its task."""
    t = spec.get("tune")
    check(isinstance(t, dict), f"{where} has no `tune:` section; add one (see docs/tuning.md), e.g. tune: "
          "{trials: 12, rounds: 100, objective: best_test_acc, space: {'*': {loop.lr: {low: 0.003, high: 0.3, "
          "log: true}}}}")
    unknown = sorted(set(t) - KEYS)
    check(not unknown, f"{where}: `tune` has unknown keys {unknown} (known: {', '.join(sorted(KEYS))})")
    for k in ("trials", "rounds", "objective", "space"):
        check(k in t, f"{where}: `tune` lacks `{k}`")
    for k in ("trials", "rounds", "seeds"):
        check(isinstance(t.get(k, 1), int) and t.get(k, 1) > 0, f"{where}: `tune.{k}` must be a positive integer")
    cols = list(spec["columns"])
    column = t.get("column", cols[0])
    check(column in cols, f"{where}: `tune.column` {column!r} is not a column ({', '.join(cols)})")
    tune = Tune(trials=t["trials"], rounds=t["rounds"], seeds=t.get("seeds", 1), objective=str(t["objective"]),
                column=column, space=row_spaces(spec, t["space"], where), sampler=_named(t, "sampler", "tpe", where),
                pruner=_named(t, "pruner", "none", where), stale_after_s=float(t.get("stale_after_s", 3600)))
    check_objective(spec, tune, where)
    return tune


def _named(t: dict[str, Any], key: str, default: str, where: str) -> dict[str, Any]:
    """``tpe`` or ``{name: tpe, seed: 0}`` -> ``{"name": "tpe", "seed": 0}``; the arguments are Optuna's own."""
    v = t.get(key, default)
    v = {"name": v} if isinstance(v, str) else dict(v or {})
    names = SAMPLERS if key == "sampler" else PRUNERS
    check(v.get("name") in names, f"{where}: `tune.{key}` {v.get('name')!r} is not one of {', '.join(names)}")
    import optuna

    cls = getattr(optuna.samplers if key == "sampler" else optuna.pruners, names[v["name"]])
    params = set(inspect.signature(cls).parameters) - {"search_space"}
    bad = sorted(set(v) - {"name"} - params)
    check(not bad, f"{where}: `tune.{key}` {v['name']} takes no {bad} (Optuna's {cls.__name__} takes "
          f"{', '.join(sorted(params)) or 'nothing'})")
    return v


def row_spaces(spec: dict[str, Any], space: Any, where: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Each row's space (``"*"`` merged under the row's own); every setting checked against what the row builds."""
    check(isinstance(space, dict) and space, f"{where}: `tune.space` is empty; give each row at least one setting, "
          "e.g. space: {'*': {loop.lr: {low: 0.003, high: 0.3, log: true}}}")
    rows = list(spec["rows"])
    bad = sorted(set(space) - {"*", *rows})
    check(not bad, f"{where}: `tune.space` names {bad}, which are not rows ({', '.join(rows)}) or \"*\"")
    out = {}
    for row in rows:
        merged = {**(space.get("*") or {}), **(space.get(row) or {})}
        check(bool(merged), f"{where}: `tune.space` is empty for row {row!r}; give it a setting (or one under \"*\")")
        config = cell_config(spec, row)
        out[row] = {k: check_setting(config, k, dist, f"{where}: `tune.space.{row}.{k}`") for k, dist in
                    merged.items()}
    return out


def cell_config(spec: dict[str, Any], row: str, col: str | None = None) -> dict[str, Any]:
    """The base recipe with a cell's overrides (dotted keys) applied: what its runs build."""
    import copy

    import yaml

    config = copy.deepcopy(yaml.safe_load(table_spec.base_path(spec).read_text()) or {})
    cell = next(c for c in table_spec.cells(spec) if c.row == row and (col is None or c.col == col))
    for key, value in cell.overrides.items():
        *head, last = key.split(".")
        node = config
        for h in head:
            node = node.setdefault(h, {}) if isinstance(node.get(h, {}), dict) else {}
        node[last] = copy.deepcopy(value)
    return config


def check_setting(config: dict[str, Any], key: str, dist: Any, where: str) -> dict[str, Any]:
    """``dist`` for setting ``key`` of a cell built from ``config``: the setting must exist (the closest one is
    named), and a range needs a numeric one."""
    check(isinstance(dist, dict) and (("low" in dist and "high" in dist and not set(dist) - RANGE_KEYS) or
                                      (set(dist) == {"choices"} and isinstance(dist["choices"], list)
                                       and dist["choices"])),
          f"{where}: give {{low: L, high: H}} (with log: true, step: S, int: true as needed) or {{choices: [...]}}, "
          f"got {dist!r}")
    annotation, known = setting_type(config, key)
    if annotation is None:
        from fedlight.core.registry import closest

        near = closest(key, known)
        raise ConfigError(f"{where}: the row has no such setting{near}" + (
            "" if near else f" (settings here: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''})"))
    if "low" in dist:
        numeric = any(t in annotation for t in ("float", "int")) and annotation not in ("bool",)
        check(numeric, f"{where}: a range needs a numeric setting, but {key} is {annotation}; give it as "
              "{choices: [...]}")
        check(dist["low"] < dist["high"] and (not dist.get("log") or dist["low"] > 0),
              f"{where}: needs low < high (and low > 0 with log: true), got {dist!r}")
    return dict(dist)


def setting_type(config: dict[str, Any], key: str) -> tuple[str | None, list[str]]:
    """(the annotation of setting ``key`` as text, or None when there is no such setting; the settings known at the
    level where it failed, dotted)."""
    from fedlight.core.loop_config import LoopConfig

    top, _, rest = key.partition(".")
    if top == "loop":
        fields = {f.name: str(f.type) for f in dataclasses.fields(LoopConfig)}
        return fields.get(rest), [f"loop.{n}" for n in fields]
    node, prefix, parts = config.get(top), top, rest.split(".") if rest else []
    while isinstance(node, dict) and "class_path" in node and len(parts) >= 2 and parts[0] == "init_args":
        params = init_annotations(node["class_path"])
        name = parts[1]
        if name not in params:
            return None, [f"{prefix}.init_args.{n}" for n in params]
        if len(parts) == 2:
            return params[name], []
        node, prefix, parts = (node.get("init_args") or {}).get(name), f"{prefix}.init_args.{name}", parts[2:]
    known = [f"{t}.init_args" for t in ("model", "data", "algorithm") if isinstance(config.get(t), dict)]
    return None, known + [f"loop.{f.name}" for f in dataclasses.fields(LoopConfig)]


def init_annotations(class_path: str) -> dict[str, str]:
    """Constructor argument -> its annotation (text; ``"float"`` from a float default when unannotated)."""
    import importlib

    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        for n, p in params.items():
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in out:
                ann = p.annotation if p.annotation is not inspect.Parameter.empty else type(p.default).__name__
                out[n] = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return out


def check_objective(spec: dict[str, Any], tune: Tune, where: str) -> None:
    """The objective must be a metric the runs report; pruning needs one that grows with the evaluations."""
    obj = tune.objective
    check(obj.startswith("rounds_to_target:") or rep.curve_key(obj) is not None,
          f"{where}: `tune.objective` {obj!r} is not read from the evaluations; use best_test_<m>, final_test_<m>, "
          "last_test_<m>:<k> or rounds_to_target:<t>")
    rep.check_metric(obj)
    produced = table_spec.task_metrics(table_spec.base_path(spec))
    key = rep.curve_key(obj)
    check(produced is None or key is None or key in produced,
          f"{where}: `tune.objective` {obj} reads {key}, which the task of {spec['base']} does not report (it "
          f"reports {', '.join(produced or ())}); e.g. objective: best_{(produced or ('test_acc',))[0]}")
    check(tune.pruner["name"] == "none" or key is not None, f"{where}: `tune.pruner` needs an objective read at "
          f"each evaluation; {obj} is known only at the end: use pruner: none")


def task_directions(recipe: Path) -> dict[str, bool] | None:
    """``test_<m>`` -> whether higher is better, for the recipe's task (None when only a run can tell)."""
    import yaml

    from fedlight.core.spec import build

    cfg = yaml.safe_load(recipe.read_text()) or {}
    try:
        task = build(cfg["task"]) if cfg.get("task") else build(cfg["data"]).default_task()
        return task.directions()
    except (ConfigError, ImportError, TypeError, ValueError, AttributeError, KeyError):
        return None
