"""``fedlight reproduce SPEC``: re-run a paper table with one command and put the paper's numbers next to ours.

A *table spec* (``recipes/tables/*.yaml``) names a base recipe, a grid of overrides and the paper's values
(:mod:`fedlight.lab.tables.spec`).
Cell ``row/col`` runs, for seed k, in ``OUT/<row>/<col>/seed<k>`` through the job runner of
:mod:`fedlight.lab.tables.runner` (``--jobs``, ``--per-gpu``, ``--launcher slurm``, ``--status``). With ``--tuned
STUDY`` each row runs at the best values a ``fedlight tune`` study found for it (:mod:`fedlight.lab.tuning.cli`).
Accuracies are in %, like the papers' tables.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import re
import shlex
import signal
import sys
from pathlib import Path

from fedlight.errors import check
from fedlight.lab.tables import jobs, lockstep_runs, runner, table_report
from fedlight.lab.tables import report as rep
from fedlight.lab.tables.report_plot import check_curve_keys
from fedlight.lab.tables.runner import Run
from fedlight.lab.tables.spec import base_path, cells, check_task_metrics, find_spec, load_spec, with_params
from fedlight.run import stops


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
        vals = {m: rep.metric_value(r.path, m, strict=False) if ok else "missing" for m in metrics}
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
    keys = [k.group(2) for m in dict.fromkeys(m for r in runs for m in r.cell.values)
            if (k := rep.ROUND_METRIC.match(m)) is not None]
    check_curve_keys([r.path for r in runs if r.done()], keys, "unknown metric")  # some run of the table logs each


# ------------------------------------------------------------------------------------------------ the command
def default_out(spec_path: Path, shrink: str | None, tuned: str | None = None) -> Path:
    tag = re.sub(r"[^A-Za-z0-9._]+", "-", (shrink or "").replace("=", "")).strip("-")
    return Path("runs") / "tables" / (spec_path.stem + ("_tuned" if tuned else "") + (f"_shrink-{tag}" if tag else ""))


def tuned_rows(spec, spec_path: Path, every: list, tuned: str) -> dict[str, str]:
    """``--tuned``: each cell of a row with a study takes its best values; row -> those values as text."""
    from fedlight.lab.tables import studies

    best = studies.tuned_values(spec_path, list(spec["rows"]), tuned)
    for c in every:
        c.overrides = with_params(c.overrides, best.get(c.row, {}))
    return {row: ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in best[row].items())
            if row in best else "stated (no study)" for row in spec["rows"]}


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
    p.add_argument("--tuned", default=None, metavar="STUDY", help="run each row at the best values of its `fedlight "
                   "tune` study: the tune output folder (or its storage URL); the table shows them in a column")
    p.add_argument("--lockstep", default="auto", metavar="auto|on|off|column|N", help="train the runs that can "
                   "share a stacked chunk (the seeds of a row; rows with the same local rule, e.g. FedAvg and FedAvgM) "
                   "as lockstep groups, one process each (`fedlight lockstep`): on, off, N (groups of at most N runs), "
                   "column (one process for all the runs of a column, whatever their rules: one GPU context instead "
                   "of several sharing the card), or auto (default): on with a GPU, off on CPU (where it gains "
                   "nothing). Each run keeps its own directory, outcome and resume")
    runner.cluster_arguments(p)
    a = p.parse_args(argv)
    lockstep = lockstep_runs.parse_mode(a.lockstep)
    spec_path = find_spec(a.spec)
    spec = load_spec(spec_path)
    check_task_metrics(spec)
    check(base_path(spec).is_file(), f"table spec {spec_path}: base recipe {spec['base']} not found")
    seeds = list(range(a.seeds if a.seeds is not None else int(spec.get("seeds", 1))))
    check(len(seeds) > 0 and a.jobs > 0, "`--seeds` and `--jobs` must be positive")
    out = Path(a.out) if a.out else default_out(spec_path, a.shrink, a.tuned)
    previous = previous_values(Path(a.previous)) if a.previous else None
    every = cells(spec)
    tuned = tuned_rows(spec, spec_path, every, a.tuned) if a.tuned else None
    pats = [s.strip() for s in a.cells.split(",") if s.strip()]
    todo = [c for c in every if any(fnmatch.fnmatchcase(c.name, pt) for pt in pats)]
    check(len(todo) > 0, f"`--cells {a.cells}` matches none of: {', '.join(c.name for c in every)}")
    runs = runner.plan(spec, every, seeds, out, a.shrink, runner.execution_args(a.fit_args), table=spec_path.stem)
    chosen = [r for r in runs if any(r.cell is c for c in todo)]
    limit, why = lockstep_runs.decide(lockstep, a.launcher)
    units = lockstep_runs.group(chosen, spec, limit, by_rule=lockstep != "column")
    if a.dry_run:
        print("\n".join(shlex.join(["fedlight", *r.argv]) for r in units))
        return 0
    if a.status:
        return runner.status(a, out, chosen)
    check(not a.table_only or out.is_dir() or previous is not None, f"`--table-only`: {out} does not exist, so it "
          "holds no run of this table; pass the --out its runs went to (or --previous TABLE_CSV), or run the table")
    jobs.settle(chosen)  # what an attempt killed before it could record it left
    launched: list[bool] = []
    try:
        return _launch(a, argv, spec, spec_path, runs, chosen, units, why, out, previous, seeds, tuned, launched)
    except stops.StoppedAtStart as e:  # a stop signal outside the runs' own (before they start, or after them)
        jobs.settle(chosen)
        when = "after its runs ended" if launched else "before it started a run"
        print(f"fedlight reproduce: stopped by {e.stopped.signal_name} {when}; its runs: {jobs.holding(chosen)}; to "
              f"continue, run the same command again: {shlex.join(['fedlight', 'reproduce', *argv])}",
              file=sys.stderr, flush=True)
        return e.stopped.status


def _launch(a, argv, spec, spec_path, runs, chosen, units, why, out, previous, seeds, tuned, launched) -> int:
    """Run the chosen runs (``launched`` gets an item once they ended), then write the table."""
    if len(units) < len({r.path for r in chosen}) and not a.table_only:
        print(f"fedlight reproduce: {len({r.path for r in chosen})} runs in {len(units)} processes, the runs that "
              f"share a stacked chunk in lockstep groups ({why if why.startswith('--') else '--lockstep ' + why})",
              flush=True)
    counts = {} if a.table_only else runner.launch(a, spec, units, out)
    launched.append(True)
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
    print(table_report.write_table(spec, spec_path, cs, done, seeds, out, command, a.shrink, a.jobs, a.previous,
                                   tuned))
    print(f"\nwrote {out / 'table.md'} and {out / 'table.csv'}")
    return 1 if counts.get("failed") or counts.get("conflict") or counts.get("stopped") else 0
