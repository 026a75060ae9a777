"""What ``fit`` hands :class:`fedlight.run.trackers.Trackers`: the ``loggers`` setting (docs/trackers.md) as
entries, checked when ``fit`` starts (a bad entry or a missing package is one line, exit 2, before anything is
written), and the tags that identify the run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fedlight.core.registry import closest
from fedlight.errors import ConfigError

ARTIFACTS = ("config.yaml", "summary.json", "final_model.pt")
NAMES = {"mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
         "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
         "csv": ("lightning.pytorch.loggers.CSVLogger", None)}  # Fabric's CSVLogger plus hparams.yaml
"""Short names: (class path, the package it needs, installed by ``pip install 'fedlight[<name>]'``)."""


def parse(loggers: Any) -> tuple[bool, list[dict[str, Any]]]:
    """``loggers`` → (TensorBoard on, the other trackers as ``{name, class_path, init_args, artifacts}``); a bad entry
    or a missing package is a :class:`ConfigError` naming the fix."""
    if loggers in (None, False, "none", "false"):
        return False, []
    items = list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
    out = [_entry(i) if isinstance(i, (str, dict)) else  # else a logger object (Python API)
           {"name": type(i).__name__.lower(), "logger": i, "init_args": {}, "artifacts": list(ARTIFACTS)}
           for i in items if i != "tensorboard"]
    seen: list[str] = []
    for e in out:  # two of one kind: csv, csv_2
        seen.append(e["name"])
        e["name"] += f"_{seen.count(e['name'])}" if seen.count(e["name"]) > 1 else ""
    return "tensorboard" in items, out


def _entry(item: str | dict[str, Any]) -> dict[str, Any]:
    spec = {"class_path": item} if isinstance(item, str) else dict(item)
    unknown = set(spec) - {"class_path", "init_args", "artifacts"}
    path = str(spec.get("class_path", ""))
    if unknown or not path:
        raise ConfigError(f"`loggers`: {item!r} is not a logger; give tensorboard, mlflow, wandb, csv or "
                          "{class_path: lightning.pytorch.loggers.X, init_args: {...}, artifacts: true|false|[files]}")
    name = path if path in NAMES else path.rsplit(".", 1)[-1].lower()
    path, package = NAMES.get(path, (path, None))
    if "." not in path:
        raise ConfigError(f"`loggers`: unknown logger {item!r}{closest(path, ['tensorboard', *NAMES])} (give "
                          "tensorboard, mlflow, wandb, csv or a class path such as lightning.pytorch.loggers.X)")
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"`loggers`: {name} needs the `{package}` package: pip install 'fedlight[{name}]'")
    arts = spec.get("artifacts", True)
    arts = list(ARTIFACTS) if arts is True else [] if arts in (False, None) else [str(a) for a in arts]
    return {"name": name, "class_path": path, "init_args": dict(spec.get("init_args") or {}), "artifacts": arts}


def run_tags(algorithm, model, data, seed: int, out: Path) -> dict[str, Any]:
    """What identifies a run in a tracker's UI."""
    import fedlight
    from fedlight.run.summary import git_revision

    return {"algorithm": getattr(algorithm, "name", type(algorithm).__name__), "model": type(model).__name__,
            "data": type(data).__name__, "seed": seed, "fedlight_version": fedlight.__version__,
            "git_revision": git_revision(), "run_dir": str(Path(out).resolve()),
            **({"privacy": algorithm.server.convention_label()}  # which ε: level, accountant, sampling, relation
               if hasattr(getattr(algorithm, "server", None), "convention_label") else {})}
