"""Trackers: a run in MLflow, Weights & Biases, a CSV file or any Lightning logger, beside TensorBoard.

``loggers`` names them (docs/trackers.md), parsed with the run's tags in :mod:`fedlight.run.tracker_entries`:
``tensorboard`` (fedlight's own writer, the default), ``mlflow``, ``wandb``, ``csv`` or any Lightning/Fabric logger.
Only global rank 0 feeds them, on a thread of their own: the recipe as params, the tags (plus a ``fedlight
reproduce`` cell's), every ``metrics.jsonl`` row with the round as the step, then ``summary/*`` figures and the
run's files as artifacts.

``trackers.json`` in the run directory is the one place a tracker's run id lives (``{name: {"id", "logged"}}``,
``logged``: the last round it holds). A round is sent once its checkpoint is on disk, so a tracker holds exactly
``metrics.jsonl``'s numbers; a resume continues the same tracker run and sends only the rows it lacks (for W&B, the
rows its local run files lack: :mod:`fedlight.run.wandb_files`). Unreachable at start: :class:`ConfigError` (exit 2)
before round 1; failing later: one warning line, training goes on, and ``summary.json`` lists the rounds it missed.
MLflow's default store and its log lines: :mod:`fedlight.run.mlflow_store`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError
from fedlight.run import atomic, faults, mlflow_store, wandb_files
from fedlight.run.directory import flatten
from fedlight.run.files import round_ranges

FILE = "trackers.json"
RESUME_ARGS = ("run_id", "id", "version")
"""The constructor argument that continues an existing run, first found wins (MLflow, W&B, CSV/TensorBoard)."""


class Trackers:
    """The trackers of one run, on global rank 0.

    Args:
        entries: from :func:`fedlight.run.tracker_entries.parse`.
        out: the run directory.
        tags: what identifies the run (algorithm, model, data, seed, version, revision, run directory).
        config_text: the resolved recipe (params of a new tracker run).
        resumed: the run continues from a checkpoint (its trackers continue their runs; else new ones).
    """

    def __init__(self, entries: list[dict[str, Any]], out: Path, tags: dict[str, Any], config_text: str,
                 resumed: bool = False) -> None:
        from fedlight.run.background import CheckpointWriter  # the record's one-thread, in-order job runner

        self.entries, self.out, self.text = entries, Path(out), config_text
        cell = _json(self.out / "reproduce.json").get("cell") or {}  # a `fedlight reproduce` cell's run
        self.tags = {**tags, **{k: cell[k] for k in ("table", "row", "column", "seed", "study", "trial") if k in cell}}
        self.state: dict[str, dict[str, Any]] = _json(self.out / FILE) if resumed else {}
        self.loggers: dict[str, Any] = {}
        self.failed: dict[str, int] = {}  # name -> the first round it missed
        self.default_stores: dict[str, str] = {}  # an MLflow tracker given no tracking URI -> the store it used
        self.last_round = 0
        self.pending: list[dict[str, Any]] = []  # rows whose checkpoint is not on disk yet
        self.writer = CheckpointWriter()
        faults.DRAIN.append(self.writer.wait)

    # ------------------------------------------------------------------------------------------ start
    def start(self) -> None:
        """Build each logger (continuing its stored run) and reach it: params and tags for a new run. Unreachable:
        one :class:`ConfigError` line."""
        if any(e["name"].startswith("mlflow") for e in self.entries):  # its import sets its loggers' level: first
            with contextlib.suppress(ImportError):
                importlib.import_module("mlflow")
        for e in self.entries:
            name, known = e["name"], self._held(e, self.state.get(e["name"], {}))
            try:
                with mlflow_store.quiet():  # MLflow's INFO lines as it creates a new store's tables
                    logger = e.get("logger") or self._build(e, known)
                    run_id = _run_id(logger)  # connects: creates or opens the tracker's run
                if known.get("id") is None or known.get("describe"):
                    self._describe(logger)
                elif hasattr(logger.experiment, "update_run"):  # MLflow: a stopped run is running again
                    logger.experiment.update_run(run_id, status="RUNNING")
            except ConfigError:
                raise
            except Exception as err:  # noqa: BLE001 - any client error is "cannot reach"
                where = e["init_args"].get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") \
                    if name.startswith("mlflow") else None
                raise ConfigError(f"`loggers`: cannot start {name}{f' at {where}' if where else ''}: "
                                  f"{_line(err)}. Fix the tracker's address or leave it out of `--loggers`") from None
            self.loggers[name] = logger
            self.state[name] = {"id": run_id, "logged": known.get("logged", 0) if known.get("id") else 0}
            if name in self.default_stores:  # a resume started in another folder finds the same store
                self.state[name]["tracking_uri"] = self.default_stores[name]
        self._save()

    def _held(self, e: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """A W&B run's ``known`` state as its local files hold it: W&B buffers what it accepted, so a kill loses
        rounds ``trackers.json`` counted as sent; the rounds after the ones its files hold are sent again (and the
        config, if they lack it)."""
        if not e["name"].startswith("wandb") or known.get("id") is None:
            return known
        save_dir = e["init_args"].get("save_dir") or self._defaults(e["name"])["save_dir"]
        held = wandb_files.rounds_held(Path(save_dir), str(known["id"]))
        if held is None:  # no file to tell by (moved elsewhere): trust trackers.json
            return known
        upto = 0
        while upto + 1 in held[0]:
            upto += 1
        return {**known, "logged": min(int(known.get("logged", 0)), upto), "describe": not held[1]}

    def _build(self, e: dict[str, Any], known: dict[str, Any]):
        module, _, cls_name = e["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)  # an error here is "cannot start" (see start)
        params = inspect.signature(cls).parameters
        ours = e["name"].startswith(("mlflow", "wandb"))  # WandbLogger hands **kwargs to wandb.init
        args = {**{k: v for k, v in self._defaults(e["name"]).items() if ours or k in params}, **e["init_args"]}
        if e["name"].startswith("mlflow") and (uri := mlflow_store.fill(args, e["init_args"], known)) is not None:
            self.default_stores[e["name"]] = uri
        resume_arg = next((a for a in RESUME_ARGS if a in params), None)
        if known.get("id") is not None and resume_arg is not None:
            args[resume_arg] = known["id"]
        try:
            return cls(**args)
        except TypeError as err:
            raise ConfigError(f"`loggers`: {e['class_path']}: {_line(err)}") from None

    def _defaults(self, name: str) -> dict[str, Any]:
        run = self.out.resolve().name
        tag_list = [f"{k}:{v}"[:64] for k, v in self.tags.items() if v is not None and k != "run_dir"]  # W&B: 64
        if name.startswith("mlflow"):
            return {"experiment_name": os.environ.get("MLFLOW_EXPERIMENT_NAME", "fedlight"), "run_name": run,
                    "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
                    "tags": {k: str(v) for k, v in self.tags.items() if v is not None}}
        if name.startswith("wandb"):
            return {"project": os.environ.get("WANDB_PROJECT", "fedlight"), "name": run, "tags": tag_list,
                    "save_dir": os.environ.get("WANDB_DIR", str(self.out)), "group": self.tags.get("table"),
                    "config": {"fedlight": self.tags}}
        return {"root_dir": str(self.out), "save_dir": str(self.out), "name": name, "version": 0}

    def _describe(self, logger) -> None:
        import yaml

        recipe = self.out / "config.yaml"  # the run's own (a resume's command may differ in execution settings)
        config = yaml.safe_load(recipe.read_text() if recipe.is_file() else self.text or "") or {}
        if _is_wandb(logger):
            return logger.log_hyperparams(config)  # nested: W&B shows it by section
        flat = flatten(config) if isinstance(config, dict) else {}
        is_mlflow = hasattr(logger.experiment, "set_tag")  # its tags were set with the run
        with contextlib.suppress(NotImplementedError):  # Fabric's own CSV/TensorBoard loggers take no params
            logger.log_hyperparams({k: str(v) for k, v in flat.items()} if is_mlflow else  # [] and {} kept
                                   {**flat, **{f"fedlight.{k}": v for k, v in self.tags.items()}})

    # ------------------------------------------------------------------------------------------ rounds
    def begin(self, rows: list[dict[str, Any]]) -> None:
        """Send the rows of ``metrics.jsonl`` a tracker lacks (a resumed run, a tracker added on resume)."""
        self.pending = list(rows)
        self._release()

    def log_round(self, row: dict[str, Any], durable: bool = True) -> None:
        """Queue ``row``; send it and the rows before it once ``durable`` (its round's checkpoint is on disk), so a
        tracker never holds a round that a resume recomputes: it holds exactly ``metrics.jsonl``'s numbers."""
        self.pending.append(row)
        if durable:
            self._release()

    def _release(self) -> None:
        rows, self.pending = self.pending, []
        for row in rows:
            self.last_round = max(self.last_round, int(row["round"]))
            self.writer.submit(lambda row=row: self._log(row))

    def _log(self, row: dict[str, Any]) -> None:
        step, numbers = int(row["round"]), metrics_of(row)
        sent = False
        for name, logger in self.loggers.items():
            if name in self.failed or step <= self.state[name]["logged"]:
                continue
            try:
                with mlflow_store.quiet():
                    logger.log_metrics(numbers, step=step)
                self.state[name]["logged"] = step
                sent = True
            except Exception as err:  # noqa: BLE001 - a tracker never stops training
                self.failed[name] = step
                warn_failed(f"tracker {name}", step, err, "summary.json lists the rounds it missed")
        if sent:
            self._save()

    # ------------------------------------------------------------------------------------------ end
    def report(self) -> dict[str, Any]:
        """``summary.json``'s ``trackers``: each tracker's run id and the rounds it missed (``"3-5"``, or ``None``)."""
        self._release()  # the run finished: every row is final
        self.writer.wait()
        missed = {n: list(range(self.state[n]["logged"] + 1, self.last_round + 1)) for n in self.loggers}
        return {n: {"id": self.state[n]["id"], "missed_rounds": round_ranges(missed[n]) or None} for n in missed}

    def finish(self, summary: dict[str, Any]) -> None:
        """Summary figures and the run's files to every tracker still working, then close their runs."""
        figures = {f"summary/{k}": v for k, v in flatten(summary).items() if _number(v)}
        for e in self.entries:
            name, logger = e["name"], self.loggers.get(e["name"])
            if logger is None or name in self.failed:
                continue
            try:
                if _is_wandb(logger):  # W&B's run summary, not one more history row
                    logger.experiment.summary.update(figures)
                else:
                    logger.log_metrics(figures, step=self.last_round)
                for f in (self.out / a for a in e["artifacts"]):
                    if f.is_file():
                        _upload(logger, f, self.out)
                files = Path(logger.experiment.dir) if _is_wandb(logger) else None
                _end(logger, "success")
                if files is not None:  # W&B links the uploaded files by absolute path: relative, the run can move
                    wandb_files.relink(files, self.out)
                self.loggers.pop(name)
            except Exception as err:  # noqa: BLE001
                print(f"fedlight: warning: tracker {name} failed at the end ({_line(err)}); the run's files are in "
                      f"{self.out}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the thread; a tracker run left unfinished is marked so where the tracker still takes it (MLflow:
        FAILED for a tracker that failed, KILLED for a stopped run)."""
        if self.writer.wait in faults.DRAIN:
            faults.DRAIN.remove(self.writer.wait)
        with contextlib.suppress(Exception):  # its failures were reported where they happened
            self.writer.close()
        for name, logger in self.loggers.items():
            failed = name in self.failed
            # the tracker is gone; the run's files are what counts
            with contextlib.suppress(Exception), mlflow_store.quiet():
                _end(logger, "KILLED" if hasattr(logger, "run_id") and not failed else "failed")
        self.loggers = {}

    def _save(self) -> None:
        atomic.atomic_write_text(self.out / FILE, json.dumps(self.state, indent=1) + "\n")


def metrics_of(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` row a tracker takes (the round is the step; lists and flags are left)."""
    return {k: v for k, v in row.items() if k != "round" and _number(v)}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _run_id(logger) -> str:
    run_id = getattr(logger, "run_id", None)  # MLflow (touching it creates the run)
    return run_id if run_id is not None else (logger.experiment, logger.version)[1]  # W&B: wandb.init; CSV: 0


def _end(logger, status: str) -> None:
    logger.finalize(status)
    if _is_wandb(logger):  # WandbLogger leaves the run open: close it now, not in an exit hook a stop skips
        logger.experiment.finish(exit_code=0 if status == "success" else 1)


def _upload(logger, path: Path, root: Path) -> None:
    exp = logger.experiment
    if hasattr(exp, "log_artifact") and hasattr(logger, "run_id"):  # MlflowClient
        exp.log_artifact(logger.run_id, str(path))
    elif _is_wandb(logger):
        exp.save(str(path), base_path=str(root), policy="now")


def _is_wandb(logger) -> bool:
    return type(logger).__module__.endswith("wandb")


def _json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text()) or {}
    return {}


def warn_failed(who: str, step: int, err: BaseException, after: str) -> None:
    """The one line that says a tracker or logger failed (at round ``step``; 0: opening, -1: the summary) and that
    training goes on without it."""
    when = {0: "as it opened", -1: "writing the summary"}.get(step, f"at round {step}")
    goes = "the run ends without it" if step == -1 else "training goes on without it"
    print(f"fedlight: warning: {who} failed {when} ({_line(err)}); {goes}, and {after}", file=sys.stderr, flush=True)


def _line(err: BaseException) -> str:
    """The error's first line that says what went wrong (SQLAlchemy starts with a hint about its own session)."""
    text = [ln for ln in str(err).strip().splitlines() if ln.strip() and not ln.startswith("(raised as a result of")]
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
