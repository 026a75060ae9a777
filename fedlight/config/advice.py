"""Settings whose scale an algorithm's paper fixes, checked before round 1.

An adaptive rule divides its step by √v (Adam-type local steps, a server Adam), so its learning rate lives on another
scale than SGD's: the lr 0.1 that trains FedAvg sends FedAdamW to 10 % accuracy. Such an algorithm declares it, as a
class attribute next to its signature::

    class FedAdamW(Algorithm):
        scales = (Scale("loop.lr", paper=3e-4, low=1e-6, high=1e-2),)

``low``/``high`` bound the values that train at all (fedlight's sanity bounds, not the paper's tuning grid). Then

* ``fedlight fit`` gives a setting the paper's value when the user did not choose it for this rule: neither a flag
  sets it, nor does the recipe (or ``--algorithm`` switched the recipe's rule, so its value was chosen for another
  rule) — and says so on stderr. The value goes into ``config.yaml`` like any other setting.
* A value outside ``[low, high]`` that the user did choose (a flag, the rule's own recipe, or :func:`fedlight.fit`)
  trains, after a :class:`ScaleWarning` that names the setting, the bounds and the paper's value.
"""

from __future__ import annotations

import warnings
from typing import Any

from fedlight.core.loop_config import SGD_LR
from fedlight.core.scale import Scale, ScaleWarning, scales_of


def _outside(s: Scale, value: Any) -> bool:
    return isinstance(value, (int, float)) and not s.low <= value <= s.high


def _message(cls: type, s: Scale, value: float) -> str:
    return (f"`{s.key}` {value:g} is outside the range in which {cls.__name__} trains ([{s.low:g}, {s.high:g}]; "
            f"its paper uses {s.paper:g}); expect a diverging loss. Set `--{s.key} {s.paper:g}` unless you mean it")


def check_scales(algorithm: Any, loop: Any) -> None:
    """Warn (:class:`ScaleWarning`) for every declared setting of ``algorithm`` outside its range."""
    for s in scales_of(algorithm):
        if s.key.startswith("loop."):
            value = getattr(loop, s.key.split(".", 1)[1], None)
        else:
            value = algorithm
            for part in (s.attr or s.key.split(".", 1)[1]).split("."):
                value = getattr(value, part, None)
        if _outside(s, value):
            warnings.warn(_message(type(algorithm), s, value), ScaleWarning, stacklevel=2)


def _cfg_value(cfg: Any, cls: type, s: Scale) -> Any:
    """The value the parsed recipe gives ``s`` (an algorithm argument it leaves out has the signature default)."""
    import inspect

    group, _, name = s.key.partition(".")
    if group == "loop":
        return cfg.get(s.key)
    value = cfg.get(f"algorithm.init_args.{name}")
    if value is None:
        param = inspect.signature(cls).parameters.get(name)
        value = None if param is None or param.default is inspect.Parameter.empty else param.default
    return value


def _in_recipes(argv: list[str], key: str) -> bool:
    """Whether a ``--config`` recipe of ``argv`` sets ``key`` (``algorithm.x`` as ``algorithm.init_args.x``)."""
    from pathlib import Path

    import yaml

    group, _, name = key.partition(".")
    path = [group, "init_args", name] if group == "algorithm" else [group, name]
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        if flag != "--config":
            continue
        try:
            node: Any = yaml.safe_load(Path(val if eq else argv[i + 1]).read_text())
        except (OSError, IndexError, yaml.YAMLError):
            continue
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return True
    return False


def _on_command_line(argv: list[str], key: str) -> bool:
    group, _, name = key.partition(".")
    flags = {f"--{key}"} | ({f"--algorithm.init_args.{name}"} if group == "algorithm" else set())
    return any(a.partition("=")[0] in flags for a in argv)


def paper_defaults(cfg: Any, argv: list[str]) -> list[str]:
    """Flags that give the parsed algorithm's declared settings their paper values where the user did not choose
    them (out of range, not on the command line, and not in the recipe unless ``--algorithm`` switched its rule)."""
    import importlib
    import sys

    path = cfg.get("algorithm.class_path") if cfg.get("algorithm") is not None else None
    if not path:  # the default rule (FedAvg): SGD's
        return ["--loop.lr", repr(SGD_LR)] if cfg.get("loop.lr") is None else []
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    switched = any(a.partition("=")[0] == "--algorithm" for a in argv)
    extra: list[str] = []
    for s in scales_of(cls):
        value = _cfg_value(cfg, cls, s)
        unset = value is None and s.key == "loop.lr"
        if not (unset or _outside(s, value)) or _on_command_line(argv, s.key) or (_in_recipes(argv, s.key)
                                                                                  and not switched):
            continue
        origin = ("unset" if unset else f"the recipe's {value:g} was set for another rule" if _in_recipes(argv, s.key)
                  else f"the default {value:g} suits SGD-type rules")
        print(f"fedlight: note: `{s.key}` set to {s.paper:g}, {cls.__name__}'s paper value ({origin}; "
              f"{cls.__name__} trains in [{s.low:g}, {s.high:g}]); pass `--{s.key}` to choose", file=sys.stderr)
        extra += [f"--{s.key}", repr(s.paper)]
    return extra + (["--loop.lr", repr(SGD_LR)] if cfg.get("loop.lr") is None and "--loop.lr" not in extra else [])


def python_defaults(algorithm: Any, loop: Any) -> Any:
    """``loop`` for a :func:`fedlight.fit` call from Python, with each declared ``loop.*`` setting of ``algorithm``
    that is unset (``None``, ``loop.lr``'s default) given its paper value, said on stderr as the command line says it,
    and an unset ``loop.lr`` of a rule that declares none :data:`SGD_LR` (a value the caller chose is always kept,
    and warned about by :func:`check_scales` when outside the rule's range)."""
    import dataclasses
    import sys

    changes = {}
    for s in scales_of(algorithm):
        name = s.key.split(".", 1)[1]
        if not s.key.startswith("loop.") or name not in getattr(loop, "__dataclass_fields__", {}):
            continue
        value, default = getattr(loop, name), type(loop).__dataclass_fields__[name].default
        if value is None or value == default and _outside(s, value):  # unset: the caller did not choose it
            cls = type(algorithm).__name__
            print(f"fedlight: note: `{s.key}` set to {s.paper:g}, {cls}'s paper value (unset; {cls} trains in "
                  f"[{s.low:g}, {s.high:g}]); pass `{s.key}` to choose", file=sys.stderr)
            changes[name] = s.paper
    loop = dataclasses.replace(loop, **changes) if changes else loop
    return loop.for_rule(algorithm) if hasattr(loop, "for_rule") else loop
