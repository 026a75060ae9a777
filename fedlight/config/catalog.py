"""What fedlight ships, as tables: feeds ``fedlight ls`` and the README's generated algorithm table."""

from __future__ import annotations

import re
from pathlib import Path

from fedlight.errors import ConfigError


def algorithm_rows(plugins: bool = False) -> list[tuple[str, str, str, str, str]]:
    """One row per registered algorithm; ``plugins``: installed packages' rules (entry points) loaded first."""
    from fedlight import get_algorithm, list_algorithms  # fedlight's own rules registered first
    from fedlight.core.registry import class_path_of, load_plugins

    if plugins:
        load_plugins()
    rows = []
    for name in list_algorithms():
        s = get_algorithm(name)
        rows.append((name, class_path_of(s.cls), s.paper, str(s.backprops), f"{s.comm[0]:g} / {s.comm[1]:g}"))
    return rows


def algorithm_table_markdown() -> str:
    head = "| name | class | paper | backprops / step | comm down / up (models) |\n|---|---|---|---|---|\n"
    return head + "".join(f"| {' | '.join(r)} |\n" for r in algorithm_rows())


CONTRACT = ("LocalContext", "Broadcast", "ClientResult", "RoundInfo")
"""The dataclasses a rule reads and writes (:mod:`fedlight.core.rules`), tabulated in docs/adding_an_algorithm.md."""


def _markdown(text: str) -> str:
    """A docstring fragment as one Markdown table cell: roles and double backquotes as code, ``|`` escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split())).replace("``", "`")
    return text.replace("|", "\\|")


def _field_docs(module) -> dict[tuple[str, str], str]:
    """(class, attribute) → the docstring written under the attribute in ``module``'s source."""
    import ast
    import inspect

    docs = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ClassDef):
            for a, b in zip(node.body, node.body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[node.name, a.target.id] = str(b.value.value)
    return docs


def contract_fields_markdown() -> str:
    """The fields of the rule contract's dataclasses (:data:`CONTRACT`) and ``LocalContext``'s methods, as Markdown
    tables generated from :mod:`fedlight.core.rules` itself."""
    import dataclasses
    import inspect

    from fedlight.core import rules

    docs, out = _field_docs(rules), []
    for name in CONTRACT:
        cls = getattr(rules, name)
        out += [f"**`{name}`**: {_markdown(inspect.getdoc(cls).splitlines()[0])}", "",
                "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = ("required" if f.default_factory is dataclasses.MISSING else f"`{f.default_factory()!r}`") \
                if f.default is dataclasses.MISSING else f"`{f.default!r}`"
            meaning = _markdown(docs.get((name, f.name), ""))
            out.append(f"| `{f.name}` | `{_markdown(str(f.type))}` | {default} | {meaning} |")
        if name == "LocalContext":
            out += ["", "| method | what it does |", "|---|---|"]
            for m, fn in vars(cls).items():
                if inspect.isfunction(fn) and not m.startswith("_"):
                    signature = _markdown(str(inspect.signature(fn)).replace("'", "").replace("(self, ", "("))
                    out.append(f"| `{m}{signature.replace('(self)', '()')}` | {_markdown(inspect.getdoc(fn) or '')} |")
        out.append("")
    return "\n".join(out)


def _names(module: str, attr: str) -> list[str]:
    mod = __import__(module, fromlist=[attr])
    return list(getattr(mod, attr))


RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe_paths() -> list[Path]:
    """Every recipe under ``recipes/`` (recursive), table specs excluded."""
    return sorted(p for p in RECIPES.rglob("*.yaml") if "tables" not in p.parts) if RECIPES.exists() else []


def _text_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def listing(what: str = "all") -> str:
    sections = {
        "algorithms": lambda: _text_table(algorithm_rows(plugins=True),
                                          ("name", "class", "paper", "backprops", "comm down/up")),
        "models": lambda: "\n".join(f"fedlight.models.{n}" for n in _names("fedlight.models", "MODELS")),
        "datasets": lambda: "\n".join(f"fedlight.data.{n}" for n in _names("fedlight.data", "DATASETS")),
        "partitioners": lambda: "\n".join(f"fedlight.data.{n}" for n in _names("fedlight.data", "PARTITIONERS")),
        "tasks": lambda: "\n".join(f"fedlight.tasks.{n}" for n in _names("fedlight.tasks", "TASKS")),
        "recipes": lambda: "\n".join(str(p.relative_to(RECIPES.parent)) for p in recipe_paths()),
    }
    if what == "all":
        return "\n\n".join(f"{k}:\n{v()}" for k, v in sections.items())
    if what not in sections:
        from fedlight.core.registry import closest

        raise ConfigError(f"`fedlight ls` takes one of {', '.join(sections)} (or nothing), got {what!r}"
                          f"{closest(what, sections)}")
    return sections[what]()


README = RECIPES.parent / "README.md"
_START, _END = "<!-- algorithms:start", "<!-- algorithms:end -->"


def readme_with_table(text: str) -> str:
    """``text`` with the generated algorithm table between the README's markers."""
    head, rest = text.split(_START, 1)
    marker_line, _, tail = rest.partition("\n")
    _, _, after = tail.partition(_END)
    return f"{head}{_START}{marker_line}\n{algorithm_table_markdown()}{_END}{after}"


if __name__ == "__main__":  # python -m fedlight.config.catalog  → refresh the README's algorithm table
    README.write_text(readme_with_table(README.read_text()))
