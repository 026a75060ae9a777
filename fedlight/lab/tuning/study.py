"""A ``fedlight tune`` study in Optuna's RDB storage: one Optuna study per row (``<name>/<row>``), made from a
protocol that is stored with it (``user_attrs["fedlight"]``), and the trials a worker takes: a new one while the
row's budget allows, or one whose worker is gone (killed; it resumes from its run's checkpoint).

A trial's worker is in its ``user_attrs["worker"]``: host, process id and start time, and the time it last reported.
It is gone when that process no longer runs on this host (no such process, a zombie, or the id reused by another
process: :func:`fedlight.lab.tables.jobs.alive`), or it has not reported for ``stale_after_s`` (another host).
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


def storage_url(text: str | None, out: Path) -> str:
    """``--storage`` (any SQLAlchemy URL), else SQLite beside the runs: ``OUT/study.db``."""
    return text or f"sqlite:///{(Path(out) / 'study.db').resolve()}"


def open_study(storage, name: str, protocol: dict[str, Any], maximize: bool, sampler, pruner, create: bool = True):
    """Load or create the row's study; a study made from another protocol is refused, naming what differs.
    ``create=False`` (a read-only command): a missing study is refused in one line, and nothing is written."""
    import optuna

    if not create:
        known = optuna.get_all_study_names(storage)
        check(name in known, f"the storage has no study {name!r} (it has {', '.join(sorted(known)) or 'none'}); "
              "run `fedlight tune` with this spec first, or pass its --out (or --storage/--study)")
        study = optuna.load_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner)  # writes nothing
    else:
        study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True, sampler=sampler,
                                    pruner=pruner, direction="maximize" if maximize else "minimize")
    made = study.user_attrs.get(PROTOCOL)
    wanted = json.loads(json.dumps(protocol, default=str))
    if made is not None and "recipe" not in made and "recipe" in wanted:  # made before the recipe was recorded
        made = {**made, "recipe": wanted["recipe"]}
        if create:
            study.set_user_attr(PROTOCOL, made)
    if made is None:
        if create:
            study.set_user_attr(PROTOCOL, wanted)
        return study
    made, wanted = _flat_recipe(made), _flat_recipe(wanted)
    diff = [k for k in sorted(set(made) | set(wanted)) if made.get(k) != wanted.get(k)]
    if diff:
        k = diff[0]
        raise ConfigError(f"study {name!r} was made from another spec: `{k}` is {json.dumps(made.get(k))} in the "
                          f"study and {json.dumps(wanted.get(k))} now" + (f" (also differ: {', '.join(diff[1:])})"
                                                                          if diff[1:] else "")
                          + "; pass another --out (or --storage/--study), or delete the study to start over")
    return study


def _flat_recipe(protocol: dict[str, Any]) -> dict[str, Any]:
    """The protocol with its ``recipe`` spread into ``recipe.<key>`` entries (a difference names the setting)."""
    return {**{k: v for k, v in protocol.items() if k != "recipe"},
            **{f"recipe.{k}": v for k, v in (protocol.get("recipe") or {}).items()}}


def host() -> str:
    from fedlight.lab.tables.jobs import host as _host

    return _host()


def mine() -> dict[str, Any]:
    from fedlight.lab.tables.jobs import start_time

    return {"host": host(), "pid": os.getpid(), "start": start_time(), "beat": time.time()}


def gone(worker: dict[str, Any] | None, stale_after_s: float) -> bool:
    """Whether a running trial's worker is gone (see the module's docstring)."""
    from fedlight.lab.tables.jobs import alive, start_time

    if not worker:
        return True
    if worker.get("host") == host() and worker.get("pid") == os.getpid():
        return worker.get("start") not in (None, start_time())  # this process runs it (else: its id, reused)
    return not alive(worker) or time.time() - float(worker.get("beat", 0)) > stale_after_s


UNMARKED_GRACE_S = 60.0
"""A running trial without a worker is another worker's new trial between ``study.ask()`` and marking it (a few
milliseconds) for this long; after it, one whose worker died in between, and free to take."""


CLAIM_SETTLE_S = 1.0
"""How long a worker that marked a gone trial waits before reading the mark back."""


def claim(study, budget: int, stale_after_s: float, taken: set[int]):
    """The next trial for this worker: a running one whose worker is gone, else a new one while the study has
    fewer than ``budget`` trials; ``None`` when neither. ``taken``: trial numbers this process already runs.

    Two workers may look at once (two Slurm jobs start together): a trial that no worker has marked yet is not
    taken until :data:`UNMARKED_GRACE_S` after it began (else both would train it, in one run directory), and of
    two workers that mark a gone trial at once, the last mark takes it: each reads the mark back
    :data:`CLAIM_SETTLE_S` after writing its own and leaves the trial when it is not its own."""
    import optuna

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in running:
        worker = t.user_attrs.get(WORKER)
        if t.number in taken or (worker is None and _age_s(t) < UNMARKED_GRACE_S) or not gone(worker,
                                                                                              stale_after_s):
            continue
        me = mine()
        trial = optuna.trial.Trial(study, t._trial_id)
        trial.set_user_attr(WORKER, me)
        time.sleep(CLAIM_SETTLE_S)  # a worker that saw the trial gone when this one did has marked it by now
        if study._storage.get_trial(t._trial_id).user_attrs.get(WORKER) == me:  # the last mark takes it
            return trial
    if len(study.get_trials(deepcopy=False)) >= budget:
        return None
    trial = study.ask()
    trial.set_user_attr(WORKER, mine())
    return trial


def _age_s(t) -> float:
    """Seconds since the trial began (Optuna records its start in local time)."""
    from datetime import datetime

    return (datetime.now() - t.datetime_start).total_seconds() if t.datetime_start is not None else float("inf")


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

    from fedlight.lab.tuning.space import SAMPLERS

    kw = {k: v for k, v in tune.sampler.items() if k != "name"}
    if tune.sampler["name"] == "grid":
        space = tune.space[row]
        check(all("choices" in d for d in space.values()), f"`tune.sampler` grid needs every setting of row {row!r} "
              "as {choices: [...]}")
        kw["search_space"] = {k: d["choices"] for k, d in space.items()}
    made = getattr(optuna.samplers, SAMPLERS[tune.sampler["name"]])(**kw)
    return made if kw.get("seed") is None or tune.sampler["name"] == "grid" else per_trial_seed(made, kw["seed"])


def per_trial_seed(inner, seed: int):
    """``inner`` (a seeded sampler) with its random state set from ``seed`` and the trial's number before each trial:
    a restarted study (a new process, its sampler seeded afresh) draws for trial k what an uninterrupted one draws,
    never trial 0's values again, and two workers sharing a study draw for different trials. (The grid sampler
    needs none: it takes a grid point no trial has.)"""
    import optuna

    class PerTrialSeed(optuna.samplers.BaseSampler):
        def infer_relative_search_space(self, study, trial):
            return inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, name, distribution):
            return inner.sample_independent(study, trial, name, distribution)

        def before_trial(self, study, trial) -> None:
            for owner in (inner, getattr(inner, "_random_sampler", None)):  # TPE draws its first trials by one
                if getattr(owner, "_rng", None) is not None:
                    owner._rng.rng.seed((seed * 1_000_003 + trial.number) % 2**32)
            inner.before_trial(study, trial)

        def after_trial(self, study, trial, state, values) -> None:
            inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            inner.reseed_rng()

    return PerTrialSeed()


def pruner(tune):
    import optuna

    from fedlight.lab.tuning.space import PRUNERS

    return getattr(optuna.pruners, PRUNERS[tune.pruner["name"]])(**{k: v for k, v in tune.pruner.items()
                                                                    if k != "name"})


