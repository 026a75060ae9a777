"""The package's face is light, and its layout is a clean stack: one path per module, no cycles, no upward import.

A rule lifted into a custom Fabric script imports only the contract. Every import inside fedlight, the tests and
the docs names the module's real path; the retired paths (of the core/engine/config grouping, and of lab/'s modules
before its packages) still work for a user's old script, with a DeprecationWarning. lab/ is a package per family:
tuning builds on tables, benchmarks and flatness stand alone, and nothing below lab/ imports it.
"""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "fedlight"
HEAVY = ("fedlight.data", "fedlight.models", "fedlight.config.cli", "fedlight.lab", "fedlight.config.api",
         "fedlight.engine.loop", "lightning", "jsonargparse", "torchvision", "submitit")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _modules_after(statement: str, since: str = "") -> list[str]:
    """The modules loaded in a fresh interpreter after ``statement`` (those loaded by ``since`` left out)."""
    code = f"import sys, json\n{since}\nbefore = set(sys.modules) if {since!r} else set()\n{statement}\n" \
           "print(json.dumps(sorted(set(sys.modules) - before)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mods = json.loads(out.strip().splitlines()[-1])
    assert "fedlight" in mods
    return mods


@pytest.mark.parametrize("statement", ["import fedlight.rules", "import fedlight.core.rules", "import fedlight",
                                       "import fedlight.algorithms.fedsam", "from fedlight.algorithms import FedAdamW",
                                       "import fedlight.core.registry", "from fedlight import params as P"])
