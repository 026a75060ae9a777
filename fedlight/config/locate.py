"""Where recipes and table specs are found: one order everywhere (``fit --config``, ``reproduce``, ``tune``, a table
spec's ``base:``, ``ls``, ``cp``).

1. the path as given (``my_recipe.yaml``, ``/abs/x.yaml``), relative to the working directory;
2. the working directory's ``recipes/`` (``recipes/X.yaml``, ``recipes/tables/X.yaml``);
3. the recipes installed with fedlight: ``fedlight/recipes/`` inside a wheel (the repository's top-level ``recipes/``
   shipped as package data), the repository's ``recipes/`` in a checkout.

A reference may be a name (``quickstart``), a file name (``quickstart.yaml``) or a repository path
(``recipes/quickstart.yaml``, ``recipes/tables/fednsam_table2.yaml``): 2 and 3 look it up with its leading
``recipes/`` taken off, with and without ``.yaml``. A reference found nowhere is a :class:`ConfigError` that names
where it looked and the closest bundled names.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from fedlight.errors import ConfigError

KINDS = {"recipe": "", "table": "tables"}  # kind -> its folder under recipes/
PLURAL = {"recipe": "recipes", "table": "tables"}  # `fedlight ls` sections


def bundled_dir() -> Path:
    """The recipes installed with this fedlight: ``fedlight/recipes`` in an installed wheel, else (a checkout,
    an editable install) the repository's top-level ``recipes/``."""
    package = Path(__file__).resolve().parents[1]
    inside = package / "recipes"
    return inside if inside.is_dir() else package.parent / "recipes"


def roots() -> list[Path]:
    """The ``recipes/`` folders searched after the path as given: the working directory's, then the installed one."""
    out: list[Path] = []
    for root in (Path.cwd() / "recipes", bundled_dir()):
        if all(root.resolve() != r.resolve() for r in out):
            out.append(root)
    return out


def bundled(kind: str = "recipe") -> list[Path]:
    """The installed recipes (``kind="recipe"``) or table specs (``"table"``), sorted by name."""
    folder = bundled_dir() / KINDS[kind]
    return sorted(folder.glob("*.yaml")) if folder.is_dir() else []


def _candidates(ref: Path, kind: str) -> list[Path]:
    rel = Path(*ref.parts[1:]) if ref.parts[0] == "recipes" and len(ref.parts) > 1 else ref
    names = [rel] if rel.suffix in (".yaml", ".yml") else [rel, rel.with_name(rel.name + ".yaml")]
    out: list[Path] = []
    for root in roots():
        for name in names:
            for cand in (root / name, root / KINDS[kind] / name):
                if cand not in out:
                    out.append(cand)
    return out


def find(ref: str | Path, *kinds: str) -> Path:
    """The file ``ref`` names, as a recipe (default) or as the first of ``kinds`` that has it (module docstring)."""
    kinds = kinds or ("recipe",)
    given = Path(ref).expanduser()
    if given.is_file():
        return given
    if str(ref).strip() and not given.is_absolute():
        for kind in kinds:
            for cand in _candidates(given, kind):
                if cand.is_file():
                    return cand.resolve()
    raise ConfigError(not_found(str(ref), kinds))


def not_found(ref: str, kinds: tuple[str, ...] = ("recipe",)) -> str:
    """One line: what was not found, where fedlight looked, the closest bundled names and how to list them."""
    what = " or ".join("table spec" if k == "table" else k for k in kinds)
    looked = [f"{ref} (as a path)"] + [f"{root / KINDS[k]}/" for root in roots() for k in kinds]
    names = [p.stem for k in kinds for p in bundled(k)]
    stem = Path(ref).name.removesuffix(".yaml").removesuffix(".yml")
    close = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    hint = f"; closest bundled: {', '.join(close)}" if close else ""
    ls = " / ".join(f"fedlight ls {PLURAL[k]}" for k in kinds)
    return f"{what} {ref!r} not found (looked at {', '.join(looked)}){hint}; list them: {ls}"


def config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config`` value that is not a file resolved (``--config quickstart`` → the installed
    ``…/recipes/quickstart.yaml``); inline YAML (``--config '{loop: {rounds: 2}}'``) is left to jsonargparse."""
    out = list(argv)
    for i, a in enumerate(out):
        flag, eq, val = a.partition("=")
        if flag != "--config" or (not eq and i + 1 >= len(out)):
            continue
        val = val if eq else out[i + 1]
        if Path(val).is_file() or any(c in val for c in ":{}[]\n") or val.startswith("-"):
            continue
        path = str(find(val, "recipe"))
        if eq:
            out[i] = f"--config={path}"
        else:
            out[i + 1] = path
    return out


def describe(path: Path, kind: str) -> str:
    """What a bundled file reproduces: a table spec's ``title``; a recipe's row of ``recipes/README.md`` (paper +
    table, the paper's number), else the first line of its header comment."""
    import yaml

    text = path.read_text()
    if kind == "table":
        for line in text.splitlines():
            if line.startswith("title:"):
                return str(yaml.safe_load(line)["title"])
        return ""
    row = _readme_rows(path.parent / "README.md").get(path.name)
    if row:
        paper, number = row
        return paper + (f" — paper: {number}" if number and not number.startswith(("—", "-")) else "")
    first = text.splitlines()[0] if text else ""
    return first.lstrip("# ").strip() if first.startswith("#") else ""


def _readme_rows(readme: Path) -> dict[str, tuple[str, str]]:
    """``{file name: (paper + table, paper number)}`` from the recipe table of ``recipes/README.md``."""
    if not readme.is_file():
        return {}
    out = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].endswith(".yaml`") and cells[0].count("`") == 2:
            out.setdefault(cells[0].strip("`"), (cells[1], cells[2]))
    return out
