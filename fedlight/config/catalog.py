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


# The README's table: the rules by family, one row per paper, its link where the paper (or one citing it) gives one.
_ARXIV, _DOI = "https://arxiv.org/abs/", "https://doi.org/"
FRONT_ROWS: list[tuple[str, tuple[str, ...], str, str]] = [
    ("baseline", ("fedavg",), "average the clients' models after K local SGD steps", ""),
    ("baseline", ("fedprox",), "a proximal term keeps each client near the global model", ""),
    ("baseline", ("scaffold",), "control variates correct each client's drift", ""),
    ("baseline", ("feddyn",), "a per-client dynamic regularizer aligns local and global optima", ""),
    ("server momentum", ("fedavgm",), "heavy-ball momentum on the averaged update", _ARXIV + "1909.06335"),
    ("server momentum", ("fedacg",), "clients start from a look-ahead point along the server momentum", ""),
    ("server adaptive", ("fedadam",), "the server takes an Adam step with the averaged update", ""),
    ("client momentum", ("fedcm",), "each local step mixes the gradient with the last global update",
     _ARXIV + "2106.10874"),
    ("client momentum", ("fedcm_client",), "every client keeps its own heavy-ball buffer across rounds", ""),
    ("sharpness-aware", ("fedsam",), "local SAM: step from the worst point in a ρ-ball", ""),
    ("sharpness-aware", ("fedasam",), "adaptive (scale-invariant) SAM locally", ""),
    ("sharpness-aware", ("mofedsam",), "FedCM's momentum mix with SAM gradients", ""),
    ("sharpness-aware", ("fedgamma",), "SAM with SCAFFOLD's drift correction", ""),
    ("sharpness-aware", ("fedspeed",), "SAM with a FedDyn-style prox-correction", ""),
    ("sharpness-aware", ("fedsmoo",), "SAM whose perturbation a primal-dual pair aligns with a global one", ""),
    ("sharpness-aware", ("fedlesam", "fedlesam_s", "fedlesam_d"),
     "perturb along the last global move: one backprop a step", _ARXIV + "2405.18890"),
    ("sharpness-aware", ("fednsam", "fednsam_s", "fednsam_d"),
     "perturb and extrapolate along the server momentum: one backprop a step", _DOI + "10.1145/3746027.3755226"),
    ("sharpness-aware", ("fedwmsam",), "perturb toward a point extrapolated along a SCAFFOLD-personalized momentum,"
     " mixed with it by an adaptive weight", _ARXIV + "2511.22080"),
    ("weight averaging", ("fedswa", "fedmoswa"),
     "a decaying local lr inside the round (SWA); FedMoSWA adds momentum and control variates", ""),
    ("adaptive", ("fedadamw",), "local AdamW starting from the server's block means of v, plus the global direction",
     _ARXIV + "2510.27486"),
    ("adaptive", ("fedlada",), "local Adam amended by the last global step", _ARXIV + "2308.00522"),
    ("adaptive", ("local_adam", "local_adamw"), "a fresh Adam / AdamW on every client each round", ""),
]


def readme_table_markdown() -> str:
    """The README's algorithm table: :data:`FRONT_ROWS`, then any registered rule they do not name."""
    from fedlight import get_algorithm, list_algorithms

    rows, named = list(FRONT_ROWS), {n for _, names, _, _ in FRONT_ROWS for n in names}
    rows += [("other", (n,), "", "") for n in list_algorithms() if n not in named]
    out = "| family | `--algorithm` | paper | idea |\n|---|---|---|---|\n"
    for family, names, idea, url in rows:
        paper = get_algorithm(names[0]).paper
        rules = ", ".join(f"`{n}`" for n in names)
        out += f"| {family} | {rules} | {f'[{paper}]({url})' if url else paper} | {idea} |\n"
    return out


CONTRACT = ("LocalContext", "Broadcast", "ClientResult", "RoundInfo")
"""The dataclasses a rule reads and writes (:mod:`fedlight.core.rules`, the messages defined in
:mod:`fedlight.core.messages`), tabulated in docs/adding_an_algorithm.md."""


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
    tables generated from the source of the modules that define them (:mod:`fedlight.core.rules`,
    :mod:`fedlight.core.messages`)."""
    import dataclasses
    import inspect

    from fedlight.core import messages, rules

    docs, out = {**_field_docs(rules), **_field_docs(messages)}, []
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


def bundled_table(kind: str) -> str:
    """The bundled recipes or table specs: name (what ``--config``, ``reproduce`` and ``cp`` take) and what each
    reproduces."""
    from fedlight.config import locate

    rows = [(p.stem, locate.describe(p, kind)) for p in locate.bundled(kind)]
    return _text_table(rows, ("name", "reproduces")) if rows else f"(no bundled {locate.PLURAL[kind]} found)"


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
        "recipes": lambda: bundled_table("recipe"),
        "tables": lambda: bundled_table("table"),
    }
    if what == "all":
        return "\n\n".join(f"{k}:\n{v()}" for k, v in sections.items())
    if what not in sections:
        from fedlight.core.registry import closest

        raise ConfigError(f"`fedlight ls` takes one of {', '.join(sections)} (or nothing), got {what!r}"
                          f"{closest(what, sections)}")
    return sections[what]()


README = Path(__file__).resolve().parents[2] / "README.md"  # the repository's (a checkout only)
_START, _END = "<!-- algorithms:start", "<!-- algorithms:end -->"


def readme_with_table(text: str) -> str:
    """``text`` with the generated algorithm table between the README's markers."""
    head, rest = text.split(_START, 1)
    marker_line, _, tail = rest.partition("\n")
    _, _, after = tail.partition(_END)
    return f"{head}{_START}{marker_line}\n{readme_table_markdown()}{_END}{after}"


if __name__ == "__main__":  # python -m fedlight.config.catalog  → refresh the README's algorithm table
    README.write_text(readme_with_table(README.read_text()))