def test_rule_imports_no_data_models_cli_or_lab(statement):
    assert [m for m in _modules_after(statement) if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []


NLP = ("transformers", "peft", "datasets", "tokenizers")


def test_the_nlp_extra_is_imported_only_when_used():
    mods = _modules_after("import fedlight, fedlight.data, fedlight.models, fedlight.tasks, fedlight.algorithms\n"
                          "from fedlight.data import GLUE, Shakespeare\nfrom fedlight.models import MODELS")
    assert [m for m in mods if m.split(".")[0] in NLP] == []


# ---------------------------------------------------------------------------------------------------- the layout

def _module_files() -> dict[str, Path]:
    return {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted(PKG.rglob("*.py"))}


MODULES = _module_files()
SHORT = {"fedlight.rules": "fedlight.core.rules", "fedlight.params": "fedlight.core.params"}
"""The two short paths users are taught: real files that re-export their module."""
FLOORS = ["core", "models", "algorithms", "tasks", "data", "runners", "run", "engine", "config", "lab"]
"""Each subpackage may import only its own floor and the floors before it (``errors`` and the package's root,
``__version__`` and the short re-export files, are the ground: everyone may import them)."""
ROOT_NAMES = {"create": "fedlight.algorithms", "get_algorithm": "fedlight.algorithms",
              "list_algorithms": "fedlight.algorithms", "register": "fedlight.core.registry",
              "fit": "fedlight.config.api", "sample_clients": "fedlight.core.sampling"}
"""``from fedlight import <name>``: the module a lazily resolved root name loads (the registry's names import every
algorithm first)."""


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every fedlight module a file imports, at top level or inside a function, as (line, module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fedlight"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module == "fedlight" and a.name in ROOT_NAMES:
                    out.append((node.lineno, ROOT_NAMES[a.name]))
                else:
                    out.append((node.lineno, full if full in MODULES else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("fedlight")]
    return out


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_every_import_names_a_real_module():
    """No import inside the package or the tests goes through a retired path (or any path without a file)."""
    from fedlight._moved import MOVED

    bad = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        if path.name == "test_imports.py":
            continue
        for line, module in _imports(path):
            if module not in MODULES and module.rsplit(".", 1)[0] not in MODULES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            elif module in SHORT and path.is_relative_to(PKG):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the short path {module}: use {SHORT[module]}")
    retired = re.compile(r"(?:from|import)\s+fedlight\.(" + "|".join(map(re.escape, MOVED)) + r")\b(?!\.)")
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").rglob("*.md")]:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if retired.search(text):
                bad.append(f"{path.relative_to(ROOT)}:{n} teaches a retired path: {text.strip()}")
    assert bad == []


def test_no_module_imports_a_higher_floor():
    bad = []
    for module, path in MODULES.items():
        mine = _floor(module)
        if mine is None:
            continue
        for line, target in _imports(path):
            theirs = _floor(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module}:{line} ({FLOORS[mine]}) imports {target} ({FLOORS[theirs]})")
    assert bad == []


def test_no_import_cycles_counting_in_function_imports():
    graph = {m: {t if t in MODULES else t.rsplit(".", 1)[0] for _, t in _imports(p)} - {m, "fedlight"}
             for m, p in MODULES.items()}
    graph = {m: {t for t in ts if t in MODULES} for m, ts in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                cycles.append(sorted([v, *component]))

    for m in graph:
        if m not in index:
            visit(m)
    assert cycles == []


LAB = {"tables": set(), "tuning": {"tables"}, "benchmarks": set(), "flatness": set()}
"""lab/'s packages and the ones each may import: a study runs a table's cells (tuning on tables); the benchmarks and
the flatness tools stand alone."""


def test_nothing_below_lab_imports_it():
    """The core, the CLI included, never imports the research tooling (the CLI names its commands as strings)."""
    bad = [f"{module}:{line} imports {target}" for module, path in MODULES.items()
           if module != "fedlight.lab" and not module.startswith("fedlight.lab.")
           for line, target in _imports(path) if target == "fedlight.lab" or target.startswith("fedlight.lab.")]
    assert bad == []


def test_lab_is_a_package_per_family_importing_only_down():
    if not all((PKG / "lab" / p / "__init__.py").is_file() for p in LAB):
        pytest.skip("lab/ is not yet packages (the restructure of issue 61 runs when the branches are merged)")
    lab = {m: p for m, p in MODULES.items() if m.startswith("fedlight.lab.")}
    assert sorted(m for m in lab if m.split(".")[2] not in LAB) == []  # every module in its family's package
    assert {m: _imports(p) for m, p in lab.items() if p.name == "__init__.py" and _imports(p)} == {}
    bad = []
    for module, path in lab.items():
        mine = module.split(".")[2]
        for line, target in _imports(path):
            theirs = target.split(".")[2] if target.startswith("fedlight.lab.") else None
            if theirs is not None and theirs != mine and theirs not in LAB[mine]:
                bad.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert bad == []


@pytest.mark.parametrize("package", ["core", "engine", "runners", "tasks", "run"])
def test_core_engine_runner_and_task_modules_stay_small(package):
    assert {str(p.relative_to(ROOT)): n for p in (PKG / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) >= 300} == {}


def test_the_short_paths_re_export_their_whole_module():
    for short, real in SHORT.items():
        s, r = importlib.import_module(short), importlib.import_module(real)
        public = {n for n, v in vars(r).items() if not n.startswith("_") and getattr(v, "__module__", None) == real}
        public |= {"Params"} if real == "fedlight.core.params" else set()  # a type alias: no __module__
        assert public <= set(s.__all__), (short, public - set(s.__all__))
        assert all(getattr(s, n) is getattr(r, n) for n in s.__all__)


def test_retired_paths_are_the_moved_modules_with_a_warning():
    """``fedlight.loop``, ``fedlight.cli`` ... (the paths before core/ engine/ config/) import the very module of
    their new home and warn, and no file is left at a retired path."""
    from fedlight._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(f"fedlight.{old}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert importlib.import_module(f"fedlight.{old}") is importlib.import_module(f"fedlight.{new}"), old
        assert any(f"fedlight.{new}" in str(w.message) for w in caught if w.category is DeprecationWarning), old
        assert not PKG.joinpath(*old.split(".")).with_suffix(".py").exists(), old
    res = subprocess.run([sys.executable, "-m", "fedlight.cli", "ls", "tasks"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=_env())
    assert res.returncode == 0 and "Regression" in res.stdout, res.stderr[-2000:]


def test_fit_is_still_importable_from_the_package():
    import fedlight
    from fedlight import fit
    from fedlight.config.api import fit as api_fit

    assert fit is api_fit and fedlight.fit is api_fit and "fit" in dir(fedlight)
    with pytest.raises(AttributeError):
        fedlight.no_such_name  # noqa: B018


# ------------------------------------------------------------------------------------------------- start-up cost

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")


def test_the_tool_commands_import_no_lightning(tmp_path):
    """``verify``, ``ls``, ``report``, ``fit --help`` and ``reproduce --status`` start without Lightning (whose import
    pulls torchmetrics, torchvision's models and torch._dynamo: ~7 s on the 2-core machine)."""
    table = ROOT / "recipes" / "tables" / "fedadamw_table1.yaml"
    commands = [["verify", str(tmp_path)], ["ls"], ["report", str(tmp_path)], ["fit", "--help"],
                ["reproduce", str(table), "--status", "--out", str(tmp_path / "t")]]
    mods = _modules_after("import contextlib as c, io\nfrom fedlight.config.cli import main\n"
                          f"for argv in {commands!r}:\n"
                          "    with c.redirect_stdout(io.StringIO()), c.redirect_stderr(io.StringIO()):\n"
                          "        try:\n            main(argv)\n        except SystemExit:\n            pass")
    assert "fedlight.config.api" in mods and "fedlight.lab.tables.reproduce" in mods and "fedlight.run.verify" in mods
    assert [m for m in mods if m.split(".")[0] in LIGHTNING] == []


def test_an_mlp_run_imports_nothing_beyond_lightning_for_its_recipe(tmp_path):
    """What a plain MLP run imports on top of ``import lightning`` holds no NLP extra, no second Lightning package
    (the standalone ``pytorch_lightning``, asked about a plain module) and no compiler."""
    mods = _modules_after(
        "from fedlight.config.api import fit\nfrom fedlight.core.loop_config import LoopConfig\n"
        "from fedlight.data import Synthetic\nfrom fedlight.models import MLP\n"
        "fit(MLP(60, [8]), Synthetic(num_clients=4), loop=LoopConfig(rounds=1, clients_per_round=2, local_steps=2),"
        f" out_dir={str(tmp_path / 'r')!r})", since="import lightning")
    added = [m for m in mods if m.split(".")[0] in (*NLP, *LIGHTNING, "timm") or m.startswith("torch._dynamo")]
    assert "fedlight.engine.loop" in mods and added == []
