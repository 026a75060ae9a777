"""One readable line for a refused command line: the root :class:`~fedlight.errors.ConfigError`, else the most
specific reason jsonargparse gives (an unknown key or class, with the closest known name)."""

from __future__ import annotations

import importlib
import re
import sys

from fedlight.config.flags import GROUPS
from fedlight.core.registry import closest
from fedlight.errors import ConfigError


def _flags(parser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _unknown(msg: str, parser) -> str | None:
    """The nearest key for ``unrecognized arguments: --loop.round 5`` or ``Group 'loop' does not accept ...``."""
    import re

    from fedlight.core.registry import closest

    flag = re.search(r"unrecognized arguments: (--[^\s=]+)", msg)
    if flag:
        f = flag.group(1)
        return (f"`{f}` is not a setting{closest(f, _flags(parser))} (every setting: `fedlight fit --help`; "
                "prefixes are not expanded)")
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", msg)
    if group:
        g, key = group.groups()
        keys = [f[len(g) + 3:] for f in _flags(parser) if f.startswith(f"--{g}.")]
        return f"`{g}.{key}` is not a setting{closest(key, keys)} (every `{g}` key: `fedlight fit --help`)"
    return None


def explain(e: BaseException, parser=None) -> str:
    """One readable message: the root ConfigError if there is one, else the most specific parser reason."""
    c: BaseException | None = e
    while c is not None:
        if isinstance(c, ConfigError):
            return str(c)
        c = c.__cause__ or c.__context__
    msg = str(e)
    for line in msg.splitlines():  # a ConfigError message reported inside a union-validation error
        if line.strip().startswith("- `"):
            return line.strip()[2:]
    if msg.strip().startswith("Unexpected config"):
        return "`--config` is empty or is not a mapping of settings (model, data, algorithm, loop, ...)"
    unknown = (_unknown(msg, parser) if parser is not None else None) or _missing_class(msg) or _nested(msg)
    if unknown:
        return unknown
    number = re.search(r'Parser key "([^"]+)":\s*Expected a <class \'(float|int)\'>\. Got value: (\S+)', msg) or \
        re.search(r'Parser key "([^"]+)":\s*Does not validate against any of the Union subtypes\s*Subtypes: '
                  r'\[<class \'(float|int)\'>, <class \'NoneType\'>\].*Given value: (\S+)\s*$', msg, re.S)  # X | None
    if number:  # YAML reads `nan`, `inf` and typos as strings
        return _number(*number.groups())
    keys = re.findall(r'Parser key "([^"]+)"', msg)
    reasons = [ln.strip() for ln in msg.splitlines() if "Got value" in ln or "not accepted" in ln]
    if len(keys) > 1 and reasons:
        return f"`{'.'.join(keys)}`: {reasons[-1]}"
    unknown = _unknown_class(msg)
    if unknown:
        return unknown
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _number(key: str, kind: str, got: str) -> str:
    """``key`` must be a (finite) number or whole number; ``got``: the value as jsonargparse shows it."""
    if re.fullmatch(r"[+-]?\.?(nan|inf|infinity)", got, re.I):
        return f"`{key}` must be a finite {'number' if kind == 'float' else 'whole number'}, got {got}"
    if kind == "int" and re.fullmatch(r"[+-]?\d+(\.0*)?(e\+?\d+)?", got.strip("'\""), re.I):  # 1e9 read as 1e9.0
        whole = int(float(got.strip("'\"")))
        return f"`{key}` must be a whole number written with digits only, e.g. {whole}; got {got}"
    return f"`{key}` must be a {'number' if kind == 'float' else 'whole number'}, got {got}"


def _nested(msg: str) -> str | None:
    """The key and reason inside a section typed ``Config | None`` (``privacy``), which jsonargparse reports under
    the section with the value as given (``NestedArg(key=..., val=...)`` from the command line, a dict from YAML)."""
    outer = re.match(r'\s*Parser key "([^"]+)":', msg)
    cls = re.search(r"Problem with given class_path '([\w.]+)':", msg)
    if not (outer and cls):
        return None
    section, inner = outer.group(1), msg[cls.end():]
    bad = re.search(r"Option '([^']+)' is not accepted", inner)
    if bad:
        module, _, name = cls.group(1).rpartition(".")
        import inspect

        keys = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
        return (f"`{section}.{bad.group(1)}` is not a setting{closest(bad.group(1), keys)} (every `{section}` key: "
                "`fedlight fit --help`)")
    number = re.search(r'Parser key "([^"]+)":.*?Expected a <class \'(float|int)\'>.*?Given value: (\S+)', inner, re.S)
    return _number(f"{section}.{number.group(1)}", *number.groups()[1:]) if number else None


def _missing_class(msg: str) -> str | None:
    """``fedlight.models.Foo is not a known class; did you mean ...`` for a class path naming no class."""
    missing = re.search(r"module '(fedlight\.\w+)' has no attribute '(\w+)'", msg)
    if missing:
        package, name = missing.groups()
        for pkg, section, attr in GROUPS.values():
            if pkg == package:
                near = closest(name, getattr(sys.modules[pkg], attr), f"{pkg}.")
                where = re.search(r'Parser key "([^"]+)"', msg)
                return (f"{f'`{where.group(1)}`: ' if where else ''}{package}.{name} is not a known class{near} "
                        f"(list them with `fedlight ls {section}`)")
    return None


def _unknown_class(msg: str) -> str | None:
    """``model: 'Foo' is not a known class; did you mean ...`` for a value of a class setting that names none."""
    key = re.search(r'Parser key "([^"]+)"', msg)
    given = re.search(r"Given value: (\S+)$", msg.strip())
    if not (key and given and key.group(1) in ("algorithm", "model", "data", "data.partition")):
        return None
    package, section, attr = GROUPS[key.group(1)]
    value = given.group(1).strip("'\"")
    near = closest(value.rsplit(".", 1)[-1], getattr(importlib.import_module(package), attr), f"{package}.")
    return f"`{key.group(1)}`: {value!r} is not a known class{near} (list them with `fedlight ls {section}`)"
