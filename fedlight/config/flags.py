"""What a recipe and its flags name, checked before parsing: class names resolve, keys exist, typos get a suggestion.

``fedlight fit`` takes a class as a registry name or class name in any letter case (``--algorithm fedadamw``,
``--model resnet18``, ``--algorithm.help FedAdamW``) and rewrites it to its class path. A key a class does not take
(``--algorithm.roh 0.01``, ``init_args: {roh: ...}`` in a recipe) is a :class:`ConfigError` naming the class, the
closest key and where its keys are listed, instead of jsonargparse's ``NestedArg(key='roh', ...)``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from fedlight.core.registry import closest, import_module
from fedlight.errors import ConfigError

# recipe key -> (package whose classes it names, `fedlight ls` section, class attribute listing the names)
GROUPS: dict[str, tuple[str, str, str]] = {
    "algorithm": ("fedlight.algorithms", "algorithms", "__all__"),
    "model": ("fedlight.models", "models", "MODELS"),
    "data": ("fedlight.data", "datasets", "DATASETS"),
    "data.partition": ("fedlight.data", "partitioners", "PARTITIONERS"),
    "task": ("fedlight.tasks", "tasks", "TASKS"),
}
SPECIAL = ("help", "class_path", "init_args", "dict_kwargs")


def class_path(group: str, value: str) -> str:
    """``value`` (a class path, a class name or an algorithm's registry name, any letter case) as a class path. An
    algorithm may also be ``module:Class`` and come from the working directory or an installed package's
    ``fedlight.algorithms`` entry point (:func:`fedlight.core.registry.algorithm_class`)."""
    if value.lstrip().startswith(("{", "[")):
        return value
    if group == "algorithm":
        import fedlight.algorithms  # noqa: F401 - fedlight's own rules register first
        from fedlight.core.registry import algorithm_class, class_path_of

        try:
            cls = algorithm_class(value)
            return value if "." in value and ":" not in value else class_path_of(cls)  # a class path stays as given
        except ConfigError as e:
            raise ConfigError(f"`--algorithm`: {e}") from None
    if "." in value:
        return value
    package, section, attr = GROUPS[group]
    names = list(getattr(importlib.import_module(package), attr))
    by_case = {n.lower(): n for n in names}
    if value.lower() in by_case:
        return f"{package}.{by_case[value.lower()]}"
    raise ConfigError(f"`--{group}`: unknown {section[:-1]} {value!r}{closest(value, names)} (list them with "
                      f"`fedlight ls {section}`, or give a class path such as {package}.{names[0]})")


def resolve_names(argv: list[str]) -> list[str]:
    """``--algorithm fednsam`` → ``--algorithm fedlight.algorithms.FedNSAM``; likewise ``--X=...`` and ``--X.help``."""
    out = list(argv)
    for i, a in enumerate(out):
        flag, eq, val = a.partition("=")
        group = flag[2:].removesuffix(".help")
        if not flag.startswith("--") or group not in GROUPS:
            continue
        if eq:
            out[i] = f"{flag}={class_path(group, val)}"
        elif i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = class_path(group, out[i + 1])
    return out


def _import(path: str) -> type | None:
    """The class at ``path`` (its module on ``sys.path`` or in the working directory), else None."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def init_keys(cls: type) -> list[str] | None:
    """The keyword arguments ``cls`` takes (following ``**kwargs`` up to its bases); None when they are open-ended."""
    keys: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if keys and klass.__module__.split(".")[0] != "fedlight":
            return None  # **kwargs handed on to e.g. nn.Module(*args, **kwargs): anything goes
        params = list(inspect.signature(init).parameters.values())[1:]
        keys += [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return keys
    return None


def _check_key(group: str, cls: type | None, key: str, where: str) -> None:
    if cls is None or key in SPECIAL:
        return
    keys = init_keys(cls)
    if keys is None or key in keys:
        return
    name = getattr(cls, "name", cls.__name__) if group == "algorithm" else cls.__name__
    raise ConfigError(f"{where}: {cls.__name__} takes no argument {key!r}{closest(key, keys)} (its arguments: "
                      f"{', '.join(keys) or 'none'}; `fedlight fit --{group}.help {name}`)")


def _cls_of(value: Any) -> type | None:
    if isinstance(value, dict):
        value = value.get("class_path")
    return _import(value) if isinstance(value, str) and "." in value else None


def _check_recipe(path: str, current: dict[str, type | None], named: set[str]) -> None:
    import yaml

    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except UnicodeDecodeError as e:
        raise ConfigError(f"`--config` {path} is not a text recipe (byte {e.start} is not UTF-8); pass a YAML file "
                          "such as recipes/fedavg_mlp_fmnist_dir0.1.yaml") from None
    except (OSError, yaml.YAMLError):
        return  # jsonargparse reports it
    if not isinstance(recipe, dict):
        return
    for group in GROUPS:
        node: Any = recipe
        for part in group.split("."):
            node = node.get(part) if isinstance(node, dict) else None
            if part != group.split(".")[-1] and isinstance(node, dict):
                node = node.get("init_args")
        if node is None:
            continue
        named.add(group)
        cls = _cls_of(node)
        if cls is not None:
            current[group] = cls
        if isinstance(node, dict):
            for key in (node.get("init_args") or {}) if isinstance(node.get("init_args"), dict) else ():
                _check_key(group, cls or current[group], key, f"`{group}.init_args.{key}` (in {path})")


def check_keys(argv: list[str]) -> None:
    """Every ``--model/--data/--algorithm`` key in ``argv`` and in its ``--config`` recipes is one its class takes."""
    current: dict[str, type | None] = dict.fromkeys(GROUPS)
    named: set[str] = set()
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag == "--config":
            _check_recipe(val, current, named)
            continue
        for group in sorted(GROUPS, key=len, reverse=True):  # data.partition before data
            if flag == f"--{group}":
                current[group] = _cls_of(val) or current[group]
                named.add(group)
                break
            if flag.startswith(f"--{group}."):
                rest = flag[len(group) + 3:].split(".")
                rest = rest[1:] if rest[0] == "init_args" and len(rest) > 1 else rest
                if group == "data" and rest[0] == "partition":
                    break
                if group == "algorithm" and group not in named and rest[0] not in SPECIAL:
                    raise ConfigError(f"`{flag}`: no algorithm is named (the default is FedAvg); name one before its "
                                      f"arguments, e.g. `--algorithm fedsam {flag} ...`")
                _check_key(group, current[group], rest[0], f"`{flag}`")
                break
