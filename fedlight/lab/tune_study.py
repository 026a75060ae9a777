"""A ``fedlight tune`` study in Optuna's RDB storage: one Optuna study per row (``<name>/<row>``), made from a
protocol that is stored with it (``user_attrs["fedlight"]``), and the trials a worker takes: a new one while the
row's budget allows, or one whose worker is gone (killed; it resumes from its run's checkpoint).

A trial's worker is in its ``user_attrs["worker"]``: host, process id and the time it last reported. It is gone
when that process no longer exists on this host, or it has not reported for ``stale_after_s`` (another host).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check

PROTOCOL = "fedlight"
WORKER = "worker"


def need_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("`fedlight tune` and `--tuned` need Optuna: pip install 'fedlight[tune]' (or pip install "
                          "optuna)") from None


def storage_url(text: str | None, out: Path) -> str:
    """``--storage`` (any SQLAlchemy URL), else SQLite beside the runs: ``OUT/study.db``."""
    return text or f"sqlite:///{(Path(out) / 'study.db').resolve()}"


def open_storage(url: str):
    """Optuna's RDB storage at ``url``; one that cannot be opened is one line (exit 2) naming it and why."""
    import optuna

    try:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}}
                                          if url.startswith("sqlite") else None)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors vary by driver; each is the same answer here
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"`--storage` {url}: cannot be opened ({why}); give an SQLAlchemy URL Optuna can use, e.g. "
                          "sqlite:///runs/tune/study.db or postgresql://user@host/db") from None


def study_name(name: str, row: str) -> str:
    return f"{name}/{row}"


def open_study(storage, name: str, protocol: dict[str, Any], maximize: bool, sampler, pruner):
    """Load or create the row's study; a study made from another protocol is refused, naming what differs."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True, sampler=sampler,
                                pruner=pruner, direction="maximize" if maximize else "minimize")
    made = study.user_attrs.get(PROTOCOL)
    wanted = json.loads(json.dumps(protocol, default=str))
    if made is None:
        study.set_user_attr(PROTOCOL, wanted)
        return study
    diff = [k for k in sorted(set(made) | set(wanted)) if made.get(k) != wanted.get(k)]
    if diff:
        k = diff[0]
        raise ConfigError(f"study {name!r} was made from another spec: `{k}` is {json.dumps(made.get(k))} in the "
                          f"study and {json.dumps(wanted.get(k))} now" + (f" (also differ: {', '.join(diff[1:])})"
                                                                          if diff[1:] else "")
                          + "; pass another --out (or --storage/--study), or delete the study to start over")
    return study


def host() -> str:
    from fedlight.lab.jobs import host as _host

    return _host()


def mine() -> dict[str, Any]:
    return {"host": host(), "pid": os.getpid(), "beat": time.time()}


def gone(worker: dict[str, Any] | None, stale_after_s: float) -> bool:
    """Whether a running trial's worker is gone (see the module's docstring)."""
    from fedlight.lab.jobs import alive

    if not worker:
        return True
    if worker.get("host") == host() and worker.get("pid") == os.getpid():
        return False  # this process runs it
    return not alive(worker) or time.time() - float(worker.get("beat", 0)) > stale_after_s


def claim(study, budget: int, stale_after_s: float, taken: set[int]):
    """The next trial for this worker: a running one whose worker is gone, else a new one while the study has
    fewer than ``budget`` trials; ``None`` when neither. ``taken``: trial numbers this process already runs."""
    import optuna

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in running:
        if t.number not in taken and gone(t.user_attrs.get(WORKER), stale_after_s):
            trial = optuna.trial.Trial(study, t._trial_id)
            trial.set_user_attr(WORKER, mine())
            return trial
    if len(study.get_trials(deepcopy=False)) >= budget:
        return None
    trial = study.ask()
    trial.set_user_attr(WORKER, mine())
    return trial


def suggest(trial, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The trial's values for ``space`` (those it already has stay: a resumed trial keeps its values)."""
    out = {}
    for key, d in space.items():
        if "choices" in d:
            out[key] = trial.suggest_categorical(key, d["choices"])
        elif d.get("int") or (isinstance(d["low"], int) and isinstance(d["high"], int) and "step" not in d
                              and not d.get("log")):
            out[key] = trial.suggest_int(key, d["low"], d["high"], step=d.get("step", 1), log=bool(d.get("log")))
        else:
            out[key] = trial.suggest_float(key, d["low"], d["high"], step=d.get("step"), log=bool(d.get("log")))
    return out


def sampler(tune, row: str):
    """Optuna's sampler of a ``tune:`` section for ``row`` (grid: over the row's ``choices``)."""
    import optuna

    from fedlight.lab.tune_space import SAMPLERS

    kw = {k: v for k, v in tune.sampler.items() if k != "name"}
    if tune.sampler["name"] == "grid":
        space = tune.space[row]
        check(all("choices" in d for d in space.values()), f"`tune.sampler` grid needs every setting of row {row!r} "
              "as {choices: [...]}")
        kw["search_space"] = {k: d["choices"] for k, d in space.items()}
    return getattr(optuna.samplers, SAMPLERS[tune.sampler["name"]])(**kw)


def pruner(tune):
    import optuna

    from fedlight.lab.tune_space import PRUNERS

    return getattr(optuna.pruners, PRUNERS[tune.pruner["name"]])(**{k: v for k, v in tune.pruner.items()
                                                                    if k != "name"})


def best(storage_or_url, name: str):
    """The best finished trial of study ``name`` (its ``params`` and ``value``); a study without one is refused."""
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=storage_or_url)
    except KeyError:
        raise ConfigError(f"`--tuned`: the storage has no study {name!r}; run `fedlight tune` first (studies there: "
                          f"{', '.join(optuna.get_all_study_names(storage_or_url)) or 'none'})") from None
    try:
        return study.best_trial
    except ValueError:
        raise ConfigError(f"`--tuned`: study {name!r} has no finished trial yet; finish `fedlight tune` "
                          "first") from None


def tuned_values(spec_path: Path, rows: list[str], tuned: str) -> dict[str, dict[str, Any]]:
    """``fedlight reproduce --tuned``: row -> the best values of its study. ``tuned``: a ``fedlight tune`` output
    folder (its ``tune.json`` names the storage and the study) or a storage URL (studies ``<spec name>/<row>``)."""
    need_optuna()
    folder = Path(tuned)
    if "://" in tuned:
        url, name = tuned, spec_path.stem
    else:
        made = folder / "tune.json"
        check(made.is_file(), f"`--tuned {tuned}`: not a `fedlight tune` output folder (no tune.json there) nor a "
              "storage URL; pass the --out of `fedlight tune` or its --storage")
        record = json.loads(made.read_text())
        url, name = record["storage"], record["study"]
    storage = open_storage(url)
    import optuna

    names = set(optuna.get_all_study_names(storage))
    out = {row: best(storage, study_name(name, row)).params for row in rows if study_name(name, row) in names}
    check(bool(out), f"`--tuned {tuned}`: no study of these rows there ({', '.join(study_name(name, r) for r in rows)};"
          f" it has {', '.join(sorted(names)) or 'none'}); run `fedlight tune` first")
    return out
